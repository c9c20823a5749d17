"""The solvers' registered costs (``cost``, ``entry_cost``: seconds per ``rows x d_in^2`` and per
``rows x d_in`` of one layer solve, :mod:`nmprune.registry`), measured on this CPU.

Every registered method and refiner solves layers of six shapes (SmolLM2-135M's three and the
three of ``benchmarks/distributed.py --scaling``'s Llama) with correlated synthetic Hessians
(``_problems.py``), 2:4, float32, each timed as the median of ``--repeats`` runs; a refiner
refines the default method's mask. A non-negative least-squares fit of
``seconds = cost x rows x d_in^2 + entry_cost x rows x d_in`` to each solver's times, relative
(every shape weighs alike), gives its two costs. The registrations quote them (to two
significant digits; tests/test_solver_costs.py holds them to this file); the fit's
largest error per shape shows how far the two-term model is from the times.

Writes benchmarks/results/solver_costs.{json,md}. Run (2 threads, alone on the machine):
    flock /tmp/nmprune-bench.lock python benchmarks/solver_costs.py [--repeats 3]
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _machine import code_commit, cpu_description  # noqa: E402
from _problems import correlated_layer  # noqa: E402

from nmprune.prox import prox_2of4  # noqa: E402
from nmprune.registry import get_refiner, methods, refiners  # noqa: E402
from nmprune.solve import solve  # noqa: E402
from nmprune.stages.plan import resolve_plan  # noqa: E402

RESULTS = Path(__file__).parent / "results"
#: (d_out, d_in): SmolLM2-135M's q/o, gate/up and down projections, then the scaling Llama's
SHAPES = [(576, 576), (1536, 576), (576, 1536), (512, 512), (1376, 512), (512, 1376)]


def fit(times: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """``(cost, entry_cost, worst)``: the non-negative least-squares fit of
    ``t = cost x rows x d_in^2 + entry_cost x rows x d_in`` to ``times`` (by shape), in relative
    error, and its largest relative error. Two unknowns: the best of the unconstrained fit
    (when both are non-negative) and the two one-term fits."""
    shapes = list(times)
    columns = torch.tensor([[r * d * d, r * d] for r, d in shapes], dtype=torch.float64)
    y = torch.tensor([times[s] for s in shapes], dtype=torch.float64)
    a = columns / y[:, None]  # relative: every shape's error counts as a fraction of its time
    ones = torch.ones(len(shapes), dtype=torch.float64)
    candidates = []
    both = torch.linalg.lstsq(a, ones[:, None]).solution[:, 0]
    if (both >= 0).all():
        candidates.append(both)
    for k in range(2):
        x = torch.zeros(2, dtype=torch.float64)
        x[k] = (a[:, k] @ ones) / (a[:, k] @ a[:, k])
        candidates.append(x)
    best = min(candidates, key=lambda x: float(((a @ x - ones) ** 2).sum()))
    worst = float((a @ best - ones).abs().max())
    return float(best[0]), float(best[1]), worst


def time_solver(kind: str, name: str, repeats: int) -> dict[tuple[int, int], float]:
    """Median seconds of ``name`` on each of :data:`SHAPES`."""
    times = {}
    for d_out, d_in in SHAPES:
        w, h, mean = correlated_layer(d_out, d_in, seed=d_out + d_in)
        if kind == "method":
            plan = resolve_plan(name, None, "2:4", {}, 0.0)
            stats = {s: {"input_mean": mean}[s] for s in plan.statistics}
            runs = [solve(w, h, plan, stats).seconds_method for _ in range(repeats)]
        else:
            base = solve(w, h, resolve_plan("prox", None, "2:4", {}, 0.0), {})
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                get_refiner(name).fn(base.weight, w, h, base.mask)
                runs.append(time.perf_counter() - start)
        times[(d_out, d_in)] = statistics.median(runs)
        print(f"{kind} {name} {d_out}x{d_in}: {times[(d_out, d_in)]:.3f} s", flush=True)
    return times


def markdown(result: dict) -> str:
    cpu = result["cpu"]
    lines = [f"# Solver costs (`benchmarks/solver_costs.py`, code of {result['commit']})", "",
             f"CPU {cpu['model']} ({cpu['llvm_target']}), {result['threads']} threads; median of "
             f"{result['repeats']} runs per shape; correlated synthetic Hessians, 2:4, float32. The fit: "
             "seconds = cost x rows x d_in^2 + entry_cost x rows x d_in (non-negative, relative error).", "",
             "| solver | cost | entry_cost | worst fit error | "
             + " | ".join(f"{r}x{d} s" for r, d in SHAPES) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(SHAPES)]
    for row in result["solvers"]:
        lines.append(f"| {row['kind']} `{row['name']}` | {row['cost']:.2g} | {row['entry_cost']:.2g} | "
                     f"{100 * row['worst']:.0f}% | "
                     + " | ".join(f"{t:.3f}" for t in row["seconds"]) + " |")
    return "\n".join(lines) + "\n"


def main(repeats: int = 3) -> None:
    prox_2of4(torch.randn(64, 4), 0.1)  # compile (or load) the prox kernels before timing
    rows = []
    for kind, name in itertools.chain((("method", m) for m in methods()), (("refiner", r) for r in refiners())):
        times = time_solver(kind, name, repeats)
        cost, entry_cost, worst = fit(times)
        rows.append({"kind": kind, "name": name, "cost": cost, "entry_cost": entry_cost, "worst": worst,
                     "seconds": list(times.values())})
    result = {"cpu": cpu_description(), "commit": code_commit(), "threads": torch.get_num_threads(),
              "repeats": repeats, "shapes": SHAPES, "solvers": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "solver_costs.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (RESULTS / "solver_costs.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 3)
