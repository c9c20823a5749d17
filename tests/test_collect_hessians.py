"""collect_hessians: one dense calibration pass serving several prune_model runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from nmprune.pipeline import collect_hessians, prune_model
from test_models_tiny import tiny_model, token_batch
from test_pipeline import manual_hessians


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_collected_hessians_equal_direct_computation(family):
    model = tiny_model(family, layers=2)
    ids = token_batch(4, 12)
    stats = collect_hessians(model, ids, dtype=torch.float64, batch_size=2, progress=False)
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and n != "lm_head"]
    assert sorted(stats) == sorted(names)
    ref = manual_hessians(model, ids, names)
    for n in names:
        torch.testing.assert_close(stats[n].hessian(), ref[n][0])
        torch.testing.assert_close(stats[n].mean(), ref[n][1])
        assert stats[n].xtx.device.type == "cpu"


@pytest.mark.parametrize("method, refine", [("wanda", "exact"), ("sparsegpt", None)])
def test_prune_with_collected_hessians_equals_normal_run(method, refine):
    dense = tiny_model("llama", layers=2)
    ids = token_batch(4, 12)
    normal, reused = copy.deepcopy(dense), copy.deepcopy(dense)
    r1 = prune_model(normal, calibration=ids, method=method, refine=refine, batch_size=4, progress=False,
                     reconstruct="none")
    stats = collect_hessians(dense, ids, batch_size=4, progress=False)
    r2 = prune_model(reused, method=method, refine=refine, hessians=stats, progress=False, reconstruct="none")
    for (k, a), b in zip(normal.state_dict().items(), reused.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    assert [r["name"] for r in r1.layers] == [r["name"] for r in r2.layers]


def test_collected_hessians_refuse_pruned_inputs_and_missing_layers():
    model = tiny_model("llama", layers=2)
    stats = collect_hessians(model, token_batch(2, 8), progress=False)
    with pytest.raises(ValueError, match="cannot be used with hessian_inputs='pruned'"):
        prune_model(copy.deepcopy(model), method="wanda", hessian_inputs="pruned", hessians=stats, reconstruct="none",
                    progress=False)
    partial = {k: v for k, v in stats.items() if ".1." not in k}
    with pytest.raises(ValueError, match="hessians has no entry for model.layers.1"):
        prune_model(copy.deepcopy(model), method="wanda", hessians=partial, progress=False, reconstruct="none")
