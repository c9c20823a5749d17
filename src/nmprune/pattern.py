"""N:M sparsity patterns: parsing, cell views, masks and checks.

A matrix ``W`` of shape ``(d_out, d_in)`` is N:M sparse when every cell of M consecutive
weights along the input dimension holds at most N non-zeros (paper Section 2.3, the set
``S_{N:M}``). Everything here is vectorised over cells.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class NMPattern:
    """At most ``n`` non-zeros in every cell of ``m`` consecutive weights (``0 < n < m``)."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not (isinstance(self.n, int) and isinstance(self.m, int) and 0 < self.n < self.m):
            raise ValueError(f"an N:M pattern needs integers 0 < N < M, got N={self.n!r}, M={self.m!r}")

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


def parse_pattern(pattern: str | NMPattern | tuple[int, int]) -> NMPattern:
    """Parse ``"2:4"`` (or ``(2, 4)``, or an :class:`NMPattern`) into an :class:`NMPattern`."""
    if isinstance(pattern, NMPattern):
        return pattern
    if isinstance(pattern, tuple) and len(pattern) == 2:
        return NMPattern(*pattern)
    if isinstance(pattern, str):
        parts = pattern.strip().split(":")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            return NMPattern(int(parts[0]), int(parts[1]))
    raise ValueError(f"pattern must look like 'N:M' with integers 0 < N < M, got {pattern!r}")


def to_cells(w: Tensor, m: int) -> Tensor:
    """View ``(..., d_in)`` as ``(..., d_in // m, m)``; ``d_in`` must be divisible by ``m``."""
    if w.shape[-1] % m:
        raise ValueError(f"input dimension {w.shape[-1]} is not divisible by M={m}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // m, m)


def from_cells(cells: Tensor) -> Tensor:
    """Undo :func:`to_cells`."""
    return cells.reshape(*cells.shape[:-2], cells.shape[-2] * cells.shape[-1])


def topn_mask(scores: Tensor, pattern: NMPattern) -> Tensor:
    """Boolean mask keeping the ``n`` largest scores of every cell (ties: lowest index first).

    This is the mask rule of Wanda and magnitude pruning (paper Theorem 1) for any score
    (NaN scores are kept first). A score's rank in its cell is the number of scores that beat
    it (larger, or equal at a lower index), counted with ``M`` whole-matrix comparisons: one
    byte of working memory per score, where a sort or top-k needs an int64 index per score.
    """
    cells = to_cells(scores, pattern.m)
    rank = torch.zeros_like(cells, dtype=torch.uint8 if pattern.m < 256 else torch.int32)
    for j in range(pattern.m):  # a loop over the M positions of a cell, not over weights
        column = cells[..., j:j + 1]
        rank += cells < column
        rank[..., j + 1:] += cells[..., j + 1:] == column
    return from_cells(rank < pattern.n)


_PACKED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # M bytes as one integer


def count_dense_cells(w: Tensor, pattern: NMPattern) -> int:
    """The number of cells of ``w`` (along its last dimension) with more than N non-zeros.

    For M in 1, 2, 4, 8 the cell's M non-zero flags (bytes 0 or 1) are read as one integer and
    its lowest set bit is cleared N times (``v & (v - 1)``): the cell has more than N non-zeros
    exactly when something is left. One pass over ``w`` and a few over ``1/M`` of it, much
    faster than a sum over a last dimension of size M (the proximal-gradient loop counts the
    cells at every iteration)."""
    flags = to_cells(w, pattern.m) != 0
    packed = _PACKED.get(pattern.m)
    if packed is None:
        return int((flags.sum(-1) > pattern.n).sum())
    v = flags.contiguous().view(packed)
    for _ in range(pattern.n):
        v = v & (v - 1)
    return int(torch.count_nonzero(v))


def is_nm_sparse(w: Tensor, pattern: str | NMPattern) -> bool:
    """True when every cell of ``w`` along its last dimension has at most N non-zeros."""
    return count_dense_cells(w, parse_pattern(pattern)) == 0


def same_mask_cells(a: Tensor, b: Tensor, m: int) -> Tensor:
    """Per cell of ``m`` consecutive weights along the last dimension of two matrices of one
    shape: whether their zero patterns are the same (bool, ``(d_out, d_in / m)``)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (to_cells(a, m) != 0).eq(to_cells(b, m) != 0).all(-1)
