"""The reduced 2:4 solver vectorised over cells in numba: ``solver="reduced"`` on CPU tensors.

The cells are cut into chunks (:func:`chunk_size`) run in parallel; within a chunk every stage
is a branch-free loop over structure-of-arrays that LLVM vectorises, and each stage hands only
the cells it could not settle to the next one:

1. load ``|z|``, sort each cell (Lemma ``lemma:sorted_prox``), settle the cells whose answer is
   ``[z_1, z_2, 0, 0]`` (``K >= 1`` or its KKT certificate; lam = 0 returns ``z``) and mark
   those proven dense (``f(z) = lam r(z)`` below :func:`_sparse_lower_bound`): these skip
   stage 2 and the boxes of stage 3;
2. the 3-sparse stationary point of ``g`` (eq. ``stationarity_3sparse``) by rounds of masked
   monotone Newton steps on ``Phi(u) = 0``, the better of it and the 2-sparse point, and the KKT
   certificate that no dense point beats it;
3. the dense case, for the cells that pass its necessary conditions: masked Newton steps on
   ``grad G = 0``; a converged point with a positive definite Hessian is the unique PSD
   stationary point of ``f`` (Corollary ``corollary:no_spurious``); where Newton failed, the
   case and ``(x, y)`` boxes may prove the dense case empty;
4. where plain Newton failed: a few masked damped-Newton steps on the convex reduced problem
   with the convexity lower bound (:func:`nmprune.prox.reduced_kernel.convex_lower_bound`) and
   a slide along the boundary of ``R`` where the line search finds no Newton step; this proves
   for most of them that the dense case cannot beat the best sparse point;
5. the cells still open (well under one per cent) are finished one by one by the exact
   dense fallbacks of :mod:`nmprune.prox.reduced_kernel`, going on from the point where
   stage 4 stopped; then everything is written back with the signs and positions of ``z``.

A cell proven dense whose dense stage found no answer goes through stages 2-5 like the others.
Cells whose 3-sparse Newton has not converged after all its rounds (none in the benchmarks)
are flagged undecided, for the torch solver. Same mathematics and certificates as
:mod:`nmprune.prox.reduced`, so the answer is the same exact minimiser. Loops index arrays with unsigned integers: numba's wrap-around of negative indices
otherwise makes the addresses non-affine and LLVM refuses to vectorise. Measurements of the
stages are in ``docs/prox.md``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numba
import numpy as np
from numba import njit, prange

from .reduced_kernel import (
    DEC_TOL,
    STEP_TOL,
    case_box,
    convex_lower_bound,
    dense_case,
    dense_weights,
    g_newton,
    g_value,
    in_r,
    objective4,
    pd4,
    phi_grad,
    sparse_point_rules_out_dense,
    xy_box,
)

MIN_CHUNK, MAX_CHUNK = 1024, 8192  # cells per chunk (see chunk_size)
ROUND_3SPARSE = 4  # masked Newton steps on Phi per round
ROUNDS_3SPARSE = 10  # rounds at most; nearly all cells converge in 3-6 steps
ITER_DENSE = 8  # masked Newton steps on grad G = 0
ITER_CONVEX = 3  # masked damped-Newton steps with the convexity bound, where plain Newton failed
CONVEX_PULLS = 12  # halvings of the start towards the origin, into R
CONVEX_HALVINGS = 4  # backtracking steps of the damped Newton line search
SLIDE_HALVINGS = 4  # backtracking steps along the boundary of R, where the Newton step failed
ROUND_DENSE = 5  # masked Newton steps on grad G = 0 on every dense cell, before compacting
DENSE_MARGIN = 1e-9  # relative margin of the dense-answer test of load_cells
_SCRATCH = 43  # float64 work rows per chunk

_JIT = {"cache": True, "error_model": "numpy"}  # numpy error model: no zero-division branches
U64 = np.uint64


@njit(inline="always", **_JIT)
def _sparse_lower_bound(z1, z2, z3, z4, lam):
    """A lower bound on ``f`` over every point with a zero entry (sorted ``z``).

    A zero at position ``i <= 3`` costs at least ``z_i^2 / 2 >= z_3^2 / 2``. With ``w_4 = 0``
    the cost is ``z_4^2 / 2`` plus the 3-variable problem ``min 0.5 ||v - z_{1:3}||^2 +
    lam v_1 v_2 v_3`` (``v >= 0``). Its minimiser either has a zero entry (cost at least
    ``z_3^2 / 2``) or is stationary, ``v_i = z_i - lam v_j v_k``; then ``l_i <= v_i <= z_i``
    with ``l_i = max(z_i - lam z_j z_k, 0)``, and its cost
    ``0.5 sum (lam v_j v_k)^2 + lam v_1 v_2 v_3`` is at least the same expression in ``l``."""
    l1 = max(z1 - lam * z2 * z3, 0.0)
    l2 = max(z2 - lam * z1 * z3, 0.0)
    l3 = max(z3 - lam * z1 * z2, 0.0)
    p12, p13, p23 = l1 * l2, l1 * l3, l2 * l3
    interior = lam * p12 * l3 + 0.5 * lam * lam * (p12 * p12 + p13 * p13 + p23 * p23)
    return min(0.5 * z3 * z3, 0.5 * z4 * z4 + interior)


@njit(**_JIT)
def load_cells(z, lam, start, a0, a1, a2, a3, lv, ranks, w0, w1, w2, w3, flag):
    """Stage 1 for cells ``start ..``: their sorted ``|z|`` into ``a0 >= a1 >= a2 >= a3``,
    lam into ``lv``, the descending rank of each position (2 bits each; ties broken by
    position, as ``torch.sort(stable=True)`` does) into ``ranks``, and the 2-sparse start
    ``[a0, a1, 0, 0]`` (``z`` for lam = 0) into ``w0..w3``; ``flag`` 1 where the 3-sparse and
    dense cases are still open: ``K < 1`` (necessary for both, see
    :func:`nmprune.prox.reduced.solve_sorted_reduced`), ``lam z_3 > 0`` and the 2-sparse
    KKT certificate fails; 4 where the answer is proven dense (``f(z) = lam r(z)`` is below
    :func:`_sparse_lower_bound`: only the dense case is open, the 3-sparse stage is
    skipped); 5 where ``z`` holds NaN or Inf (left undecided, for the caller's error)."""
    for t in range(U64(a0.shape[0])):
        i = U64(4) * (U64(start) + t)
        b0 = abs(np.float64(z[i]))
        b1 = abs(np.float64(z[i + U64(1)]))
        b2 = abs(np.float64(z[i + U64(2)]))
        b3 = abs(np.float64(z[i + U64(3)]))
        c01, c02, c03 = np.int32(b1 > b0), np.int32(b2 > b0), np.int32(b3 > b0)
        c12, c13, c23 = np.int32(b2 > b1), np.int32(b3 > b1), np.int32(b3 > b2)
        r0 = c01 + c02 + c03
        r1 = 1 - c01 + c12 + c13
        r2 = 2 - c02 - c12 + c23
        r3 = 3 - c03 - c13 - c23
        # the sorted values by a sorting network (five compare-exchanges)
        p0, q0 = max(b0, b1), min(b0, b1)
        p1, q1 = max(b2, b3), min(b2, b3)
        z1, m0 = max(p0, p1), min(p0, p1)
        m1, z4 = max(q0, q1), min(q0, q1)
        z2, z3 = max(m0, m1), min(m0, m1)
        lam_t = np.float64(lam[U64(start) + t])
        a0[t], a1[t], a2[t], a3[t], lv[t] = z1, z2, z3, z4, lam_t
        ranks[t] = r0 | (r1 << 2) | (r2 << 4) | (r3 << 6)
        zero = lam_t == 0.0
        w0[t] = z1
        w1[t] = z2
        w2[t] = z3 if zero else 0.0
        w3[t] = z4 if zero else 0.0
        rest = 2.0 - lam_t * z1  # K >= 1, i.e. lam (z1 + sqrt(z1^2 - z2^2)) >= 2, without the root
        big_k = (rest <= 0.0) | (lam_t * lam_t * ((z1 - z2) * (z1 + z2)) >= rest * rest)
        cert = (lam_t * z1 * z2 >= z3) & pd4(lam_t, z1, z2, 0.0, 0.0)
        # f(z) = lam r(z) bounds the minimum from above; below the lower bound on every
        # point with a zero entry the answer is dense (no sparse case to solve)
        reg = z1 * z2 * (z3 + z4) + z3 * z4 * (z1 + z2)
        dense = lam_t * reg < _sparse_lower_bound(z1, z2, z3, z4, lam_t) * (1.0 - DENSE_MARGIN)
        settled = zero | big_k | (lam_t * z3 <= 0.0) | cert
        finite = (b0 < np.inf) & (b1 < np.inf) & (b2 < np.inf) & (b3 < np.inf)  # False for NaN
        flag[t] = (0.0 if settled else (4.0 if dense else 1.0)) if finite else 5.0


@njit(**_JIT)
def _select(flag, value, idx):
    """Positions ``t`` with ``flag[t] == value`` into ``idx[:k]``; returns ``k``."""
    k = U64(0)
    for t in range(U64(flag.shape[0])):
        idx[k] = t
        k += U64(flag[t] == value)
    return k


@njit(**_JIT)
def _gather(idx, src, dst):
    for j in range(U64(dst.shape[0])):
        dst[j] = src[idx[j]]


@njit(**_JIT)
def _scatter(idx, src, dst):
    for j in range(U64(src.shape[0])):
        dst[idx[j]] = src[j]


@njit(inline="always", **_JIT)
def _three_newton(u, step, a, b, c, lo, hi, state):
    """One masked Newton step ``u - step`` on ``Phi(u) = 0`` (a cell with ``state`` 0 moves;
    1 once it has converged, 2 once it leaves the region that holds a valid PSD root), and
    the next step. With ``p = 1 + u``, ``q = 1 - u`` (:func:`nmprune.prox.reduced.three_sparse_root`):
    ``Phi = N / (4 p^2 q^2)`` and ``Phi' = D / (2 p^3 q^3)`` with
    ``N = 4 (u - c) p^2 q^2 + A^2 q^2 - B^2 p^2``, ``D = 2 p^3 q^3 - A^2 q^3 - B^2 p^3``,
    so the step ``Phi / Phi' = N p q / (2 D)`` costs one division (the divisions bound the
    vectorised rounds). Its tests in these terms:
    ``Phi' <= 0`` is ``D p q <= 0``; the residual test is scaled by ``4 p^2 q^2``."""
    un = u - step
    p, q = 1.0 + un, 1.0 - un
    pq = p * q
    pq2 = pq * pq
    aq, bp = a * a * (q * q), b * b * (p * p)
    num = 4.0 * (un - c) * pq2 + aq - bp
    den = 2.0 * pq2 * pq - aq * q - bp * p
    out = (un <= lo) | (un >= hi) | (den * pq <= 0.0)
    done = (abs(step) <= STEP_TOL * un) | (abs(num) <= 4e-16 * (4.0 * pq2 * (un + c) + aq + bp))
    active = state == 0.0
    new = (2.0 if out else (1.0 if done else 0.0)) if active else state
    return (un if active else u), (num * pq / (2.0 * den) if active else step), new


@njit(**_JIT)
def _three_start(z1, z2, z3, lv, a, b, c, lo, hi, u, step, state):
    """The start of the 3-sparse root search (:func:`nmprune.prox.reduced.three_sparse_root`)
    of every cell: ``a = lam (z1 + z2)``, ``b = lam (z1 - z2)``, ``c = lam z3``, the region
    ``(lo, hi)`` that holds the valid root, the inflection point ``u*``, the Newton step
    ``Phi / Phi'`` there, and the state (0 iterating, 2 proven absent)."""
    for j in range(U64(u.shape[0])):
        x1, x2, lam = z1[j], z2[j], lv[j]
        s, d = x1 + x2, x1 - x2
        cj = lam * z3[j]
        root = np.sqrt(d * s)  # u* = (1 - r) / (1 + r) with r = sqrt(d / s) = root / s
        uj = (s - root) / (s + root)
        k = lam * (x1 + root) * 0.5
        aj, bj = lam * s, lam * d
        pj = uj + k * (aj - bj) * 0.25 - cj
        umax = min(x2 / x1, cj)
        left = pj > 0.0
        a[j], b[j], c[j], u[j], step[j] = aj, bj, cj, uj, pj / (1.0 - k * k)
        lo[j] = 0.0 if left else -np.inf
        hi[j] = np.inf if left else umax
        state[j] = 2.0 if (k >= 1.0) | (~left & (uj >= umax)) else 0.0


@njit(**_JIT)
def _three_round(a, b, c, lo, hi, u, step, state):
    """``ROUND_3SPARSE`` masked Newton steps on ``Phi(u) = 0`` (arrays as in
    :func:`_three_start`), the state of each cell kept in registers in between."""
    for j in range(U64(u.shape[0])):
        aj, bj, cj, loj, hij = a[j], b[j], c[j], lo[j], hi[j]
        uj, sj, st = u[j], step[j], state[j]
        for _ in range(ROUND_3SPARSE):
            uj, sj, st = _three_newton(uj, sj, aj, bj, cj, loj, hij, st)
        u[j], step[j], state[j] = uj, sj, st


@njit(**_JIT)
def _three_round_rows(ws, row, n):
    """:func:`_three_round` on the first ``n`` entries of rows ``row .. row + 7`` of ``ws``,
    passed as contiguous 1-D rows (2-D views would stop LLVM vectorising the round)."""
    _three_round(ws[row, :n], ws[row + 1, :n], ws[row + 2, :n], ws[row + 3, :n], ws[row + 4, :n],
                 ws[row + 5, :n], ws[row + 6, :n], ws[row + 7, :n])


@njit(**_JIT)
def _three_solve(z1, z2, z3, lv, ws, row, n, idx):
    """The 3-sparse root ``u = lam w_3`` of the ``n`` cells ``z1[:n] ..``: the arrays of
    :func:`_three_start` are rows ``row .. row + 7`` of ``ws``, rows ``row + 8 ..`` hold the
    cells still iterating after each round of :func:`_three_round` (their positions in
    ``idx``). ``state`` (row ``row + 7``) ends 0 not converged, 1 converged, 2 proven
    absent; ``u`` is row ``row + 5``, ``c`` row ``row + 2``."""
    r0, r1 = row, row + 8
    _three_start(z1, z2, z3, lv, ws[r0, :n], ws[r0 + 1, :n], ws[r0 + 2, :n], ws[r0 + 3, :n],
                 ws[r0 + 4, :n], ws[r0 + 5, :n], ws[r0 + 6, :n], ws[r0 + 7, :n])
    _three_round_rows(ws, r0, n)
    for _ in range(ROUNDS_3SPARSE - 1):
        k = _select(ws[r0 + 7, :n], 0.0, idx)
        if k == 0:
            break
        sel = idx[:k]
        for r in range(8):
            _gather(sel, ws[r0 + r, :n], ws[r1 + r, :k])
        _three_round_rows(ws, r1, k)
        for r in range(5, 8):  # u, step, state
            _scatter(sel, ws[r1 + r, :k], ws[r0 + r, :n])


@njit(**_JIT)
def _three_finish(z1, z2, z3, z4, lv, u, c, state, w0, w1, w2, flag):
    """The better of the 3-sparse point and the 2-sparse one into ``w0..w2``; ``flag``:
    0 settled, 1 the dense case must be checked, 2 undecided (Newton not converged)."""
    for j in range(U64(u.shape[0])):
        x1, x2, x3, x4, lam, uj, st = z1[j], z2[j], z3[j], z4[j], lv[j], u[j], state[j]
        found = (st == 1.0) & (uj > 0.0) & (uj * x1 < x2) & (uj < c[j])
        inv = 1.0 / (1.0 - uj * uj)
        v1 = (x1 - uj * x2) * inv
        v2 = (x2 - uj * x1) * inv
        v3 = uj / lam
        f3 = 0.5 * ((v1 - x1) ** 2 + (v2 - x2) ** 2 + (v3 - x3) ** 2 + x4 * x4) + lam * v1 * v2 * v3
        take = found & (f3 < 0.5 * (x3 * x3 + x4 * x4))
        v1 = v1 if take else x1
        v2 = v2 if take else x2
        v3 = v3 if take else 0.0
        w0[j], w1[j], w2[j] = v1, v2, v3
        # the dense case needs z_4 > 0, the PSD bound lam z1 z2 < 9 z4, a non-empty case
        # box, lam (z_1 - z_2) < 1 and lam (z_3 - z_4) < 1, and no certificate of the best
        # sparse point
        box = case_box(x1, x2, x3, x4, lam)[0]
        open_ = ((lam * x4 > 0.0) & (lam * x1 * x2 < 9.0 * x4) & box & (lam * (x1 - x2) < 1.0)
                 & (lam * (x3 - x4) < 1.0) & ~sparse_point_rules_out_dense(v1, v2, v3, x3, x4, lam))
        flag[j] = 2.0 if st == 0.0 else (1.0 if open_ else 0.0)


@njit(**_JIT)
def _dense_init(z1, z2, z3, z4, lv, x, y, s1, s2, d1, d2, state):
    """``(S_1, S_2)/2`` and the reduced constants; ``state`` 0 (iterating)."""
    for j in range(U64(x.shape[0])):
        lam = lv[j]
        p, q = lam * (z1[j] + z2[j]), lam * (z3[j] + z4[j])
        s1[j], s2[j], d1[j], d2[j] = p, q, lam * (z1[j] - z2[j]), lam * (z3[j] - z4[j])
        x[j], y[j], state[j] = 0.5 * p, 0.5 * q, 0.0


@njit(**_JIT)
def _box_empty(z1, z2, z3, z4, lv, state):
    """``state`` 3 where the case and ``(x, y)`` boxes prove that there is no dense PSD
    stationary point with ``w_2, w_4 > 0`` (the reduced constants are computed again here:
    cheaper than gathering them)."""
    for j in range(U64(z1.shape[0])):
        x1, x2, x3, x4, lam = z1[j], z2[j], z3[j], z4[j], lv[j]
        _, l1, l2, l3, l4, h1, h2, h3, h4 = case_box(x1, x2, x3, x4, lam)
        box, _, _, _, _ = xy_box(lam * (x1 + x2), lam * (x3 + x4), lam * (x1 - x2), lam * (x3 - x4),
                                  lam * (l1 + l2), lam * (h1 + h2), lam * (l3 + l4), lam * (h3 + h4))
        state[j] = state[j] if box else 3.0


@njit(**_JIT)
def _dense_unconverged_boxes(z1, z2, z3, z4, lv, state, ws, row, idx):
    """:func:`_box_empty` on the cells where dense Newton did not converge (``state`` 0 or
    2), gathered into rows ``row .. row + 5`` of ``ws`` (their positions in ``idx``). Newton
    runs first because the boxes cost more than its steps and are only needed where it
    fails: most cells have a dense answer while lam is small."""
    k = U64(0)
    for t in range(U64(z1.shape[0])):
        idx[k] = t
        k += U64(state[t] != 1.0)
    if k == 0:
        return
    sel = idx[:k]
    for r, src in enumerate((z1, z2, z3, z4, lv, state)):
        _gather(sel, src, ws[row + r, :k])
    _box_empty(ws[row, :k], ws[row + 1, :k], ws[row + 2, :k], ws[row + 3, :k], ws[row + 4, :k], ws[row + 5, :k])
    _scatter(sel, ws[row + 5, :k], state)


@njit(**_JIT)
def _dense_step(x, y, s1, s2, d1, d2, state):
    """One masked Newton step on ``grad G = 0``; ``state`` 1 once converged at a point with
    ``x, y < 1`` and a positive definite ``grad^2 G``, 2 if an iterate leaves ``x, y < 1``."""
    for j in range(U64(x.shape[0])):
        xj, yj = x[j], y[j]
        _, _, h11, _, _, det, dx, dy = g_newton(xj, yj, s1[j], s2[j], d1[j], d2[j])
        out = (xj >= 1.0) | (yj >= 1.0)
        done = (h11 > 0.0) & (det > 0.0) & (abs(dx) + abs(dy) <= STEP_TOL * (xj + yj))
        active = state[j] == 0.0
        state[j] = (2.0 if out else (1.0 if done else 0.0)) if active else state[j]
        move = active & ~out & ~done
        x[j] = xj + dx if move else xj
        y[j] = yj + dy if move else yj


@njit(**_JIT)
def _dense_rows(ws, row, n, steps):
    """``steps`` of :func:`_dense_step` on the first ``n`` entries of rows ``row .. row + 6``
    of ``ws`` (x, y, S_1, S_2, d_1, d_2, state), passed as contiguous 1-D rows."""
    for _ in range(steps):
        _dense_step(ws[row, :n], ws[row + 1, :n], ws[row + 2, :n], ws[row + 3, :n],
                    ws[row + 4, :n], ws[row + 5, :n], ws[row + 6, :n])


@njit(**_JIT)
def _dense_solve(ws, row, n, idx):
    """``ITER_DENSE`` masked Newton steps on the ``n`` cells in rows ``row .. row + 6`` of
    ``ws``: ``ROUND_DENSE`` on all of them, the rest only on the cells still iterating,
    gathered into rows ``row + 7 ..`` (their positions in ``idx``)."""
    _dense_rows(ws, row, n, ROUND_DENSE)
    k = _select(ws[row + 6, :n], 0.0, idx)
    if k == 0:
        return
    sel = idx[:k]
    for r in range(7):
        _gather(sel, ws[row + r, :n], ws[row + 7 + r, :k])
    _dense_rows(ws, row + 7, k, ITER_DENSE - ROUND_DENSE)
    for r in (0, 1, 6):  # x, y, state
        _scatter(sel, ws[row + 7 + r, :k], ws[row + r, :n])


@njit(**_JIT)
def _no_dense_answer(w3, flag):
    """For cells proven dense: flag 1 (the 3-sparse stage and the rest of the pass) where the
    dense stage found no dense answer (``w_4 = 0``), else 0."""
    for j in range(U64(w3.shape[0])):
        flag[j] = 1.0 if w3[j] == 0.0 else 0.0


@njit(**_JIT)
def _dense_finish(z1, z2, z3, z4, lv, x, y, state, w0, w1, w2, w3, flag):
    """Keep the dense point where it is valid (``w_2, w_4 > 0``) and better; ``flag`` 1
    where Newton did not converge (the convex stage tries), else 0."""
    for j in range(U64(x.shape[0])):
        x1, x2, x3, x4, lam, st = z1[j], z2[j], z3[j], z4[j], lv[j], state[j]
        v1, v2, v3, v4 = dense_weights(x[j], y[j], x1, x2, x3, x4, lam)
        p1, p2, p3 = w0[j], w1[j], w2[j]
        best = objective4(p1, p2, p3, 0.0, x1, x2, x3, x4, lam)
        take = (st == 1.0) & (v2 > 0.0) & (v4 > 0.0) & (objective4(v1, v2, v3, v4, x1, x2, x3, x4, lam) < best)
        w0[j] = v1 if take else p1
        w1[j] = v2 if take else p2
        w2[j] = v3 if take else p3
        w3[j] = v4 if take else 0.0
        flag[j] = 0.0 if (st == 1.0) | (st == 3.0) else 1.0


@njit(**_JIT)
def _convex_start(z1, z2, z3, z4, lv, w0, w1, w2, target, s1, s2, d1, d2, xlo, xhi, ylo, yhi):
    """For the cells where plain Newton failed (the reduced constants and the start
    ``(S_1, S_2)/2`` set by :func:`_dense_init`), as in
    :func:`nmprune.prox.reduced_kernel.dense_case`: the ``(x, y)`` box and the bound to beat
    (``4 lam^2`` times the best sparse objective). Two loops: one over all these arrays would
    need too many run-time aliasing checks to vectorise."""
    for j in range(U64(s1.shape[0])):
        x1, x2, x3, x4, lam = z1[j], z2[j], z3[j], z4[j], lv[j]
        _, l1, l2, l3, l4, h1, h2, h3, h4 = case_box(x1, x2, x3, x4, lam)
        _, a, b, c, d = xy_box(s1[j], s2[j], d1[j], d2[j], lam * (l1 + l2), lam * (h1 + h2),
                               lam * (l3 + l4), lam * (h3 + h4))
        xlo[j], xhi[j], ylo[j], yhi[j] = a, b, c, d
    for j in range(U64(s1.shape[0])):
        x1, x2, x3, x4, lam = z1[j], z2[j], z3[j], z4[j], lv[j]
        target[j] = 4.0 * lam * lam * objective4(w0[j], w1[j], w2[j], 0.0, x1, x2, x3, x4, lam)


@njit(**_JIT)
def _convex_pull(x, y, s1, s2, d1, d2):
    """Halve the points outside ``R`` (towards the origin, which the convex ``R`` holds)."""
    for j in range(U64(x.shape[0])):
        inside = in_r(x[j], y[j], s1[j], s2[j], d1[j], d2[j])
        x[j] = x[j] if inside else 0.5 * x[j]
        y[j] = y[j] if inside else 0.5 * y[j]


@njit(**_JIT)
def _convex_bound(x, y, s1, s2, d1, d2, xlo, xhi, ylo, yhi, target, gv, dx, dy, dec, state):
    """At the current point of the cells still iterating (``state`` 0): state 3 where the
    convexity bound (:func:`nmprune.prox.reduced_kernel.convex_lower_bound`) proves that
    the dense case cannot beat the best sparse point, state 2 where the point is not in
    ``R`` or the damped Newton method has converged (a stationary point: the per-cell
    solver takes the cell); else ``G``, the Newton direction and decrement for the step."""
    for j in range(U64(x.shape[0])):
        xj, yj, p, q, e, f = x[j], y[j], s1[j], s2[j], d1[j], d2[j]
        g1, g2, h11, h12, h22, _, u, v = g_newton(xj, yj, p, q, e, f)
        gj = g_value(xj, yj, p, q, e, f)
        bound = convex_lower_bound(xj, yj, gj, g1, g2, h11, h12, h22, e, f, xlo[j], xhi[j], ylo[j], yhi[j])
        dj = -(g1 * u + g2 * v)
        done = (dj <= DEC_TOL * (p * p + q * q)) & (abs(u) + abs(v) <= STEP_TOL * (xj + yj))
        gv[j], dx[j], dy[j], dec[j] = gj, u, v, dj
        st = state[j]
        new = 3.0 if bound > target[j] else (2.0 if done | ~in_r(xj, yj, p, q, e, f) else 0.0)
        state[j] = new if st == 0.0 else st


@njit(**_JIT)
def _convex_try(t, x, y, s1, s2, d1, d2, gv, dx, dy, dec, xn, yn, moved):
    """Backtracking: the first step length ``t`` (1, 1/2, ...) that stays in ``R`` and
    decreases ``G`` enough is kept in ``xn, yn`` (``moved`` 1)."""
    for j in range(U64(x.shape[0])):
        cx, cy = x[j] + t * dx[j], y[j] + t * dy[j]
        p, q, e, f = s1[j], s2[j], d1[j], d2[j]
        ok = ((moved[j] == 0.0) & in_r(cx, cy, p, q, e, f)
              & (g_value(cx, cy, p, q, e, f) <= gv[j] - 2e-4 * t * dec[j]))
        xn[j] = cx if ok else xn[j]
        yn[j] = cy if ok else yn[j]
        moved[j] = 1.0 if ok else moved[j]


@njit(**_JIT)
def _convex_slide_dir(x, y, s1, s2, d1, d2, tx, ty):
    """The direction of the boundary slide of
    :func:`nmprune.prox.reduced_kernel._dense_convex`: minus the gradient of ``G`` projected
    onto the tangent of ``phi = 0``, of length 0.1. Near the boundary of ``R``, where
    ``grad^2 G`` turns singular, Newton steps are cut short; this slides along it."""
    for j in range(U64(x.shape[0])):
        xj, yj, e, f = x[j], y[j], d1[j], d2[j]
        g1, g2, h11, h12, h22, _, _, _ = g_newton(xj, yj, s1[j], s2[j], e, f)
        nx, ny, _ = phi_grad(xj, yj, h11, h12, h22, e, f)
        proj = (g1 * nx + g2 * ny) / (nx * nx + ny * ny)
        ax, ay = proj * nx - g1, proj * ny - g2
        norm = np.sqrt(ax * ax + ay * ay)
        scale = 0.1 / norm if norm > 0.0 else 0.0
        tx[j], ty[j] = ax * scale, ay * scale


@njit(**_JIT)
def _convex_slide(t, x, y, s1, s2, d1, d2, gv, tx, ty, xn, yn, moved):
    """For the cells whose Newton line search found no step (``moved`` 0): the first slide
    length ``t`` that stays in ``R`` and lowers ``G`` is kept in ``xn, yn`` (``moved`` 1)."""
    for j in range(U64(x.shape[0])):
        cx, cy = x[j] + t * tx[j], y[j] + t * ty[j]
        p, q, e, f = s1[j], s2[j], d1[j], d2[j]
        ok = (moved[j] == 0.0) & in_r(cx, cy, p, q, e, f) & (g_value(cx, cy, p, q, e, f) < gv[j])
        xn[j] = cx if ok else xn[j]
        yn[j] = cy if ok else yn[j]
        moved[j] = 1.0 if ok else moved[j]


@njit(**_JIT)
def _convex_move(x, y, xn, yn, moved, state):
    """Take the accepted steps; a cell still iterating without one has stalled (state 2)."""
    for j in range(U64(x.shape[0])):
        active = state[j] == 0.0
        go = active & (moved[j] == 1.0)
        x[j] = xn[j] if go else x[j]
        y[j] = yn[j] if go else y[j]
        state[j] = 2.0 if active & ~go else state[j]
        moved[j] = 0.0


@njit(inline="always", **_JIT)
def _pick(r, w0, w1, w2, w3):
    lo = w1 if (r & 1) == 1 else w0
    hi = w3 if (r & 1) == 1 else w2
    return hi if r >= 2 else lo


@njit(**_JIT)
def _store(z, start, w0, w1, w2, w3, ranks, out):
    """The sorted solutions back at the positions and with the signs of ``z``."""
    for t in range(U64(w0.shape[0])):
        i = U64(4) * (U64(start) + t)
        v0, v1, v2, v3, r = w0[t], w1[t], w2[t], w3[t], ranks[t]
        out[i] = math.copysign(_pick(r & 3, v0, v1, v2, v3), z[i])
        out[i + U64(1)] = math.copysign(_pick((r >> 2) & 3, v0, v1, v2, v3), z[i + U64(1)])
        out[i + U64(2)] = math.copysign(_pick((r >> 4) & 3, v0, v1, v2, v3), z[i + U64(2)])
        out[i + U64(3)] = math.copysign(_pick((r >> 6) & 3, v0, v1, v2, v3), z[i + U64(3)])


@njit(**_JIT)
def _chunk(z, lam, out, undecided, start, stop, ws, ranks, idx):
    """Stages 1-5 of the module docstring for cells ``start .. stop``, in the work rows
    ``ws`` (``_SCRATCH`` rows of at least ``stop - start`` entries), ``ranks`` and ``idx``
    (a stage's cells, then the cells of its later rounds: twice as long)."""
    m = stop - start
    ranks = ranks[:m]
    a0, a1, a2, a3, lv = ws[0, :m], ws[1, :m], ws[2, :m], ws[3, :m], ws[4, :m]
    w0, w1, w2, w3, flag = ws[5, :m], ws[6, :m], ws[7, :m], ws[8, :m], ws[9, :m]
    resume_x, resume_y = ws[41, :m], ws[42, :m]  # the convex stage's last point, for stage 5
    load_cells(z, lam, start, a0, a1, a2, a3, lv, ranks, w0, w1, w2, w3, flag)
    # rows 10.. hold the compacted cells of one stage at a time
    # stages, in this order: 1 the dense case of the cells proven dense (flag 4; those without
    # a dense answer get flag 1), 0 the 3-sparse case (flag 1), 2 the dense case of the cells
    # stage 0 left open (flag 1), 3 the convex stage (flag 1 again)
    for stage in (1, 0, 2, 3):
        k = _select(flag, 4.0 if stage == 1 else 1.0, idx)
        if k == 0:  # flag 4 comes only from load_cells; flag 1 from load_cells or the stage before
            if stage == 1:
                continue
            break
        sel = idx[:k]
        z1, z2, z3, z4, lk = ws[10, :k], ws[11, :k], ws[12, :k], ws[13, :k], ws[14, :k]
        v0, v1, v2, v3, fk = ws[15, :k], ws[16, :k], ws[17, :k], ws[18, :k], ws[19, :k]
        for src, dst in ((a0, z1), (a1, z2), (a2, z3), (a3, z4), (lv, lk)):
            _gather(sel, src, dst)
        if stage > 0:  # the best sparse point so far
            for src, dst in ((w0, v0), (w1, v1), (w2, v2)):
                _gather(sel, src, dst)
        if stage == 0:
            _three_solve(z1, z2, z3, lk, ws, 20, k, idx[m:])  # rows 20-35
            _three_finish(z1, z2, z3, z4, lk, ws[25, :k], ws[22, :k], ws[27, :k], v0, v1, v2, fk)
            for src, dst in ((v0, w0), (v1, w1), (v2, w2), (fk, flag)):
                _scatter(sel, src, dst)
        elif stage < 3:
            x, y, s1, s2 = ws[20, :k], ws[21, :k], ws[22, :k], ws[23, :k]
            d1, d2, state = ws[24, :k], ws[25, :k], ws[26, :k]
            _dense_init(z1, z2, z3, z4, lk, x, y, s1, s2, d1, d2, state)
            _dense_solve(ws, 20, k, idx[m:])  # rows 20-33
            if stage == 2:  # the cells proven dense skip the boxes (see _no_dense_answer)
                _dense_unconverged_boxes(z1, z2, z3, z4, lk, state, ws, 34, idx[m:])  # rows 34-39
            _dense_finish(z1, z2, z3, z4, lk, x, y, state, v0, v1, v2, v3, fk)
            if stage == 1:  # no dense answer found: the whole pass (its sparse cases are unsolved)
                _no_dense_answer(v3, fk)
            for src, dst in ((v0, w0), (v1, w1), (v2, w2), (v3, w3), (fk, flag)):
                _scatter(sel, src, dst)
        else:
            x, y, target, gv = ws[20, :k], ws[21, :k], ws[22, :k], ws[23, :k]
            s1, s2, d1, d2 = ws[24, :k], ws[25, :k], ws[26, :k], ws[27, :k]
            xlo, xhi, ylo, yhi = ws[28, :k], ws[29, :k], ws[30, :k], ws[31, :k]
            dx, dy, dec, state = ws[32, :k], ws[33, :k], ws[34, :k], ws[35, :k]
            xn, yn, moved = ws[36, :k], ws[37, :k], ws[38, :k]
            tx, ty = ws[39, :k], ws[40, :k]
            _dense_init(z1, z2, z3, z4, lk, x, y, s1, s2, d1, d2, state)
            _convex_start(z1, z2, z3, z4, lk, v0, v1, v2, target, s1, s2, d1, d2, xlo, xhi, ylo, yhi)
            for _ in range(CONVEX_PULLS):
                _convex_pull(x, y, s1, s2, d1, d2)
            moved[:] = 0.0
            for _ in range(ITER_CONVEX):
                _convex_bound(x, y, s1, s2, d1, d2, xlo, xhi, ylo, yhi, target, gv, dx, dy, dec, state)
                step = 1.0
                for _ in range(CONVEX_HALVINGS):
                    _convex_try(step, x, y, s1, s2, d1, d2, gv, dx, dy, dec, xn, yn, moved)
                    step *= 0.5
                _convex_slide_dir(x, y, s1, s2, d1, d2, tx, ty)
                step = 1.0
                for _ in range(SLIDE_HALVINGS):
                    _convex_slide(step, x, y, s1, s2, d1, d2, gv, tx, ty, xn, yn, moved)
                    step *= 0.5
                _convex_move(x, y, xn, yn, moved, state)
            _convex_bound(x, y, s1, s2, d1, d2, xlo, xhi, ylo, yhi, target, gv, dx, dy, dec, state)
            for j in range(k):  # proven: the sparse answer stands; else the per-cell fallbacks
                flag[sel[j]] = 0.0 if state[j] == 3.0 else 3.0
                resume_x[sel[j]], resume_y[sel[j]] = x[j], y[j]
    for t in range(m):
        if (flag[t] == 2.0) | (flag[t] == 5.0):  # 3-sparse Newton not converged; NaN or Inf
            undecided[start + t] = True
        elif flag[t] == 3.0:  # plain dense Newton failed: the per-cell dense fallbacks
            best = objective4(w0[t], w1[t], w2[t], 0.0, a0[t], a1[t], a2[t], a3[t], lv[t])
            w0[t], w1[t], w2[t], w3[t] = dense_case(a0[t], a1[t], a2[t], a3[t], lv[t], w0[t], w1[t],
                                                     w2[t], best, resume_x[t], resume_y[t])
    _store(z, start, w0, w1, w2, w3, ranks, out)


@njit(parallel=True, **_JIT)
def prox_cells(z, lam, out, undecided, chunk, ws, ranks, idx):
    """The 2:4 prox of every cell ``z[4 i : 4 i + 4]`` (flat, float32 or float64) with
    ``lam[i]`` into ``out`` (flat, like ``z``), ``chunk`` cells at a time; ``undecided[i]``
    is set where the exact torch path must re-solve the cell (3-sparse Newton not converged:
    rare) and where the cell holds NaN or Inf. Thread ``t``
    works in ``ws[t]``, ``ranks[t]``, ``idx[t]`` (:func:`_workspace`)."""
    n = z.shape[0] // 4
    for c in prange((n + chunk - 1) // chunk):
        t = numba.get_thread_id()
        _chunk(z, lam, out, undecided, c * chunk, min(n, (c + 1) * chunk), ws[t], ranks[t], idx[t])


def chunk_size(cells: int, threads: int) -> int:
    """Cells per chunk: the fewest chunks of at most ``MAX_CHUNK`` cells whose number is a
    multiple of the thread count, all of (nearly) the same size, and no chunk below
    ``MIN_CHUNK``. Large chunks give the rare later stages arrays long enough to vectorise;
    numba splits the chunks evenly over the threads, so equal shares matter more than many
    chunks."""
    threads = max(1, threads)
    per_thread = -(-cells // (threads * MAX_CHUNK))
    return max(MIN_CHUNK, -(-cells // (threads * per_thread)))


COMPILED_DTYPES: set[tuple[str, str]] = set()  # (z dtype, lam dtype) pairs prox_cells has run for


@contextlib.contextmanager
def _interleaved_vector_loops(compiling: bool) -> Iterator[None]:
    """While ``compiling``: LLVM's loop vectoriser told to interleave two vectors of cells per
    iteration (``-force-vector-interleave=2``), then its default (0, its own cost model) again.

    Its cost model does not interleave loops with bodies this large, so each loop keeps one
    vector of cells in flight and waits on the latency of its dependent operations (a Newton
    round, the rounds of a box); two independent vectors per iteration hide part of it.
    The option is global to LLVM, so it is set only while this module's kernels compile (the
    first call per dtype; later calls and numba's on-disk cache compile nothing)."""
    if not compiling:
        yield
        return
    import llvmlite.binding as llvm

    llvm.set_option("nmprune", "-force-vector-interleave=2")
    try:
        yield
    finally:
        llvm.set_option("nmprune", "-force-vector-interleave=0")


_WORKSPACE: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []


def _workspace(threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Work arrays for ``threads`` numba threads, each for one chunk of up to ``MAX_CHUNK``
    cells (2.8 MB), kept between calls (replaced only by a larger set; the compiled kernel holds
    the GIL, so calls never share them): allocated per call, glibc can map and unmap them every
    time, and the page faults cost a large part of the kernel. Rows are ``MAX_CHUNK + 8``
    apart, a whole number of cache lines plus one, so that the loops over ten and more rows do
    not evict each other from L1 (rows a power of two apart do)."""
    if not _WORKSPACE or _WORKSPACE[0][0].shape[0] < threads:
        _WORKSPACE[:] = [(np.empty((threads, _SCRATCH, MAX_CHUNK + 8)), np.empty((threads, MAX_CHUNK), np.int32),
                          np.empty((threads, 2 * MAX_CHUNK), np.uint64))]
    return _WORKSPACE[0]


def run(z: np.ndarray, lam: np.ndarray, out: np.ndarray, undecided: np.ndarray, chunk: int | None = None) -> None:
    """:func:`prox_cells` for cells ``z`` (``(n, 4)``, C-contiguous) on as many numba threads as
    torch uses (torch's thread count is left as it was); ``chunk`` cells at a time (default
    :func:`chunk_size`, at most ``MAX_CHUNK``)."""
    import torch

    threads = torch.get_num_threads()
    workers = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(workers)
    chunk = chunk_size(z.shape[0], threads) if chunk is None else chunk
    if not 0 < chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be between 1 and {MAX_CHUNK} cells, got {chunk}")
    key = (z.dtype.str, lam.dtype.str)
    try:
        with _interleaved_vector_loops(key not in COMPILED_DTYPES):
            prox_cells(z.reshape(-1), lam, out.reshape(-1), undecided, chunk, *_workspace(workers))
        COMPILED_DTYPES.add(key)
    finally:
        # numba's OpenMP layer can change the OpenMP thread count that torch reads
        torch.set_num_threads(threads)
