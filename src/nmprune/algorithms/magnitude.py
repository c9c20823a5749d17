"""Magnitude pruning: keep the N largest ``|W_ij|`` of every cell (ignores ``H``)."""

from __future__ import annotations

from torch import Tensor

from ..pattern import NMPattern, topn_mask
from ..registry import register_method


@register_method("magnitude", description="keep the N largest |W_ij| per cell", entry_cost=4.1e-9,
                 rows="independent")
def magnitude(w: Tensor, h: Tensor, pattern: NMPattern) -> Tensor:
    """Zero the ``M - N`` smallest-magnitude weights of every cell."""
    return w * topn_mask(w.abs(), pattern)
