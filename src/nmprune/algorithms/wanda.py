"""Wanda (Sun et al., 2023): prune by the score ``|W_ij| H_jj^{1/2}``.

For a diagonal Hessian this mask is optimal (paper Theorem ``thm:wanda_opt``, eq.
``wanda_loss``): the loss of a mask is the sum of the squared scores it prunes.
"""

from __future__ import annotations

from torch import Tensor

from ..linalg import wanda_score
from ..pattern import NMPattern, topn_mask
from ..registry import register_method


@register_method("wanda", description="keep the N largest |W_ij| * sqrt(H_jj) per cell",
                 cost=6.1e-14, entry_cost=4.0e-9, rows="independent")
def wanda(w: Tensor, h: Tensor, pattern: NMPattern) -> Tensor:
    """Zero the ``M - N`` weights with the smallest ``|W_ij| sqrt(H_jj)`` in every cell."""
    return w * topn_mask(wanda_score(w, h), pattern)
