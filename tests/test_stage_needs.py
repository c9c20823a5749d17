"""What the dry run reads by layer name (nmprune/stages/needs.py), against what a run measures
on the same block: the inputs the statistics stage keeps one Hessian for, and the layers whose
output reaches later tokens (the keys and values that token shares compute on more tokens)."""

from __future__ import annotations

import pytest
import torch
from test_models_tiny import FAMILIES, tiny_model, token_batch

from nmprune.models import weight_matrix
from nmprune.stages.block_runner import run_block
from nmprune.stages.source import ModelBlocks
from nmprune.stages.statistics import HessianCollector, hessian_inputs
from nmprune.stages.token_shares import CAUSAL_LAYERS, layer_reach


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_plans_layer_names_agree_with_what_the_run_measures(family):
    source = ModelBlocks(tiny_model(family))
    length = 16
    inputs = source.capture([token_batch(1, length)], torch.device("cpu"))
    block, layers = source.blocks[0], source.layers(0)
    hidden = inputs.hidden[0]
    call = inputs.call(0, hidden)
    with torch.no_grad(), HessianCollector(block, dict(layers)) as collector:
        run_block(block, hidden, call)
    # one accumulator per input the layers really share, as many and as wide as the plan counts
    measured = sorted(collector.stats[lead].xsum.shape[0] for lead in set(collector.leader.values()))
    shapes = {name: tuple(weight_matrix(m).shape) for name, m in layers.items()}
    assert sorted(hessian_inputs(shapes)) == measured
    with torch.no_grad():
        reach = layer_reach(lambda: run_block(block, hidden, call), layers, length)
    assert "all" not in reach.values()  # causal blocks: no layer reaches earlier tokens
    named = {name for name in layers if name.rsplit(".", 1)[-1] in CAUSAL_LAYERS}
    assert {name for name, r in reach.items() if r == "causal"} == named
