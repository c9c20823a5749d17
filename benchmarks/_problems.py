"""Synthetic layer problems shared by the benchmarks (no model files needed)."""

from __future__ import annotations

import torch
from torch import Tensor


def synthetic_hessian(d: int, alpha: float, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The paper's Section 4.1 generator: ``alpha diag(U[0,1]) + (1 - alpha) Z Z^T`` with
    ``Z ~ N(0, 1/d)``, and one random weight row ``w ~ N(0, 1)``. Returns ``(w (1, d), H)``."""
    g = torch.Generator().manual_seed(seed)
    diag = torch.diag(torch.rand(d, generator=g, dtype=torch.float64))
    z = torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5
    h = alpha * diag + (1 - alpha) * (z @ z.T)
    w = torch.randn(1, d, generator=g, dtype=torch.float64)
    return w.float(), h.float()


def correlated_layer(d_out: int, d_in: int, seed: int = 0, rank: int = 32, n: int | None = None,
                     dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """A layer-like problem: activations ``X = (F A + E) * s`` with ``rank`` shared factors
    (strongly correlated channels), isotropic noise and log-normal channel scales (a few large
    "outlier" channels, as in LLM activations); ``H = X X^T / n`` from ``n = 4 d_in`` samples;
    weights ``N(0, 1/d_in)``; the inputs get a per-channel offset so that their mean (DSnoT's
    statistic) is not zero. Returns ``(W, H, input_mean)``."""
    g = torch.Generator().manual_seed(seed)
    n = n or 4 * d_in
    f = torch.randn(d_in, rank, generator=g) * (torch.arange(1, rank + 1) ** -0.5)
    x = 2.0 * f @ torch.randn(rank, n, generator=g) + torch.randn(d_in, n, generator=g)
    x = (x + 0.5 * torch.randn(d_in, 1, generator=g)) * torch.exp(0.8 * torch.randn(d_in, 1, generator=g))
    h = x @ x.T / n
    h = 0.5 * (h + h.T)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    return w.to(dtype), h.to(dtype), x.mean(1).to(dtype)
