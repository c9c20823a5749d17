"""Masked gradient descent refinement (paper eq. ``masked_gd``, Section 3.1)."""

from __future__ import annotations

from torch import Tensor

from .._linalg import gd_step_size
from ..registry import register_refiner


@register_refiner("gd", description="masked gradient descent on the local loss (paper eq. masked_gd)")
def refine_gd(w: Tensor, w_star: Tensor, h: Tensor, mask: Tensor, *, steps: int = 1000,
              step_size: float | None = None) -> Tensor:
    """``W <- W - eta * 2 M . (W H - W* H)`` for ``steps`` steps, all rows at once.

    ``eta`` defaults to ``1 / (2 gamma_max(H))`` (paper Section 3.1), for which the local
    loss decreases monotonically; 1000 steps is the paper's setting. Works for singular
    ``H`` (it converges to a minimiser on the mask's support).
    """
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    eta = gd_step_size(h) if step_size is None else float(step_size)
    if not eta >= 0.0:
        raise ValueError(f"step_size must be non-negative, got {step_size!r}")
    keep = mask.to(w.dtype)
    w = w * keep
    target = w_star @ h
    two_eta = 2.0 * eta
    for _ in range(steps):
        w = w - two_eta * keep * (w @ h - target)
    return w
