"""Paper Figure 1 (fig:regpath): regularisation paths w(lam) of the 2:4 prox for four inputs,
with the critical thresholds lam_1* (3-sparse point becomes critical) and lam_2* = z_3/(z_1 z_2)
(2-sparse point becomes critical) of Lemma lem:opt_cond_ext dashed.

Writes benchmarks/results/figure1_regpath.png.  Run: python benchmarks/figure1.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from nmprune.prox import prox_2of4, prox_nm  # noqa: E402

INPUTS = {
    "(a) easy": [1.6, 1.1, 0.8, 0.5],
    "(b) nearly-tied $z_{2:4}$": [1.6, 1.11, 1.1, 1.09],
    "(c) nearly-tied $z_{1:3}$": [1.6, 1.59, 1.58, 1.09],
    "(d) all nearly tied": [1.6, 1.59, 1.58, 1.57],
}
OUT = Path(__file__).parent / "results" / "figure1_regpath.png"


def thresholds(z: torch.Tensor, lams: torch.Tensor) -> tuple[float, float]:
    """lam_2* = z3/(z1 z2); lam_1* = smallest lam with lam >= z4 / e_2(w^(3)(lam)), where w^(3) is
    the minimiser of the 3-variable problem g (the r_{2:3} prox of z_{1:3})."""
    lam2 = float(z[2] / (z[0] * z[1]))
    w3 = prox_nm(z[:3].expand(len(lams), 3), lams, 2)
    e2 = w3[:, 0] * w3[:, 1] + w3[:, 0] * w3[:, 2] + w3[:, 1] * w3[:, 2]
    ok = lams * e2 >= z[3]
    lam1 = float(lams[ok.nonzero()[0, 0]]) if bool(ok.any()) else float("nan")
    return lam1, lam2


def main() -> None:
    lams = torch.linspace(0.0, 1.5, 3001, dtype=torch.float64)
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for ax, (title, zl) in zip(axes, INPUTS.items()):
        z = torch.tensor(zl, dtype=torch.float64)
        w = prox_2of4(z.expand(len(lams), 4), lams)
        for i in range(4):
            ax.plot(lams, w[:, i], label=f"$w_{i + 1}$")
        lam1, lam2 = thresholds(z, lams)
        for v, name in ((lam1, r"$\lambda_1^*$"), (lam2, r"$\lambda_2^*$")):
            ax.axvline(v, ls="--", color="gray", lw=1)
            ax.text(v, 1.62, name, ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{title}\nz={zl}", fontsize=10)
        ax.set_xlabel(r"$\lambda$")
        ax.set_ylim(-0.05, 1.75)
    axes[0].set_ylabel("prox solution")
    axes[0].legend(loc="center right")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
