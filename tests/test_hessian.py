"""Hook Hessians equal X X^T / n of the captured inputs; block-by-block execution equals
the model's own forward pass."""

from __future__ import annotations

import pytest
import torch

from nmprune.stages.block_runner import capture_block_inputs, run_block
from nmprune.stages.statistics import HessianCollector, accumulate, new_stats
from nmprune.models import find_blocks, find_linears
from test_models_tiny import FAMILIES, tiny_model, token_batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accumulate_equals_direct_formula(dtype):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, 8, generator=g), torch.randn(2, 7, 8, generator=g)]
    stats = new_stats(8, dtype)
    for x in xs:
        accumulate(stats, x)
    rows = torch.cat([x.reshape(-1, 8) for x in xs]).double()
    assert stats.count == rows.shape[0]
    assert stats.hessian().dtype == dtype
    torch.testing.assert_close(stats.hessian().double(), rows.T @ rows / rows.shape[0])
    torch.testing.assert_close(stats.mean().double(), rows.mean(0))


def test_accumulate_rejects_bad_input():
    with pytest.raises(ValueError, match="does not match"):
        accumulate(new_stats(4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="float32 or float64"):
        new_stats(4, torch.float16)
    with pytest.raises(ValueError, match="no inputs"):
        new_stats(4).hessian()


def _capture_inputs(layers):
    """Plain hooks keeping every input each layer receives (the oracle)."""
    seen = {n: [] for n in layers}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: seen[n].append(args[0].detach().clone()))
               for n, m in layers.items()]
    return seen, handles


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_hook_hessians_equal_captured_inputs(family):
    model = tiny_model(family)
    _, blocks = find_blocks(model)
    layers = find_linears(blocks[1])
    seen, handles = _capture_inputs(layers)
    ids = token_batch(6, 12)
    with HessianCollector(blocks[1], layers, torch.float64) as coll, torch.no_grad():
        for batch in ids.split(4):  # two batches of different sizes
            model(batch)
    for h in handles:
        h.remove()
    for name in layers:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen[name]]).double()
        torch.testing.assert_close(coll.of(name).hessian(), x.T @ x / x.shape[0])
        torch.testing.assert_close(coll.of(name).mean(), x.mean(0))
    if family == "llama":  # q/k/v share one accumulator, gate/up another
        assert coll.of("self_attn.q_proj") is coll.of("self_attn.k_proj") is coll.of("self_attn.v_proj")
        assert coll.of("mlp.gate_proj") is coll.of("mlp.up_proj")
        assert coll.of("self_attn.o_proj") is not coll.of("self_attn.q_proj")
        assert len(coll.stats) == 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_by_block_equals_model_forward(family):
    model = tiny_model(family, layers=3)
    name, blocks = find_blocks(model)
    ids = token_batch(5, 10)
    batches = list(ids.split(2))  # batch sizes 2, 2, 1
    with torch.no_grad():
        inputs = capture_block_inputs(model, name, blocks, batches, torch.device("cpu"))
        ref = [model(b, output_hidden_states=True).hidden_states for b in batches]
        hidden = inputs.hidden
        for i, block in enumerate(blocks):
            for b, h in enumerate(hidden):
                torch.testing.assert_close(h, ref[b][i], rtol=1e-5, atol=1e-5)
            hidden = [run_block(block, h, inputs.call(i, h)) for h in hidden]
    assert dict(model.named_modules())[name] is blocks  # the real blocks are back in place


def test_capture_moves_nothing_but_returns_hidden_on_device():
    model = tiny_model("llama")
    name, blocks = find_blocks(model)
    inputs = capture_block_inputs(model, name, blocks, [token_batch(2, 8)], torch.device("cpu"),
                                  keep_hidden=False)
    assert inputs.hidden == [] and inputs.calls
    assert all(p.device.type == "cpu" for p in model.parameters())
