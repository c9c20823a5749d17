"""The paper's gradient-descent solver for the 2:4 prox (Section "Parallelized Prox by Gradient
Descent", Conjecture ``conj:gd_works``), kept for ablations.

On sorted non-negative cells it enumerates the three cases of Lemma ``lem:three_cases``: the
2-sparse point ``[z_1, z_2, 0, 0]``, and the 3-sparse and dense problems, each solved by
projected gradient descent ``w <- max(w - grad/4, 0)`` from ``w = 0`` (step 1/4 from Fact
``facts:convex``). A case stops once its (projected) gradient norm grows, which cannot happen
inside the convex region, or once it is below ``tol`` or after ``max_iter`` steps. The best
objective of the three candidates is returned. Runs in the dtype of its input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .problem import grad_2of4, objective_2of4

STEP = 0.25


def _gd_case(z: Tensor, lam: Tensor, max_iter: int, tol: float) -> Tensor:
    """Projected GD from zero on the restricted problem; stopped rows are frozen and dropped
    from the working set every few steps."""
    n = z.shape[0]
    out = torch.zeros_like(z)
    w = torch.zeros_like(z)
    idx = torch.arange(n, device=z.device)
    zs, ls = z, lam
    prev = torch.full((n,), torch.inf, dtype=z.dtype, device=z.device)
    running = torch.ones(n, dtype=torch.bool, device=z.device)
    tol_abs = tol * z.abs().amax(-1)
    for it in range(max_iter):
        w_new = (w - STEP * grad_2of4(w, zs, ls)).clamp_min(0.0)
        gnorm = (w - w_new).norm(dim=-1) / STEP
        # a growing gradient norm means we left the convex region: keep the last iterate
        running &= (gnorm <= prev) & (gnorm > tol_abs)
        w = torch.where(running[:, None], w_new, w)
        prev = gnorm
        if it % 8 == 7:
            out[idx] = w
            if not bool(running.any()):
                return out
            idx, w, zs, ls, prev, tol_abs, running = (
                idx[running], w[running], zs[running], ls[running], prev[running], tol_abs[running],
                running[running])
    out[idx] = w
    return out


def solve_sorted_gd(z: Tensor, lam: Tensor, max_iter: int = 2000, tol: float = 1e-7) -> Tensor:
    """Algorithm ``alg:prox_enumerate`` with the GD inner solver on sorted non-negative ``(B, 4)``."""
    w = z.clone()
    w[:, 2:] = 0.0
    best = objective_2of4(w, z, lam)
    for k in (3, 4):
        zk = z[:, :k]
        wk = _gd_case(zk, lam, max_iter, tol)
        fk = objective_2of4(wk, zk, lam) + (0.5 * z[:, 3].square() if k == 3 else 0.0)
        better = fk < best
        best = torch.where(better, fk, best)
        w[better, :k] = wk[better]
        if k == 3:
            w[better, 3] = 0.0
    return w
