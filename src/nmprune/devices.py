"""The one place that decides the default compute device, and whether it computes bfloat16 fast."""

from __future__ import annotations

import torch


def default_device(spec: str | torch.device | None = None) -> torch.device:
    """The compute device to use: ``spec`` itself when given (a string such as ``"cpu"``,
    ``"cuda"``, ``"cuda:1"`` or a :class:`torch.device`), else ``cuda`` (the current CUDA
    device) when CUDA is available, else the CPU. ``""`` counts as not given."""
    if isinstance(spec, torch.device):
        return spec
    if spec:
        return torch.device(spec)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fast_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively: a CUDA device with bfloat16
    support, or a CPU with AVX512-BF16 or AMX (elsewhere torch emulates it, slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


#: the settings that choose bfloat16 products (:func:`low_precision`): ``auto``, ``full``, ``bfloat16``
PRECISIONS = ("auto", "full", "bfloat16")


def low_precision(precision: str, device: torch.device, worthwhile: bool) -> torch.dtype | None:
    """The dtype of the products a ``precision`` setting (:data:`PRECISIONS`) asks for, None for
    the working dtype: ``bfloat16`` always; ``full`` never; ``auto`` where the work is
    ``worthwhile`` in bfloat16 (the caller's judgement of its size) and the device computes it
    natively (:func:`fast_bfloat16`)."""
    if precision == "bfloat16":
        return torch.bfloat16
    if precision == "full" or not worthwhile:
        return None
    return torch.bfloat16 if fast_bfloat16(device) else None


def products_in(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast on ``device`` to ``dtype`` (:func:`low_precision`'s answer); off for None."""
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
