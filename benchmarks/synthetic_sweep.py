"""Paper Figure ``fig:synthetic``: local loss of every method (+ exact refinement) on the
synthetic Hessians ``alpha diag + (1 - alpha) Z Z^T`` of Section 4.1, one row, d = 1024.

Writes benchmarks/results/synthetic_sweep.{json,md,png}. Run:
    flock /tmp/nmprune-bench.lock python benchmarks/synthetic_sweep.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _problems import synthetic_hessian  # noqa: E402

from nmprune.solve import prune_layer  # noqa: E402

PAPER = {"lambda0": 0.01, "beta": 1.01, "lambda_adapt": False, "solver": "gd",
         "accelerate": False, "finish": 0.0, "gradient_precision": "full"}
RUNS = {  # label -> (method, method options, refiner, refiner options)
    "magnitude+exact": ("magnitude", {}, "exact", {}),
    "wanda+exact": ("wanda", {}, "exact", {}),
    "sparsegpt+exact": ("sparsegpt", {}, "exact", {}),
    "prox-l0+exact": ("prox-l0", {}, "exact", {}),
    "prox-l1+exact": ("prox-l1", {}, "exact", {}),
    "prox-l2+exact": ("prox-l2", {}, "exact", {}),
    "prox (paper settings)+gd1000": ("prox", PAPER, "gd", {}),
    "prox (defaults)+exact": ("prox", {}, "exact", {}),
}
ALPHAS = [0.0, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0]


def main(d: int = 1024, seed: int = 0) -> None:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    rows = []
    for alpha in ALPHAS:
        w, h = synthetic_hessian(d, alpha, seed)
        for label, (method, opts, refine, ropts) in RUNS.items():
            start = time.perf_counter()
            res = prune_layer(w, h, method=method, refine=refine, **opts,
                              **{f"refine_{k}": v for k, v in ropts.items()})
            rows.append({"alpha": alpha, "run": label, "loss_method": res.loss_method,
                         "loss": res.loss_refined, "seconds": time.perf_counter() - start})
            print(f"alpha={alpha:.1f} {label:32s} loss {res.loss_refined:.4f}", flush=True)
    (out / "synthetic_sweep.json").write_text(json.dumps({"d": d, "seed": seed, "rows": rows}, indent=1))

    labels = list(RUNS)
    lines = [f"# Synthetic Hessian sweep (paper Section 4.1, d={d}, one row, seed {seed})", "",
             "Local loss after refinement (lower is better). alpha=1: diagonal H (no correlation).", "",
             "| alpha | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for alpha in ALPHAS:
        vals = {r["run"]: r["loss"] for r in rows if r["alpha"] == alpha}
        best = min(vals.values())
        cells = [f"**{vals[k]:.4f}**" if vals[k] <= best * (1 + 1e-6) else f"{vals[k]:.4f}" for k in labels]
        lines.append(f"| {alpha:.1f} | " + " | ".join(cells) + " |")
    (out / "synthetic_sweep.md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in labels:
        ys = [r["loss"] / next(q["loss"] for q in rows if q["alpha"] == r["alpha"] and q["run"] == "wanda+exact")
              for r in rows if r["run"] == label]
        ax.plot(ALPHAS, ys, marker="o", label=label)
    ax.set_xlabel("alpha (1 = uncorrelated inputs)")
    ax.set_ylabel("local loss / loss of wanda+exact")
    ax.set_title(f"Synthetic Hessians, d={d}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "synthetic_sweep.png", dpi=120)


if __name__ == "__main__":
    main()
