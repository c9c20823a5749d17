"""The CUDA paths against the CPU: every method and refiner on one layer, and a whole prune
of a tiny model in memory and streamed. Marked ``cuda``; without a CUDA device each test is
skipped with that reason (shown by ``-ra``). benchmarks/gpu_check.py measures the same on
real sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_method_and_refiner_on_cuda_matches_the_cpu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    for row in gpu_check.agreement(torch.device("cuda"), 256, 256):
        assert row["same_mask_cells"] >= 0.99 and row["loss_rel_diff"] < 1e-3, row


def test_pipeline_on_cuda_matches_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check
    from test_models_tiny import save_tiny_model_dir, write_text

    text = write_text(tmp_path / "text.txt")
    model = save_tiny_model_dir(tmp_path / "model", "llama", layers=2, text=text.read_text())
    settings = {"calib": str(text), "eval": [str(text)], "nsamples": 4, "seqlen": 16,
                "eval_seqlen": 16, "eval_max_tokens": 128}
    rows = gpu_check.pipeline(torch.device("cuda"), model, tmp_path, settings)
    for row in rows:
        limit = 1e-3 if row["dtype"] == "float32" else 0.05
        assert row["perplexity_rel_diff"] < limit, row
