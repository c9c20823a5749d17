"""Input checks and the sign/permutation reduction shared by the proximal operators.

Lemma ``lemma:sorted_prox``: the prox objective is invariant to joint permutations and sign
flips of ``w`` and ``z``, so every solver works on ``|z|`` sorted in decreasing order and the
result is mapped back with the signs and positions of ``z``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..checks import check_float


def check_cells(z: Tensor, m: int | None = None, *, finite: bool = True) -> None:
    """``z`` must be a floating tensor of cells ``(..., M)`` (``M == m`` when given), finite
    unless ``finite`` is False (a caller that finds NaN and Inf itself)."""
    check_float("z", z, finite=finite)
    if z.ndim == 0:
        raise ValueError("z must have a last dimension holding the cells, got a 0-d tensor")
    if m is not None and z.shape[-1] != m:
        raise ValueError(f"z must have cells of {m} weights in its last dimension, got {z.shape[-1]}")
    if z.shape[-1] < 2:
        raise ValueError(f"cells need at least 2 weights, got {z.shape[-1]}")


def lam_tensor(lam: float | Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
    """``lam`` checked (finite, >= 0, float) and broadcast to one value per cell, in ``dtype``."""
    if isinstance(lam, Tensor):
        check_float("lam", lam)
        if bool((lam < 0).any()):
            raise ValueError("lam must be non-negative")
        try:
            out = torch.broadcast_to(lam.to(device=z.device), z.shape[:-1])
        except RuntimeError as err:
            raise ValueError(
                f"lam of shape {tuple(lam.shape)} does not broadcast to the cell shape {tuple(z.shape[:-1])}"
            ) from err
        return out.to(dtype)
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise ValueError(f"lam must be a float or a tensor, got {type(lam).__name__}")
    if not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be finite and non-negative, got {lam!r}")
    return torch.full(z.shape[:-1], float(lam), dtype=dtype, device=z.device)


def check_n(n: int, m: int) -> None:
    """``n`` must be an integer with ``0 < n < M``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n < m:
        raise ValueError(f"n must be an integer with 0 < n < M={m}, got {n!r}")


def sort_abs(z: Tensor) -> tuple[Tensor, Tensor]:
    """``(|z| sorted decreasingly along the last dim, the sorting permutation)``."""
    a, order = torch.sort(z.abs(), dim=-1, descending=True, stable=True)
    return a, order


def unsort(w_sorted: Tensor, order: Tensor, z: Tensor) -> Tensor:
    """Put the non-negative sorted solution back at the positions and with the signs of ``z``."""
    w = torch.empty_like(w_sorted).scatter_(-1, order, w_sorted)
    return torch.where(z < 0, -w, w)
