"""The solver call for one layer (paper eq. ``n_m_squard_loss``): :func:`solve`.

``solve(W, H, plan)`` checks the tensors, runs the plan's registered method (see
:mod:`nmprune.algorithms`) and, if planned, its mask-held refiner, and reports the local
squared loss (paper eq. ``squared_loss``) after each stage. Everything is computed in float32
(float64 when ``W`` or ``H`` is float64) and cast back to ``W``'s dtype at the end. The
public :func:`prune_layer` / :func:`prune_matrix` resolve their settings into a plan
(:func:`nmprune.stages.plan.resolve_plan`) and call it. Methods and refiners know nothing about
models or files.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .checks import NonFiniteModel, check_float, check_symmetric
from .linalg import wanda_score
from .loss import local_loss
from .pattern import NMPattern, is_nm_sparse, topn_mask
from .stages.plan import LayerPlan, resolve_plan
from .registry import RowShards, get_method


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


def check_problem(w: Tensor, h: Tensor, pattern: NMPattern) -> None:
    """What :func:`solve` checks of its inputs (ValueError, or
    :class:`~nmprune.checks.NonFiniteModel` for values beyond float32's range)."""
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
    _check_representable(w, h)


def _check_representable(w: Tensor, h: Tensor) -> None:
    """The squared loss ``Tr(W H W^T)`` (eq. ``squared_loss``) of the dense weights stays
    below float32's range: its bound ``d_out d_in max|w|^2 tr(H)`` (float64) does. Weights
    or inputs beyond that would turn every solver's arithmetic into Inf and NaN."""
    if not w.numel():
        return
    lo, hi = torch.aminmax(w)  # one pass, no |w|-sized temporary on every solve
    largest = max(-float(lo), float(hi))
    trace = float(h.diagonal().double().abs().sum())
    if not w.numel() * largest ** 2 * trace < torch.finfo(torch.float32).max:
        raise NonFiniteModel(f"W (largest |w| {largest:.3g}) and H (trace {trace:.3g}) are too large "
                             "for float32 arithmetic: the squared loss overflows (are the weights right?)")


def _compute_dtype(w: Tensor, h: Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (w.dtype, h.dtype) else torch.float32


def _sync(t: Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def full_mask(w_pruned: Tensor, w_star: Tensor, h: Tensor, pattern: NMPattern,
              shards: RowShards | None = None) -> Tensor:
    """Exactly N positions per cell: the non-zeros of ``w_pruned`` first, then the highest
    Wanda scores ``|W*_ij| H_jj^{1/2}`` (a free slot can only help a mask-held refiner).
    ``shards``: the rows are one share of a layer's (the scores are scaled by the layer's
    largest, as for the whole layer)."""
    score = wanda_score(w_star, h)  # one temporary of W's size
    largest = score.max() if score.numel() else None
    if shards is not None:
        largest = shards.max([float(largest) if largest is not None else 0.0])[0]
    if score.numel():
        score.div_(1.0 + largest)
    return topn_mask(score.add_(w_pruned != 0), pattern)


@contextmanager
def dampened(h: Tensor, damp: float) -> Iterator[Tensor]:
    """``H + damp * mean(diag H) * I`` for the ``with`` body: ``h`` itself with its diagonal
    raised in place and restored bit for bit on exit (also on an error), so no second
    ``d_in x d_in`` matrix exists; a new tensor where ``h`` cannot be written in place
    (non-contiguous, an inference tensor, one requiring grad).

    The local loss with this ``H`` is ``Tr((W-W*) H (W-W*)^T) + damp * mean(diag H) *
    ||W - W*||_F^2``: a Tikhonov pull towards the dense weights, scaled like SparseGPT's
    dampening. It keeps solvers from fitting the directions an under-determined ``H`` (fewer
    calibration tokens than inputs) does not see.
    """
    if damp == 0.0:
        yield h
        return
    diagonal = torch.diagonal(h)
    shift = damp * float(diagonal.detach().mean())
    if not h.is_contiguous() or h.is_inference() or h.requires_grad:
        out = h.clone()
        out.diagonal().add_(shift)
        yield out
        return
    original = diagonal.clone()
    diagonal.add_(shift)
    try:
        yield h
    finally:
        diagonal.copy_(original)


def solve(W: Tensor, H: Tensor, plan: LayerPlan, statistics: Mapping[str, Tensor] | None = None,
          shards: RowShards | None = None) -> LayerResult:
    """Prune ``W`` (d_out, d_in) to ``plan.pattern`` along ``d_in`` minimising
    ``Tr((W-W*) H (W-W*)^T)`` with the plan's method, then its refiner (if any).

    ``statistics`` holds input statistics the method declared (``plan.statistics``; one not
    given takes the method's default).
    With ``plan.damp > 0`` the method and the refiner see :func:`dampened` ``(H, damp)``
    instead of ``H`` (``H``'s diagonal is raised in place while they run); the reported
    losses are always on ``H`` itself. Raises ValueError on
    bad tensors (shapes, dtypes, devices, NaN/Inf, a non-symmetric ``H``).

    ``shards``: ``W`` is this process's share of a layer's rows, the others solved at the same
    time by other processes (:class:`~nmprune.registry.RowShards`); the plan's solvers must
    not be registered ``rows="whole"``, and those registered ``"reduced"`` get ``shards``.
    The losses are then this share's part of the layer's (the loss is a sum over rows).
    """
    p = plan.pattern
    check_problem(W, H, p)
    extra = dict(statistics or {})
    unknown = sorted(set(extra) - set(plan.statistics))
    if unknown:
        raise ValueError(f"method {plan.method.name!r} takes no statistic {unknown[0]!r}")
    dtype = _compute_dtype(W, H)
    w_star, h = W.to(dtype), H.to(dtype)
    method_shards, refiner_shards = _shards(plan, shards)

    start = time.perf_counter()
    with dampened(h, plan.damp) as h_solve:
        w = plan.method.fn(w_star, h_solve, p, **extra, **method_shards, **plan.method_options)
        _sync(w)
    seconds_method = time.perf_counter() - start
    if w.shape != w_star.shape or not is_nm_sparse(w, p):
        raise RuntimeError(f"method {plan.method.name!r} did not return an exactly {p} sparse matrix")
    mask = full_mask(w, w_star, h, p, shards)
    loss_method = local_loss(w, w_star, h)

    loss_refined, seconds_refine = None, 0.0
    if plan.refiner is not None:
        start = time.perf_counter()
        with dampened(h, plan.damp) as h_solve:
            w = plan.refiner.fn(w, w_star, h_solve, mask, **refiner_shards, **plan.refiner_options)
            _sync(w)
        seconds_refine = time.perf_counter() - start
        if bool((w[~mask] != 0).any()):
            raise RuntimeError(f"refiner {plan.refiner.name!r} changed weights outside the mask")
        loss_refined = local_loss(w, w_star, h)

    return LayerResult(weight=w.to(W.dtype), mask=mask, loss_method=loss_method,
                       loss_refined=loss_refined, seconds_method=seconds_method,
                       seconds_refine=seconds_refine)


def _shards(plan: LayerPlan, shards: RowShards | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``shards`` keyword of the plan's method and refiner (empty for a whole layer and
    for solvers whose rows are independent)."""
    if shards is None:
        return {}, {}
    if not plan.splits_rows:
        whole = next(r.name for r in (plan.method, plan.refiner) if r is not None and r.rows == "whole")
        raise ValueError(f"{whole!r} solves a layer only whole (registered rows='whole'), not a share of its rows")
    return tuple({"shards": shards} if r is not None and r.rows == "reduced" else {}
                 for r in (plan.method, plan.refiner))


def prune_layer(W: Tensor, H: Tensor, method: str = "prox", pattern: str | NMPattern = "2:4",
                refine: str | None = None, *, damp: float = 0.0, **options: Any) -> LayerResult:
    """:func:`solve` with the plan made from these settings.

    ``method`` is any name of :func:`nmprune.methods`; ``refine`` (``None``, ``"gd"``,
    ``"exact"``) then re-optimises the kept weights with the mask held. ``options`` go to
    the method (its keyword-only parameters; the statistics it declares, e.g. DSnoT's
    ``input_mean``, are given the same way) and, prefixed ``refine_``, to the refiner.
    Raises ValueError naming any bad input or option.
    """
    declared = get_method(method).statistics if isinstance(method, str) else ()
    statistics = {k: options.pop(k) for k in list(options) if k in declared}
    return solve(W, H, resolve_plan(method, refine, pattern, options, damp), statistics)


def prune_matrix(W: Tensor, H: Tensor, method: str = "prox", pattern: str | NMPattern = "2:4",
                 refine: str | None = None, *, damp: float = 0.0, **options: Any) -> Tensor:
    """The pruned weights of :func:`prune_layer` (same shape, dtype and device as ``W``)."""
    return prune_layer(W, H, method=method, pattern=pattern, refine=refine, damp=damp,
                       **options).weight
