"""Speed of refine="exact" (direct batched Cholesky, PCG with the Jacobi and the inverse-Hessian
preconditioners, and the automatic choice) against 1000 steps of masked gradient descent
(refine="gd", paper eq. ``masked_gd``).

Problems: correlated layer Hessians from ``_problems.correlated_layer`` (``H = X X^T / n``,
rank-32 shared factors, outlier channel scales), float32, with a Wanda 2:4 mask. Shapes
576x576, 1536x576, 576x1536 (d_out x d_in) in full; 4096x4096 on its first ``ROWS_4096``
rows, with every time scaled to the 4096 rows (the rows are independent problems, and every
solver's cost is linear in d_out, except the inverse preconditioner's one inversion of H, which
is timed on its own and counted once) and gd run for ``GD_STEPS_4096`` steps with its time
scaled linearly to 1000 steps (its loss is the one after the steps it ran). "auto" is what the
refiner picks for the whole layer. Losses are
evaluated in float64; "gap" is relative to a float64 direct solve (omitted for 4096, where
that solve would take minutes). One intra-op thread; the load average is recorded.

Writes benchmarks/results/refine_speed.json and refine_speed.md.
Run: flock /tmp/nmprune-bench.lock python3 benchmarks/refine_speed.py
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _machine import cpu_description
from _problems import correlated_layer

from nmprune.algorithms.refine_exact import pick_preconditioner, pick_solver
from nmprune.solve import prune_layer
from nmprune.registry import get_refiner

RESULTS = ROOT / "benchmarks" / "results"
GD_STEPS = 1000
ROWS_4096 = 128
GD_STEPS_4096 = 20
SHAPES: list[tuple[int, int, int, int]] = [  # d_out, d_in, rows run, gd steps run
    (576, 576, 576, GD_STEPS),
    (1536, 576, 1536, GD_STEPS),
    (576, 1536, 576, GD_STEPS),
    (4096, 4096, ROWS_4096, GD_STEPS_4096),
]
VARIANTS = ("auto", "direct", "pcg-jacobi", "pcg-inverse")


def loss64(w: Tensor, w_star: Tensor, h: Tensor) -> float:
    d = w.double() - w_star.double()
    return float(((d @ h.double()) * d).sum())


def timed(fn: Callable[[], Tensor], repeat: int) -> tuple[Tensor, float]:
    """Result and best wall time of ``repeat`` runs."""
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_shape(d_out: int, d_in: int, rows: int, gd_steps: int) -> dict[str, Any]:
    w_full, h, _ = correlated_layer(d_out, d_in)
    w_star = w_full[:rows].contiguous()
    res = prune_layer(w_star, h, method="wanda")
    start, mask = res.weight, res.mask
    scale = d_out / rows
    exact, gd = get_refiner("exact").fn, get_refiner("gd").fn
    k = int(mask.sum(1).max())
    max_iter = inspect.signature(exact).parameters["max_iter"].default
    auto_solver = pick_solver(d_out, d_in, k, max_iter=max_iter)
    auto_pre = pick_preconditioner(d_out, d_in)
    options = {"auto": {"solver": "auto", "preconditioner": auto_pre},
               "direct": {"solver": "direct", "preconditioner": auto_pre},
               "pcg-jacobi": {"solver": "pcg", "preconditioner": "jacobi"},
               "pcg-inverse": {"solver": "pcg", "preconditioner": "inverse"}}
    # the one-off cost of the inverse preconditioner: a one-row refine with it (the inversion
    # and one row's few products)
    _, inverse_sec = timed(lambda: exact(start[:1], w_star[:1], h, mask[:1], solver="pcg",
                                         preconditioner="inverse"), 1)
    row: dict[str, Any] = {"shape": f"{d_out}x{d_in}", "rows_run": rows, "time_scale": scale,
                           "auto_picks": f"{auto_solver}, {auto_pre}", "inverse_seconds": inverse_sec,
                           "loss_wanda": loss64(start, w_star, h)}
    repeat = 2 if rows == d_out else 1
    out, sec = timed(lambda: gd(start, w_star, h, mask, steps=gd_steps), 1)
    row["gd"] = {"steps_run": gd_steps, "loss": loss64(out, w_star, h),
                 "seconds_1000": sec * scale * GD_STEPS / gd_steps}
    for name in VARIANTS:
        opts = options[name]
        out, sec = timed(lambda o=opts: exact(start, w_star, h, mask, **o), repeat)
        once = inverse_sec if opts["preconditioner"] == "inverse" else 0.0  # not per row
        sec = (sec - once) * scale + once
        row[f"exact_{name}"] = {**opts, "loss": loss64(out, w_star, h), "seconds": sec,
                                "ratio_to_gd": sec / row["gd"]["seconds_1000"]}
    if rows == d_out:
        ref = exact(start.double(), w_star.double(), h.double(), mask, solver="direct", tol=1e-12)
        ref_loss = loss64(ref, w_star, h)
        row["loss_float64_direct"] = ref_loss
        for key in ("gd", *(f"exact_{name}" for name in VARIANTS)):
            row[key]["gap"] = (row[key]["loss"] - ref_loss) / ref_loss
    print(json.dumps(row), flush=True)
    return row


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# refine=\"exact\" vs 1000 masked gd steps",
        "",
        (f"torch {meta['torch']}, {meta['cpu']}, torch threads: {meta['threads']}; "
         f"load average (1/5/15 min) before: {meta['load_before']}, after: {meta['load_after']}."),
        ("Correlated float32 problems (`_problems.correlated_layer`), Wanda 2:4 mask; losses in "
         "float64; gap relative to a float64 direct solve. Times: best of 2 (1 for 4096); where "
         "auto picks direct it runs the same code as direct, so their difference is timing noise "
         "on this shared machine."),
        (f"4096x4096: run on its first {ROWS_4096} rows, times scaled x{4096 // ROWS_4096} to all "
         f"rows (rows are independent; the inverse preconditioner's one inversion of H is counted "
         f"once); gd ran {GD_STEPS_4096} steps, time scaled to 1000 steps, loss after those steps. "
         "auto: the solver and preconditioner the refiner picks for the whole layer; direct "
         "polishes with that preconditioner."),
        "",
        "| shape | auto picks | inversion s | wanda loss | gd 1000 s | gd loss | solver | s | / gd | loss | gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for solver in VARIANTS:
            e = r[f"exact_{solver}"]
            gap = f"{e['gap']:.1e}" if "gap" in e else "-"
            lines.append(f"| {r['shape']} | {r['auto_picks']} | {r['inverse_seconds']:.2f} | {r['loss_wanda']:.4g} | "
                         f"{r['gd']['seconds_1000']:.2f} | {r['gd']['loss']:.6g} | {solver} | "
                         f"{e['seconds']:.2f} | {e['ratio_to_gd']:.3f} | {e['loss']:.6g} | {gap} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    meta = {"torch": torch.__version__, "cpu": cpu_description(),
            "threads": torch.get_num_threads(), "load_before": load()}
    rows = [run_shape(*shape) for shape in SHAPES]
    meta["load_after"] = load()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "refine_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (RESULTS / "refine_speed.md").write_text(markdown(meta, rows))


if __name__ == "__main__":
    main()
