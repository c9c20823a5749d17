"""The one place that decides the default compute device."""

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
