"""The 2:4 proximal operator ``prox_{lam r_{2:4}}(z)`` (eq. ``prox_original``), cell by cell."""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import non_finite_error
from .cells import check_cells, lam_tensor, sort_abs, unsort
from .gd_solver import solve_sorted_gd
from .newton import solve_sorted_newton
from .reduced import solve_sorted_reduced

SOLVERS = ("reduced", "newton", "gd")


def prox_2of4(
    z: Tensor,
    lam: float | Tensor,
    *,
    solver: str = "reduced",
    gd_max_iter: int = 2000,
    gd_tol: float = 1e-7,
) -> Tensor:
    """Global minimiser of ``0.5||w - z||^2 + lam r_{2:4}(w)`` for every cell ``z[..., :4]``.

    ``lam`` is a float or a tensor broadcastable to ``z.shape[:-1]`` (one value per cell).
    The cells are reduced to sorted non-negative form (Lemma ``lemma:sorted_prox``), solved, and
    mapped back. ``solver="reduced"`` (default, :mod:`nmprune.prox.reduced`: the cases reduced to
    one and two scalar equations) and ``solver="newton"`` (damped Newton on the case problems,
    :mod:`nmprune.prox.newton`) are exact and compute in float64 internally; ``solver="gd"`` is the paper's projected-GD enumeration
    (Conjecture ``conj:gd_works``) run in the dtype of ``z`` for at most ``gd_max_iter`` steps per
    case, stopping a case when its gradient norm grows or drops below ``gd_tol * max|z|``.
    Returns a tensor of the shape, dtype and device of ``z``.
    """
    compiled = solver == "reduced" and z.device.type == "cpu"
    check_cells(z, 4, finite=not compiled)  # the compiled kernel finds NaN and Inf as it loads
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if isinstance(gd_max_iter, bool) or not isinstance(gd_max_iter, int) or gd_max_iter < 1:
        raise ValueError(f"gd_max_iter must be a positive integer, got {gd_max_iter!r}")
    if not gd_tol >= 0:
        raise ValueError(f"gd_tol must be non-negative, got {gd_tol!r}")
    work = z.dtype if solver == "gd" else torch.float64
    lam_c = lam_tensor(lam, z, work).reshape(-1)
    zc = z.reshape(-1, 4)
    if compiled:
        return _reduced_compiled(zc.detach(), lam_c).reshape(z.shape)
    a, order = sort_abs(zc)
    a = a.to(work)
    if solver == "reduced":
        w = solve_sorted_reduced(a, lam_c)
    elif solver == "newton":
        w = solve_sorted_newton(a, lam_c)
    else:
        w = solve_sorted_gd(a, lam_c, gd_max_iter, gd_tol)
    return unsort(w.to(z.dtype), order, zc).reshape(z.shape)


def _reduced_compiled(zc: Tensor, lam_c: Tensor) -> Tensor:
    """``solver="reduced"`` on CPU: the compiled kernel (:mod:`nmprune.prox.reduced_simd`),
    with the cells it leaves undecided re-solved by the torch solver. The kernel also leaves
    the cells holding NaN or Inf undecided: they raise the ``ValueError`` that
    :func:`check_cells` would (finding them as the kernel loads saves a pass over ``z``).
    numba is imported here, on first use, so that runs of the other methods never load its
    compiler (about 55 MiB resident)."""
    from . import reduced_simd

    kernel_dtype = zc.dtype if zc.dtype in (torch.float32, torch.float64) else torch.float32
    zk = zc.to(kernel_dtype).contiguous()
    out = torch.empty_like(zk)
    undecided = torch.zeros(zk.shape[0], dtype=torch.bool)
    if zk.shape[0]:
        reduced_simd.run(zk.numpy(), lam_c.contiguous().numpy(), out.numpy(), undecided.numpy())
    if undecided.numpy().any():  # rare; numpy's any costs a fifth of torch's nonzero
        rows = undecided.nonzero().squeeze(-1)
        if not bool(torch.isfinite(zk[rows]).all()):
            raise non_finite_error("z")
        a, order = sort_abs(zk[rows])
        w = solve_sorted_reduced(a.to(torch.float64), lam_c[rows])
        out[rows] = unsort(w.to(kernel_dtype), order, zk[rows])
    return out.to(zc.dtype)
