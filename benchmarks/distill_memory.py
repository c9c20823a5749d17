"""The global distillation pass's peak memory and quality (issue 63, items 1 and 2): the pass
of one code version, with or without block checkpointing, in one process or sharded over
``ranks`` processes (:mod:`nmprune.stages.sharded_pass`, under torchrun, gloo), on one model
pruned and reconstructed without it (``nmprune prune --distill-epochs 0 --out BASE``).

Each row runs in a process of its own: it loads BASE, computes the dense model's top-k
distribution on the row's windows (the pipeline's windows: the calibration text's first
``nsamples``, cached in ``/tmp`` between rows), resets the process's peak resident set
(``/proc/self/clear_refs``), runs :func:`nmprune.stages.distillation.distill` as the
pipeline does (the held-out eighth, keep-if-better) and reads the peak again: the pass's
own peak is the rise over the resident set before it (sharded: each rank's, with the sharded
copy it builds, on its share of the windows). Then wiki and Austen perplexity.
``code=COMMIT`` runs the row on that commit's ``src/`` (a git worktree in /tmp), which
measures today's pass against an earlier one on the same machine, back to back.

    flock /tmp/nmprune-bench.lock python benchmarks/distill_memory.py --base runs/d0 \\
        --rows code=7010599 --rows checkpoint=0 --rows checkpoint=1 --rows ranks=2

Rows go to ``benchmarks/results/distill_memory/BASE/ROW.json``; the summary to
``benchmarks/results/distill_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _machine import code_commit, cpu_description

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ROWS_DIR = RESULTS / "distill_memory"
EVAL = ("wiki", "austen")
EVAL_TOKENS, EVAL_SEQLEN = 8192, 512
#: a row's settings: the windows (the default job's 64 + 128 own), the code (``here``: this
#: checkout) and block checkpointing
DEFAULTS = {"nsamples": 192, "seqlen": 512, "code": "here", "checkpoint": 0, "ranks": 1}
MIB = 1 << 20


def parse_row(spec: str) -> dict[str, Any]:
    row = dict(DEFAULTS)
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"unknown row setting {key!r}; one of {', '.join(DEFAULTS)}")
        row[key] = value if key == "code" else int(value)
    return row


def row_name(row: dict[str, Any]) -> str:
    return ",".join(f"{k}={row[k]}" for k in DEFAULTS if k != "ranks" or row[k] != 1)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(base: str, row: dict[str, Any]) -> dict[str, Any]:
    """One row, in this process (its code is whichever ``nmprune`` this process imports)."""
    import torch
    import torch.distributed as dist

    from nmprune.data import calibration_batch
    from nmprune.distill import DISTILL_TOPK, teacher_topk
    from nmprune.job import evaluate, open_model
    from nmprune.memory import release_memory
    from nmprune.reconstruct import FitOptions
    from nmprune.stages import distillation
    from nmprune.stages.reconstruction import held_out_batches

    torch.manual_seed(0)
    pruned, tokenizer, _ = open_model(base, None, "float32", False)
    calibration = calibration_batch(tokenizer, "wiki", row["nsamples"], row["seqlen"], seed=0)
    batches = list(calibration.split(1))
    cache = Path(f"/tmp/nmprune-distill-teachers-{row['nsamples']}x{row['seqlen']}.pt")
    if cache.exists():
        teachers = [distillation.TeacherTopK(*t) for t in torch.load(cache)]
    else:
        dense, _, _ = open_model(None, None, "float32", False)
        with torch.no_grad():
            teachers = [teacher_topk(dense.model(b).logits, DISTILL_TOPK) for b in batches]
        torch.save([(t.logp, t.ids) for t in teachers], cache)
        del dense
    release_memory()
    names = [n for i in range(len(pruned)) for n in pruned.layers(i)]
    options = FitOptions(1, 1e-3, 1, 0, precision="auto")
    extra = {"checkpoint_blocks": bool(row["checkpoint"])}
    if "checkpoint_blocks" not in inspect.signature(distillation.distill).parameters:
        if row["checkpoint"]:
            raise SystemExit(f"the code of row {row_name(row)} has no block checkpointing")
        extra = {}
    total, rank, all_reduce = len(batches), 0, (lambda tensors: None)
    positions = list(range(total))
    if row["ranks"] > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        positions = [g for g in positions if g * row["ranks"] // total == rank]  # contiguous shares

        def all_reduce(tensors):
            for t in tensors:
                dist.all_reduce(t)

    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    if row["ranks"] > 1:
        from nmprune.stages.sharded_pass import sharded_options

        options = sharded_options(options, row["ranks"])
    with _training_model(pruned, row["ranks"]) as model:
        weights = [model.get_submodule(n).weight for n in names]
        windows = distillation.PassWindows([batches[g] for g in positions], [teachers[g] for g in positions],
                                           positions, total, held_out_batches(total))
        record = distillation.distill(model, weights, windows, options,
                                      distillation.PassRuntime(all_reduce, torch.device("cpu"), progress=rank == 0),
                                      **extra)
    peak = _status("VmHWM")
    peaks = [(peak - before) / MIB]
    if row["ranks"] > 1:
        peaks = [None] * row["ranks"]
        dist.all_gather_object(peaks, (peak - before) / MIB)
        dist.destroy_process_group()
    ppl = evaluate(pruned, tokenizer, list(EVAL), EVAL_SEQLEN, EVAL_TOKENS, "cpu", progress=False) if rank == 0 else {}
    return {"row": row, "distillation": record, "rss_before_mib": before / MIB, "pass_peak_mib": max(peaks),
            "pass_peak_per_rank_mib": peaks, "perplexity": ppl, "rank": rank}


def _training_model(pruned: Any, ranks: int) -> Any:
    """The model the pass trains: ``pruned`` itself in one process, else its copy sharded over
    the ranks (:func:`nmprune.stages.sharded_pass.sharded_whole`, products in bfloat16 where
    the pass trains in it)."""
    from contextlib import nullcontext

    import torch

    if ranks == 1:
        return nullcontext(pruned.model)
    from nmprune.reconstruct import training_dtype
    from nmprune.stages.sharded_pass import sharded_whole
    from nmprune.stages.sink import ModelSink

    weights = [m.weight for i in range(len(pruned)) for m in pruned.layers(i).values()]
    return sharded_whole(pruned, ModelSink(pruned), torch.device("cpu"),
                         training_dtype("auto", weights, torch.device("cpu")))


def _worktree(commit: str) -> Path:
    path = Path(f"/tmp/nmprune-code-{commit}")
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True)
    return path


def run_row(base: str, row: dict[str, Any]) -> dict[str, Any]:
    """The row in a process of its own, on its code."""
    src = ROOT / "src" if row["code"] == "here" else _worktree(row["code"]) / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    started = time.perf_counter()
    launcher = [sys.executable] if row["ranks"] == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(row["ranks"])]
    out = subprocess.run([*launcher, __file__, "--base", base, "--measure", row_name(row)], env=env,
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    result = next(r for r in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))
                  if r["rank"] == 0)
    result["commit"] = code_commit() if row["code"] == "here" else row["code"]
    result["seconds"] = time.perf_counter() - started
    return result


def markdown(rows: list[dict[str, Any]], machine: dict[str, str]) -> str:
    lines = ["# The global distillation pass's peak memory on SmolLM2 (issue 63)", "",
             "One epoch on the default job's windows, from a model pruned with `--distill-epochs 0`, in one "
             "process or sharded over `ranks` (torchrun, gloo; each rank one thread); "
             f"CPU {machine.get('model', '?')} ({machine.get('llvm_target', '?')}), rows back to back. "
             "`pass peak`: the rise of the resident set during the pass over the set before it (the model "
             "and the dense distribution loaded; sharded, the largest rank's). `code`: the commit of the pass.", "",
             "| base | code | windows | checkpointing | ranks | steps | pass peak MiB | held-out KL before -> after | "
             "kept | wiki | Austen | pass s | train dtype |",
             "|---|---|---:|---|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        s, d, p = r["row"], r["distillation"], r["perplexity"]
        lines.append(f"| {r['base']} | {r['commit']} | {s['nsamples']} x {s['seqlen']} | "
                     f"{'blocks' if s['checkpoint'] else 'none'} | {s.get('ranks', 1)} | {d['steps']} | "
                     f"{r['pass_peak_mib']:.0f} | "
                     f"{d['heldout_before']:.4f} -> {d['heldout_trained']:.4f} | {d['kept']} | {p['wiki']:.2f} | "
                     f"{p['austen']:.2f} | {d['seconds']:.0f} | {d['train_dtype']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a run pruned with --distill-epochs 0")
    parser.add_argument("--rows", action="append", default=[], help="e.g. checkpoint=1 or code=COMMIT (repeatable)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one row in this process: the rows' subprocess
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.base, parse_row(args.measure))))
        return
    name = Path(args.base).name
    folder = ROWS_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    machine = cpu_description()
    for spec in args.rows:
        row = parse_row(spec)
        path = folder / f"{row_name(row)}.json"
        if path.exists() and not args.force:
            continue
        result = run_row(args.base, row)
        result.update(base=name, cpu=machine)
        path.write_text(json.dumps(result, indent=1))
        print(row_name(row), f"{result['pass_peak_mib']:.0f} MiB", result["perplexity"], flush=True)
    rows = [json.loads(p.read_text()) for p in sorted(ROWS_DIR.glob("*/*.json"))]
    (RESULTS / "distill_memory.json").write_text(json.dumps({"cpu": machine, "rows": rows}, indent=1))
    (RESULTS / "distill_memory.md").write_text(markdown(rows, machine))
    print(markdown(rows, machine))


if __name__ == "__main__":
    main()
