"""benchmarks/gpu_check.py runs without a GPU (its CPU fallback: the same code on the CPU
against itself, shapes scaled down), so the script a lent GPU runs first does not rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_check_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    from nmprune.registry import methods, refiners

    result = gpu_check.main(["--device", "cpu", "--scale", "64", "--repeats", "1", "--out", str(tmp_path)])
    assert result["fallback"] and json.loads((tmp_path / "gpu.json").read_text()) == result
    assert "Agreement with the CPU" in (tmp_path / "gpu.md").read_text()
    pairs = {(r["method"], r["refine"]) for r in result["agreement"]}
    assert pairs == {(m, r) for m in methods() for r in [None, *refiners()]}
    for r in result["agreement"]:  # the CPU against itself: the same masks and losses
        assert r["same_mask_cells"] >= 0.999 and r["loss_rel_diff"] < 1e-4, r
    assert {(r["method"], tuple(r["shape"])) for r in result["speed"]} == \
        {(m, (o // 64, i // 64)) for m, _ in gpu_check.TIMED for o, i in gpu_check.LLAMA_8B_SHAPES}
    assert all(r["seconds_median"] > 0 and r["peak_device_bytes"] is None for r in result["speed"])
    sys.modules.pop("gpu_check", None)
