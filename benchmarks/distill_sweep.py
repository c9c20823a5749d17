"""Levers of the global distillation pass (issue 45, item 4), swept on one model pruned and
reconstructed without it (``nmprune prune --distill-epochs 0 --out BASE``).

Each row loads BASE's weights, distils them towards the dense model's next-token distribution
with the pipeline's own stage (:func:`nmprune.stages.distillation.distill`: the top-k KL, the
held-out eighth, the keep-if-better rule) and measures wiki and Austen perplexity. The dense
distribution here comes from the dense model's forward pass, which is what the pipeline carries
through the blocks. A row's ``nsamples`` may exceed the run's calibration set: the calibration
text is drawn again with that many windows (the first ones are not the same windows), which
measures what more distillation data alone would give; ``seed=N`` draws them with another
calibration seed, which measures how much one draw of the windows moves the result.

Rows are written to ``benchmarks/results/distill_sweep/BASE/ROW.json`` (BASE: the base run's
folder name) when done and skipped by a later run (``--force`` redoes them); the summary of
every base's rows is ``benchmarks/results/distill_sweep.{json,md}``.

    flock /tmp/nmprune-bench.lock python benchmarks/distill_sweep.py --base runs/d0 \\
        --rows lr=1e-3 --rows lr=2e-3 --rows lr=1e-3,nsamples=128 --rows nsamples=128,seed=1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from _machine import code_commit, cpu_description

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ROWS_DIR = RESULTS / "distill_sweep"
EVAL = ("wiki", "austen")
EVAL_TOKENS, EVAL_SEQLEN = 8192, 512
#: a row's settings and their defaults (the pipeline's: one epoch, lr 1e-3, the run's 64 x 512)
DEFAULTS = {"lr": 1e-3, "epochs": 1, "nsamples": 64, "seqlen": 512, "topk": 64}
#: a row's draw of its windows from the text (the calibration seed; 0: the runs' own seed), left
#: out of the names of rows drawn with 0
SEED = "seed"


def parse_row(spec: str) -> dict[str, Any]:
    """``lr=2e-3,nsamples=128`` -> the row's settings over :data:`DEFAULTS`."""
    row = dict(DEFAULTS)
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == SEED:
            row[SEED] = int(value)
            continue
        if key not in DEFAULTS:
            raise SystemExit(f"unknown row setting {key!r}; one of {', '.join([*DEFAULTS, SEED])}")
        row[key] = type(DEFAULTS[key])(float(value)) if key != "lr" else float(value)
    return row


def row_name(row: dict[str, Any]) -> str:
    return ",".join([f"{k}={row[k]:g}" for k in DEFAULTS] + ([f"{SEED}={row[SEED]}"] if row.get(SEED) else []))


def run_row(base: str, row: dict[str, Any], precision: str) -> dict[str, Any]:
    """Distil BASE's pruned weights with ``row``'s settings; its perplexities and times."""
    from nmprune.data import calibration_batch
    from nmprune.distill import teacher_topk
    from nmprune.job import evaluate, open_model
    from nmprune.reconstruct import FitOptions
    from nmprune.stages.distillation import PassRuntime, PassWindows, distill
    from nmprune.stages.reconstruction import held_out_batches

    torch.manual_seed(0)
    dense, tokenizer, _ = open_model(None, None, "float32", False)
    pruned, _, _ = open_model(base, None, "float32", False)
    calibration = calibration_batch(tokenizer, "wiki", row["nsamples"], row["seqlen"], seed=row.get(SEED, 0))
    batches = list(calibration.split(1))
    started = time.perf_counter()
    with torch.no_grad():
        teachers = [teacher_topk(dense.model(b).logits, row["topk"]) for b in batches]
    teacher_seconds = time.perf_counter() - started
    del dense
    weights = [m.weight for i in range(len(pruned)) for m in pruned.layers(i).values()]
    options = FitOptions(row["epochs"], row["lr"], 1, 0, precision=precision)
    windows = PassWindows(batches, teachers, list(range(len(batches))), len(batches), held_out_batches(len(batches)))
    record = distill(pruned.model, weights, windows, options,
                     PassRuntime(lambda tensors: None, torch.device("cpu"), progress=True))
    ppl = evaluate(pruned, tokenizer, list(EVAL), EVAL_SEQLEN, EVAL_TOKENS, "cpu", progress=False)
    return {"row": row, "distillation": record, "teacher_seconds": teacher_seconds, "perplexity": ppl}


def markdown(bases: dict[str, dict[str, Any]], rows: list[dict[str, Any]], machine: dict[str, str]) -> str:
    lines = ["# Global distillation levers on SmolLM2 (issue 45)", "",
             "Each base is a run pruned with `--distill-epochs 0`: `default` with the other settings "
             "at their defaults, `reconstruct-epochs-1` with one reconstruction epoch (`d0`: the default of "
             "cac73b4, the same pruned model as `default`); "
             f"CPU {machine.get('model', '?')} ({machine.get('llvm_target', '?')}). Compare the rows' perplexities; "
             "their times only where both ran alone (the 192-window row shared the CPU with the test suite, "
             "the seed-1 row its teacher s). "
             "`code`: the commit checked out when the row was written.", "",
             "| base | base wiki | base Austen |", "|---|---:|---:|"]
    lines += [f"| {name} | {b['wiki']:.2f} | {b['austen']:.2f} |" for name, b in bases.items()]
    lines += ["", "| base | lr | epochs | samples | top-k | wiki | Austen | held-out KL before -> after | kept | "
              "teacher s | pass s | code |", "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|"]
    for r in rows:
        s, d, p = r["row"], r["distillation"], r["perplexity"]
        seed = f" (seed {s[SEED]})" if s.get(SEED) else ""
        lines.append(f"| {r['base']} | {s['lr']:g} | {s['epochs']} | {s['nsamples']}{seed} | {s['topk']} | "
                     f"{p['wiki']:.2f} | {p['austen']:.2f} | {d['heldout_before']:.4f} -> {d['heldout_trained']:.4f} | {d['kept']} | "
                     f"{r['teacher_seconds']:.0f} | {d['seconds']:.0f} | {r['commit']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a run pruned with --distill-epochs 0 (its folder name "
                        "names it in the table)")
    parser.add_argument("--rows", action="append", default=[], help="e.g. lr=2e-3,nsamples=128 (repeatable)")
    parser.add_argument("--precision", default="auto", help="--train-precision of the pass")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    from nmprune.job import evaluate, open_model

    name = Path(args.base).name
    folder = ROWS_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    machine = cpu_description()
    base_file = folder / "base.json"
    if not base_file.exists() or args.force:
        model, tokenizer, _ = open_model(args.base, None, "float32", False)
        base_file.write_text(json.dumps(evaluate(model, tokenizer, list(EVAL), EVAL_SEQLEN, EVAL_TOKENS, "cpu",
                                                 progress=False)))
    for spec in args.rows:
        row = parse_row(spec)
        path = folder / f"{row_name(row)}.json"
        if path.exists() and not args.force:
            continue
        result = run_row(args.base, row, args.precision)
        result.update(base=name, commit=code_commit(), cpu=machine)
        path.write_text(json.dumps(result, indent=1))
        print(row_name(row), result["perplexity"], flush=True)
    bases = {p.name: json.loads((p / "base.json").read_text()) for p in sorted(ROWS_DIR.iterdir()) if p.is_dir()}
    rows = [json.loads(p.read_text()) for p in sorted(ROWS_DIR.glob("*/*=*.json"))]
    rows.sort(key=lambda r: [r["base"], *(r["row"][k] for k in DEFAULTS), r["row"].get(SEED, 0)])
    (RESULTS / "distill_sweep.json").write_text(json.dumps({"bases": bases, "cpu": machine, "rows": rows}, indent=1))
    (RESULTS / "distill_sweep.md").write_text(markdown(bases, rows, machine))
    print(markdown(bases, rows, machine))


if __name__ == "__main__":
    main()
