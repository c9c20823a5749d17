"""Exact 2:4 prox by dimension reduction (``solver="reduced"`` in torch: the GPU path for float64
tensors or without triton, and the cells the compiled kernels, numba on CPU and Triton on CUDA,
leave undecided).

Algorithm ``alg:prox_enumerate`` on sorted non-negative cells (Lemma ``lemma:sorted_prox``):
the best of the 2-sparse point ``[z_1, z_2, 0, 0]`` and the stationary points of ``g`` (eq.
``prox_sorted3``) and ``f`` (eq. ``prox_sorted``) with a PSD Hessian, each the minimiser of its
case over the convex PSD region (Lemma ``lem:hessian``, Corollary ``corollary:no_spurious``).
The 3-sparse case reduces to one scalar equation ``Phi(u) = 0`` (``u = lam w_3``, eq.
``stationarity_3sparse``) solved by monotone Newton from its inflection point, and the dense
case to two, ``grad G(x, y) = 0`` (``x = lam (w_1 + w_2)``, ``y = lam (w_3 + w_4)``); necessary
conditions and KKT certificates skip most cells. The few cells neither solved nor certified go
to the damped-Newton solver of :mod:`nmprune.prox.newton`, so the result is always exact. Runs
in float64. The derivations are in ``docs/prox.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .newton import solve_case, solve_sorted_newton
from .problem import grad_hess_2of4, objective_2of4, positive_definite

ITER_3SPARSE = 12
ITER_DENSE = 10
STEP_TOL = 1e-12


def three_sparse_root(z1: Tensor, z2: Tensor, z3: Tensor, lam: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``u = lam w_3`` of the PSD stationary point of ``g`` for cells with
    ``z_1 >= z_2 >= z_3 > 0``, ``lam > 0``, by monotone Newton from the inflection ``u*``.

    Returns ``(u, found, none)``: ``found`` where ``u`` is the converged valid root, ``none``
    where it is proven that no valid PSD root exists; the remaining cells are undecided."""
    s, d = z1 + z2, z1 - z2
    a, b, c = lam * s, lam * d, lam * z3
    r = (d / s).sqrt()
    u = (1 - r) / (1 + r)
    k = lam * (z1 + (d * s).sqrt()) / 2
    phi = u + k * (a - b) / 4 - c
    dphi = 1 - k * k
    umax = torch.minimum(z2 / z1, c)
    left = phi > 0  # the root lies left of u* (convex part) else right of it (concave part)
    none = (k >= 1) | (~left & (u >= umax))
    # iterates may only move within (lo, hi): left of u* they stay above the root, so falling
    # to u <= 0 proves there is no root u > 0; right of u* they stay below it, so reaching
    # u >= umax proves the root is invalid
    lo = torch.where(left, 0.0, -torch.inf)
    hi = torch.where(left, torch.inf, umax)
    step = torch.zeros_like(u)
    for _ in range(ITER_3SPARSE):
        # rows proven empty keep iterating (cheaper than masking); their flag is sticky
        step = phi / dphi
        u = u - step
        ip, im = 1 / (1 + u), 1 / (1 - u)
        aa, bb = a * ip, b * im
        aa, bb = aa * aa, bb * bb
        phi = u + (aa - bb) * 0.25 - c
        dphi = 1 - (aa * ip + bb * im) * 0.5
        none |= (u <= lo) | (u >= hi) | (dphi <= 0)
    # phi == 0 at u* exactly: step 0/... stays put (dphi > 0 there since k < 1)
    # converged: a relative step of 1e-12, or a residual at rounding level (roots near u = 0)
    converged = ~none & ((step.abs() <= STEP_TOL * u) | (phi.abs() <= 4e-16 * (u.abs() + (aa + bb) * 0.25 + c)))
    # the PSD root is unique: a converged root outside the valid range proves there is none
    invalid = converged & ((u <= 0) | (u >= umax))
    return u, converged & ~invalid, none | invalid


def dense_point(z1: Tensor, z2: Tensor, z3: Tensor, z4: Tensor, lam: Tensor) -> tuple[Tensor, Tensor]:
    """The PSD stationary point of ``f`` from the two reduced equations ``grad G(x, y) = 0``
    (``lam > 0``). Returns ``(w (B, 4), pd)``, ``pd`` where Newton converged to a point with
    ``x, y < 1`` and a positive definite Hessian (the unique PSD stationary point of ``f``;
    ``w`` may then have non-positive entries, proving the dense case has no interior point)."""
    s1, s2 = lam * (z1 + z2), lam * (z3 + z4)
    d1, d2 = lam * (z1 - z2), lam * (z3 - z4)
    x, y = 0.5 * s1, 0.5 * s2
    dx = dy = torch.zeros_like(x)
    h11 = det = torch.ones_like(x)
    for _ in range(ITER_DENSE + 1):
        ix, iy = 1 / (1 - x), 1 / (1 - y)
        e2, e1 = d2 * ix, d1 * iy
        g1 = x - s1 + x * y + 0.5 * (y * y - e2 * e2)
        g2 = y - s2 + x * y + 0.5 * (x * x - e1 * e1)
        h11 = 1 + y - e2 * e2 * ix
        h22 = 1 + x - e1 * e1 * iy
        h12 = x + y
        det = h11 * h22 - h12 * h12
        dx = (h12 * g2 - h22 * g1) / det
        dy = (h12 * g1 - h11 * g2) / det
        x, y = x + dx, y + dy
    x, y = x - dx, y - dy  # the last point whose Hessian was checked
    pd = (x < 1) & (y < 1) & (h11 > 0) & (det > 0) & (dx.abs() + dy.abs() <= STEP_TOL * (x + y))
    p, q = x / lam, y / lam
    a, b = (z1 - z2) / (1 - y), (z3 - z4) / (1 - x)
    w = torch.stack(((p + a) / 2, (p - a) / 2, (q + b) / 2, (q - b) / 2), -1)
    return w, pd


def sparse_point_rules_out_dense(w: Tensor, z: Tensor, lam: Tensor) -> Tensor:
    """True where the sparse candidate ``w = [w_1, w_2, w_3, 0]`` (a 2-sparse point or a
    stationary point of ``g``) is a KKT point of ``f`` with non-negative multipliers and a
    positive definite Hessian (eq. ``hessian_4sparse``): it then minimises ``f`` over the PSD
    region intersected with ``w >= 0`` (convex problem ``convex_constrained_prob4``), so no
    dense point can beat it. The cheap multiplier tests run first."""
    w1, w2, w3, _ = w.unbind(-1)
    z3, z4 = z[:, 2], z[:, 3]
    nu3 = torch.where(w3 > 0, 0.0, lam * w1 * w2 - z3)  # w_3 = 0: its multiplier (lem:opt_cond_ext)
    nu4 = lam * (w1 * w2 + w3 * (w1 + w2)) - z4
    out = (nu3 >= 0) & (nu4 >= 0)
    rows = out.nonzero().squeeze(-1)
    if rows.numel():
        out[rows] = positive_definite(grad_hess_2of4(w[rows], z[rows], lam[rows])[1])
    return out


def solve_sorted_reduced(z: Tensor, lam: Tensor) -> Tensor:
    """Exact 2:4 prox of sorted non-negative float64 cells ``z`` (B, 4), ``lam`` (B,)."""
    z1, z2, z3, z4 = z.unbind(-1)
    w = z.clone()
    w[:, 2:] = 0.0
    best = 0.5 * (z3 * z3 + z4 * z4)
    # necessary for a PSD 3-sparse point and (shifted by w_4) for a dense one
    k_ok = lam * (z1 + ((z1 - z2) * (z1 + z2)).sqrt()) < 2
    fallback = torch.zeros_like(k_ok)

    rows = (k_ok & (lam * z3 > 0)).nonzero().squeeze(-1)
    if rows.numel():
        a, l3 = z[rows], lam[rows]
        u, found, none = three_sparse_root(a[:, 0], a[:, 1], a[:, 2], l3)
        fallback[rows[~found & ~none]] = True
        rows, a, l3, u = rows[found], a[found], l3[found], u[found]
        den = 1 - u * u
        w3 = torch.stack(((a[:, 0] - u * a[:, 1]) / den, (a[:, 1] - u * a[:, 0]) / den, u / l3,
                          torch.zeros_like(u)), -1)
        f3 = objective_2of4(w3, a, l3)
        better = f3 < best[rows]
        w[rows[better]] = w3[better]
        best[rows[better]] = f3[better]

    # dense: z_4 > 0 and K < 1 needed; the PSD bound lam z1 z2 >= 9 z4 (w_i >= z_i / 3) excludes
    cand = k_ok & (lam * z4 > 0) & (lam * z1 * z2 < 9 * z4) & ~fallback
    rows = cand.nonzero().squeeze(-1)
    if rows.numel():
        rows = rows[~sparse_point_rules_out_dense(w[rows], z[rows], lam[rows])]
    if rows.numel():
        a, l4 = z[rows], lam[rows]
        w4, pd = dense_point(a[:, 0], a[:, 1], a[:, 2], a[:, 3], l4)
        pos = pd & (w4[:, 1] > 0) & (w4[:, 3] > 0)
        f4 = torch.where(pos, objective_2of4(w4, a, l4), torch.full_like(l4, torch.inf))
        better = f4 < best[rows]
        w[rows[better]] = w4[better]
        best[rows[better]] = f4[better]
        # no certificate either way: the exact damped Newton on the 4-variable case
        solve_case(z, lam, 4, rows[~pd], w, best)

    rows = fallback.nonzero().squeeze(-1)
    if rows.numel():
        w[rows] = solve_sorted_newton(z[rows], lam[rows])
    return torch.where((lam == 0)[:, None], z, w)
