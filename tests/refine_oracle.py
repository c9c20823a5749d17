"""Slow, obviously right float64 reference for mask-held refinement (used by the method and
refiner tests): the minimiser of the local loss with the mask held, one least-squares solve
per row (``gelsd``: minimum-norm solutions on singular blocks)."""

from __future__ import annotations

import torch


def masked_optimum(w_star: torch.Tensor, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w_star, h = w_star.double(), h.double()
    target = w_star @ h
    out = torch.zeros_like(w_star)
    for r in range(w_star.shape[0]):
        s = mask[r]
        if s.any():
            out[r, s] = torch.linalg.lstsq(h[s][:, s], target[r, s].unsqueeze(1),
                                           driver="gelsd").solution.squeeze(1)
    return out
