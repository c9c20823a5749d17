"""Slow, obviously right float64 references for the proximal operators (used by the prox tests
and by benchmarks/prox_speed.py; no code shared with nmprune.prox).

The N:M prox objective ``0.5||w - z||^2 + lam * sum_{|S|=N+1} prod_{j in S} |w_j|`` is written
out by subset enumeration. Its minimiser has the signs of ``z`` and ``|w_i| <= |z_i|``, so we
minimise over the box ``0 <= w <= |z|`` on EVERY support (all coordinates outside the support
fixed to zero) from many random starting points by projected gradient descent (autograd
gradient, step 1/L with L a bound on the Hessian norm over the box), and keep the best value.
Cells are first scaled to ``max|z| = 1`` (``lam`` scaled accordingly), which leaves the relative
objective unchanged.
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch
from torch import Tensor


def objective(w: Tensor, z: Tensor, lam: Tensor, n: int) -> Tensor:
    """Prox objective per cell, the regularizer by explicit subset enumeration."""
    a = w.abs()
    reg = torch.zeros_like(a[..., 0])
    for s in itertools.combinations(range(w.shape[-1]), n + 1):
        reg = reg + a[..., list(s)].prod(-1)
    return 0.5 * (w - z).square().sum(-1) + lam * reg


def _gradient(w: Tensor, z: Tensor, lam: Tensor, n: int) -> Tensor:
    """Gradient on w >= 0: ``w_i - z_i + lam * sum over N-subsets S of the others of prod w_S``."""
    m = w.shape[-1]
    x = w.unbind(-1)
    cols = []
    for i in range(m):
        others = [j for j in range(m) if j != i]
        acc = torch.zeros_like(x[0])
        for s in itertools.combinations(others, n):
            acc = acc + functools.reduce(operator.mul, [x[j] for j in s])
        cols.append(acc)
    return w - z + lam[..., None] * torch.stack(cols, -1)


def reference_min(z: Tensor, lam: Tensor, n: int, starts: int = 4, iters: int = 1500,
                  seed: int = 0) -> Tensor:
    """Smallest objective found for each cell of ``z`` (B, M) with ``lam`` (B,), float64.

    Runs single-threaded (many small kernels: much faster than contended intra-op threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_min(z, lam, n, starts, iters, seed)
    finally:
        torch.set_num_threads(threads)


def _reference_min(z: Tensor, lam: Tensor, n: int, starts: int, iters: int, seed: int) -> Tensor:
    z = z.to(torch.float64)
    lam = lam.to(torch.float64)
    bsz, m = z.shape
    scale = z.abs().amax(-1).clamp_min(1e-300)
    a = z.abs() / scale[:, None]
    lam_s = lam * scale.pow(n - 1)  # objective(c w; c z, lam) = c^2 objective(w; z, lam c^(n-1))
    # the n largest entries alone (regularizer zero) is always feasible
    best = 0.5 * a.square().sum(-1) - 0.5 * a.sort(-1, descending=True).values[:, :n].square().sum(-1)
    supports = [s for k in range(n + 1, m + 1) for s in itertools.combinations(range(m), k)]
    gen = torch.Generator().manual_seed(seed)
    # Hessian bound on the box [0, 1]^M: 1 + (M - 1) * lam * C(M - 2, N - 1)
    lip = 1.0 + (m - 1) * lam_s * len(list(itertools.combinations(range(m - 2), n - 1)))
    # every (support, start) pair is a row of one batch
    masks = torch.zeros(len(supports), m, dtype=torch.float64)
    for r, s in enumerate(supports):
        masks[r, list(s)] = 1.0
    hi = (a[:, None, None, :] * masks[None, :, None, :]).expand(bsz, len(supports), starts + 2, m)
    u = torch.rand(bsz, len(supports), starts, m, generator=gen, dtype=torch.float64)
    w = torch.cat([torch.ones(bsz, len(supports), 2, m, dtype=torch.float64), u], 2) * hi
    w[:, :, 1] *= 0.5
    hi = hi.reshape(-1, m)
    w = w.reshape(-1, m)
    rows = len(supports) * (starts + 2)
    zz = a.repeat_interleave(rows, 0)
    ll = lam_s.repeat_interleave(rows, 0)
    step = (1.0 / lip).repeat_interleave(rows, 0)[:, None]
    for _ in range(iters):
        w = torch.minimum((w - step * _gradient(w, zz, ll, n)).clamp_min(0.0), hi)
    found = objective(w, zz, ll, n).reshape(bsz, rows).amin(-1)
    return torch.minimum(best, found) * scale.square()
