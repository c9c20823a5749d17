"""benchmarks/gpu_check.py runs without a GPU (its CPU fallback: the same code on the CPU
against itself, shapes scaled down), so the script a lent GPU runs first does not rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_check_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    from nmprune.registry import methods, refiners
    from test_models_tiny import save_tiny_model_dir, write_text

    text = write_text(tmp_path / "text.txt")
    model = save_tiny_model_dir(tmp_path / "model", "llama", layers=2, text=text.read_text())
    result = gpu_check.main(["--device", "cpu", "--scale", "64", "--repeats", "1", "--out", str(tmp_path),
                             "--model", str(model), "--calib", str(text), "--nsamples", "4",
                             "--seqlen", "16", "--eval-max-tokens", "128",
                             "--block-nsamples", "4", "--block-seqlen", "16"])
    assert result["fallback"] and json.loads((tmp_path / "gpu.json").read_text()) == result
    assert "Agreement with the CPU" in (tmp_path / "gpu.md").read_text()
    pairs = {(r["method"], r["refine"]) for r in result["agreement"]}
    assert pairs == {(m, r) for m in methods() for r in [None, *refiners()]}
    for r in result["agreement"]:  # the CPU against itself: the same masks and losses
        assert r["same_mask_cells"] >= 0.999 and r["loss_rel_diff"] < 1e-4, r
    assert {(r["method"], tuple(r["shape"])) for r in result["speed"]} == \
        {(m, (o // 64, i // 64)) for m, _ in gpu_check.TIMED for o, i in gpu_check.LLAMA_8B_SHAPES}
    assert all(r["seconds_median"] > 0 and r["peak_device_bytes"] is None for r in result["speed"])
    runs = [(r["device"], r["dtype"], r["streamed"]) for r in result["pipeline"]]
    assert runs == [("cpu", "float32", False), ("cpu", "float32", False), ("cpu", "float32", True),
                    ("cpu", "bfloat16", False), ("cpu", "bfloat16", True)]
    for r in result["pipeline"]:
        assert r["perplexity"][str(text)] > 1 and r["seconds"] > 0
    assert all(r["perplexity_rel_diff"] == 0 for r in result["pipeline"][:3])  # float32: the same run
    assert all(r["perplexity_rel_diff"] < 0.05 for r in result["pipeline"][3:])  # bfloat16: close
    assert "The whole pipeline (model)" in (tmp_path / "gpu.md").read_text()
    # the 8B-shaped block, scaled down: solved, then reconstructed in float32 and in bfloat16
    # products; one sample per step, one of the four held out, the default number of epochs
    from nmprune.config import PruneSettings

    assert [b["train_dtype"] for b in result["block"]] == ["float32", "bfloat16"]
    for block in result["block"]:
        assert block["settings"] == {"nsamples": 4, "seqlen": 16}
        assert block["steps"] == 3 * PruneSettings().reconstruct_epochs  # 2
        assert block["layer_seconds"] > 0 and block["reconstruction_seconds"] > 0
        assert 0 < block["heldout_after"] <= block["heldout_before"] and block["kept"] in ("reconstructed", "solved")
    assert "Reconstruction in float32 over bfloat16" in (tmp_path / "gpu.md").read_text()
    # a step's costs beside its products: every linear weight of the block trained, half kept
    (step,) = result["step"]
    assert step["trained_weights"] == 2 * step["kept_entries"] > 0
    assert step["per_parameter"] > 0 and step["per_entry"] > 0
    assert "A reconstruction step's costs" in (tmp_path / "gpu.md").read_text()
    # the default job on two 8B-shaped blocks, streamed: each stage measured beside its plan
    stages = {r["stage"]: r for r in result["job"]}
    assert set(stages) == {"layer_solves", "calibration_passes", "reconstruction", "prune (all)"}
    assert all(r["planned_seconds"] > 0 and r["measured_seconds"] > 0 for r in stages.values())
    assert stages["prune (all)"]["planned_seconds"] == pytest.approx(
        sum(r["planned_seconds"] for name, r in stages.items() if name != "prune (all)"))
    assert list(result["seconds"]) == list(gpu_check.PARTS) and result["failed"] == {}
    # a later run of some parts on the same device keeps the others; a part that fails (here:
    # no tokenizer) is reported with its traceback and the next part still runs
    again = gpu_check.main(["--device", "cpu", "--scale", "64", "--repeats", "1", "--out", str(tmp_path),
                            "--parts", "block,speed", "--merge", "--tokenizer", str(tmp_path / "missing")])
    assert again["pipeline"] == result["pipeline"] and again["speed"] != result["speed"]
    assert set(again["seconds"]) == set(gpu_check.PARTS) and "block" not in again
    assert list(again["failed"]) == ["block"] and "Traceback" in again["failed"]["block"]
    assert "## Part block FAILED" in (tmp_path / "gpu.md").read_text()
    sys.modules.pop("gpu_check", None)
    # the lean pass on the 8B-shaped model, scaled down: checkpointed and not, the plan beside it
    # the pass sharded with FSDP2 over a process group of one rank (gloo here)
    (sharded,) = result["sharded"]
    assert sharded["mask_held"] and sharded["steps"] == 3 and sharded["train_dtype"] == "bfloat16"
    assert "The pass sharded with FSDP2" in (tmp_path / "gpu.md").read_text()
    assert [r["checkpointed"] for r in result["distill"]] == [True, False]
    for r in result["distill"]:
        assert r["train_dtype"] == "bfloat16" and r["steps"] == 3 and r["seconds"] > 0  # 4 windows, 1 held out
        assert r["peak_device_bytes"] is None and r["planned_peak_bytes"] > 0
    assert result["distill"][0]["last_epoch_kl"] == pytest.approx(result["distill"][1]["last_epoch_kl"], rel=1e-3)
    assert result["distill"][0]["planned_peak_bytes"] < result["distill"][1]["planned_peak_bytes"]
    assert "The global distillation's lean pass" in (tmp_path / "gpu.md").read_text()

