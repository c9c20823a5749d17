"""The local squared loss of a pruned layer and its gradient (paper eq. 2-3, Appendix A)."""

from __future__ import annotations

import torch
from torch import Tensor


def local_loss_tensor(w: Tensor, w_star: Tensor, h: Tensor) -> Tensor:
    """``L(W) = Tr((W - W*) H (W - W*)^T)`` (paper eq. ``squared_loss``), as a 0-dim tensor.

    Computed in at least float32 (float64 stays float64).
    """
    dtype = torch.promote_types(torch.promote_types(w.dtype, h.dtype), torch.float32)
    d = (w - w_star).to(dtype)
    return (d @ h.to(dtype)).mul_(d).sum()


def local_loss(w: Tensor, w_star: Tensor, h: Tensor) -> float:
    """``L(W) = Tr((W - W*) H (W - W*)^T)`` (paper eq. ``squared_loss``) as a Python float."""
    if w.shape != w_star.shape or h.shape != (w.shape[-1], w.shape[-1]):
        raise ValueError(f"shapes do not match: W {tuple(w.shape)}, W* {tuple(w_star.shape)}, "
                         f"H {tuple(h.shape)}")
    return float(local_loss_tensor(w, w_star, h))


def local_loss_grad(w: Tensor, w_star_h: Tensor, h: Tensor) -> Tensor:
    """``grad L(W) = 2 (W H - W* H)`` (paper Appendix A); ``w_star_h = W* H`` is precomputed once."""
    return 2.0 * (w @ h - w_star_h)
