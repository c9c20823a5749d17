"""What the per-layer Wanda reference of the report costs next to the layer solve.

``nmprune.stages.executor.run_job`` solves every layer with its plan and then, only for the report
(``loss_wanda``, ``loss_vs_wanda``, the summary's ``mean_loss_vs_wanda``), computes the local
loss of Wanda's mask with the same pattern and dampening. This times both on synthetic layers
of SmolLM2-135M's shapes (correlated Hessians, ``_problems.correlated_layer``; 2:4, float32,
damp 0.01 as the default settings) for the default plan (prox + exact) and the baselines, with
and without exact refinement:

* ``solve``: ``nmprune.solve.solve`` with the plan (what ``run_job`` runs before the reference);
* ``reference``: ``nmprune.stages.executor.wanda_loss`` (what ``run_job`` runs now: nothing when the
  plan's method stage is Wanda itself, whose loss is the reference, else Wanda and one loss
  product);
* ``reference_via_solve``: what ``run_job`` ran before, ``local_loss(solve(W, H,
  wanda_reference).weight, W, H)`` (tensor checks, mask completion and a second loss product;
  nothing when the plan was the reference itself, i.e. Wanda without refinement).

Each configuration runs once to warm up (numba, allocator), then ``--runs`` times; a run
times the solve and both references back to back on the same problem (wall seconds; the
process's CPU seconds are kept in the JSON too). Medians of the runs. ``--threads`` sets
torch's intra-op threads (default: torch's own choice).
Besides the four shapes, the table gives one SmolLM2 block (q, k, v, o, gate, up, down: the
sums of the shapes' medians, 576x576 twice, 192x576 twice, 1536x576 twice, 576x1536 once).

Writes benchmarks/results/wanda_reference.{json,md}. Run (alone on the machine):
    flock /tmp/nmprune-bench.lock python benchmarks/wanda_reference.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _machine import cpu_description  # noqa: E402
from _problems import correlated_layer  # noqa: E402

from nmprune.stages.executor import wanda_loss  # noqa: E402
from nmprune.loss import local_loss  # noqa: E402
from nmprune.stages.plan import resolve_plan, wanda_reference  # noqa: E402
from nmprune.solve import solve  # noqa: E402

# (name, d_out, d_in, layers of that shape in one SmolLM2-135M block)
SHAPES = [("q_proj/o_proj", 576, 576, 2), ("k_proj/v_proj", 192, 576, 2),
          ("gate/up_proj", 1536, 576, 2), ("down_proj", 576, 1536, 1)]
CONFIGS = [("prox", "exact"), ("prox", None), ("sparsegpt", "exact"), ("sparsegpt", None),
           ("wanda", "exact"), ("wanda", None), ("magnitude", "exact"), ("magnitude", None)]
DAMP = 0.01  # PruneSettings' default


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    lines = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return lines[0] if lines else "unknown"


CPU_SECONDS: list[float] = []  # the process CPU seconds of each timed() call, in order


def timed(fn):
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    CPU_SECONDS.append(time.process_time() - cpu)
    return out, time.perf_counter() - start


def measure(method: str, refine: str | None, d_out: int, d_in: int, runs: int) -> dict:
    w, h, mean = correlated_layer(d_out, d_in, seed=0)
    plan = resolve_plan(method, refine, "2:4", {}, DAMP)
    reference = wanda_reference(plan.pattern, plan.damp)
    same_stage = replace(plan, refiner=None, refiner_options={}) == reference
    stats = {"input_mean": mean} if "input_mean" in plan.statistics else {}
    rows, cpu = [], []
    for i in range(runs + 1):
        CPU_SECONDS.clear()
        result, t_solve = timed(lambda: solve(w, h, plan, stats))
        loss, t_ref = timed(lambda: wanda_loss(w, h, plan, result.loss_method))
        before, t_before = (result.loss_method, 0.0) if plan == reference else \
            timed(lambda: local_loss(solve(w, h, reference).weight, w, h))
        assert abs(before - loss) <= 1e-5 * abs(before), (before, loss)
        if i:  # the first run warms up
            rows.append((t_solve, t_ref, t_before))
            cpu.append(tuple(CPU_SECONDS) + (0.0,) * (3 - len(CPU_SECONDS)))
    t_solve, t_ref, t_before = (statistics.median(c) for c in zip(*rows))
    c_solve, c_ref, c_before = (statistics.median(c) for c in zip(*cpu))
    return {"method": method, "refine": refine, "d_out": d_out, "d_in": d_in, "runs": runs,
            "reference_is_method_stage": same_stage,
            "solve_s": t_solve, "reference_s": t_ref, "reference_via_solve_s": t_before,
            "fraction": t_ref / t_solve, "fraction_via_solve": t_before / t_solve,
            "solve_cpu_s": c_solve, "reference_cpu_s": c_ref, "reference_via_solve_cpu_s": c_before,
            "solve_s_all": [r[0] for r in rows], "reference_s_all": [r[1] for r in rows],
            "reference_via_solve_s_all": [r[2] for r in rows]}


def label(method: str, refine: str | None) -> str:
    return method + (f" + {refine}" if refine else "")


def write(results: dict, out: Path) -> None:
    (out / "wanda_reference.json").write_text(json.dumps(results, indent=1))
    m = results["machine"]
    lines = ["# Cost of the per-layer Wanda reference", "",
             f"CPU: {m['lscpu_model']} (`/proc/cpuinfo`: {m['cpu']['model']}, LLVM target "
             f"{m['cpu']['llvm_target']}), {m['threads']} torch threads, load average "
             f"{m['load_before']:.2f} before / {m['load_after']:.2f} after; torch {m['torch']}. "
             f"Synthetic correlated layers (`_problems.correlated_layer`), 2:4, float32, damp {DAMP}; "
             f"medians of {results['runs']} runs after one warm-up run.", "",
             "`reference` is `executor.wanda_loss` (what `run_job` computes now; ~0 when the plan's "
             "method is Wanda, whose own loss is the reference), `via solve` what `run_job` computed "
             "before, `local_loss(solve(W, H, wanda_reference))` (0 for Wanda without refinement). "
             "Fractions are of the solve (`solve.solve` with the plan).", "",
             "| plan | shape | solve s | reference s | fraction | via solve s | fraction via solve |",
             "|---|---|---|---|---|---|---|"]
    for r in results["layers"]:
        lines.append(f"| {label(r['method'], r['refine'])} | {r['d_out']}x{r['d_in']} | {r['solve_s']:.4f} | "
                     f"{r['reference_s']:.4f} | {100 * r['fraction']:.2f}% | {r['reference_via_solve_s']:.4f} | "
                     f"{100 * r['fraction_via_solve']:.2f}% |")
    lines += ["", "One SmolLM2-135M block (2 x 576x576, 2 x 192x576, 2 x 1536x576, 1 x 576x1536):", "",
              "| plan | solve s | reference s | fraction | via solve s | fraction via solve |",
              "|---|---|---|---|---|---|"]
    for b in results["blocks"]:
        lines.append(f"| {label(b['method'], b['refine'])} | {b['solve_s']:.3f} | {b['reference_s']:.4f} | "
                     f"{100 * b['fraction']:.2f}% | {b['reference_via_solve_s']:.4f} | "
                     f"{100 * b['fraction_via_solve']:.2f}% |")
    (out / "wanda_reference.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = {"lscpu_model": lscpu_model(), "cpu": cpu_description(), "threads": torch.get_num_threads(),
               "load_before": os.getloadavg()[0], "torch": torch.__version__}
    layers = []
    for method, refine in CONFIGS:
        for _, d_out, d_in, _count in SHAPES:
            r = measure(method, refine, d_out, d_in, args.runs)
            print(json.dumps({k: v for k, v in r.items() if not k.endswith("_all")}), flush=True)
            layers.append(r)
    blocks = []
    for method, refine in CONFIGS:
        mine = {(r["d_out"], r["d_in"]): r for r in layers if (r["method"], r["refine"]) == (method, refine)}
        total = {key: sum(count * mine[(d_out, d_in)][key] for _, d_out, d_in, count in SHAPES)
                 for key in ("solve_s", "reference_s", "reference_via_solve_s")}
        blocks.append({"method": method, "refine": refine, **total,
                       "fraction": total["reference_s"] / total["solve_s"],
                       "fraction_via_solve": total["reference_via_solve_s"] / total["solve_s"]})
    machine["load_after"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    write({"machine": machine, "runs": args.runs, "damp": DAMP, "layers": layers, "blocks": blocks},
           args.out)


if __name__ == "__main__":
    main()
