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
from test_models_tiny import save_tiny_model_dir, write_text  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny 3-block Llama directory with its tokenizer, a text, and a run.yaml pruning it
    with wanda + gd on that text: ``(folder, model folder, text file, run.yaml)``."""
    base = tmp_path_factory.mktemp("cli")
    text = write_text(base / "text.txt")
    model_dir = save_tiny_model_dir(base / "model", "llama", layers=3, text=text.read_text())
    yaml_file = base / "run.yaml"
    yaml_file.write_text(f"model: {model_dir}\nmethod: wanda\nrefine: gd\ncalib: {text}\n"
                         f"nsamples: 4\nseqlen: 16\nbatch_size: 2\neval: ['{text}']\n"
                         f"eval_seqlen: 16\neval_max_tokens: 256\n")
    return base, model_dir, text, yaml_file
