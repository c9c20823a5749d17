"""devices.default_device: the one place that decides the default compute device."""

from __future__ import annotations

import pytest
import torch

from nmprune.devices import default_device
from nmprune.distributed import rank_device


def test_a_given_device_is_used_as_it_is():
    assert default_device("cpu") == torch.device("cpu")
    assert default_device(torch.device("cpu")) == torch.device("cpu")
    assert default_device("cuda:1") == torch.device("cuda", 1)  # named, not checked for presence
    assert isinstance(default_device("cpu"), torch.device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_default_is_the_cpu():
    assert default_device(None) == torch.device("cpu")
    assert default_device() == torch.device("cpu")
    assert default_device("") == torch.device("cpu")


def test_with_cuda_the_default_is_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device(None) == torch.device("cuda")
    assert default_device("cpu") == torch.device("cpu")
    # under torchrun each rank takes its own GPU by default
    assert rank_device(None, 3) == torch.device("cuda", 3)
    assert rank_device("cpu", 3) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device(None) == torch.device("cpu") == rank_device(None, 3)


def test_a_bad_device_string_is_torchs_error():
    with pytest.raises(RuntimeError):
        default_device("no-such-device")
