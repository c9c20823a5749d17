"""Test-wide settings.

The tests use small tensors, for which a second intra-op thread only adds OpenMP
synchronisation: on a shared 2-core machine it made tiny matmuls ~1000x slower (16 us ->
31 ms). One thread keeps the suite fast and its timings stable.

The Hugging Face libraries run offline (set before they are imported): a test never
reaches the network, and a data set that is not on disk fails at once.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
