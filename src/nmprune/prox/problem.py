"""The restricted prox problems the torch solvers share: objective, gradient and Hessian of the
2:4 cases ``g`` (3 variables, eq. ``prox_sorted3``) and ``f`` (4 variables, eq.
``prox_sorted``) and of the general N:M case, and an unrolled Cholesky for their small Hessians.

All act on sorted non-negative cells (Lemma ``lemma:sorted_prox``) row by row: ``w``, ``z`` of
shape ``(B, k)``, ``lam`` of shape ``(B,)``. A small symmetric matrix per row is held entry by
entry (:data:`Entries`): elementwise tensor operations on ``k <= 8`` entries are much faster
than batched LAPACK calls on tiny matrices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .regularizers import leave_one_out_symmetric

# a small symmetric matrix per row, entry by entry: (B,) tensors, or floats shared by all rows
Entries = list[list[Any]]


def objective_2of4(w: Tensor, z: Tensor, lam: Tensor) -> Tensor:
    """``0.5||w - z||^2 + lam r_{2:4}(w)`` for non-negative ``w`` with 3 or 4 entries."""
    q = 0.5 * (w - z).square().sum(-1)
    if w.shape[-1] == 3:
        return q + lam * w[:, 0] * w[:, 1] * w[:, 2]
    w1, w2, w3, w4 = w.unbind(-1)
    return q + lam * (w1 * w2 * (w3 + w4) + w3 * w4 * (w1 + w2))


def others_2of4(w: Tensor) -> Tensor:
    """``e_{k-2}`` of the other entries, the derivative of ``r_{2:4}`` restricted to ``k``
    entries: the product of the other two (k = 3) or the sum of the pairwise products of the
    other three (k = 4)."""
    if w.shape[-1] == 3:
        w1, w2, w3 = w.unbind(-1)
        return torch.stack((w2 * w3, w1 * w3, w1 * w2), -1)
    w1, w2, w3, w4 = w.unbind(-1)
    p12, p13, p14, p23, p24, p34 = w1 * w2, w1 * w3, w1 * w4, w2 * w3, w2 * w4, w3 * w4
    return torch.stack((p23 + p24 + p34, p13 + p14 + p34, p12 + p14 + p24, p12 + p13 + p23), -1)


def grad_2of4(w: Tensor, z: Tensor, lam: Tensor) -> Tensor:
    """Gradient ``w - z + lam e_{k-2}(w_{-i})`` of ``g`` (k = 3) or ``f`` (k = 4)."""
    return w - z + lam[:, None] * others_2of4(w)


def grad_hess_2of4(w: Tensor, z: Tensor, lam: Tensor) -> tuple[Tensor, Entries]:
    """Gradient and Hessian entries (eqs. ``hessian_3sparse``/``hessian_4sparse``) of ``g``/``f``:
    unit diagonal, off-diagonal ``lam w_k`` (k = 3) or ``lam (w_k + w_l)`` (k = 4) over the
    entries ``k, l`` other than the row and column."""
    k = w.shape[-1]
    hess: Entries = [[1.0] * k for _ in range(k)]
    if k == 3:
        w1, w2, w3 = w.unbind(-1)
        pairs = ((0, 1, w3), (0, 2, w2), (1, 2, w1))
    else:
        w1, w2, w3, w4 = w.unbind(-1)
        pairs = ((0, 1, w3 + w4), (0, 2, w2 + w4), (0, 3, w2 + w3),
                 (1, 2, w1 + w4), (1, 3, w1 + w3), (2, 3, w1 + w2))
    for i, j, s in pairs:
        hess[i][j] = hess[j][i] = lam * s
    return grad_2of4(w, z, lam), hess


def grad_hess_nm(w: Tensor, z: Tensor, lam: Tensor, n: int) -> tuple[Tensor, Entries]:
    """Gradient ``w - z + lam e_N(w_{-i})`` and Hessian ``I + lam e_{N-1}(w_{-i,-j})`` (i != j)
    of the N:M case problem ``0.5||w - z||^2 + lam e_{N+1}(w)`` (eq. ``regularizer_nm``)."""
    loo = leave_one_out_symmetric(w, n)  # (B, k, n+1): e_t(w without i)
    grad = w - z + lam[:, None] * loo[..., n]
    # e_t(w without i, j) = e_t(w without i) - w_j e_{t-1}(w without i, j)
    pair = torch.ones(w.shape + (w.shape[-1],), dtype=w.dtype, device=w.device)
    for t in range(1, n):
        pair = loo[..., t].unsqueeze(-1) - w[:, None, :] * pair
    hess = lam[:, None, None] * pair
    k = w.shape[-1]
    return grad, [[1.0 if i == j else hess[:, i, j] for j in range(k)] for i in range(k)]


def cholesky(ent: Entries) -> tuple[Entries, Tensor | bool]:
    """Unrolled Cholesky of a batch of small symmetric matrices given entry-wise: the lower
    factor in the same form and a flag per row (True when positive definite)."""
    k = len(ent)
    low: Entries = [[0.0] * k for _ in range(k)]
    ok: Tensor | bool = True
    for j in range(k):
        s = ent[j][j]
        for t in range(j):
            s = s - low[j][t] * low[j][t]
        if isinstance(s, Tensor):
            ok = ok & (s > 0)
            dj = s.clamp_min(1e-300).sqrt()
        else:
            dj = max(s, 1e-300) ** 0.5
        low[j][j] = dj
        for i in range(j + 1, k):
            s = ent[i][j]
            for t in range(j):
                s = s - low[i][t] * low[j][t]
            low[i][j] = s / dj
    return low, ok


def positive_definite(ent: Entries) -> Tensor | bool:
    """True for the rows whose matrix (given entry-wise) is positive definite."""
    return cholesky(ent)[1]


def cholesky_solve(low: Entries, b: Tensor) -> Tensor:
    """Solve ``L L^T x = b`` for ``b`` of shape ``(B, k)``, ``L`` from :func:`cholesky`."""
    k = b.shape[-1]
    y: list[Tensor] = []
    for i in range(k):
        s = b[:, i]
        for t in range(i):
            s = s - low[i][t] * y[t]
        y.append(s / low[i][i])
    x: list[Tensor] = [None] * k  # type: ignore[list-item]
    for i in reversed(range(k)):
        s = y[i]
        for t in range(i + 1, k):
            s = s - low[t][i] * x[t]
        x[i] = s / low[i][i]
    return torch.stack(x, -1)
