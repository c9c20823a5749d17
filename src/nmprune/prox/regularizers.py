"""The N:M regularizers of the paper and the prox objective.

``r_{N:M}(w) = sum over (N+1)-subsets S of prod_{j in S} |w_j|`` (eq. ``regularizer_nm``) is
the elementary symmetric polynomial ``e_{N+1}(|w|)`` of the cell; it is zero exactly when the
cell has at most N non-zeros (Fact ``fact:nullspace``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import check_float


def elementary_symmetric(x: Tensor, k: int) -> Tensor:
    """``[e_0(x), ..., e_k(x)]`` over the last dimension of ``x``: shape ``x.shape[:-1] + (k+1,)``.

    Computed by the recurrence ``e_j <- e_j + x_i e_{j-1}`` over the (few) entries of a cell,
    vectorised over all cells.
    """
    e = [torch.ones_like(x[..., 0])] + [torch.zeros_like(x[..., 0]) for _ in range(k)]
    for i in range(x.shape[-1]):
        xi = x[..., i]
        for j in range(min(k, i + 1), 0, -1):
            e[j] = e[j] + xi * e[j - 1]
    return torch.stack(e, dim=-1)


def leave_one_out_symmetric(x: Tensor, k: int) -> Tensor:
    """``out[..., i, j] = e_j(x without entry i)`` for ``j = 0..k``: shape ``x.shape + (k+1,)``."""
    e = elementary_symmetric(x, k)  # (..., k+1)
    out = [torch.ones_like(x)]
    for j in range(1, k + 1):
        # e_j(x) = e_j(x_{-i}) + x_i e_{j-1}(x_{-i})
        out.append(e[..., j].unsqueeze(-1) - x * out[j - 1])
    return torch.stack(out, dim=-1)


def r_nm(w: Tensor, n: int) -> Tensor:
    """``r_{N:M}(w)`` of every cell ``w[..., :]`` (M = ``w.shape[-1]``), eq. ``regularizer_nm``."""
    check_float("w", w)
    m = w.shape[-1]
    if not (isinstance(n, int) and 0 < n < m):
        raise ValueError(f"n must be an integer with 0 < n < M={m}, got {n!r}")
    return elementary_symmetric(w.abs(), n + 1)[..., n + 1]


def r_2of4(w: Tensor) -> Tensor:
    """``r_{2:4}(w)``: the sum of the four triple products of ``|w|`` (eq. ``prox_original``)."""
    check_float("w", w)
    if w.shape[-1] != 4:
        raise ValueError(f"r_2of4 needs cells of 4 weights in the last dimension, got {w.shape[-1]}")
    a = w.abs()
    a1, a2, a3, a4 = a.unbind(-1)
    return a1 * a2 * (a3 + a4) + a3 * a4 * (a1 + a2)


def prox_objective(w: Tensor, z: Tensor, lam: Tensor | float, n: int) -> Tensor:
    """``0.5 ||w - z||^2 + lam r_{N:M}(w)`` per cell (the objective every N:M prox minimises)."""
    return 0.5 * (w - z).square().sum(-1) + lam * elementary_symmetric(w.abs(), n + 1)[..., n + 1]
