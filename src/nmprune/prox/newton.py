"""Exact damped-Newton solver for the 2:4 prox on sorted non-negative cells (``solver="newton"``),
and the damped Newton method that the torch reduced solver falls back on and ``prox_nm`` runs.

Algorithm ``alg:prox_enumerate`` on ``z_1 >= z_2 >= z_3 >= z_4 >= 0`` (Lemma
``lemma:sorted_prox``): the best of the 2-sparse point ``[z_1, z_2, 0, 0]`` and the minimisers
of the 3-variable problem ``g`` (eq. ``prox_sorted3``) and the 4-variable problem ``f`` (eq.
``prox_sorted``), each over the region where its Hessian is PSD (convex by Lemma
``lem:hessian``), so the best candidate is the global minimiser (Theorem ``thm:optimality``).
Most cells are decided without iterating, by the necessary conditions of Lemma
``lem:opt_cond_ext``, bound boxes from the stationarity equations and KKT certificates; the
rest run a feasible damped Newton method, which converges to the case minimiser when it is
interior. Runs in float64. The reasoning behind each test is in ``docs/prox.md``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .problem import Entries, cholesky, cholesky_solve, grad_hess_2of4, objective_2of4, others_2of4, positive_definite

_MAX_NEWTON = 30
_NEWTON_TRIALS = 2
_GRAD_TRIALS = 4
_FACE_TOL = 1e-12
_DEC_TOL = 1e-22
_BOUND_ROUNDS = 4


def _max_step(w: Tensor, d: Tensor) -> Tensor:
    """Largest ``a`` (capped at 2) with ``w + a d >= 0`` row-wise."""
    ratio = torch.where(d < 0, -w / d.clamp_max(-1e-300), torch.full_like(w, 2.0))
    return ratio.amin(-1).clamp_max(2.0)


def damped_newton(
    z: Tensor,
    lam: Tensor,
    w: Tensor,
    objective: Callable[[Tensor, Tensor, Tensor], Tensor],
    grad_hess: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Entries]],
    box: tuple[Tensor, Tensor] | None = None,
    beat: Tensor | None = None,
) -> Tensor:
    """Minimise ``objective`` row by row over ``w > 0`` with a positive definite Hessian, from the
    strictly feasible start ``w``: Newton directions, a fraction-to-the-boundary step, and
    backtracking until the Hessian factorises and the Armijo condition holds. Rows are
    independent; only unfinished rows are iterated (compaction).

    Optional pruning: when every interior minimiser is known to lie in ``box = (lo, hi)`` and
    only a value below ``beat`` matters, a row stops as soon as the linear lower bound
    ``f(w) + min_{lo <= v <= hi} grad^T (v - w)`` (valid because ``f`` is convex on the PSD
    region, which holds ``w`` and the minimiser) exceeds ``beat``: the case cannot win."""
    n = z.shape[0]
    out = torch.empty_like(z)
    if n == 0:
        return out
    idx = torch.arange(n, device=z.device)
    zs, ls = z, lam
    lo, hi = box if box is not None else (torch.zeros_like(z), z)
    beat = beat if beat is not None else torch.full_like(lam, torch.inf)
    f = objective(w, zs, ls)
    for _ in range(_MAX_NEWTON):
        grad, hess = grad_hess(w, zs, ls)
        chol, _ = cholesky(hess)
        d = cholesky_solve(chol, -grad)
        dec = -(grad * d).sum(-1)
        # converged: Newton step ~1e-11 relative (objective error ~1e-22 relative); or the iterate
        # collapses onto the face w_min = 0 (the case minimiser is not interior, a smaller case
        # holds it; the iterate stays a feasible candidate)
        zmax = zs.amax(-1)
        done = (dec <= _DEC_TOL * zmax.square()) | (w.amin(-1) <= _FACE_TOL * zmax)
        lower = f + torch.minimum(grad * (lo - w), grad * (hi - w)).sum(-1)
        done |= lower > beat
        # trial steps: Newton (fraction to the boundary keeps w > 0) shrunk by 4 a few times, then
        # gradient steps from 1/4 (Fact ``facts:convex``) halved: near the PSD boundary the Newton
        # direction can leave the region while a gradient step still makes progress
        alpha_n = torch.clamp(0.99 * _max_step(w, d), max=1.0)
        alpha_g = torch.clamp(0.99 * _max_step(w, -grad), max=0.25)
        gg = grad.square().sum(-1)
        pending = ~done
        w_new = w.clone()
        f_new = f.clone()
        accepted = torch.zeros_like(done)
        for trial in range(_NEWTON_TRIALS + _GRAD_TRIALS):
            p = pending.nonzero().squeeze(-1)
            if p.numel() == 0:
                break
            if trial < _NEWTON_TRIALS:
                a = alpha_n[p] * 0.25**trial
                cand = w[p] + a[:, None] * d[p]
                need = f[p] - 1e-4 * a * dec[p]
            else:
                a = alpha_g[p] * 0.5 ** (trial - _NEWTON_TRIALS)
                cand = w[p] - a[:, None] * grad[p]
                need = f[p] - 1e-4 * a * gg[p]
            fc = objective(cand, zs[p], ls[p])
            _, hc = grad_hess(cand, zs[p], ls[p])
            ok = (fc <= need) & positive_definite(hc)
            okp = p[ok]
            w_new[okp] = cand[ok]
            f_new[okp] = fc[ok]
            accepted[okp] = True
            pending[okp] = False
        # rows with no acceptable step cannot improve any further
        finished = done | ~accepted
        out[idx[finished]] = w_new[finished]
        keep = ~finished
        if not bool(keep.any()):
            return out
        idx, w, f, zs, ls = idx[keep], w_new[keep], f_new[keep], zs[keep], ls[keep]
        lo, hi, beat = lo[keep], hi[keep], beat[keep]
    out[idx] = w
    return out


def _case_bounds(z: Tensor, lam: Tensor, k: int, rounds: int = _BOUND_ROUNDS) -> tuple[Tensor, Tensor]:
    """Bounds ``lo <= w <= hi`` that every interior local minimiser of the k-variable case
    (k = 3: ``g``, k = 4: ``f``) satisfies, for sorted ``z`` (B, k).

    Start: ``0 <= w <= z`` and the PSD bounds ``w_1 >= z_1/c, w_2 >= z_2/c`` (c = 2 for k = 3,
    c = 3 for k = 4); then propagate through the stationarity equations
    ``w_i = z_i - lam e_{k-2}(w without i)`` (Lemma ``lem:three_cases``), which are monotone.
    """
    c = 2.0 if k == 3 else 3.0
    hi = z.clone()
    lo = torch.zeros_like(z)
    lo[:, :2] = z[:, :2] / c
    lam_ = lam[:, None]
    for _ in range(rounds):
        hi = torch.minimum(hi, z - lam_ * others_2of4(lo))
        lo = torch.maximum(lo, z - lam_ * others_2of4(hi))
    return lo, hi


def kkt_point_of_case(w: Tensor, z: Tensor, lam: Tensor) -> Tensor:
    """True where the point ``w`` (its last entry 0) minimises the problem over the PSD region
    and ``w >= 0``: stationary in its non-zero entries (up to 1e-9 of the scale), a non-negative
    partial derivative in the zero one (KKT), and a positive definite Hessian. Since the
    objective is convex on that convex region (Lemma ``lem:hessian``), no interior minimiser
    of this case can have a smaller value, so the case need not be solved."""
    grad, hess = grad_hess_2of4(w, z, lam)
    nz = w > 0
    stationary = torch.where(nz, grad.abs(), torch.zeros_like(grad)).amax(-1) <= 1e-9 * z[:, 0]
    kkt = (grad >= 0) | nz
    return stationary & kkt.all(-1) & positive_definite(hess)


def solve_sorted_newton(z: Tensor, lam: Tensor) -> Tensor:
    """Exact 2:4 prox of sorted non-negative float64 cells ``z`` (shape ``(B, 4)``), ``lam`` (B,)."""
    z1, z2, z3, z4 = z.unbind(-1)
    w = z.clone()
    w[:, 2:] = 0.0
    best = objective_2of4(w, z, lam)
    # Lemma lem:opt_cond_ext: 2-sparse needs lam >= z3/(z1 z2)
    best = torch.where(lam * z1 * z2 >= z3, best, torch.full_like(best, torch.inf))
    # ... and 3-sparse needs lam >= z4/(z1 z2 + z1 z3 + z2 z3)
    three_needed = lam * (z1 * z2 + z1 * z3 + z2 * z3) >= z4
    # KKT certificates (see kkt_point_of_case): where the 2-sparse point is a KKT point of the 3- (4-)
    # variable problem inside its PSD region, that case cannot do better
    two = z.clone()
    two[:, 2:] = 0.0
    skip = {3: kkt_point_of_case(two[:, :3], z[:, :3], lam), 4: kkt_point_of_case(two, z, lam)}
    for k in (3, 4):
        # a case is possible only where z_k > 0 and the bounds leave room for w_k > 0
        cand = (z[:, k - 1] > 0) & ~skip[k] & (three_needed if k == 3 else True)
        rows = cand.nonzero().squeeze(-1)
        r = solve_case(z, lam, k, rows, w, best)
        if k == 3 and r.numel():
            # a 3-sparse candidate that is a KKT point of the 4-variable problem settles it too
            skip[4][r] |= kkt_point_of_case(w[r], z[r], lam[r])
    return w


def solve_case(z: Tensor, lam: Tensor, k: int, rows: Tensor, w: Tensor, best: Tensor) -> Tensor:
    """Solve the k-variable case (k = 3: ``g``, eq. ``convex_constrained_prob3``; k = 4: ``f``,
    eq. ``convex_constrained_prob4``) of the sorted cells ``z[rows]`` by :func:`damped_newton`
    and keep it where it beats ``best`` (updating ``w`` and ``best`` in place; ``best`` may be
    ``inf`` where the current candidate is known not to be optimal).

    Returns the rows that improved."""
    zk, lk = z[rows, :k], lam[rows]
    lo, hi = _case_bounds(zk, lk, k)
    keep = (hi[:, -1] > 0) & (lo <= hi).all(-1)
    rows, zk, lk, lo, hi = rows[keep], zk[keep], lk[keep], lo[keep], hi[keep]
    if rows.numel() == 0:
        return rows
    # start: the middle of the bounds where the Hessian is positive definite there, else a
    # point well inside the PSD region (Gershgorin row sums <= 2 lam sum(w) <= 1/2)
    mid = 0.5 * (lo + hi)
    inside = positive_definite(grad_hess_2of4(mid, zk, lk)[1])
    safe = zk * torch.clamp(0.25 / (lk * zk.sum(-1)).clamp_min(1e-300), max=1.0)[:, None]
    start = torch.where(inside[:, None] & (mid > 0).all(-1, keepdim=True), mid, safe)
    rest = 0.5 * z[rows, k:].square().sum(-1)  # the fixed zeros w_{k+1:4}
    wk = damped_newton(zk, lk, start, objective_2of4, grad_hess_2of4, (lo, hi), best[rows] - rest)
    fk = objective_2of4(wk, zk, lk) + rest
    better = fk < best[rows]
    r = rows[better]
    best[r] = fk[better]
    w[r] = 0.0
    w[r, :k] = wk[better]
    return r
