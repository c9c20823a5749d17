"""Token shares of a reconstruction step (nmprune.stages.token_shares): the layers' reach is
measured right in every family, and the gradients of the shares add up to the whole sample's,
checked in float64 against one process computing every token."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nmprune.stages.block_runner import block_hidden
from nmprune.stages.token_shares import (attention_on_share, computing_share, layer_reach, share_attention_candidates,
                                        token_shares)
from test_models_tiny import FAMILIES, tiny_model, token_batch

ATTENTION_INPUTS = {"k_proj", "v_proj", "c_attn", "qkv_proj"}  # names whose reach is causal here
#: OPT runs its MLP on the tokens flattened into one axis with the batch: no token axis to tell
FLAT = {("opt", "fc1"), ("opt", "fc2")}


def _first_block(family: str, seqlen: int = 12, attention: str = "eager"):
    """Block 0 of a tiny ``family`` model in float64 with the arguments the model gives it,
    with transformers' ``attention`` implementation."""
    model = tiny_model(family, layers=1).double()
    model.config._attn_implementation = attention
    block = next(m for name, m in model.named_modules() if name.endswith(".0") and "layers" in name or name == "transformer.h.0")
    seen = {}

    def hook(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise StopIteration

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(token_batch(2, seqlen), use_cache=False)
    except StopIteration:
        pass
    handle.remove()
    hidden = seen["args"][0] if seen["args"] else seen["kwargs"].pop("hidden_states")
    rest = seen["args"][1:]
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
    return block, (lambda h: block_hidden(block(h, *rest, **seen["kwargs"]))), hidden.detach(), linears


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_layer_reaches_its_own_token_or_the_later_ones(family):
    block, run, hidden, linears = _first_block(family)
    with torch.no_grad():
        reach = layer_reach(lambda: run(hidden), linears, hidden.shape[-2])
    for name, kind in reach.items():
        expected = ("all" if (family, name) in FLAT else
                    "causal" if name.split(".")[-1] in ATTENTION_INPUTS else "token")
        assert kind == expected, (family, name, kind)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("queries", ["whole", "share"])
def test_the_shares_gradients_add_up_to_the_whole_samples(family, world, queries):
    """With attention on every query (transformers' eager attention), or (``share``, SDPA
    where the family has it: not Gemma-2, whose soft cap SDPA lacks) on the share's queries,
    which every SDPA family's measurement (:func:`attention_on_share`) allows: Llama's SDPA
    call without a mask, Mistral's sliding window with one."""
    sdpa = queries == "share" and family != "gemma2"
    block, run, hidden, linears = _first_block(family, attention="sdpa" if sdpa else "eager")
    length = hidden.shape[-2]
    target = torch.randn_like(hidden)
    weights = [m.weight for m in linears.values()]
    for p in block.parameters():
        p.requires_grad_(False)
    for w in weights:
        w.requires_grad_(True)
    whole = torch.autograd.grad((run(hidden) - target).square().sum(), weights)
    with torch.no_grad():
        reach = layer_reach(lambda: run(hidden), linears, length)
    shares = token_shares(length, world, 0.7)
    summed = [torch.zeros_like(w) for w in weights]
    for share in shares:
        attention = []
        if queries == "share":
            with torch.no_grad():
                attention = attention_on_share(lambda: run(hidden), linears, reach, share, length,
                                               share_attention_candidates(block, linears, reach))
            assert bool(attention) == sdpa, (family, share)
        with computing_share(linears, reach, share, length, attention):
            out = run(hidden)[..., share.start:share.stop, :]
        grads = torch.autograd.grad((out - target[..., share.start:share.stop, :]).square().sum(), weights)
        for s, g in zip(summed, grads):
            s += g
    for name, a, b in zip(linears, whole, summed):
        # float64, but some families' norms compute in float32 (Qwen3's per-head norms)
        gap = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a))
        assert gap < 1e-6, (family, name, gap)
    # the forwards and configs are the modules' own again
    assert all("forward" not in m.__dict__ for m in linears.values())
    assert all(getattr(getattr(m, "config", None), "_attn_implementation", None) != "nmprune_query_share"
               for m in block.modules())


def test_a_layer_that_computes_more_tokens_than_it_needs_is_still_exact():
    """Every layer marked as reaching all tokens runs whole, and the gradient is unchanged."""
    block, run, hidden, linears = _first_block("llama")
    length = hidden.shape[-2]
    weights = [m.weight for m in linears.values()]
    for p in block.parameters():
        p.requires_grad_(False)
    for w in weights:
        w.requires_grad_(True)
    share = range(3, 7)
    with computing_share(linears, {}, share, length):
        a = torch.autograd.grad(run(hidden)[..., 3:7, :].square().sum(), weights)
    b = torch.autograd.grad(run(hidden)[..., 3:7, :].square().sum(), weights)
    assert all(torch.allclose(x, y, rtol=1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("length,world,cost", [(512, 2, 0.834), (2048, 8, 0.98), (16, 3, 0.5), (5, 5, 0.9),
                                               (100, 4, 1.0), (100, 4, 0.0)])
def test_token_shares_cover_the_tokens_and_balance_the_work(length, world, cost):
    shares = token_shares(length, world, cost)
    assert [t for s in shares for t in s] == list(range(length))
    assert all(len(s) >= 1 for s in shares)
    work = [cost * len(s) + (1 - cost) * s.stop for s in shares]
    if length >= 100 * world:
        assert max(work) / (sum(work) / world) < 1.02, work
    if cost == 1.0:
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    if cost < 1.0 and length >= 100 * world:
        assert len(shares[0]) >= len(shares[-1])  # the later shares attend to more tokens


def test_token_shares_refuse_fewer_tokens_than_processes():
    with pytest.raises(ValueError, match="3 tokens cannot be shared by 4"):
        token_shares(3, 4, 0.8)
