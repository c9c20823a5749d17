"""The 2:4 proximal operator ``prox_{lam r_{2:4}}(z)`` (eq. ``prox_original``), cell by cell."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

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
    :mod:`nmprune.prox.newton`) are exact and compute in float64 internally, except that
    ``"reduced"`` on CUDA sends float32 and 16-bit ``z`` to the float32 Triton kernel of
    :mod:`nmprune.prox.two_four_triton` where triton is installed (exact up to float32 rounding;
    the cells it cannot settle go to the float64 solver); ``solver="gd"`` is the paper's
    projected-GD enumeration (Conjecture ``conj:gd_works``) run in the dtype of ``z`` for at most
    ``gd_max_iter`` steps per case, stopping a case when its gradient norm grows or drops below
    ``gd_tol * max|z|``.
    Returns a tensor of the shape, dtype and device of ``z``.
    """
    kernel = _kernel(z, solver)
    check_cells(z, 4, finite=kernel is None)  # the compiled kernels find NaN and Inf as they load
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if isinstance(gd_max_iter, bool) or not isinstance(gd_max_iter, int) or gd_max_iter < 1:
        raise ValueError(f"gd_max_iter must be a positive integer, got {gd_max_iter!r}")
    if not gd_tol >= 0:
        raise ValueError(f"gd_tol must be non-negative, got {gd_tol!r}")
    work = z.dtype if solver == "gd" else torch.float64
    if kernel is not None and z.device.type == "cuda":
        work = torch.float32  # the Triton kernel computes in float32: half the bytes of lam
    lam_c = lam_tensor(lam, z, work).reshape(-1)
    zc = z.reshape(-1, 4)
    if kernel is not None:
        return kernel(zc.detach(), lam_c).reshape(z.shape)
    a, order = sort_abs(zc)
    a = a.to(work)
    if solver == "reduced":
        w = solve_sorted_reduced(a, lam_c)
    elif solver == "newton":
        w = solve_sorted_newton(a, lam_c)
    else:
        w = solve_sorted_gd(a, lam_c, gd_max_iter, gd_tol)
    return unsort(w.to(z.dtype), order, zc).reshape(z.shape)


def _kernel(z: Tensor, solver: str) -> Callable[[Tensor, Tensor], Tensor] | None:
    """The compiled path of ``solver="reduced"``: numba on CPU; on CUDA the Triton kernel for
    float32 and 16-bit ``z`` (float64 keeps the float64 torch solver); None for the torch solvers."""
    if solver != "reduced" or not isinstance(z, Tensor):
        return None
    if z.device.type == "cpu":
        return _reduced_compiled
    if z.device.type == "cuda" and z.dtype != torch.float64:
        return _triton_prox()
    return None


def triton_installed() -> bool:
    """Whether triton can be imported, so that CUDA's float32 and 16-bit cells go to the Triton
    kernel (:func:`_kernel`); nothing is imported."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_prox() -> Callable[[Tensor, Tensor], Tensor] | None:
    """:func:`nmprune.prox.two_four_triton.prox_2of4_triton`, imported on the first CUDA call
    (CPU runs never load triton); None where triton is not installed."""
    try:
        from .two_four_triton import prox_2of4_triton
    except ImportError:
        return None
    return prox_2of4_triton


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
