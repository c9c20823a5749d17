"""Closed-form proxes: the simpler 2:4 regularizers of Appendix ``app:other_regularizers``
(eqs. ``L0``, ``L1``, ``L2``, generalised to N:M cells) and the 1:M prox of ``r_{1:M}``.

All act on cells ``z[..., :M]``: by Lemma ``lemma:sorted_prox`` the ``n`` largest magnitudes are
kept and only the ``M - n`` smallest are penalised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cells import check_cells, check_n, lam_tensor, sort_abs, unsort


def _smallest_mask(z: Tensor, n: int) -> Tensor:
    """True at the ``M - n`` smallest-magnitude entries of every cell (ties: later index)."""
    order = torch.sort(z.abs(), dim=-1, descending=True, stable=True).indices
    mask = torch.ones_like(z, dtype=torch.bool)
    return mask.scatter_(-1, order[..., :n], False)


def _prepare(z: Tensor, lam: float | Tensor, n: int) -> tuple[Tensor, Tensor]:
    check_cells(z)
    check_n(n, z.shape[-1])
    return _smallest_mask(z, n), lam_tensor(lam, z, z.dtype).unsqueeze(-1)


def prox_l0(z: Tensor, lam: float | Tensor, n: int = 2) -> Tensor:
    """Prox of ``R_0`` (eq. ``L0``): a penalised entry becomes 0 if ``lam > z^2/2``, else stays."""
    small, lam_ = _prepare(z, lam, n)
    return torch.where(small & (lam_ > 0.5 * z.square()), torch.zeros_like(z), z)


def prox_l1(z: Tensor, lam: float | Tensor, n: int = 2) -> Tensor:
    """Prox of ``R_1`` (eq. ``L1``): penalised entries are soft-thresholded by ``lam``."""
    small, lam_ = _prepare(z, lam, n)
    soft = torch.sign(z) * (z.abs() - lam_).clamp_min(0.0)
    return torch.where(small, soft, z)


def prox_l2(z: Tensor, lam: float | Tensor, n: int = 2) -> Tensor:
    """Prox of ``R_2`` (eq. ``L2``): penalised entries are shrunk to ``z / (1 + lam)``."""
    small, lam_ = _prepare(z, lam, n)
    return torch.where(small, z / (1.0 + lam_), z)


def prox_1ofm(z: Tensor, lam: float | Tensor) -> Tensor:
    """Exact prox of ``r_{1:M}(w) = sum_{i<j} |w_i||w_j|`` for cells ``z[..., :M]``.

    On sorted non-negative ``z`` the optimum is supported on a top-``k`` set (Lemma
    ``lemma:sorted_prox``). There the objective is quadratic with Hessian
    ``(1 - lam) I + lam 11^T``; for ``lam < 1`` its unique stationary point is
    ``w_i = (z_i - lam s) / (1 - lam)`` with ``s = sum_{i<=k} z_i / (1 + (k-1) lam)``, and it is the
    restricted minimiser when all its entries are positive. For ``lam >= 1`` (not convex for
    ``k >= 2``) the optimum is 1-sparse. The best feasible candidate over ``k`` is returned.
    """
    check_cells(z)
    m = z.shape[-1]
    work = torch.float64 if z.dtype != torch.float64 else z.dtype
    lam_c = lam_tensor(lam, z, work).reshape(-1, 1, 1)
    zc = z.reshape(-1, m)
    a, order = sort_abs(zc)
    a = a.to(work)
    k = torch.arange(1, m + 1, device=z.device, dtype=work)  # support sizes
    s = a.cumsum(-1)[:, :, None] / (1.0 + (k[:, None] - 1.0) * lam_c)  # (B, K, 1)
    convex = lam_c < 1.0
    cand = (a[:, None, :] - lam_c * s) / torch.where(convex, 1.0 - lam_c, torch.ones_like(lam_c))
    in_support = torch.arange(m, device=z.device)[None, :] < k[:, None]  # (K, M)
    cand = torch.where(in_support, cand, torch.zeros_like(cand))
    cand[:, 0, :] = 0.0
    cand[:, 0, 0] = a[:, 0]  # k = 1: keep the largest entry
    zk = a[:, None, :]
    e2 = 0.5 * (cand.sum(-1).square() - cand.square().sum(-1))
    obj = 0.5 * (cand - zk).square().sum(-1) + lam_c[..., 0] * e2
    feasible = ((cand > 0) | ~in_support).all(-1) & (convex[..., 0] | (k == 1))
    obj = torch.where(feasible, obj, torch.full_like(obj, torch.inf))
    best = obj.argmin(-1)
    w = cand[torch.arange(cand.shape[0], device=z.device), best]
    return unsort(w.to(z.dtype), order, zc).reshape(z.shape)
