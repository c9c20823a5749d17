"""Exact solver for the 2:4 prox on sorted non-negative cells (the default, ``solver="newton"``).

Works on ``z_1 >= z_2 >= z_3 >= z_4 >= 0`` (Lemma ``lemma:sorted_prox``) and follows Algorithm
``alg:prox_enumerate``: the answer is the best of the 2-sparse point ``[z_1, z_2, 0, 0]``, the
minimiser of the 3-variable problem ``g`` (eq. ``prox_sorted3``) and of the 4-variable problem
``f`` (eq. ``prox_sorted``), each restricted to the region where its Hessian is PSD
(problems ``convex_constrained_prob3``/``convex_constrained_prob4``, convex by Lemma
``lem:hessian``). Every candidate is a feasible point, so the best of them is never worse than
the true case it approximates, and it is the global minimiser whenever the case holding the
optimum is solved (Theorem ``thm:optimality``).

Speed comes from deciding most cells without iterating. At an interior local minimum the
Hessian is PSD, so its 2x2 minors give ``lam w_k <= 1`` (3-sparse) and ``lam (w_k + w_l) <= 1``
(dense). With the stationarity equations of Lemma ``lem:three_cases`` this yields
``w_1 >= z_1/2, w_2 >= z_2/2`` for a 3-sparse optimum and ``w_1 >= z_1/3, w_2 >= z_2/3`` for a
dense one, hence the sufficient tests

* 3-sparse impossible when ``lam z_1 z_2 >= 4 z_3``, dense impossible when ``lam z_1 z_2 >= 9 z_4``
  (so the cell is exactly ``[z_1, z_2, 0, 0]`` when both hold),

and the necessary conditions of Lemma ``lem:opt_cond_ext``: 2-sparse needs
``lam >= z_3 / (z_1 z_2)``, 3-sparse needs ``lam >= z_4 / (z_1 z_2 + z_1 z_3 + z_2 z_3)``.
Only the cells left undecided are iterated, each case by a damped Newton method that keeps its
iterates strictly positive and inside the PSD region (Cholesky succeeds) with an Armijo line
search: a feasible descent method for a convex problem, so it converges to the case minimiser
when that minimiser is interior (quadratically near it). Internally everything runs in float64.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

_MAX_NEWTON = 60
_MAX_HALVINGS = 40


def _objective(w: Tensor, z: Tensor, lam: Tensor) -> Tensor:
    """``0.5||w - z||^2 + lam r_{2:4}(w)`` for non-negative ``w`` with 3 or 4 entries."""
    q = 0.5 * (w - z).square().sum(-1)
    if w.shape[-1] == 3:
        return q + lam * w[:, 0] * w[:, 1] * w[:, 2]
    w1, w2, w3, w4 = w.unbind(-1)
    return q + lam * (w1 * w2 * (w3 + w4) + w3 * w4 * (w1 + w2))


def _grad_hess(w: Tensor, z: Tensor, lam: Tensor) -> tuple[Tensor, Tensor]:
    """Gradient and Hessian (eqs. ``hessian_3sparse``/``hessian_4sparse``) of ``g`` or ``f``."""
    lam_ = lam[:, None]
    k = w.shape[-1]
    hess = torch.empty(w.shape[0], k, k, dtype=w.dtype, device=w.device)
    if k == 3:
        w1, w2, w3 = w.unbind(-1)
        grad = w - z + lam_ * torch.stack((w2 * w3, w1 * w3, w1 * w2), -1)
        off = lam_ * w  # H_ij = lam * w_k for {i, j, k} = {1, 2, 3}
        hess[:, 0, 1] = hess[:, 1, 0] = off[:, 2]
        hess[:, 0, 2] = hess[:, 2, 0] = off[:, 1]
        hess[:, 1, 2] = hess[:, 2, 1] = off[:, 0]
    else:
        w1, w2, w3, w4 = w.unbind(-1)
        p12, p13, p14, p23, p24, p34 = w1 * w2, w1 * w3, w1 * w4, w2 * w3, w2 * w4, w3 * w4
        grad = w - z + lam_ * torch.stack(
            (p23 + p24 + p34, p13 + p14 + p34, p12 + p14 + p24, p12 + p13 + p23), -1
        )
        for i, j, a, b in ((0, 1, w3, w4), (0, 2, w2, w4), (0, 3, w2, w3),
                           (1, 2, w1, w4), (1, 3, w1, w3), (2, 3, w1, w2)):
            hess[:, i, j] = hess[:, j, i] = lam * (a + b)
    idx = torch.arange(k, device=w.device)
    hess[:, idx, idx] = 1.0
    return grad, hess


def damped_newton(
    z: Tensor,
    lam: Tensor,
    w: Tensor,
    objective: Callable[[Tensor, Tensor, Tensor], Tensor],
    grad_hess: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]],
) -> Tensor:
    """Minimise ``objective`` row by row over ``w > 0`` with a positive definite Hessian, from the
    strictly feasible start ``w``: Newton directions, a fraction-to-the-boundary step, and
    backtracking until the Hessian factorises and the Armijo condition holds. Rows are
    independent; only unfinished rows are iterated (compaction)."""
    n = z.shape[0]
    out = torch.empty_like(z)
    if n == 0:
        return out
    idx = torch.arange(n, device=z.device)
    zs, ls = z, lam
    f = objective(w, zs, ls)
    tiny = torch.finfo(z.dtype).eps
    for _ in range(_MAX_NEWTON):
        grad, hess = grad_hess(w, zs, ls)
        chol, _ = torch.linalg.cholesky_ex(hess)
        d = torch.cholesky_solve(-grad.unsqueeze(-1), chol).squeeze(-1)
        dec = -(grad * d).sum(-1)
        # converged when the Newton decrement is at rounding level of the objective scale
        done = dec <= tiny * tiny * zs.square().sum(-1)
        # fraction to the boundary keeps iterates strictly positive
        ratio = torch.where(d < 0, -w / d.clamp_max(-1e-300), torch.full_like(w, 2.0))
        alpha = torch.clamp(0.995 * ratio.min(-1).values, max=1.0)
        pending = ~done
        w_new = w.clone()
        f_new = f.clone()
        accepted = torch.zeros_like(done)
        for _ in range(_MAX_HALVINGS):
            p = pending.nonzero().squeeze(-1)
            if p.numel() == 0:
                break
            cand = w[p] + alpha[p, None] * d[p]
            fc = objective(cand, zs[p], ls[p])
            _, hc = grad_hess(cand, zs[p], ls[p])
            info = torch.linalg.cholesky_ex(hc).info
            ok = (info == 0) & (fc <= f[p] - 1e-4 * alpha[p] * dec[p])
            okp = p[ok]
            w_new[okp] = cand[ok]
            f_new[okp] = fc[ok]
            accepted[okp] = True
            pending[okp] = False
            alpha[p[~ok]] *= 0.5
        # rows with no acceptable step cannot improve any further
        finished = done | ~accepted
        out[idx[finished]] = w_new[finished]
        keep = ~finished
        if not bool(keep.any()):
            return out
        idx, w, f, zs, ls = idx[keep], w_new[keep], f_new[keep], zs[keep], ls[keep]
    out[idx] = w
    return out


def solve_sorted_newton(z: Tensor, lam: Tensor) -> Tensor:
    """Exact 2:4 prox of sorted non-negative float64 cells ``z`` (shape ``(B, 4)``), ``lam`` (B,)."""
    z1, z2, z3, z4 = z.unbind(-1)
    a = lam * z1 * z2
    three_possible = (a < 4 * z3) & (lam * (z1 * z2 + z1 * z3 + z2 * z3) >= z4)
    dense_possible = a < 9 * z4
    two_possible = a >= z3

    w = z.clone()
    w[:, 2:] = 0.0
    best = _objective(w, z, lam)
    best = torch.where(two_possible, best, torch.full_like(best, torch.inf))

    for k, possible in ((3, three_possible), (4, dense_possible)):
        rows = possible.nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        zk, lk = z[rows, :k], lam[rows]
        # start strictly inside the PSD region: Gershgorin row sums <= 2 lam sum(w) <= 1/2
        start = zk * torch.clamp(0.25 / (lk * zk.sum(-1)).clamp_min(1e-300), max=1.0)[:, None]
        wk = damped_newton(zk, lk, start, _objective, _grad_hess)
        fk = _objective(wk, zk, lk) + (0.5 * z[rows, k:].square().sum(-1) if k == 3 else 0.0)
        better = fk < best[rows]
        r = rows[better]
        best[r] = fk[better]
        w[r, :k] = wk[better]
        if k == 3:
            w[r, 3] = 0.0
    return w
