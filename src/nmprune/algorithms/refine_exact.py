"""Exact mask-held refinement: the minimiser of the local loss (paper eq. ``squared_loss``)
over weights supported on a fixed mask -- the fixed point that masked gradient descent
(eq. ``masked_gd``) approaches, reached in far fewer matrix products.

Per row ``r`` with kept set ``S`` the optimum solves ``H_SS w_S = (W* H)_S`` (the masked
gradient ``2 M . (W H - W* H)`` vanishes). Two solvers, chosen by a flop estimate:

* ``direct``: every row's ``k x k`` block ``H_SS`` is gathered (``k`` kept entries per row,
  always the same for an N:M mask; rows with fewer are padded with identity rows) and
  factorised by a batched Cholesky decomposition, a chunk of rows at a time, in the Wanda
  (Jacobi) scaled coordinates ``H_ij (H_ii H_jj)^{-1/2}`` (paper Section 4) with a ridge of
  ``eps`` on the unit diagonal, raised on the rows whose block is numerically singular.
  Cost about ``d_out k^3 / 3`` flops; a few PCG iterations then polish it to ``tol``.
* ``pcg``: all rows together by preconditioned conjugate gradients, each row with its own
  step sizes; one iteration costs one ``(d_out x d_in) @ (d_in x d_in)`` product
  (``2 d_out d_in^2`` flops), like one step of eq. ``masked_gd``, and one more with the
  ``inverse`` preconditioner. Preconditioners: ``jacobi`` (``diag H``, the Wanda scaling) or
  ``inverse``, the kept block of the inverse Hessian, ``M^-1 = P (H + delta)^-1 P`` for each
  row's mask ``P`` -- the inverse of the Schur complement of the pruned block, which is
  ``H_SS`` less what the pruned inputs explain. On real layers, whose kept block differs
  little from that Schur complement, it needs 3.5-4x fewer iterations to a given gap, for one
  ``d_in^3`` inversion per call (measured in docs/methods.md#refiners).

The system is always consistent (its right side lies in the range of ``H_SS``), so singular
``H`` and dead inputs need no damping for CG: it converges to a minimiser, and directions with
zero curvature are left unchanged. The direct solve puts the dead inputs' zero rows to one on
the diagonal (their right side is zero, so their weights become zero); a rank-deficient
``H_SS`` whose factorisation fails gets a larger ridge, which keeps its weights bounded along
the null directions.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import Tensor

from ..linalg import column_scale
from ..registry import NonNegativeFloat, NonNegativeInt, PositiveInt, RowShards, register_refiner

SOLVERS = ("auto", "direct", "pcg")
PRECONDITIONERS = ("auto", "jacobi", "inverse")
_RIDGE_GROWTH = 10.0
_INVERSE_RIDGE = 1e-4  # delta of the inverse preconditioner, relative to the unit diagonal
_ITERATIONS_SAVED = 10  # products the inverse preconditioner saves, net (docs/methods.md#refiners)


def _loss(w: Tensor, w_star: Tensor, wh: Tensor, target: Tensor) -> float:
    """``Tr((W-W*) H (W-W*)^T)`` from ``W H`` and ``target = W* H``."""
    return float(((w - w_star) * (wh - target)).sum())


def _summer(shards: RowShards | None) -> Callable[[float], float]:
    """A total over the layer's rows: ``shards``' sum, or the value itself for a whole layer."""
    return (lambda x: x) if shards is None else (lambda x: shards.sum([x])[0])


def direct_flops(d_out: int, k: int) -> float:
    """Flop estimate of the direct solve: one ``k x k`` Cholesky factorisation per row."""
    return d_out * k ** 3 / 3.0


def pcg_flops(d_out: int, d_in: int, iterations: int) -> float:
    """Flop estimate of ``iterations`` PCG iterations: one ``W H``-sized product each."""
    return 2.0 * d_out * d_in ** 2 * iterations


def inverse_flops(d_in: int) -> float:
    """Flop estimate of the inverse preconditioner: a float64 Cholesky factorisation and
    inverse of ``H`` (``~d_in^3``, counted twice for float64)."""
    return 2.0 * d_in ** 3


def pick_preconditioner(d_out: int, d_in: int) -> str:
    """``"inverse"`` when its inversion costs less than the products it saves (it doubles
    the cost of an iteration and needs about a quarter of the iterations, counted as
    ``_ITERATIONS_SAVED`` products saved), else
    ``"jacobi"`` (a few rows of a wide layer)."""
    return "inverse" if inverse_flops(d_in) < pcg_flops(d_out, d_in, _ITERATIONS_SAVED) else "jacobi"


def _preconditioner(h: Tensor, keep: Tensor, kind: str) -> Callable[[Tensor, Tensor], Tensor]:
    """``apply(resid, out)``: ``out = M^-1 resid`` for ``resid`` zero outside ``keep``.

    ``jacobi``: ``resid / diag H`` (0 on dead inputs). ``inverse``: ``(resid @ Hinv) . keep``
    with ``Hinv = (H + delta diag H)^-1``, computed in float64 in the Jacobi-scaled coordinates
    (dead inputs: unit diagonal there), ``delta = _INVERSE_RIDGE``, raised tenfold while the
    factorisation fails (singular or indefinite ``H``); any symmetric positive definite ``M``
    leaves CG's answer unchanged, ``delta`` only costs iterations."""
    diag = torch.diagonal(h)
    if kind == "jacobi":
        inv_diag = torch.where(diag > 0, 1.0 / diag.clamp_min(torch.finfo(h.dtype).tiny), 0.0) * keep
        return lambda resid, out: torch.mul(resid, inv_diag, out=out)
    s = column_scale(h).double()
    hs = h.to(torch.float64, copy=True).div_(s[:, None]).div_(s[None, :])  # two float64 copies at most
    hs.diagonal().masked_fill_(diag <= 0, 1.0).add_(_INVERSE_RIDGE)
    ridge = _INVERSE_RIDGE
    factor, info = torch.linalg.cholesky_ex(hs)
    while int(info) != 0 and ridge < 1.0:
        hs.diagonal().add_(ridge * (_RIDGE_GROWTH - 1.0))
        ridge *= _RIDGE_GROWTH
        factor, info = torch.linalg.cholesky_ex(hs)
    del hs
    if int(info) != 0:  # not even H + I factorises: H is not PSD or not finite
        return _preconditioner(h, keep, "jacobi")
    hinv = torch.cholesky_inverse(factor)
    del factor
    hinv = hinv.div_(s[:, None]).div_(s[None, :]).to(h.dtype)
    return lambda resid, out: torch.matmul(resid, hinv, out=out).mul_(keep)


def pick_solver(d_out: int, d_in: int, k: int, max_iter: int) -> str:
    """``"direct"`` when its flop estimate is below that of ``max_iter`` PCG iterations (the
    budget PCG tends to use up on correlated Hessians), else ``"pcg"``."""
    return "direct" if direct_flops(d_out, k) < pcg_flops(d_out, d_in, max_iter) else "pcg"


def _chunk_rows(k: int, d_in: int, element_size: int, device: torch.device) -> int:
    """Rows per chunk of the direct solve: their gathered rows of ``H`` (``k x d_in``), blocks
    and factors (``k x k`` each) take at most 256 MiB on an accelerator, 8 MiB on the CPU,
    where larger buffers fall out of the cache and make the gather memory-bound."""
    budget = (256 if device.type != "cpu" else 8) * 2 ** 20
    return max(1, budget // ((k * d_in + 2 * k * k) * element_size))


def _cholesky_solve(factor: Tensor, b: Tensor) -> Tensor:
    """``y`` with ``factor factor^T y = b`` (batched; two triangular solves)."""
    z = torch.linalg.solve_triangular(factor, b.unsqueeze(-1), upper=False)
    return torch.linalg.solve_triangular(factor.mT, z, upper=True).squeeze(-1)


def _solve_blocks(a: Tensor, b: Tensor, fallback: Tensor) -> Tensor:
    """Solve the unit-diagonal PSD systems ``(a + ridge I) y = b`` (batched, ``a`` is
    overwritten). The ridge starts at the machine epsilon, below the rounding error of the
    factorisation itself (its effect on the loss is second order in the ridge); it grows
    tenfold on the rows whose Cholesky factorisation fails (a numerically singular block), up
    to ``k`` (beyond the spectrum of a unit-diagonal PSD block); rows that still fail (an
    indefinite or non-finite ``H``) get ``fallback``."""
    k = a.shape[-1]
    ridge = torch.finfo(a.dtype).eps
    a.diagonal(dim1=-2, dim2=-1).add_(ridge)
    factor, info = torch.linalg.cholesky_ex(a)
    y = _cholesky_solve(factor, b)
    rows = (info != 0).nonzero().squeeze(1)
    sub = a[rows]
    while rows.numel() and ridge < k:
        sub.diagonal(dim1=-2, dim2=-1).add_(ridge * (_RIDGE_GROWTH - 1.0))
        ridge *= _RIDGE_GROWTH
        factor, info = torch.linalg.cholesky_ex(sub)
        y[rows] = _cholesky_solve(factor, b[rows])
        failed = info != 0
        rows, sub = rows[failed], sub[failed]
    y[rows] = fallback[rows]
    return y


def _direct(w: Tensor, h: Tensor, mask: Tensor, target: Tensor, k: int) -> Tensor:
    """Masked minimiser by per-row Cholesky solves of ``H_SS w_S = target_S`` (see module
    docstring); ``w`` (already zero outside ``mask``) is the fallback of unsolvable rows."""
    d_out, d_in = w.shape
    s = column_scale(h)
    hs = h / s[:, None] / s[None, :]
    hs.diagonal().masked_fill_(torch.diagonal(h) <= 0, 1.0)  # dead inputs: zero row and column
    counts = mask.sum(1)
    order = torch.sort(mask.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :k]
    valid = torch.arange(k, device=w.device) < counts[:, None]  # (d_out, k): kept entries first
    padded = not bool(valid.all())
    s_kept = s[order]
    rhs = (target.gather(1, order) / s_kept) * valid
    start = w.gather(1, order) * s_kept
    out = torch.empty_like(rhs)
    chunk = _chunk_rows(k, d_in, h.element_size(), h.device)
    rows_buf = h.new_empty(min(chunk, d_out) * k, d_in)
    block_buf = h.new_empty(min(chunk, d_out), k, k)
    for lo in range(0, d_out, chunk):
        idx = order[lo:lo + chunk]
        n = idx.shape[0]
        rows = torch.index_select(hs, 0, idx.reshape(-1), out=rows_buf[:n * k]).view(n, k, d_in)
        a = torch.gather(rows, 2, idx[:, None, :].expand(n, k, k), out=block_buf[:n])
        if padded:  # identity on the padding: its weight solves 1 * y = 0
            v = valid[lo:lo + chunk]
            a.mul_(v[:, :, None] & v[:, None, :]).diagonal(dim1=-2, dim2=-1).add_(~v)
        out[lo:lo + chunk] = _solve_blocks(a, rhs[lo:lo + chunk], start[lo:lo + chunk])
    return torch.zeros_like(w).scatter_(1, order, out / s_kept * valid)


def _pcg(w: Tensor, w_star: Tensor, h: Tensor, keep: Tensor, target: Tensor, *, tol: float,
         max_iter: int, restart: int, precondition: Callable[[Tensor, Tensor], Tensor],
         best_w: Tensor, best_loss: float, total: Callable[[float], float]) -> Tensor:
    """Batched preconditioned CG from ``w``; returns ``best_w`` (loss ``best_loss``) unless it
    finds a lower loss. The iteration updates its ``(d_out, d_in)`` buffers in place (one
    product, one more for the inverse preconditioner, and about six passes over them). Losses
    and decreases are the layer's totals (``total``: of every share of its rows)."""
    dot = torch.linalg.vecdot
    it = 0
    while it < max_iter:
        wh = w @ h  # exact residual and loss at every (re)start
        loss = total(_loss(w, w_star, wh, target))
        if loss > best_loss:
            return best_w
        best_w, best_loss = w, loss
        w = w.clone()  # best_w stays the restart point
        resid = torch.sub(target, wh, out=wh).mul_(keep)
        z = precondition(resid, torch.empty_like(resid))
        rz = dot(resid, z)
        p = z.clone()
        for _ in range(min(restart, max_iter - it)):
            it += 1
            q = torch.matmul(p, h).mul_(keep)
            pq = dot(p, q)
            ok = pq > 0
            alpha = torch.where(ok, dot(p, resid) / torch.where(ok, pq, 1.0), 0.0)
            w.addcmul_(alpha[:, None], p)
            decrease = total(float((alpha * rz).sum()))
            loss -= decrease
            if decrease <= tol * max(loss, 0.0):
                it = max_iter  # converged
                break
            resid.addcmul_(alpha[:, None], q, value=-1.0)
            precondition(resid, z)
            rz_new = dot(resid, z)
            beta = torch.where(rz > 0, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)
            rz = rz_new
            p.mul_(beta[:, None]).add_(z)
    return w if total(_loss(w, w_star, w @ h, target)) <= best_loss else best_w


@register_refiner("exact", description="minimiser of the local loss with the mask held "
                                       "(batched Cholesky or PCG)", cost=1.0e-9, rows="reduced")
def refine_exact(w: Tensor, w_star: Tensor, h: Tensor, mask: Tensor, *,
                 solver: Literal[SOLVERS] = "pcg", preconditioner: Literal[PRECONDITIONERS] = "auto",
                 tol: NonNegativeFloat = 1e-8, max_iter: NonNegativeInt = 600,
                 restart: PositiveInt = 25, shards: RowShards | None = None) -> Tensor:
    """Minimise ``Tr((W-W*) H (W-W*)^T)`` over ``W`` zero outside ``mask``, warm-started at ``w``.

    The default is ``"pcg"``: on real Hessians it converges in a few dozen iterations and beats
    the direct solve, and on strongly rank-deficient Hessians (fewer calibration tokens than
    inputs) the float32 direct solve amplifies rounding in the null space of ``H[S,S]`` (any
    exact fit overfits such an ``H``; the pipeline dampens it, :func:`nmprune.solve.dampened`).
    ``solver="auto"`` takes the direct solve when its flop estimate ``d_out k^3 / 3`` (``k``
    the most entries a row keeps) is below that of ``max_iter`` PCG iterations
    (``2 d_out d_in^2`` each); ``"direct"`` and ``"pcg"`` force one. The direct solution is
    polished by PCG (it stops after an iteration or two when the solve was accurate).
    ``preconditioner`` (``"jacobi"``, ``"inverse"``, or ``"auto"``: :func:`pick_preconditioner`)
    is PCG's (module docstring).

    PCG stops when an iteration lowers the loss by less than ``tol`` times the current loss
    (CG knows each row's decrease: ``alpha_r (p_r . r_r)``), or after ``max_iter`` iterations.
    The remaining gap is larger than the last decrease; the default ``1e-8`` leaves less than
    1e-7 of the optimal loss on real layers (measured in docs/methods.md#refiners). Every
    ``restart`` iterations the residual and the loss are recomputed exactly (no extra product:
    they come from ``W H``) and CG restarts from them; if rounding made the true loss worse
    than at the previous restart, the previous iterate is returned. This keeps
    float32 reliable on ill-conditioned Hessians. The result's loss never exceeds that of
    ``w`` with the mask applied.

    ``shards``: ``w`` is one share of a layer's rows (:class:`~nmprune.registry.RowShards`); the
    choices (solver, preconditioner) and PCG's losses are the whole layer's, so every share
    stops where the whole layer would.
    """
    keep = mask.to(w.dtype)
    w = w * keep
    if w.numel() == 0:
        return w
    d_out, d_in = w.shape
    k = int(mask.sum(1).max())
    if shards is not None:  # the whole layer's rows and kept entries decide, on every share
        k = int(shards.max([k])[0])
        d_out = int(shards.sum([d_out])[0])
    direct = (pick_solver(d_out, d_in, k, max_iter) if solver == "auto" else solver) == "direct"
    if k == 0 or (not direct and max_iter == 0):
        return w  # nothing kept (the only feasible point) or nothing to do
    target = w_star @ h
    kind = pick_preconditioner(d_out, d_in) if preconditioner == "auto" else preconditioner
    options = {"tol": tol, "max_iter": max_iter, "restart": restart,
               "precondition": _preconditioner(h, keep, kind), "total": _summer(shards)}
    if not direct:
        return _pcg(w, w_star, h, keep, target, best_w=w, best_loss=float("inf"), **options)
    start_loss = options["total"](_loss(w, w_star, w @ h, target))
    return _pcg(_direct(w, h, mask, target, k), w_star, h, keep, target, best_w=w,
                best_loss=start_loss, **options)
