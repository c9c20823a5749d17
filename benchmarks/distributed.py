"""Two ranks against one on this 2-core machine, and a projection to the paper's 8B setting.

Runs ``nmprune prune`` on the packaged SmolLM2-135M (default settings unless flags are given)
as 1 rank x 2 threads and as ``torchrun --nproc-per-node 2`` (2 ranks x 1 thread, gloo),
then compares

* result: masks (share of 2:4 cells with the same mask), total local loss, perplexity;
* work: wall time, each rank's busy seconds, CPU seconds of the layer phase (summed over
  ranks against the 1-rank run: at most 1.1x), busiest rank's layer time against the mean
  (at most 1.2x), peak RSS of the largest process.

The projection fits ``seconds = f x rows x d_in^2`` to the 1-rank run's per-layer solve
times, turns ``f`` into floating-point work with this CPU's measured fp32 matmul rate, and
spreads Llama-3.1-8B's 224 layer solves over 1/2/4/8 GPUs with the pipeline's assignment
(longest first to the least-loaded rank) one block at a time, over the pipeline's window of
blocks (:func:`nmprune.distributed.balance_window`) and over all blocks at once. GPU rate assumed: NVIDIA A100's 19.5 TFLOP/s fp32 peak (A100 datasheet;
the paper's GPU); a second column scales the 1-GPU total to the paper's measured 11,170 s
for its method on that model (Table ``tab:runtime``).

``--scaling`` measures the issue's speed-up instead: the default job (prox + exact + block
reconstruction) on a random 4-block Llama of hidden size 512 (memory.py's checkpoint
builder), 1 rank against 2 torchrun ranks, one thread per process, three runs of each
alternated, and the dry run's time for both beside the medians (``distributed_scaling.{json,md}``;
``--scaling-replan`` redoes only the dry run, with today's code).

A second projection covers the streamed design (every rank reads only its current block) for
Llama-3.1-8B and 70B with nmprune's defaults, from ``nmprune prune --dry-run``'s model
(:func:`projection_streamed`; ``--projection-only`` redoes just that section).

Writes benchmarks/results/distributed.{json,md}. Run:
    flock /tmp/nmprune-bench.lock python benchmarks/distributed.py [extra nmprune prune flags]
    flock /tmp/nmprune-bench.lock python benchmarks/distributed.py --scaling
    python benchmarks/distributed.py --projection-only
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import code_commit, cpu_description  # noqa: E402

from nmprune.distributed import CUDA_SPEEDUP, TRITON_ENTRY_SPEEDUP, balance_window, makespan  # noqa: E402
from nmprune.prox.two_four import triton_installed  # noqa: E402
from nmprune.pattern import same_mask_cells  # noqa: E402
from nmprune.resources import BF16_TRAINING_SPEEDUP  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
A100_FP32_FLOPS = 19.5e12  # NVIDIA A100 datasheet, peak fp32 (non-tensor-core)
PAPER_8B_SECONDS = 11170.0  # paper Table tab:runtime, proposed regularizer, Llama-3.1 8B
# Llama-3.1-8B: 32 blocks of (rows, d_in)
LLAMA_8B_BLOCK = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
                  "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)}
LLAMA_8B_BLOCKS = 32


def run(cmd: list[str], env: dict[str, str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return {"wall_seconds": wall,
            "cpu_seconds": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "peak_rss_mib": after.ru_maxrss / 1024}


def load(out: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(out.glob("*.safetensors")):  # one file, or a streamed run's shards
        state.update(load_file(shard))
    return json.loads((out / "nmprune_report.json").read_text()), state


def matmul_flops(threads: int) -> float:
    """This CPU's fp32 matmul rate (FLOP/s) on SmolLM2-sized operands."""
    torch.set_num_threads(threads)
    a, b = torch.randn(1536, 576), torch.randn(576, 576)
    for _ in range(3):
        a @ b
    n, start = 20, time.perf_counter()
    for _ in range(n):
        a @ b
    return n * 2 * 1536 * 576 * 576 / (time.perf_counter() - start)


def projection(factor_flops: float) -> list[dict]:
    """Layer-phase wall time of Llama-3.1-8B on 1/2/4/8 GPUs (seconds): one block at a time,
    the pipeline's window of blocks (:func:`balance_window`), all blocks at once."""
    block = [rows * d_in ** 2 * factor_flops / A100_FP32_FLOPS for rows, d_in in LLAMA_8B_BLOCK.values()]
    total = sum(block) * LLAMA_8B_BLOCKS
    rows = []
    for gpus in (1, 2, 4, 8):
        k = balance_window([block] * LLAMA_8B_BLOCKS, gpus)
        windows = [min(k, LLAMA_8B_BLOCKS - i) for i in range(0, LLAMA_8B_BLOCKS, k)]
        times = {"per_block_seconds": makespan(block, gpus) * LLAMA_8B_BLOCKS,
                 "window_seconds": sum(makespan(block * w, gpus) for w in windows),
                 "whole_model_seconds": makespan(block * LLAMA_8B_BLOCKS, gpus)}
        rows.append({"gpus": gpus, "window_blocks": k, **times, "ideal_seconds": total / gpus,
                     **{key.replace("seconds", "paper_scaled"): PAPER_8B_SECONDS * t / total
                        for key, t in times.items()}})
    return rows


def main(extra: list[str]) -> None:
    commit = code_commit()
    load_start = os.getloadavg()[0]
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with tempfile.TemporaryDirectory() as tmp:
        one_cmd = [sys.executable, "-m", "nmprune", "prune", "--quiet", *extra, "--out", f"{tmp}/one"]
        two_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "nmprune", "prune", "--quiet", *extra, "--out", f"{tmp}/two"]
        runs = {"1 rank x 2 threads": run(one_cmd, base),
                "2 ranks x 1 thread": run(two_cmd, {**base, "OMP_NUM_THREADS": "1"})}
        (one, state_one), (two, state_two) = load(Path(tmp) / "one"), load(Path(tmp) / "two")
    names = [r["name"] for r in one["layers"] if not r["skipped"]]
    same = [same_mask_cells(state_one[f"{n}.weight"], state_two[f"{n}.weight"], 4) for n in names]
    agreement = float(sum(s.sum() for s in same)) / sum(s.numel() for s in same)
    loss = [sum(r["loss_refined"] or r["loss_method"] for r in rep["layers"] if not r["skipped"])
            for rep in (one, two)]
    ppl = {d: [one["perplexity"]["pruned"][d], two["perplexity"]["pruned"][d]]
           for d in one["perplexity"]["pruned"]}
    for label, rep in zip(runs, (one, two)):
        runs[label]["report_seconds"] = rep["seconds"]
        runs[label]["per_rank"] = [{k: v for k, v in p.items() if k != "layers"} | {"layers": len(p["layers"])}
                                   for p in rep["per_rank"]]
    layer_cpu = [sum(p["layer_cpu_seconds"] for p in rep["per_rank"]) for rep in (one, two)]
    solve = [p["solve_seconds"] for p in two["per_rank"]]
    sizes = [r["shape"][0] * r["shape"][1] ** 2 for r in one["layers"] if not r["skipped"]]
    seconds = [r["seconds"] for r in one["layers"] if not r["skipped"]]
    factor = sum(s * z for s, z in zip(seconds, sizes)) / sum(z * z for z in sizes)
    cpu_flops = matmul_flops(2)
    result = {
        "commit": commit, "cpu": cpu_description(), "load_average": [load_start, os.getloadavg()[0]],
        "args": extra, "runs": runs,
        "same_mask_cells": agreement, "total_local_loss": loss,
        "loss_rel_diff": abs(loss[1] - loss[0]) / loss[0],
        "perplexity": ppl, "perplexity_rel_diff": {d: abs(b - a) / a for d, (a, b) in ppl.items()},
        "layer_cpu_seconds": layer_cpu, "layer_cpu_ratio": layer_cpu[1] / layer_cpu[0],
        "busiest_over_mean": max(solve) / (sum(solve) / len(solve)),
        "fit_seconds_per_row_din2": factor, "cpu_matmul_flops_2_threads": cpu_flops,
        "flops_per_row_din2": factor * cpu_flops,
        "projection_8b": projection(factor * cpu_flops),
        "projection_streamed": projection_streamed(),
        "projection_streamed_triton": triton_installed(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distributed.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "distributed.md").write_text(markdown(result))
    print(markdown(result))


# The streamed design's projection: the paper's calibration (128 x 2048 tokens), bfloat16,
# prox + exact refinement with block reconstruction (nmprune's defaults), on H200-class GPUs
PROJECTED = {"Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                  num_key_value_heads=8, num_hidden_layers=32),
             "Llama-3.1-70B": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                   num_key_value_heads=8, num_hidden_layers=80)}
READ_BYTES_PER_S = 2e9  # shared file system, per rank (assumed); every rank reads each block once


def projection_streamed() -> list[dict]:
    """Each PROJECTED model on 1/2/4/8 GPUs, streamed: per-rank memory and the time of each
    phase from ``nmprune prune --dry-run``'s model (:mod:`nmprune.resources`, which prices the
    layer solves as the executor spreads them: shares of every layer's rows), plus reading
    the blocks."""
    from transformers import LlamaConfig

    from nmprune.config import build_config
    from nmprune.resources import plan_run

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in PROJECTED.items():
            LlamaConfig(**shape, vocab_size=128256, dtype="bfloat16", tie_word_embeddings=False,
                        architectures=["LlamaForCausalLM"]).save_pretrained(f"{tmp}/{name}")
            for gpus in (1, 2, 4, 8):
                config = build_config({"model": f"{tmp}/{name}", "device": "cuda", "nsamples": 128,
                                       "seqlen": 2048, "eval": []})
                needs = plan_run(config, gpus, streamed=True)
                seconds = {**needs.seconds, "reading_blocks": needs.output_disk / READ_BYTES_PER_S}
                rows.append({"model": name, "gpus": gpus, "cpu_peak_per_rank": needs.cpu_peak_per_rank,
                             "device_peak_per_rank": needs.device_peak_per_rank, "seconds": seconds,
                             "total_seconds": sum(seconds.values())})
    return rows


def markdown(r: dict) -> str:
    lines = ["# Pruning on several ranks: 2 ranks x 1 thread against 1 rank x 2 threads", "",
             f"`nmprune prune {' '.join(r['args'])}` (packaged SmolLM2-135M, default settings unless "
             f"flags are shown), {r['cpu']['model']} with 2 cores, commit {r['commit']}; load average "
             f"{r['load_average'][0]:.1f} at the start, {r['load_average'][1]:.1f} at the end. The 2-rank "
             "run is `torchrun --standalone --nproc-per-node 2` on gloo. On 2 cores, 2 ranks of 1 thread "
             "have the compute of 1 rank of 2 threads, so the wall times show the overhead of the "
             "second process, not a speed-up; the speed-up of more devices is the projection below.", "",
             "| run | wall s | CPU s (all processes) | peak RSS MiB (largest process) | prune s | layers s | rank: busy s / layer CPU s / layers solved |",
             "|---|---|---|---|---|---|---|"]
    for label, run_ in r["runs"].items():
        ranks = "; ".join(f"{p['rank']}: {p['busy_seconds']:.0f} / {p['layer_cpu_seconds']:.0f} / {p['layers']}"
                          for p in run_["per_rank"])
        lines.append(f"| {label} | {run_['wall_seconds']:.0f} | {run_['cpu_seconds']:.0f} | "
                     f"{run_['peak_rss_mib']:.0f} | {run_['report_seconds']['prune']:.0f} | "
                     f"{run_['report_seconds']['pipeline']['layers']:.0f} | {ranks} |")
    ppl = ", ".join(f"{d}: {a:.3f} vs {b:.3f} ({r['perplexity_rel_diff'][d]:.2e})"
                    for d, (a, b) in r["perplexity"].items())
    lines += ["", "| check | measured | bound | met |", "|---|---|---|---|",
              f"| same 2:4 masks | {100 * r['same_mask_cells']:.3f}% of cells | >= 99.9% | "
              f"{'yes' if r['same_mask_cells'] >= 0.999 else 'no'} |",
              f"| total local loss | {r['total_local_loss'][0]:.6g} vs {r['total_local_loss'][1]:.6g} "
              f"({r['loss_rel_diff']:.2e}) | 1e-4 relative | {'yes' if r['loss_rel_diff'] <= 1e-4 else 'no'} |",
              f"| pruned perplexity | {ppl} | 0.1% | "
              f"{'yes' if all(v <= 1e-3 for v in r['perplexity_rel_diff'].values()) else 'no'} |",
              f"| layer-phase CPU s, 2 ranks summed / 1 rank | {r['layer_cpu_seconds'][1]:.0f} / "
              f"{r['layer_cpu_seconds'][0]:.0f} = {r['layer_cpu_ratio']:.2f} | 1.1 | "
              f"{'yes' if r['layer_cpu_ratio'] <= 1.1 else 'no'} |",
              f"| busiest rank's layer time / mean | {r['busiest_over_mean']:.3f} | 1.2 | "
              f"{'yes' if r['busiest_over_mean'] <= 1.2 else 'no'} |", "",
              "## Projection: Llama-3.1-8B layer phase on 1, 2, 4, 8 GPUs", "",
              f"Per-layer fit on the 1-rank run: {r['fit_seconds_per_row_din2']:.3e} s per rows x d_in^2 "
              f"at {r['cpu_matmul_flops_2_threads'] / 1e9:.0f} GFLOP/s (this CPU's fp32 matmul, 2 threads) = "
              f"{r['flops_per_row_din2']:.0f} FLOP per rows x d_in^2. GPU assumed: A100 at its "
              "19.5 TFLOP/s fp32 peak (NVIDIA datasheet; an optimistic bound). The last two columns "
              "scale the 1-GPU total to the paper's measured 11,170 s for its method on this model "
              "(Table tab:runtime). Calibration and I/O are not included.", "",
              "| GPUs | one block at a time | nmprune's window (blocks) | all blocks at once | ideal | paper-scaled: one block / window / all (min) |",
              "|---|---|---|---|---|---|"]
    for p in r["projection_8b"]:
        lines.append(f"| {p['gpus']} | {p['per_block_seconds']:.0f} s | {p['window_seconds']:.0f} s "
                     f"({p['window_blocks']}) | {p['whole_model_seconds']:.0f} s | {p['ideal_seconds']:.0f} s | "
                     f"{p['per_block_paper_scaled'] / 60:.0f} / {p['window_paper_scaled'] / 60:.0f} / "
                     f"{p['whole_model_paper_scaled'] / 60:.0f} |")
    if "projection_streamed" in r:
        lines += ["", "## Projection of the streamed design: Llama-3.1-8B and 70B on 1, 2, 4, 8 GPUs", "",
                  "Every rank streams the model (reads only its current block from a shared file system, "
                  f"assumed {READ_BYTES_PER_S / 1e9:.0f} GB/s per rank), runs its share of the 128 x 2048 "
                  "calibration tokens and solves its share of each block's layers; rank 0 writes. "
                  "nmprune's defaults (prox + exact, block reconstruction, bfloat16). Memory and the "
                  "passes' time come from `nmprune prune --dry-run` (nmprune/resources.py: layer solves "
                  f"at the cost model's products with H / {CUDA_SPEEDUP['products']:g} "
                  "(nmprune.distributed.CUDA_SPEEDUP) and passes at 60 TFLOP/s, both measured on an H200 "
                  "(benchmarks/results/gpu.md); the prox's work on every weight "
                  + (f"/ {TRITON_ENTRY_SPEEDUP:g} in the Triton kernel (nmprune.distributed.TRITON_ENTRY_SPEEDUP, "
                     "an estimate from benchmarks/results/prox_kernel_cost.md: no GPU has run the kernel)"
                     if r.get("projection_streamed_triton") else
                     f"/ {CUDA_SPEEDUP['entries']:g} (the float64 torch prox, measured; triton was not installed)")
                  + "; the reconstruction's training in bfloat16 at "
                  f"{BF16_TRAINING_SPEEDUP['cuda']:g}x that rate, an estimate no GPU has checked); "
                  "the ranks solve shares of every layer's rows or whole layers, whichever the cost model "
                  "says is faster (nmprune.distributed.split_rows), "
                  "one block at a time; every reconstruction step of one sample is shared by tokens "
                  "(the busiest rank's share: keys and values run up to its end). Estimates, not "
                  "measurements: no multi-GPU run has been made.", "",
                  "| model | GPUs | CPU peak / rank | device peak / rank | layer solves | calibration passes "
                  "| reconstruction | reading blocks | total |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in r["projection_streamed"]:
            sec = p["seconds"]
            lines.append(f"| {p['model']} | {p['gpus']} | {p['cpu_peak_per_rank'] / 2**30:.1f} GiB | "
                         f"{p['device_peak_per_rank'] / 2**30:.1f} GiB | {sec['layer_solves'] / 60:.0f} min | "
                         f"{sec['calibration_passes'] / 60:.1f} min | {sec.get('reconstruction', 0) / 60:.1f} min | "
                         f"{sec['reading_blocks'] / 60:.1f} min | {p['total_seconds'] / 60:.0f} min |")
    return "\n".join(lines) + "\n"


SCALING_MODEL = dict(hidden=512, inter=1376, blocks=4, heads=8)
SCALING_RUNS = 3
#: the scaling runs' key of one rank with two threads
THREADED = "1x2"


def dry_run_seconds(model: Path, ranks: int) -> float:
    """The dry run's total time for the default job on ``ranks`` CPU ranks of one thread each
    (as the runs have: ``OMP_NUM_THREADS=1``)."""
    from nmprune.config import build_config
    from nmprune.resources import plan_run

    config = build_config({"model": str(model), "calib": str(model / "text.txt"), "device": "cpu", "eval": [],
                           "distill_epochs": 0})
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return sum(plan_run(config, ranks).seconds.values())
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def scaling() -> None:
    """The ``--scaling`` measurement of the module docstring."""
    from memory import BUILD

    commit, load_start = code_commit(), os.getloadavg()[0]
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        subprocess.run([sys.executable, "-c", BUILD.format(**SCALING_MODEL), str(model)], check=True)
        # --distill-epochs 0: two ranks stream the safetensors model, where the global pass is
        # skipped, and one rank holds it whole; both then do the same work
        args = ["-m", "nmprune", "prune", "--quiet", "--model", str(model), "--calib", str(model / "text.txt"),
                "--no-eval", "--distill-epochs", "0"]
        # 1 and 2 ranks of one thread, and (what resources.CPU_THREAD_SCALING is fitted to) one
        # rank of two threads
        one_rank = [sys.executable, *args]
        cmds = {1: (one_rank, env),
                2: ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
                    env),
                THREADED: (one_rank, {**env, "OMP_NUM_THREADS": "2"})}
        walls: dict[int | str, list[float]] = {key: [] for key in cmds}
        for k in range(SCALING_RUNS):
            for key, (cmd, cmd_env) in cmds.items():
                walls[key].append(run(cmd + ["--out", f"{tmp}/out-{key}-{k}"], cmd_env)["wall_seconds"])
                print(f"{key} rank(s), run {k + 1}: {walls[key][-1]:.1f} s", flush=True)
        (one, state_one), (two, state_two) = load(Path(tmp) / "out-1-0"), load(Path(tmp) / "out-2-0")
        planned = {ranks: dry_run_seconds(model, ranks) for ranks in (1, 2)}
    names = [r["name"] for r in one["layers"] if not r["skipped"]]
    same = [same_mask_cells(state_one[f"{n}.weight"], state_two[f"{n}.weight"], 4) for n in names]
    median = {r: sorted(w)[len(w) // 2] for r, w in walls.items()}
    result = {"commit": commit, "cpu": cpu_description(), "load_average": [load_start, os.getloadavg()[0]],
              "model": SCALING_MODEL, "wall_seconds": walls, "median_seconds": median,
              "speedup": median[1] / median[2], "thread_speedup": median[1] / median[THREADED],
              "planned_seconds": planned,
              "planned_over_measured": {r: planned[r] / median[r] for r in planned},
              "same_mask_cells": float(sum(x.sum() for x in same)) / sum(x.numel() for x in same),
              "split_layers": sum(1 for r in two["layers"] if r.get("shares")), "layers": len(names)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distributed_scaling.json").write_text(json.dumps(result, indent=1))
    text = scaling_markdown(json.loads(json.dumps(result)))  # rank counts as the JSON's keys
    (RESULTS / "distributed_scaling.md").write_text(text)
    print(text)


def scaling_replan() -> None:
    """``--scaling-replan``: the dry run's times again with today's code (the plan changed, the
    runs did not), against the saved measurements."""
    from memory import BUILD

    result = json.loads((RESULTS / "distributed_scaling.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        subprocess.run([sys.executable, "-c", BUILD.format(**result["model"]), str(model)], check=True,
                       capture_output=True)
        planned = {str(r): dry_run_seconds(model, r) for r in (1, 2)}
    result.update(planned_seconds=planned, plan_commit=code_commit(),
                  planned_over_measured={r: planned[r] / result["median_seconds"][r] for r in planned})
    (RESULTS / "distributed_scaling.json").write_text(json.dumps(result, indent=1))
    text = scaling_markdown(result)
    (RESULTS / "distributed_scaling.md").write_text(text)
    print(text)


def scaling_markdown(r: dict) -> str:
    m = r["model"]
    ok = lambda met: "yes" if met else "no"  # noqa: E731
    lines = ["# Two ranks against one: the default job on a random Llama", "",
             f"`nmprune prune --no-eval` (prox + exact + block reconstruction, default calibration) on a "
             f"random {m['blocks']}-block Llama, hidden size {m['hidden']}, MLP {m['inter']}, one thread per "
             f"process; {r['cpu']['model']}, commit {r['commit']}; load average {r['load_average'][0]:.1f} "
             f"at the start, {r['load_average'][1]:.1f} at the end. {SCALING_RUNS} runs of each, alternated; "
             f"medians. {r['split_layers']} of the 2-rank run's {r['layers']} layer solves were split "
             "by rows between the ranks."
             + (f" The dry run's times are of commit {r['plan_commit']}." if r.get("plan_commit") else ""), "",
             "| ranks | wall s (runs) | median s | dry run s | dry run / measured |", "|---:|---|---:|---:|---:|"]
    for ranks in ("1", "2"):
        walls = ", ".join(f"{w:.1f}" for w in r["wall_seconds"][ranks])
        lines.append(f"| {ranks} | {walls} | {r['median_seconds'][ranks]:.1f} | {r['planned_seconds'][ranks]:.1f} | "
                     f"{r['planned_over_measured'][ranks]:.2f} |")
    if THREADED in r["wall_seconds"]:
        walls = ", ".join(f"{w:.1f}" for w in r["wall_seconds"][THREADED])
        lines.append(f"| 1, two threads | {walls} | {r['median_seconds'][THREADED]:.1f} | | |")
        lines += ["", f"One rank of two threads is {r['thread_speedup']:.2f}x as fast as one of one thread "
                  f"(the dry run's thread scaling, `resources.CPU_THREAD_SCALING`, is "
                  f"log2 of it: {math.log2(r['thread_speedup']):.2f}), and "
                  f"{r['median_seconds']['2'] / r['median_seconds'][THREADED]:.2f}x as fast as two ranks "
                  "of one thread: on one machine, threads are the faster way to use its cores."]
    within = all(abs(v - 1) <= 0.35 for v in r["planned_over_measured"].values())
    lines += ["", "| check | measured | target | met |", "|---|---|---|---|",
              f"| speed-up, 2 ranks over 1 | {r['speedup']:.2f}x | >= 1.8x | {ok(r['speedup'] >= 1.8)} |",
              f"| same 2:4 masks | {100 * r['same_mask_cells']:.3f}% of cells | >= 99% | "
              f"{ok(r['same_mask_cells'] >= 0.99)} |",
              f"| dry run within 35% of the wall time | "
              f"{', '.join(f'{k} rank(s): {v:.2f}' for k, v in r['planned_over_measured'].items())} | "
              f"0.65-1.35 | {ok(within)} |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--scaling"]:
        scaling()
    elif sys.argv[1:] == ["--scaling-replan"]:
        scaling_replan()
    elif sys.argv[1:] == ["--scaling-report"]:  # the table again from the saved JSON
        print(scaling_markdown(json.loads((RESULTS / "distributed_scaling.json").read_text())))
    elif sys.argv[1:] == ["--projection-only"]:  # redo the projection, keep the measured runs
        result = json.loads((RESULTS / "distributed.json").read_text())
        result["projection_streamed"] = projection_streamed()
        result["projection_streamed_triton"] = triton_installed()
        (RESULTS / "distributed.json").write_text(json.dumps(result, indent=1))
        (RESULTS / "distributed.md").write_text(markdown(result))
        print(markdown(result))
    else:
        main(sys.argv[1:])
