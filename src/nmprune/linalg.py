"""Small linear-algebra helpers shared by the layer solvers (no model or file knowledge)."""

from __future__ import annotations

import torch
from torch import Tensor


def gamma_max(h: Tensor, iters: int = 100, rtol: float = 1e-4) -> float:
    """Largest eigenvalue ``gamma_max(H)`` of a symmetric positive semi-definite ``H``.

    Used for the gradient step ``eta = 1 / (2 gamma_max(H))`` of paper Section 3.1
    (eq. ``masked_gd``). Power iteration on a deterministic start vector, stopped when the
    Rayleigh quotient changes by less than ``rtol``; the estimate is a lower bound that is
    within ``rtol`` of the true value long before it could make the step unstable (gradient
    descent on the quadratic stays stable for any estimate above ``gamma_max / 2``). Returns
    0.0 for ``H == 0``.
    """
    d = h.shape[0]
    if d == 0:
        return 0.0
    gen = torch.Generator(device="cpu").manual_seed(0)
    v = (1.0 + torch.rand(d, generator=gen, dtype=torch.float64)).to(h.device, h.dtype)
    v = v / v.norm()
    est = 0.0
    for _ in range(iters):
        hv = h @ v
        new = float(v @ hv)
        norm = hv.norm()
        if float(norm) == 0.0:
            return 0.0
        v = hv / norm
        if abs(new - est) <= rtol * abs(new):
            return new
        est = new
    return est


def gd_step_size(h: Tensor) -> float:
    """``eta = 1 / (2 gamma_max(H))`` (paper Section 3.1); 0 when ``H == 0`` (nothing to do)."""
    g = gamma_max(h)
    return 0.0 if g <= 0.0 else 1.0 / (2.0 * g)


def wanda_scale(h: Tensor) -> Tensor:
    """Per-input scale ``H_jj^{1/2}`` used by Wanda scores and the Wanda-style rescaling.

    Dead inputs (``H_jj == 0``) get scale 0.
    """
    return torch.diagonal(h).clamp_min(0.0).sqrt()


def wanda_score(w: Tensor, h: Tensor) -> Tensor:
    """Wanda's score ``|W_ij| H_jj^{1/2}`` (a new tensor of ``w``'s size, built in place):
    the loss of pruning one weight when ``H`` is diagonal (paper eq. ``wanda_loss``)."""
    return w.abs().mul_(wanda_scale(h))


def column_scale(h: Tensor) -> Tensor:
    """``s_j = H_jj^{1/2}``, with 1 for dead inputs (``H_jj == 0``, whose row and column of a
    PSD ``H`` are zero, so the weights there are left as they are)."""
    s = wanda_scale(h)
    return torch.where(s > 0, s, torch.ones_like(s))


def rescale(w: Tensor, h: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Wanda-style change of variables (paper Section 4): ``W_ij -> W_ij s_j``,
    ``H_ij -> H_ij / (s_i s_j)``. The local loss is invariant; undo with ``W / s``."""
    return w * s, h / s[:, None] / s[None, :]
