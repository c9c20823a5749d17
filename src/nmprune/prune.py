"""One entry point for every layer-level N:M pruning method (paper eq. ``n_m_squard_loss``).

``prune_layer(W, H, method, pattern, refine, **options)`` validates its inputs, runs a
registered method (see :mod:`nmprune.algorithms`) and optionally a registered mask-held
refiner, and reports the local squared loss (paper eq. ``squared_loss``) after each stage.
Everything is computed in float32 (float64 when ``W`` or ``H`` is float64) and cast back
to ``W``'s dtype at the end. Methods and refiners know nothing about models or files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._checks import check_float, check_non_negative, check_symmetric
from ._linalg import wanda_scale
from .loss import local_loss
from .pattern import NMPattern, is_nm_sparse, parse_pattern, topn_mask
from .registry import get_method, get_refiner, split_options


@dataclass
class LayerResult:
    """Outcome of :func:`prune_layer`.

    ``mask`` holds exactly N allowed positions per cell: the method's non-zeros, completed
    (where a cell has fewer than N non-zeros) by the remaining positions with the largest
    Wanda score; ``weight`` is zero outside it. ``loss_method`` is the local loss right
    after the method, ``loss_refined`` after refinement (``None`` without refinement).
    """

    weight: Tensor
    mask: Tensor
    loss_method: float
    loss_refined: float | None
    seconds_method: float
    seconds_refine: float


def _validate(w: Tensor, h: Tensor, pattern: NMPattern) -> None:
    check_float("W", w)
    check_float("H", h)
    if w.ndim != 2:
        raise ValueError(f"W must be a matrix (d_out, d_in), got shape {tuple(w.shape)}")
    if h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"shapes do not match: H must be (d_in, d_in) = ({w.shape[1]}, {w.shape[1]}) "
                         f"for W of shape {tuple(w.shape)}, got H of shape {tuple(h.shape)}")
    if w.device != h.device:
        raise ValueError(f"W and H are on different devices ({w.device} and {h.device})")
    if w.shape[1] % pattern.m:
        raise ValueError(f"input dimension d_in={w.shape[1]} is not divisible by M={pattern.m}")
    check_symmetric("H", h)


def _compute_dtype(w: Tensor, h: Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (w.dtype, h.dtype) else torch.float32


def _sync(t: Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def full_mask(w_pruned: Tensor, w_star: Tensor, h: Tensor, pattern: NMPattern) -> Tensor:
    """Exactly N positions per cell: the non-zeros of ``w_pruned`` first, then the highest
    Wanda scores ``|W*_ij| H_jj^{1/2}`` (a free slot can only help a mask-held refiner)."""
    score = w_star.abs() * wanda_scale(h)
    score = score / (1.0 + score.max()) if score.numel() else score
    return topn_mask((w_pruned != 0).to(score.dtype) + score, pattern)


def dampen(h: Tensor, damp: float) -> Tensor:
    """``H + damp * mean(diag H) * I`` (a new tensor; ``h`` itself when ``damp == 0``).

    The local loss with this ``H`` is ``Tr((W-W*) H (W-W*)^T) + damp * mean(diag H) *
    ||W - W*||_F^2``: a Tikhonov pull towards the dense weights, scaled like SparseGPT's
    dampening. It keeps solvers from fitting the directions an under-determined ``H`` (fewer
    calibration tokens than inputs) does not see.
    """
    if damp == 0.0:
        return h
    out = h.clone()
    out.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    return out


def prune_layer(W: Tensor, H: Tensor, method: str = "prox", pattern: str | NMPattern = "2:4",
                refine: str | None = None, *, damp: float = 0.0, **options: Any) -> LayerResult:
    """Prune ``W`` (d_out, d_in) to N:M along ``d_in`` minimising ``Tr((W-W*) H (W-W*)^T)``.

    ``method`` is any name of :func:`nmprune.methods`; ``refine`` (``None``, ``"gd"``,
    ``"exact"``) then re-optimises the kept weights with the mask held. ``options`` go to
    the method (its keyword-only parameters) and, prefixed ``refine_``, to the refiner.
    With ``damp > 0`` the method and the refiner see :func:`dampen` ``(H, damp)`` instead of
    ``H``; the reported losses are always on ``H`` itself. Raises ValueError naming any bad
    input or option.
    """
    p = parse_pattern(pattern)
    _validate(W, H, p)
    damp = check_non_negative("damp", damp)
    m = get_method(method)
    if not m.supports(p):
        raise ValueError(f"method {method!r} does not support pattern {p}")
    r = get_refiner(refine) if refine is not None else None
    m_opts, r_opts = split_options(options, m, r)

    dtype = _compute_dtype(W, H)
    w_star, h = W.to(dtype), H.to(dtype)
    h_solve = dampen(h, damp)

    start = time.perf_counter()
    w = m.fn(w_star, h_solve, p, **m_opts)
    _sync(w)
    seconds_method = time.perf_counter() - start
    if w.shape != w_star.shape or not is_nm_sparse(w, p):
        raise RuntimeError(f"method {method!r} did not return an exactly {p} sparse matrix")
    mask = full_mask(w, w_star, h, p)
    loss_method = local_loss(w, w_star, h)

    loss_refined, seconds_refine = None, 0.0
    if r is not None:
        start = time.perf_counter()
        w = r.fn(w, w_star, h_solve, mask, **r_opts)
        _sync(w)
        seconds_refine = time.perf_counter() - start
        if bool((w[~mask] != 0).any()):
            raise RuntimeError(f"refiner {refine!r} changed weights outside the mask")
        loss_refined = local_loss(w, w_star, h)

    return LayerResult(weight=w.to(W.dtype), mask=mask, loss_method=loss_method,
                       loss_refined=loss_refined, seconds_method=seconds_method,
                       seconds_refine=seconds_refine)


def prune_matrix(W: Tensor, H: Tensor, method: str = "prox", pattern: str | NMPattern = "2:4",
                 refine: str | None = None, *, damp: float = 0.0, **options: Any) -> Tensor:
    """The pruned weights of :func:`prune_layer` (same shape, dtype and device as ``W``)."""
    return prune_layer(W, H, method=method, pattern=pattern, refine=refine, damp=damp,
                       **options).weight
