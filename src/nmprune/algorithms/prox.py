"""Proximal-gradient N:M pruning (paper Algorithm ``alg:prox_e2e``) with the exact 2:4 prox
(eq. ``prox_original``, ``nmprune.prox.prox_2of4``) and, for comparison, the simpler
regularisers of Appendix ``app:other_regularizers`` (eqs. ``L0``, ``L1``, ``L2``).

One loop serves all four registered methods (``prox``, ``prox-l0``, ``prox-l1``,
``prox-l2``); only the cell-wise proximal operator differs. Each iteration is

    W <- W - eta * 2 (W H - W* H)          (gradient of eq. ``squared_loss``)
    W <- prox_{lambda_k r}(W)               (cell by cell)

in the Wanda-scaled coordinates ``W_ij H_jj^{1/2}``, ``H_ij (H_ii H_jj)^{-1/2}`` (paper
Section 4; dead inputs keep scale 1), with ``eta = 1/(2 gamma_max(H))`` and the
exponential schedule ``lambda_k = lambda_0 beta^k`` -- divided by ``mean|W*|`` (of the scaled
weights) when ``lambda_adapt`` is set (eq. ``lambda_adapt``). It stops when ``W`` is N:M.

Paper-faithful settings: ``lambda0=0.01, beta=1.01, lambda_adapt=False, solver="gd",
accelerate=False, finish=0.0, gradient_precision="full"`` (``shrink_momentum`` then plays no
role; the 70B-model setting is ``lambda0=1e-3, beta=1.005, lambda_adapt=True``). Our defaults
(measured in docs/methods.md#the-proximal-loop-srcnmprunealgorithmsproxpy) trade the slow
schedule for a scale-adaptive faster one, accelerate it, and finish early: once at most a
fraction ``finish`` of the cells is still not N:M, those cells are projected onto N:M (their
N largest magnitudes kept) -- a mask-held refiner then re-optimises all kept weights.
``max_iter`` guards the loop: reaching it projects the remaining cells the same way and emits
a RuntimeWarning saying how many cells were projected.

``accelerate=True`` extrapolates the gradient point as FISTA does (Beck & Teboulle), with FISTA's
coefficient ``c_k`` but one change, ``shrink_momentum`` (``rho``): the last step splits into the
gradient step's part ``z_{k-1} - w_{k-1}`` and the prox's shrinkage ``w_k - z_{k-1}``
(``z = y - 2 eta (y - W*) H`` is the point the prox is applied to), and

    y_k = w_k + c_k (z_{k-1} - w_{k-1}) + rho c_k (w_k - z_{k-1})

(``rho = 1`` is classical FISTA, ``y_k = w_k + c_k (w_k - w_{k-1})``). At full weight the
shrinkage builds up momentum of its own while lambda grows, up to ``1/(1 - c_k)`` times one
prox step, and the gradient pulls an overshoot back only at the rate ``eta * 2 gamma`` of the
direction's curvature ``gamma``. ``"auto"`` (the ``prox`` default) sets ``rho = min(1, 4
gamma_mean / gamma_max)`` (``gamma_mean = tr(H)/d``, 1 in the scaled coordinates): classical
FISTA where the step is large against the average curvature, less extrapolated shrinkage where
a few large eigenvalues force a short step. It lowers the loss on real and synthetic layers
at the cost of more iterations (measured in docs/methods.md#measurements, "The extrapolated
shrinkage").

``gradient_precision="bfloat16"`` computes the product ``(Y - W*) H`` of the gradient step in
bfloat16 (the difference formed in the working precision first, so only the gradient itself
carries bfloat16's 2^-8 relative rounding; the step, the prox and everything else stay in
float32). ``"auto"`` (the ``prox`` default) does so for float32 work with at least
``BF16_MIN_ROWS`` rows (fewer make the product a matrix-vector-like one that bfloat16 does not
speed up) where the hardware has native bfloat16 products (CUDA devices that support bfloat16,
CPUs with AVX512-BF16 or AMX), and keeps full precision otherwise; ``"full"`` always keeps
it. The loss after exact refinement barely moves and the loop runs faster (measured in
docs/methods.md#the-proximal-loop-srcnmprunealgorithmsproxpy).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Annotated, Any, Callable, Literal

import torch
from torch import Tensor

from ..devices import PRECISIONS, low_precision
from ..linalg import column_scale, gd_step_size, rescale
from ..pattern import NMPattern, count_dense_cells, from_cells, to_cells, topn_mask
from ..prox import prox_2of4, prox_l0, prox_l1, prox_l2, prox_nm
from ..prox.two_four import SOLVERS, triton_installed
from ..registry import NonNegativeInt, PositiveFloat, Range, RowShards, register_method

CellProx = Callable[[Tensor, Tensor], Tensor]  # (cells (..., M), lambda per cell) -> cells
Growth = Annotated[float, Range(1, low_open=True)]  # beta: lambda must grow
Finish = Annotated[float, Range(0, 1, high_open=True)]  # fraction of cells left to project
Momentum = Annotated[float, Range(0, 1)]  # shrink_momentum rho


def prox_gradient(w_star: Tensor, h: Tensor, pattern: NMPattern, cell_prox: CellProx, *,
                  lambda0: float, beta: float, lambda_adapt: bool, max_iter: int,
                  finish: float, accelerate: bool, shrink_momentum: float | str, method: str,
                  gradient_precision: str = "full", shards: RowShards | None = None) -> Tensor:
    """Algorithm ``alg:prox_e2e`` for any cell-wise prox; returns an N:M matrix in the original
    (unscaled) coordinates. See the module docstring for the options.

    ``shards``: ``w_star`` is one share of a layer's rows (:class:`~nmprune.registry.RowShards`),
    and the loop's two totals over the rows -- ``mean|W*|`` of eq. ``lambda_adapt`` (from
    the whole layer's weights, so bit for bit the whole layer's) and the count of cells not
    yet N:M, which decides when the loop stops -- are those of the whole layer, so every
    share takes the iterations the whole layer would. The count's sum over the shares
    travels while the share computes its next iterate (one more iterate held meanwhile),
    which is dropped when the count ends the loop."""
    low = gradient_dtype(gradient_precision, w_star)
    s = column_scale(h)
    w_star, h = rescale(w_star, h, s)
    eta = gd_step_size(h)
    if shrink_momentum == "auto":
        shrink_momentum = auto_shrink_momentum(h, eta)
    lam = float(lambda0)
    if lambda_adapt:
        whole = w_star if shards is None else shards.whole * s  # the scaled weights of all rows
        mean_abs = float(whole.abs().mean()) if whole.numel() else 0.0
        del whole
        lam = lam / mean_abs if mean_abs > 0 else lam
    if low is None:
        step_target = (2.0 * eta) * (w_star @ h)  # the constant part of the gradient step
    else:
        h_low = h.to(low)
    n_cells = w_star.numel() // pattern.m
    if shards is not None:
        n_cells = int(shards.sum([n_cells])[0])

    def advance(w: Tensor, w_prev: Tensor, z_prev: Tensor,
                momentum: float) -> tuple[Tensor, Tensor, Tensor, float]:
        """One iteration from ``w`` at the current ``lam``: the new iterate and what the next
        extrapolation keeps (``w_prev``, ``z_prev``, ``momentum``)."""
        if accelerate:  # y = w + c (z_prev - w_prev) + rho c (w - z_prev), rho = shrink_momentum
            next_m = 0.5 * (1.0 + (1.0 + 4.0 * momentum * momentum) ** 0.5)
            c = (momentum - 1.0) / next_m
            momentum = next_m
            y = torch.lerp(w_prev, w, 1.0 + c)  # classical FISTA: w + c (w - w_prev)
            if shrink_momentum != 1.0:  # minus (1 - rho) c times the prox's shrinkage w - z_prev
                damp = (1.0 - shrink_momentum) * c
                y.add_(z_prev, alpha=damp).sub_(w, alpha=damp)
        else:
            y = w
        if low is None:  # z = y - 2 eta (y H - W* H), as one GEMM into a fresh tensor and one add
            z = torch.addmm(y, y, h, alpha=-2.0 * eta).add_(step_target)
        else:  # the same step with (y - W*) H in low precision
            z = torch.add(y, torch.mm(torch.sub(y, w_star).to(low), h_low).to(y.dtype), alpha=-2.0 * eta)
        del y
        if accelerate:  # kept for the next extrapolation only
            w_prev, z_prev = w, z
        return from_cells(cell_prox(to_cells(z, pattern.m), torch.tensor(lam, dtype=z.dtype))), w_prev, z_prev, momentum

    state = (w_star.clone(), w_star, w_star, 1.0)
    it = 0
    while True:
        w = state[0]
        if shards is None:
            n_left, ahead = count_dense_cells(w, pattern), None
        else:
            # the whole layer's count travels while this share computes the next iterate,
            # which is dropped if the count ends the loop
            total = shards.sum_started([count_dense_cells(w, pattern)])
            ahead = advance(*state) if it < max_iter else None
            n_left = int(total()[0])
        if n_left == 0:
            break
        if n_left <= finish * n_cells or it >= max_iter:
            if it >= max_iter:
                warnings.warn(f"{method}: max_iter={max_iter} reached with {n_left} of {n_cells} "
                              "cells not yet N:M; they were projected onto N:M (N largest kept)",
                              RuntimeWarning, stacklevel=4)
            w = w * topn_mask(w.abs(), pattern)
            break
        state = ahead if ahead is not None else advance(*state)
        lam *= beta
        it += 1
    return w / s


# rho = min(1, gain * mean eigenvalue / gamma_max); 4 and 8 fit alike (docs/methods.md#measurements)
SHRINK_MOMENTUM_GAIN = 4.0


def auto_shrink_momentum(h: Tensor, eta: float) -> float:
    """``shrink_momentum="auto"``: ``min(1, 4 * mean eigenvalue(H) / gamma_max(H))`` for the
    scaled ``H`` (mean eigenvalue ``tr(H) / d``, 1 without dead inputs; ``gamma_max = 1 /
    (2 eta)``). The smaller the step is against the average curvature, the less an average
    direction's gradient pulls back where the extrapolated shrinkage overshoots."""
    mean_eig = float(torch.diagonal(h).sum()) / h.shape[0] if h.shape[0] else 0.0
    return min(1.0, SHRINK_MOMENTUM_GAIN * mean_eig * 2.0 * eta)


GRADIENT_PRECISIONS = PRECISIONS
# fewer rows are not faster in bfloat16 (docs/methods.md#the-proximal-loop-srcnmprunealgorithmsproxpy)
BF16_MIN_ROWS = 64


def gradient_dtype(precision: str, w: Tensor) -> torch.dtype | None:
    """The dtype of the gradient product for ``gradient_precision`` (None: the working dtype)."""
    return low_precision(precision, w.device, w.dtype == torch.float32 and w.shape[0] >= BF16_MIN_ROWS)


#: the default 2:4 prox solver of ``prox`` (:func:`nmprune.prox.prox_2of4`)
PROX_SOLVER = "reduced"


def uses_triton_kernel(pattern: NMPattern, options: Mapping[str, Any]) -> bool:
    """Whether ``prox`` with these method ``options`` sends its cells to the Triton kernel on
    CUDA: the 2:4 prox with ``solver="reduced"`` (the default) where triton is installed."""
    return ((pattern.n, pattern.m) == (2, 4) and options.get("solver", PROX_SOLVER) == "reduced"
            and triton_installed())


def _exact_prox(pattern: NMPattern, solver: str) -> CellProx:
    if (pattern.n, pattern.m) == (2, 4):
        return lambda z, lam: prox_2of4(z, lam, solver=solver)
    return lambda z, lam: prox_nm(z, lam, pattern.n)  # the solver choice concerns 2:4 only


@register_method("prox", description="proximal gradient with the exact N:M prox (paper Alg. prox_e2e)",
                 cost=3.5e-10, entry_cost=3.8e-7, rows="reduced")
def prox(w: Tensor, h: Tensor, pattern: NMPattern, *, lambda0: PositiveFloat = 0.001,
         beta: Growth = 1.05, lambda_adapt: bool = True, solver: Literal[SOLVERS] = PROX_SOLVER,
         max_iter: NonNegativeInt = 5000, finish: Finish = 0.005, accelerate: bool = True,
         shrink_momentum: Momentum | Literal["auto"] = "auto",
         gradient_precision: Literal[GRADIENT_PRECISIONS] = "auto",
         shards: RowShards | None = None) -> Tensor:
    """Prox pruner with the regulariser ``r_{N:M}`` (eq. ``regularizer_nm``). ``solver`` picks
    the 2:4 prox solver (``prox_2of4``); other patterns always use ``prox_nm``."""
    return prox_gradient(w, h, pattern, _exact_prox(pattern, solver), lambda0=lambda0, beta=beta,
                         lambda_adapt=lambda_adapt, max_iter=max_iter, finish=finish,
                         accelerate=accelerate, shrink_momentum=shrink_momentum, method="prox",
                         gradient_precision=gradient_precision, shards=shards)


def _register_simple(name: str, cell_prox: Callable[..., Tensor], eq: str, cost: float, entry_cost: float) -> None:
    def method(w: Tensor, h: Tensor, pattern: NMPattern, *, lambda0: PositiveFloat = 0.01,
               beta: Growth = 1.01, lambda_adapt: bool = False, max_iter: NonNegativeInt = 5000,
               finish: Finish = 0.0, accelerate: bool = False, shrink_momentum: Momentum = 1.0,
               gradient_precision: Literal[GRADIENT_PRECISIONS] = "full",
               shards: RowShards | None = None) -> Tensor:
        return prox_gradient(w, h, pattern, lambda z, lam: cell_prox(z, lam, pattern.n),
                             lambda0=lambda0, beta=beta, lambda_adapt=lambda_adapt,
                             max_iter=max_iter, finish=finish, accelerate=accelerate,
                             shrink_momentum=shrink_momentum, method=name,
                             gradient_precision=gradient_precision, shards=shards)

    method.__doc__ = f"Prox pruner with the regulariser of eq. ``{eq}`` (Appendix app:other_regularizers)."
    register_method(name, description=f"proximal gradient with the {eq} regulariser", cost=cost,
                    entry_cost=entry_cost, rows="reduced")(method)


_register_simple("prox-l0", prox_l0, "L0", cost=2.2e-9, entry_cost=5.5e-6)
_register_simple("prox-l1", prox_l1, "L1", cost=2.0e-10, entry_cost=1.3e-6)
def _prox_l2_flushed(z: Tensor, lam: Tensor, n: int) -> Tensor:
    """Prox of ``R_2`` (eq. ``L2``), which only shrinks and never reaches exact zeros for finite
    ``lambda`` (Appendix app:other_regularizers): entries shrunk below ``1e-3`` times the largest
    magnitude of their cell are set to zero, so the loop ends once the shrinkage is that strong."""
    out = prox_l2(z, lam, n)
    tiny = out.abs() <= 1e-3 * z.abs().amax(-1, keepdim=True)
    return torch.where(tiny, torch.zeros_like(out), out)


_register_simple("prox-l2", _prox_l2_flushed, "L2", cost=4.1e-9, entry_cost=1.1e-5)
