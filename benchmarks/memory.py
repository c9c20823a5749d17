"""Peak memory of streamed pruning (``nmprune prune --offload``) against the checkpoint size.

Builds random-weight Llama-architecture checkpoints (hidden 1024, intermediate 4096, 16
heads, float32, tied embeddings; safetensors shards of at most 200 MB with an index) with
``BLOCKS`` decoder blocks each, and a local tokenizer (byte-level BPE, 4096 entries, trained
on the first 400k characters of the packaged wiki text, saved with it as ``text.txt``, as the
tests make theirs), prunes each with every ``METHOD`` (small calibration: 8 x 128 tokens of
that text; dense and pruned perplexity on 2048 tokens of its held-out tenth, streamed too)
and records the peak resident set of
the run (``wait4`` of the child: exact, like ``/usr/bin/time -v``) and of a bare
``python -c "import torch, transformers, nmprune"``. Targets (issue 20): the run's peak
above the bare one is at most 25% of the checkpoint and does not grow with the block count.
Then the largest run repeats in a memory control group capped at 75% of the checkpoint's
size (the kernel's hard limit on the group's resident memory, page cache included, which
``systemd-run -p MemoryMax=`` sets too; created directly under ``/sys/fs/cgroup``, cgroup v1
or v2, as root); then without ``--offload``, where nmprune must pick streaming itself from
the group's headroom; and, as a control, forced to load the model whole (``offload: false``),
which the kernel must kill.

    flock /tmp/nmprune-bench.lock python benchmarks/memory.py [--blocks 16 24 32] [--methods wanda sparsegpt]
    flock /tmp/nmprune-bench.lock python benchmarks/memory.py --ranks 2 --blocks 16 32 --methods wanda

With ``--ranks N`` it runs N streamed gloo ranks under torchrun on the 16- and 32-block
checkpoints instead (each rank writes its own peak RSS, VmHWM, at exit), compares their masks with
one streamed process, and loads the 16-block model whole on the same ranks (one copy each)
for comparison: ``benchmarks/results/memory_ranks.{json,md}``.

Writes ``benchmarks/results/memory.{json,md}``; the generated checkpoints and outputs
under ``runs/memory_bench`` are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _machine import code_commit, cpu_description

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "runs" / "memory_bench"
HEADS = 16
TARGET_FRACTION = 0.25
MB = 1 << 20

BUILD = r"""
import sys, torch
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from nmprune.data import load_text
out = Path(sys.argv[1])
text = load_text("wiki", "calib")[:400_000]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "<eos>"],
                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
config = LlamaConfig(vocab_size=len(tok), hidden_size={hidden}, intermediate_size={inter},
                     num_hidden_layers={blocks}, num_attention_heads={heads},
                     num_key_value_heads={heads}, max_position_embeddings=2048,
                     tie_word_embeddings=True, dtype="float32")
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(out, max_shard_size="200MB")
tok.save_pretrained(out)
(out / "text.txt").write_text(text)
(out / "run.yaml").write_text(f"eval: [{{out / 'text.txt'}}]\ncalib: {{out / 'text.txt'}}\n")
(out / "run_in_memory.yaml").write_text((out / "run.yaml").read_text() + "offload: false\n")
"""


def memory_cgroup(limit: int) -> Path:
    """A new memory control group capped at ``limit`` bytes (no swap beyond it)."""
    for root, files in ((Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")),
                        (Path("/sys/fs/cgroup"), ("memory.max", "memory.swap.max"))):
        if (root / files[0]).exists() or (root / "cgroup.controllers").exists() and \
                "memory" in (root / "cgroup.controllers").read_text().split():
            group = root / f"nmprune-memory-bench-{os.getpid()}"
            group.mkdir()
            (group / files[0]).write_text(str(limit))
            if (group / files[1]).exists():
                (group / files[1]).write_text(str(limit) if files[1].startswith("memory.memsw") else "0")
            return group
    raise RuntimeError("no writable memory control group (cgroup v1 or v2) on this machine")


def in_cgroup(group: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run inside ``group`` (the shell joins it, then becomes ``cmd``)."""
    return ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *cmd]


def measured(cmd: list[str]) -> dict:
    """Run ``cmd`` and take its own peak RSS from ``wait4``."""
    start = time.perf_counter()
    with open(WORK / "stdout.txt", "w") as out, open(WORK / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"cmd": " ".join(cmd).replace(str(ROOT) + "/", ""), "rc": proc.returncode,
            "seconds": time.perf_counter() - start, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "stdout_tail": (WORK / "stdout.txt").read_text()[-1500:],
            "stderr_tail": (WORK / "stderr.txt").read_text()[-1500:]}


# Llama-3.1-8B and Llama-3.1-70B shapes (their config.json): hidden, intermediate, blocks,
# query heads, key/value heads, head dim, vocabulary, tied embeddings
SHAPES = {"SmolLM2-135M": (576, 1536, 30, 9, 3, 64, 49152, True),
          "8B": (4096, 14336, 32, 32, 8, 128, 128256, False),
          "70B": (8192, 28672, 80, 64, 8, 128, 128256, False)}


def memory_plan(name: str, dtype_bytes: int = 2, nsamples: int = 64, seqlen: int = 512,
                batch_size: int = 2) -> dict[str, int]:
    """Bytes a streamed run holds, from a Llama model's shapes: one block's weights (run
    dtype), its float32 Hessians (one per distinct layer input: q/k/v share one, gate/up
    one; all are held while the block's statistics are collected), the largest layer's
    solver memory (float32 working weight and pruned result, and SparseGPT's two ``d_in x
    d_in`` factorisations; the Hessian itself is dampened in place), the calibration
    hidden states (run dtype, one set), the MLP activations of one batch, and the modules
    outside the blocks (embeddings and LM head) loaded for the capture and the evaluation
    head."""
    h, f, _, nq, nkv, hd, vocab, tied = SHAPES[name]
    layers = {"q": (nq * hd, h), "k": (nkv * hd, h), "v": (nkv * hd, h), "o": (h, nq * hd),
              "gate": (f, h), "up": (f, h), "down": (h, f)}
    weights = sum(a * b for a, b in layers.values()) * dtype_bytes + 2 * h * dtype_bytes  # + 2 norms
    hessians = 4 * (h * h + (nq * hd) ** 2 + h * h + f * f)
    solver = 4 * (2 * h * f + 2 * f * f)
    hidden = nsamples * seqlen * h * dtype_bytes
    mlp = 3 * batch_size * seqlen * f * dtype_bytes
    outside = vocab * h * dtype_bytes * (1 if tied else 2)
    return {"block_weights": weights, "hessians": hessians, "solver_largest_layer": solver,
            "calibration_hidden": hidden, "mlp_activations_one_batch": mlp,
            "embeddings_and_head": outside,
            "block_phase": weights + hessians + solver + hidden + mlp,
            "capture_phase": outside + weights + hidden}


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


#: further ``nmprune prune`` flags for every run (``--prune-args``)
EXTRA_PRUNE_ARGS: list[str] = []
#: streamed and in-memory runs compared on the same work: the global distillation pass, which
#: only a model held whole makes (``distill_epochs: auto``), is off in both
NO_DISTILLATION = ["--distill-epochs", "0"]


def prune_cmd(model: Path, out: Path, method: str, offload: bool | None = True) -> list[str]:
    """``offload``: True streams (``--offload``), False loads the model whole (YAML
    ``offload: false``), None lets nmprune choose from the memory available."""
    config = model / ("run_in_memory.yaml" if offload is False else "run.yaml")
    return ["nmprune", "prune", "--config", str(config), "--model", str(model),
            "--out", str(out), "--method", method,
            "--refine", "none", "--nsamples", "8", "--seqlen", "128", "--eval-seqlen", "128",
            "--eval-max-tokens", "2048", "--quiet", *(["--offload"] if offload is True else []),
            *NO_DISTILLATION, *EXTRA_PRUNE_ARGS]


def plan_lines() -> list[str]:
    """The memory plan of a streamed run (default calibration 64 x 512, batch 2) of
    SmolLM2-135M in float32 and of an 8B and a 70B Llama in bfloat16, as Markdown."""
    plans = {"SmolLM2-135M float32": memory_plan("SmolLM2-135M", 4),
             "Llama-3.1-8B bfloat16": memory_plan("8B"), "Llama-3.1-70B bfloat16": memory_plan("70B")}
    lines = ["## Memory plan of a streamed run, from the shapes (64 x 512 calibration tokens, batch 2)", "",
             "| MiB | " + " | ".join(plans) + " |", "|---|" + "---:|" * len(plans)]
    for key in next(iter(plans.values())):
        lines.append(f"| {key.replace('_', ' ')} | " + " | ".join(f"{p[key] / MB:,.0f}" for p in plans.values()) + " |")
    return lines + [""]


CONVERT = r"""
import sys
from nmprune.models import load_model
model, tok, _ = load_model(None)
model.save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
"""


def smollm2_runs(bare: dict) -> list[dict]:
    """The packaged SmolLM2-135M saved as safetensors (float32), pruned with wanda at the
    default calibration and evaluation, streamed and in memory."""
    model = WORK / "smollm2"
    subprocess.run([sys.executable, "-c", CONVERT, str(model)], check=True)
    runs = []
    for offload in (True, False):
        out = WORK / f"smollm2-out-{offload}"
        cmd = ["nmprune", "prune", "--model", str(model), "--out", str(out), "--method", "wanda",
               "--refine", "none", "--quiet", *(["--offload"] if offload else []), *NO_DISTILLATION]
        r = measured(cmd)
        if r["rc"] != 0:
            raise RuntimeError(f"{r['cmd']} failed:\n{r['stderr_tail']}")
        report = json.loads((out / "nmprune_report.json").read_text())
        r.update(offload=offload, checkpoint_bytes=checkpoint_bytes(model),
                 above_bare_bytes=r["peak_rss_bytes"] - bare["peak_rss_bytes"],
                 perplexity=report["perplexity"], stage_seconds=report["seconds"])
        runs.append(r)
        shutil.rmtree(out)
    shutil.rmtree(model)
    return runs


def main(blocks: list[int], methods: list[str], hidden: int, intermediate: int, smollm2: bool) -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    load = os.getloadavg()
    bare = measured([sys.executable, "-c", "import torch, transformers, nmprune"])
    runs, sizes = [], {}
    try:
        smollm2 = smollm2_runs(bare) if smollm2 else []
        for n in blocks:
            model = WORK / f"llama-{n}"
            build = BUILD.format(hidden=hidden, inter=intermediate, blocks=n, heads=HEADS)
            subprocess.run([sys.executable, "-c", build, str(model)], check=True)
            sizes[n] = checkpoint_bytes(model)
            for method in methods:
                out = WORK / f"out-{n}-{method}"
                r = measured(prune_cmd(model, out, method))
                if r["rc"] != 0:
                    raise RuntimeError(f"{r['cmd']} failed:\n{r['stderr_tail']}")
                report = json.loads((out / "nmprune_report.json").read_text())
                r.update(blocks=n, method=method, checkpoint_bytes=sizes[n],
                         above_bare_bytes=r["peak_rss_bytes"] - bare["peak_rss_bytes"],
                         perplexity=report["perplexity"], stage_seconds=report["seconds"],
                         output_bytes=checkpoint_bytes(out))
                r["fraction_of_checkpoint"] = r["above_bare_bytes"] / sizes[n]
                runs.append(r)
                shutil.rmtree(out)
            if n != max(blocks):
                shutil.rmtree(model)
        largest = WORK / f"llama-{max(blocks)}"
        limit = int(0.75 * sizes[max(blocks)]) // MB * MB
        group = memory_cgroup(limit)
        try:
            capped = measured(in_cgroup(group, prune_cmd(largest, WORK / "out-capped", methods[0])))
            automatic = measured(in_cgroup(group, prune_cmd(largest, WORK / "out-automatic", methods[0],
                                                            offload=None)))
            control = measured(in_cgroup(group, prune_cmd(largest, WORK / "out-control", methods[0],
                                                          offload=False)))
        finally:
            group.rmdir()
        for r in (capped, automatic, control):
            r.update(limit_bytes=limit, cgroup=str(group.parent), blocks=max(blocks), method=methods[0])
    finally:
        shutil.rmtree(WORK, ignore_errors=True)

    worst = {n: max(r["above_bare_bytes"] for r in runs if r["blocks"] == n) for n in blocks}
    growth = worst[max(blocks)] / worst[min(blocks)] if worst[min(blocks)] > 0 else None
    res = {"bare": bare, "runs": runs, "capped": capped, "automatic": automatic,
           "control_in_memory": control,
           "smollm2": smollm2,
           "target_fraction": TARGET_FRACTION,
           "fraction_ok": all(r["fraction_of_checkpoint"] <= TARGET_FRACTION for r in runs),
           "growth_largest_over_smallest": growth, "capped_ok": capped["rc"] == 0,
           "cpus": os.cpu_count(), "cpu": cpu_description(), "load_average_start": load,
           "load_average_end": os.getloadavg(),
           "commit": code_commit()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(res, indent=1))
    lines = ["# Peak memory of streamed pruning (`nmprune prune --offload`)", "",
             f"Random-weight Llama checkpoints (hidden {hidden}, intermediate {intermediate}, float32, "
             f"tied embeddings, 200 MB shards, a 4096-entry BPE tokenizer trained on 400k characters "
             f"of the wiki text), calibration 8 x 128 tokens of that text, "
             f"dense and pruned perplexity on 2048 of its held-out tokens (windows of 128), all streamed. "
             f"Commit {res['commit']}, {res['cpu']['model']} ({os.cpu_count()} cores; load average {load[0]:.1f} at the start, {res['load_average_end'][0]:.1f} "
             f"at the end). Peak RSS from `wait4` of each run; bare "
             f"`python -c \"import torch, transformers, nmprune\"`: {bare['peak_rss_bytes'] / MB:.0f} MiB.", "",
             "| blocks | checkpoint | method | peak RSS | above bare | / checkpoint (target <= 25%) | wall |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['blocks']} | {r['checkpoint_bytes'] / MB:.0f} MiB | {r['method']} | "
                     f"{r['peak_rss_bytes'] / MB:.0f} MiB | {r['above_bare_bytes'] / MB:.0f} MiB | "
                     f"{100 * r['fraction_of_checkpoint']:.1f}% | {r['seconds']:.0f} s |")
    lines += ["", f"Largest peak above bare, {max(blocks)} blocks over {min(blocks)} blocks: "
              f"{growth:.2f}x (checkpoint {sizes[max(blocks)] / sizes[min(blocks)]:.1f}x).", "",
              f"In a memory control group capped at {capped['limit_bytes'] / MB:.0f} MiB "
              f"({100 * capped['limit_bytes'] / sizes[max(blocks)]:.0f}% of the {max(blocks)}-block "
              f"checkpoint; `{capped['cgroup']}`, made directly since `systemd-run --scope -p MemoryMax=` "
              f"needs systemd as PID 1, which this machine lacks): the streamed {capped['method']} run "
              f"{'passes' if capped['rc'] == 0 else 'FAILS (exit ' + str(capped['rc']) + ')'} "
              f"(peak RSS {capped['peak_rss_bytes'] / MB:.0f} MiB, {capped['seconds']:.0f} s); without "
              f"`--offload` nmprune {'chooses streaming itself and passes' if automatic['rc'] == 0 else 'FAILS (exit ' + str(automatic['rc']) + ')'} "
              f"(peak {automatic['peak_rss_bytes'] / MB:.0f} MiB, {automatic['seconds']:.0f} s); forced "
              f"to load the model whole (`offload: false`) it "
              f"{'is killed, as expected' if control['rc'] != 0 else 'passes too'} (exit {control['rc']}).", ""]
    lines += [] if not smollm2 else ["## The packaged SmolLM2-135M (float32 safetensors), wanda, default calibration and evaluation", "",
              f"Checkpoint {smollm2[0]['checkpoint_bytes'] / MB:.0f} MiB; 64 x 512 calibration tokens, "
              "8192 evaluation tokens in windows of 512.", "",
              "| run | peak RSS | above bare | wiki perplexity dense / pruned | wall |", "|---|---:|---:|---|---:|"]
    for r in smollm2:
        ppl = r["perplexity"]
        lines.append(f"| {'streamed (--offload)' if r['offload'] else 'in memory'} | "
                     f"{r['peak_rss_bytes'] / MB:.0f} MiB | {r['above_bare_bytes'] / MB:.0f} MiB | "
                     f"{ppl['dense']['wiki']:.4f} / {ppl['pruned']['wiki']:.4f} | {r['seconds']:.0f} s |")
    lines += [""] + plan_lines()
    (RESULTS / "memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


# One rank of ``nmprune prune`` that writes its own peak RSS to PEAKS/rank-RANK.json when it
# exits: VmHWM, the high-water mark of this process's own memory map. (ru_maxrss would not do:
# it keeps the RSS of the process that forked it, this benchmark's, across the exec.)
RANK_WRAPPER = r"""
import atexit, json, os, sys
from pathlib import Path
from nmprune.cli import main
peaks = Path(os.environ["NMPRUNE_BENCH_PEAKS"])
rank = int(os.environ.get("RANK", "0"))
def hwm():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
atexit.register(lambda: (peaks / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss_bytes": hwm()})))
sys.exit(main(sys.argv[1:]))
"""


def ranks_run(model: Path, out: Path, method: str, ranks: int, offload: bool) -> dict:
    """``nmprune prune`` on ``ranks`` gloo ranks (torchrun, one machine): each rank's own
    peak RSS, the run's wall time and its report."""
    peaks = WORK / f"peaks-{out.name}"
    peaks.mkdir()
    wrapper = WORK / "rank_wrapper.py"
    wrapper.write_text(RANK_WRAPPER)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    cmd = [*launcher, str(wrapper), *prune_cmd(model, out, method, offload)[1:]]
    os.environ["NMPRUNE_BENCH_PEAKS"] = str(peaks)
    r = measured(cmd)
    if r["rc"] != 0:
        raise RuntimeError(f"{r['cmd']} failed:\n{r['stderr_tail']}")
    r["per_rank_peak_rss_bytes"] = [json.loads((peaks / f"rank-{i}.json").read_text())["peak_rss_bytes"]
                                    for i in range(ranks)]
    r["report"] = json.loads((out / "nmprune_report.json").read_text())
    return r


def same_masks(a: Path, b: Path) -> float:
    """Fraction of 2:4 cells with the same mask in the decoder layers of two saved models."""
    from safetensors.torch import load_file

    from nmprune.pattern import same_mask_cells

    def weights(path: Path) -> dict:
        return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()
                if ".layers." in k and k.endswith("proj.weight")}

    wa, wb = weights(a), weights(b)
    same = [same_mask_cells(wa[k], wb[k], 4) for k in wa]
    return float(sum(int(t.sum()) for t in same)) / sum(t.numel() for t in same) if same else float("nan")


def estimated_peak(model: Path, out: Path, method: str, ranks: int, offload: bool) -> int:
    """``nmprune prune --dry-run``'s peak CPU memory per rank for the run :func:`prune_cmd` makes."""
    from nmprune.cli import build_parser, config_from_args
    from nmprune.resources import plan_run

    config = config_from_args(build_parser().parse_args(prune_cmd(model, out, method, offload)[1:]))
    return plan_run(config, ranks, streamed=offload).cpu_peak_per_rank


def ranks_main(blocks: list[int], method: str, hidden: int, intermediate: int, ranks: int,
               smollm2: bool = True, name: str = "memory_ranks") -> None:
    """Issue 33's check: ``ranks`` streamed gloo ranks on the random checkpoints of ``blocks``
    blocks against one streamed process (per-rank peak RSS above a bare import, masks), and
    the same ranks loading the smallest model whole (each rank its own copy), into
    ``benchmarks/results/memory_ranks.{json,md}``."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    load = os.getloadavg()
    bare = measured([sys.executable, "-c", "import torch, transformers, nmprune"])
    rows = []
    try:
        for n in [*blocks, *(["SmolLM2"] if smollm2 else [])]:
            model = WORK / f"llama-{n}"
            if n == "SmolLM2":  # the packaged model as float32 safetensors, wiki text
                subprocess.run([sys.executable, "-c", CONVERT, str(model)], check=True)
                (model / "run.yaml").write_text("eval: [wiki]\ncalib: wiki\n")
                (model / "run_in_memory.yaml").write_text("eval: [wiki]\ncalib: wiki\noffload: false\n")
            else:
                subprocess.run([sys.executable, "-c", BUILD.format(hidden=hidden, inter=intermediate, blocks=n,
                                                                   heads=HEADS), str(model)], check=True)
            size = checkpoint_bytes(model)
            one = ranks_run(model, WORK / f"one-{n}", method, 1, True)
            layouts = [(True, WORK / f"ranks-{n}")] + ([(False, WORK / f"ranks-memory-{n}")] if n == min(blocks) else [])
            rows.append({"blocks": n, "checkpoint_bytes": size, "method": method, "ranks": 1, "streamed": True,
                         "seconds": one["seconds"], "per_rank_peak_rss_bytes": one["per_rank_peak_rss_bytes"],
                         "per_rank_above_bare_bytes": [p - bare["peak_rss_bytes"] for p in one["per_rank_peak_rss_bytes"]],
                         "estimated_peak_bytes": estimated_peak(model, WORK / f"one-{n}", method, 1, True),
                         "same_mask_cells_vs_one_rank": 1.0, "cmd": one["cmd"]})
            for offload, out in layouts:
                r = ranks_run(model, out, method, ranks, offload)
                rows.append({"blocks": n, "checkpoint_bytes": size, "method": method, "ranks": ranks,
                             "streamed": r["report"]["streamed"], "seconds": r["seconds"],
                             "per_rank_peak_rss_bytes": r["per_rank_peak_rss_bytes"],
                             "per_rank_above_bare_bytes": [p - bare["peak_rss_bytes"] for p in r["per_rank_peak_rss_bytes"]],
                             "same_mask_cells_vs_one_rank": same_masks(WORK / f"one-{n}", out),
                             "estimated_peak_bytes": estimated_peak(model, out, method, ranks, offload),
                             "perplexity": r["report"]["perplexity"]["pruned"], "cmd": r["cmd"]})
                shutil.rmtree(out)
            shutil.rmtree(WORK / f"one-{n}")
            shutil.rmtree(model)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    streamed = [r for r in rows if r["streamed"] and r["ranks"] == ranks and r["blocks"] in blocks]
    worst = {r["blocks"]: max(r["per_rank_above_bare_bytes"]) for r in streamed}
    for r in rows:
        r["estimate_over_measured"] = r["estimated_peak_bytes"] / max(r["per_rank_peak_rss_bytes"])
    res = {"bare": bare, "rows": rows, "target_fraction": TARGET_FRACTION,
           "fraction_ok": all(max(r["per_rank_above_bare_bytes"]) <= TARGET_FRACTION * r["checkpoint_bytes"]
                              for r in streamed),
           "growth_largest_over_smallest": worst[max(blocks)] / worst[min(blocks)],
           "masks_ok": all(r["same_mask_cells_vs_one_rank"] >= 0.999 for r in rows),
           "estimates_within_25_percent": all(abs(r["estimate_over_measured"] - 1) <= 0.25 for r in rows),
           "cpu": cpu_description(), "cpus": os.cpu_count(), "load_average_start": load,
           "load_average_end": os.getloadavg(),
           "commit": code_commit()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    res["prune_args"] = EXTRA_PRUNE_ARGS
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Peak memory per rank: {ranks} gloo ranks under torchrun", "",
             f"The random checkpoints of `memory.md` (hidden {hidden}, intermediate {intermediate}, float32), "
             f"{method}, {' '.join(EXTRA_PRUNE_ARGS) or 'the default reconstruction'}, 8 x 128 calibration "
             "tokens; each rank's own peak RSS "
             f"(VmHWM at exit), against one streamed process. Commit {res['commit']}, "
             f"{res['cpu']['model']} ({res['cpus']} cores, each rank 1 thread; load average {load[0]:.1f} at "
             f"the start, {res['load_average_end'][0]:.1f} at the end); bare import "
             f"{bare['peak_rss_bytes'] / MB:.0f} MiB.", "",
             "| blocks | checkpoint | ranks | weights | per-rank peak RSS | above bare (max) | / checkpoint "
             "(target <= 25%) | same masks as 1 rank | --dry-run estimate / measured | wall |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        above = max(r["per_rank_above_bare_bytes"])
        lines.append(f"| {r['blocks']} | {r['checkpoint_bytes'] / MB:.0f} MiB | {r['ranks']} | "
                     f"{'streamed' if r['streamed'] else 'in memory, one copy per rank'} | "
                     + ", ".join(f"{p / MB:.0f}" for p in r["per_rank_peak_rss_bytes"]) + " MiB | "
                     f"{above / MB:.0f} MiB | {100 * above / r['checkpoint_bytes']:.1f}% | "
                     f"{100 * r['same_mask_cells_vs_one_rank']:.2f}% | "
                     f"{r['estimated_peak_bytes'] / MB:.0f} MiB, {r['estimate_over_measured']:.2f}x | "
                     f"{r['seconds']:.0f} s |")
    lines += ["", f"Largest per-rank peak above bare, streamed, {max(blocks)} blocks over {min(blocks)}: "
              f"{res['growth_largest_over_smallest']:.2f}x (target <= 1.1x). The dry run's estimates "
              f"{'are all' if res['estimates_within_25_percent'] else 'are NOT all'} within 25% of the "
              "measured peaks.", ""]
    (RESULTS / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 24, 32])
    parser.add_argument("--methods", nargs="+", default=["wanda", "sparsegpt"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--skip-smollm2", action="store_true", help="no SmolLM2 runs (a quick check)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="instead: RANKS streamed torchrun ranks against one process, per-rank "
                        "peaks and masks (the first --methods only), into memory_ranks.{json,md}")
    parser.add_argument("--prune-args", default="", help="further nmprune prune flags for every run, "
                        "e.g. '--reconstruct none' (with --ranks: results named memory_ranks_<flags>)")
    args = parser.parse_args()
    EXTRA_PRUNE_ARGS.extend(args.prune_args.split())
    if args.ranks:
        name = "memory_ranks" + "".join(f"_{a.lstrip('-')}" for a in EXTRA_PRUNE_ARGS)
        ranks_main(args.blocks, args.methods[0], args.hidden, args.intermediate, args.ranks,
                   not args.skip_smollm2, name)
    else:
        main(args.blocks, args.methods, args.hidden, args.intermediate, not args.skip_smollm2)
