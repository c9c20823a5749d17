"""Masked gradient descent refinement (paper eq. ``masked_gd``, Section 3.1)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..linalg import column_scale, gd_step_size, rescale
from ..registry import NonNegativeFloat, NonNegativeInt, register_refiner


@register_refiner("gd", description="masked gradient descent on the local loss (paper eq. masked_gd)",
                  cost=1.0e-8, rows="independent")
def refine_gd(w: Tensor, w_star: Tensor, h: Tensor, mask: Tensor, *, steps: NonNegativeInt = 1000,
              step_size: NonNegativeFloat | None = None, scaled: bool = True) -> Tensor:
    """``W <- W - eta * 2 M . (W H - W* H)`` for ``steps`` steps, all rows at once.

    ``eta`` defaults to ``1 / (2 gamma_max(H))`` (paper Section 3.1), for which the local
    loss decreases monotonically; 1000 steps is the paper's setting. With ``scaled=True``
    (default) the steps run in the Wanda-scaled coordinates ``W_ij H_jj^{1/2}``,
    ``H_ij (H_ii H_jj)^{-1/2}`` that the paper applies to all methods (Section 4); the loss is
    the same function, only better conditioned. ``scaled=False`` runs eq. ``masked_gd`` on the
    raw ``H``. Works for singular ``H`` (converges to a minimiser on the mask's support).
    """
    s = column_scale(h) if scaled else torch.ones(h.shape[0], dtype=h.dtype, device=h.device)
    w, h = rescale(w, h, s)
    w_star = w_star * s
    eta = gd_step_size(h) if step_size is None else float(step_size)
    keep = mask.to(w.dtype)
    w = w * keep
    target = w_star @ h
    two_eta = 2.0 * eta
    for _ in range(steps):
        w = w - two_eta * keep * (w @ h - target)
    return w / s
