"""Input checks shared by the solvers: every problem is named in a ValueError, nothing is cast."""

from __future__ import annotations

import math

import torch
from torch import Tensor


class NonFiniteModel(ValueError):
    """The model's own weights or activations are not finite, or overflow float32: nothing
    computed from them is worth keeping (a run that meets one removes its checkpoint, so
    that the rerun on corrected weights starts clean)."""


def check_float(name: str, t: Tensor, *, finite: bool = True) -> None:
    """Reject non-tensors, integer/bool dtypes, and (unless ``finite`` is False, for a caller
    that checks them itself with :func:`non_finite_error`) NaN or Inf entries."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must have a floating-point dtype, got {t.dtype}")
    if finite and t.numel() and not all_finite(t):
        raise non_finite_error(name)


def non_finite_error(name: str) -> ValueError:
    """The error for a tensor ``name`` with NaN or Inf entries."""
    return ValueError(f"{name} contains NaN or Inf")


def all_finite(t: Tensor) -> bool:
    """True when no entry is NaN or +-Inf: the min and max (one reduction, which propagates
    NaN) are finite. Much faster than ``isfinite(t).all()``, which writes a bool tensor."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_symmetric(name: str, h: Tensor, rtol: float = 1e-4) -> None:
    """Reject a non-square or non-symmetric matrix (relative to its largest entry). The
    asymmetry is taken over blocks of rows, so the check needs only about ``2**22`` entries
    of working memory, not copies of ``h``."""
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(h.shape)}")
    if not h.numel():
        return
    lo, hi = torch.aminmax(h)
    scale = max(-float(lo), float(hi))
    rows = max(1, 2**22 // h.shape[0])
    asymmetry = max(float((h[i:i + rows] - h[:, i:i + rows].T).abs_().max())
                    for i in range(0, h.shape[0], rows))
    if asymmetry > rtol * max(scale, 1e-30):
        raise ValueError(f"{name} is not symmetric")


def check_non_negative(name: str, value: object) -> float:
    """Reject anything but a finite, non-negative int or float (bools too); returns it as float."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value < 0):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)
