"""Speed and accuracy of the proximal operators.

* 2:4 prox, float32, 2^20 cells with mixed lam: cells/second of the default exact solver
  ("reduced"), of the damped-Newton exact solver ("newton") and of the paper's GD solver (on a
  subsample, stated), at the default intra-op thread count and at one thread;
* worst relative objective gap of each solver vs the float64 brute-force reference
  (tests/prox_bruteforce.py) on a sample of easy and hard cells; the GD solver both with its
  defaults (float32) and run "to the same accuracy" (float64, tol 1e-12, 20000 steps);
* the prox of a whole 1536x576 float32 matrix vs the matmul W @ H (H 576x576), timed back to
  back in the same process (the machine is shared: the load average is recorded), at one lam
  (the median 2-sparse threshold, a hard mix of the three cases) and inside a whole
  proximal-gradient run of the default `prox` pruner on a layer-like problem (every
  iteration's prox call timed; lam grows from "most cells dense" to "all 2-sparse");
* the general N:M prox (4:8, 3:6, 2:8) vs brute force.

Writes benchmarks/results/prox_speed.json and prox_speed.md.
Run: flock /tmp/nmprune-bench.lock python benchmarks/prox_speed.py
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _machine import cpu_description  # noqa: E402
from _problems import correlated_layer  # noqa: E402
from prox_bruteforce import objective, reference_min  # noqa: E402

from nmprune.algorithms.prox import prox_gradient  # noqa: E402
from nmprune.pattern import NMPattern  # noqa: E402
from nmprune.registry import get_method  # noqa: E402
from nmprune.prox import prox_2of4, prox_nm  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def mixed_cells(n: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian cells; lam log-uniform over [10^-1.5, 10] / max|z|, so the three cases mix."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 4, generator=g, dtype=torch.float64)
    lam = 10 ** torch.empty(n, dtype=torch.float64).uniform_(-1.5, 1.0, generator=g)
    lam = lam / z.abs().amax(-1)
    return z.to(dtype), lam.to(dtype)


def hard_cells(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Near-ties, exact ties, zeros and scales 1e-3..1e3."""
    g = torch.Generator().manual_seed(seed)
    q = n // 4
    base = torch.rand(q, 1, generator=g, dtype=torch.float64) + 0.5
    parts = [
        base + 1e-6 * torch.randn(q, 4, generator=g, dtype=torch.float64),
        base + 1e-2 * torch.randn(q, 4, generator=g, dtype=torch.float64),
        torch.randint(1, 4, (q, 4), generator=g).to(torch.float64),
    ]
    zz = torch.randn(n - 3 * q, 4, generator=g, dtype=torch.float64)
    zz[torch.rand(zz.shape, generator=g) < 0.3] = 0.0
    parts.append(zz)
    z = torch.cat(parts) * 10 ** torch.empty(n, 1, dtype=torch.float64).uniform_(-3, 3, generator=g)
    z = z * torch.where(torch.rand(z.shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    lam = 10 ** torch.empty(n, dtype=torch.float64).uniform_(-2, 1.3, generator=g)
    return z, lam / z.abs().amax(-1).clamp_min(1e-30)


def timed(fn, repeat: int = 3) -> float:
    """Best wall time of ``repeat`` runs (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def worst_gap(w: torch.Tensor, z: torch.Tensor, lam: torch.Tensor, ref: torch.Tensor, n: int) -> float:
    f = objective(w.to(torch.float64), z, lam, n)
    return float(((f - ref) / (ref.abs() + 1e-12 * z.square().sum(-1) + 1e-300)).max())


def main() -> None:
    threads = torch.get_num_threads()
    res: dict = {"torch": torch.__version__, "cpu": cpu_description(),
                 "default_threads": threads, "load_average_at_start": os.getloadavg()}

    # ---- throughput, 2^20 cells float32 -------------------------------------------------------
    z, lam = mixed_cells(1 << 20, 0)
    sub = 1 << 16
    speed = {}
    for nt in sorted({threads, 1}):
        torch.set_num_threads(nt)
        t_reduced = timed(lambda: prox_2of4(z, lam), repeat=2)
        t_newton = timed(lambda: prox_2of4(z, lam, solver="newton"), repeat=1)
        t_gd = timed(lambda: prox_2of4(z[:sub], lam[:sub], solver="gd"), repeat=1)
        t_gd_acc = timed(lambda: prox_2of4(z[:sub].double(), lam[:sub].double(), solver="gd",
                                           gd_max_iter=20000, gd_tol=1e-12), repeat=1)
        speed[f"threads={nt}"] = {
            "reduced_cells_per_s": z.shape[0] / t_reduced,
            "reduced_seconds_2^20": t_reduced,
            "newton_cells_per_s": z.shape[0] / t_newton,
            "gd_default_fp32_cells_per_s (2^16 subsample)": sub / t_gd,
            "gd_same_accuracy_fp64_cells_per_s (2^16 subsample)": sub / t_gd_acc,
            "speedup_vs_gd_default": (z.shape[0] / t_reduced) / (sub / t_gd),
            "speedup_vs_gd_same_accuracy": (z.shape[0] / t_reduced) / (sub / t_gd_acc),
            "speedup_vs_newton": t_newton / t_reduced,
        }
    torch.set_num_threads(threads)
    res["throughput"] = speed

    # ---- accuracy vs brute force ---------------------------------------------------------------
    zm, lm = mixed_cells(2000, 1, torch.float64)
    zh, lh = hard_cells(2000, 2)
    za, la = torch.cat([zm, zh]), torch.cat([lm, lh])
    ref = reference_min(za, la, 2, iters=1500)
    z32, l32 = za.float(), la.float()
    z32d, l32d = z32.double(), l32.double()
    ref32 = reference_min(z32d, l32d, 2, iters=1500, seed=1)
    res["accuracy_2of4"] = {
        "cells": len(za),
        "reduced_fp64_worst_rel_gap": worst_gap(prox_2of4(za, la), za, la, ref, 2),
        "reduced_fp32_io_worst_rel_gap": worst_gap(prox_2of4(z32, l32), z32d, l32d, ref32, 2),
        "newton_fp64_worst_rel_gap": worst_gap(prox_2of4(za, la, solver="newton"), za, la, ref, 2),
        "newton_fp32_io_worst_rel_gap": worst_gap(prox_2of4(z32, l32, solver="newton"), z32d, l32d, ref32, 2),
        "gd_default_fp32_worst_rel_gap": worst_gap(prox_2of4(z32, l32, solver="gd"), z32d, l32d, ref32, 2),
        "gd_same_accuracy_fp64_worst_rel_gap": worst_gap(
            prox_2of4(za, la, solver="gd", gd_max_iter=20000, gd_tol=1e-12), za, la, ref, 2),
    }

    # ---- one 1536 x 576 matrix vs W @ H --------------------------------------------------------
    g = torch.Generator().manual_seed(3)
    w_mat = torch.randn(1536, 576, generator=g) * 0.02
    h = torch.randn(576, 576, generator=g)
    h = h @ h.T / 576
    cells = w_mat.reshape(-1, 4)
    a = cells.abs().sort(-1, descending=True).values
    lam_mat = float((a[:, 2] / (a[:, 0] * a[:, 1])).median())  # half the cells near their 2:4 threshold
    matrix = {}
    for nt in sorted({threads, 1}):
        torch.set_num_threads(nt)
        t_prox = timed(lambda: prox_2of4(cells, lam_mat), repeat=3)
        t_mm = timed(lambda: w_mat @ h, repeat=5)
        t_newton = timed(lambda: prox_2of4(cells, lam_mat, solver="newton"), repeat=1)
        matrix[f"threads={nt}"] = {"prox_ms": 1e3 * t_prox, "matmul_ms": 1e3 * t_mm,
                                   "prox_over_matmul": t_prox / t_mm, "newton_prox_ms": 1e3 * t_newton}
    torch.set_num_threads(threads)
    res["matrix_1536x576"] = {"lam": lam_mat, **matrix}
    res["prox_gradient_run_1536x576"] = prox_in_run(threads)

    # ---- general N:M vs brute force --------------------------------------------------------------
    general = {}
    for n, m, cells_n, starts, iters in ((4, 8, 40, 2, 600), (3, 6, 200, 3, 800), (2, 8, 40, 2, 600)):
        gen = torch.Generator().manual_seed(10 + n + m)
        zg = torch.randn(cells_n, m, generator=gen, dtype=torch.float64)
        lg = 10 ** torch.empty(cells_n, dtype=torch.float64).uniform_(-2, 0.5, generator=gen)
        t = time.perf_counter()
        wg = prox_nm(zg, lg, n)
        t_solve = time.perf_counter() - t
        rg = reference_min(zg, lg, n, starts=starts, iters=iters)
        fg = objective(wg, zg, lg, n)
        gaps = (fg - rg) / rg.abs().clamp_min(1e-12)
        general[f"{n}:{m}"] = {"cells": cells_n, "worst_rel_gap": float(gaps.max()),
                               "cells_worse_than_ref_by_1e-6": int((gaps > 1e-6).sum()),
                               "best_rel_gap (negative: prox beats the reference)": float(gaps.min()),
                               "solve_seconds": t_solve}
    res["general_nm"] = general
    res["load_average_at_end"] = os.getloadavg()

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prox_speed.json").write_text(json.dumps(res, indent=2))
    (RESULTS / "prox_speed.md").write_text(to_markdown(res))
    print(to_markdown(res))


def prox_in_run(threads: int) -> dict:
    """Every prox call of one default ``prox`` pruning run (1536x576, correlated H, the
    registered method's defaults) timed, against ``W @ H`` timed in the same process."""
    w, h, _ = correlated_layer(1536, 576, seed=5)
    params = inspect.signature(get_method("prox").fn).parameters.values()
    options = {q.name: q.default for q in params if q.kind is inspect.Parameter.KEYWORD_ONLY}
    solver = options.pop("solver")
    calls: list[float] = []

    def timed_prox(z: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = prox_2of4(z, lam, solver=solver)
        calls.append(time.perf_counter() - t)
        return out

    out = {}
    for nt in sorted({threads, 1}):
        torch.set_num_threads(nt)
        prox_2of4(w.reshape(-1, 4), 0.1)  # warm-up: loads the compiled kernels
        calls.clear()
        t = time.perf_counter()
        prox_gradient(w, h, NMPattern(2, 4), timed_prox, method="prox", **options)
        total = time.perf_counter() - t
        t_mm = timed(lambda: w @ h, repeat=5)
        out[f"threads={nt}"] = {"iterations": len(calls), "run_s": total, "prox_total_s": sum(calls),
                                "prox_mean_ms": 1e3 * sum(calls) / len(calls), "prox_max_ms": 1e3 * max(calls),
                                "matmul_ms": 1e3 * t_mm, "prox_mean_over_matmul": sum(calls) / len(calls) / t_mm}
    torch.set_num_threads(threads)
    return out


def to_markdown(res: dict) -> str:
    load0 = ", ".join(f"{x:.1f}" for x in res["load_average_at_start"])
    load1 = ", ".join(f"{x:.1f}" for x in res["load_average_at_end"])
    lines = [f"# Proximal operator speed and accuracy (torch {res['torch']}, "
             f"{res['default_threads']} default threads)", "",
             f"CPU: {res['cpu']['model']} (LLVM target {res['cpu']['llvm_target']}); timings compare only on the same CPU.", "",
             f"Shared 2-core machine: load average (1, 5, 15 min) {load0} at the start, {load1} at the end.", "",
             "## 2:4 prox throughput, float32, 2^20 cells (GD on a 2^16 subsample)", "",
             "| threads | reduced (default) cells/s | newton cells/s | GD default cells/s | GD same-accuracy (fp64) cells/s | reduced vs newton | reduced vs GD default | reduced vs GD same accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for k, v in res["throughput"].items():
        lines.append(f"| {k} | {v['reduced_cells_per_s']:.3g} | {v['newton_cells_per_s']:.3g} | "
                     f"{v['gd_default_fp32_cells_per_s (2^16 subsample)']:.3g} | "
                     f"{v['gd_same_accuracy_fp64_cells_per_s (2^16 subsample)']:.3g} | {v['speedup_vs_newton']:.1f}x | "
                     f"{v['speedup_vs_gd_default']:.1f}x | {v['speedup_vs_gd_same_accuracy']:.1f}x |")
    acc = res["accuracy_2of4"]
    lines += ["", f"## 2:4 accuracy vs float64 brute force ({acc['cells']} mixed + hard cells)", "",
              "| solver | worst relative objective gap |", "|---|---|"]
    for k, v in acc.items():
        if k != "cells":
            lines.append(f"| {k} | {v:.3e} |")
    mat = res["matrix_1536x576"]
    lines += ["", f"## prox of a 1536x576 matrix (lam = {mat['lam']:.4g}) vs W @ H (H 576x576)", "",
              "| threads | prox ms (reduced) | matmul ms | prox / matmul | prox ms (newton) |", "|---|---|---|---|---|"]
    for k, v in mat.items():
        if k != "lam":
            lines.append(f"| {k} | {v['prox_ms']:.1f} | {v['matmul_ms']:.1f} | {v['prox_over_matmul']:.2f} | "
                         f"{v['newton_prox_ms']:.1f} |")
    run = res["prox_gradient_run_1536x576"]
    lines += ["", "## prox inside a whole default `prox` pruning run (1536x576, correlated H) vs W @ H", "",
              "| threads | iterations | run s | prox total s | prox mean ms | prox max ms | matmul ms | mean prox / matmul |",
              "|---|---|---|---|---|---|---|---|"]
    for k, v in run.items():
        lines.append(f"| {k} | {v['iterations']} | {v['run_s']:.2f} | {v['prox_total_s']:.2f} | {v['prox_mean_ms']:.1f} | "
                     f"{v['prox_max_ms']:.1f} | {v['matmul_ms']:.1f} | {v['prox_mean_over_matmul']:.2f} |")
    lines += ["", "## general N:M prox vs brute force", "",
              "| pattern | cells | worst relative gap | cells worse by >1e-6 | solve s |", "|---|---|---|---|---|"]
    for k, v in res["general_nm"].items():
        lines.append(f"| {k} | {v['cells']} | {v['worst_rel_gap']:.2e} | {v['cells_worse_than_ref_by_1e-6']} | {v['solve_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
