"""Token shares: several processes compute one reconstruction step of one sample together.

A block's reconstruction loss is a sum over the sample's tokens (``sum_t ||y_t - t_t||^2``),
so its gradient is the sum of the gradients of any split of the tokens. Process ``r`` takes
the loss of a contiguous share of the tokens; the other tokens' outputs do not enter its
loss, and most of the block's layers act on each token alone, so it computes those layers only
on its share. A layer whose output at one token reaches the block's output at other tokens
(through attention: the key and value projections) must also be computed on the tokens the
share attends to -- every earlier token of a causal block -- and the block's own operations
(norms, activations, attention itself) run on the whole sample. Summed over processes, the
gradients are those of the whole sample, up to the order of the sums: one-sample steps (the
best setting, docs/methods.md) train at every process's pace with the quality of one process.

Which layers are which is measured, not assumed from their names (:func:`layer_reach`): the
output of each layer is perturbed at one token, and the block's outputs show where it reaches.
Computing a layer on more tokens than it needs is always exact (its values are the true ones),
so a layer whose token axis cannot be told (an input that is not ``(..., tokens, features)``)
simply runs whole.

Attention itself costs as much as the block's linear layers on a CPU at 512 tokens, so it
runs on the share's queries too where that can be done and checked: an attention module
that asks transformers' attention interface for ``"sdpa"`` is given, for the step, a copy of
its config naming :data:`QUERY_SHARE_ATTENTION`, transformers' own SDPA on the share's query
rows against the keys they attend to (:func:`query_share_attention`). Whether that leaves the
share's outputs as they were is measured on a real sample before training
(:func:`attention_on_share`); where it does not, attention runs whole.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

#: What a layer's output at token ``t`` reaches in the block's output: token ``t`` only, ``t``
#: and the tokens after it (a causal block's keys and values), or earlier tokens too.
REACHES = ("token", "causal", "all")


@dataclass(frozen=True)
class TokenSharing:
    """The processes that share each step's tokens: this one is ``rank`` of ``world``;
    ``owner(g)`` is the process that holds calibration batch ``g``; ``broadcast(t, src)``
    overwrites ``t`` on every process with process ``src``'s ``t``, and ``gather(value)``
    gives every process's ``value``, by rank (both collectives)."""

    rank: int
    world: int
    owner: Callable[[int], int]
    broadcast: Callable[[Tensor, int], None]
    gather: Callable[[Any], list[Any]]


def layer_reach(run: Callable[[], Tensor], layers: Mapping[str, nn.Module], length: int) -> dict[str, str]:
    """For each of ``layers`` (modules acting on each token alone, such as ``nn.Linear``),
    which tokens of the block's output its output at one token reaches (:data:`REACHES`):
    ``run()`` computes the block's output, ``(..., length, features)``, with no gradient; the
    layer's output at the middle token is perturbed by its own scale and the rows of the
    block's output that move beyond rounding are read off."""
    middle = length // 2
    base = run().float()
    # a row moved when it changes by more than rounding of its own size
    floor = 1e-4 * base.abs().amax(dim=tuple(i for i in range(base.dim()) if i != base.dim() - 2)).clamp(min=1e-6)
    reach = {}
    for name, layer in layers.items():
        seen: list[bool] = []

        def nudge(module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
            seen.append(isinstance(out, Tensor) and out.dim() >= 2 and out.shape[-2] == length)
            if not seen[-1]:
                return None
            bump = torch.zeros_like(out)
            bump[..., middle, :] = out[..., middle, :].abs().mean() + 1.0
            return out + bump

        handle = layer.register_forward_hook(nudge)
        try:
            moved = (run().float() - base).abs()
        finally:
            handle.remove()
        if not seen or not all(seen):
            reach[name] = "all"  # no token axis to tell: the layer runs whole
            continue
        rows = moved.amax(dim=tuple(i for i in range(moved.dim()) if i != moved.dim() - 2)) > floor
        if bool(rows[:middle].any()):
            reach[name] = "all"
        elif bool(rows[middle + 1:].any()):
            reach[name] = "causal"
        else:
            reach[name] = "token"
    return reach


def widest(reaches: list[Mapping[str, str]]) -> dict[str, str]:
    """Per layer, the widest of several measurements of its reach (:data:`REACHES`): every
    process then computes what any of them found needed."""
    return {name: max((r.get(name, "all") for r in reaches), key=REACHES.index) for name in reaches[0]}


def token_cost(layers: Mapping[str, nn.Module], reach: Mapping[str, str]) -> float:
    """The part of the work on ``layers`` (by weight size) done on each token's own row,
    among the layers that run on shares (:func:`token_shares`' ``per_token``)."""
    sizes = {kind: sum(layers[n].weight.numel() for n, k in reach.items() if k == kind) for kind in REACHES}
    shared = sizes["token"] + sizes["causal"]
    return sizes["token"] / shared if shared else 1.0


def token_shares(length: int, world: int, per_token: float) -> list[range]:
    """Contiguous shares of ``length`` tokens for ``world`` processes, sized so that each
    computes about the same: share ``[a, b)`` costs ``per_token * (b - a) + (1 - per_token)
    * b``, where ``per_token`` is the part of the block's layers that act on each token alone
    (the rest, the keys and values, run on every token up to ``b``). Equal costs make the
    ends a geometric series: ``b_r = C (1 - c^r) / (1 - c)`` with ``c = per_token``. Every
    share holds at least one token when ``length >= world``."""
    if length < world:
        raise ValueError(f"{length} tokens cannot be shared by {world} processes")
    c = min(max(per_token, 0.0), 1.0)
    ends = [length * (r / world if c >= 1.0 else (1 - c ** r) / (1 - c ** world)) for r in range(world + 1)]
    bounds = [0]
    for r in range(1, world + 1):
        # at least one token each, and room for one token per later share
        bounds.append(min(max(round(ends[r]), bounds[-1] + 1), length - (world - r)))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _rows_only(forward: Callable[..., Tensor], rows: range, length: int) -> Callable[..., Tensor]:
    """``forward`` computed on the token rows ``rows`` only (zeros elsewhere, which nothing
    of this process's loss reads); inputs without a token axis of ``length`` run whole."""
    def restricted(x: Tensor, *args, **kwargs) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-2] != length:
            return forward(x, *args, **kwargs)
        # contiguous: some layers view their input flat (GPT-2's Conv1D)
        part = forward(x[..., rows.start:rows.stop, :].contiguous(), *args, **kwargs)
        return torch.nn.functional.pad(part, (0, 0, rows.start, length - rows.stop))
    return restricted


#: The attention implementation, registered with transformers' ``AttentionInterface``, that
#: computes the query rows of a module's token share only (:func:`query_share_attention`)
QUERY_SHARE_ATTENTION = "nmprune_query_share"


def query_share_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Any]:
    """transformers' SDPA attention (``(batch, heads, tokens, head_dim)`` in, ``(batch,
    tokens, heads, head_dim)`` out) computed on the query rows ``[a, b)`` of
    ``module._query_share = (range(a, b), length)`` alone, the other rows zero. A given mask
    keeps its rows ``[a, b)``; without one a causal module's queries see the keys up to
    their own (keys past ``b`` are dropped; for ``a > 0`` a boolean mask aligned to the
    bottom right says so, as SDPA's own causal flag aligns to the top left)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    rows, length = module._query_share
    a, b = rows.start, rows.stop
    if query.shape[-2] != length or key.shape[-2] != length:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    causal = kwargs.get("is_causal")
    if attention_mask is not None:
        attention_mask = attention_mask[..., a:b, :]
    elif causal if causal is not None else getattr(module, "is_causal", True):
        key, value = key[..., :b, :], value[..., :b, :]
        if a > 0:
            attention_mask = torch.ones(1, 1, b - a, b, dtype=torch.bool, device=query.device).tril(a)
    out, weights = sdpa(module, query[..., a:b, :], key, value, attention_mask, **kwargs)
    return torch.nn.functional.pad(out, (0, 0, 0, 0, a, length - b)), weights


def share_attention_candidates(block: nn.Module, layers: Mapping[str, nn.Module],
                               reach: Mapping[str, str]) -> list[nn.Module]:
    """The modules of ``block`` that hold a ``"causal"`` layer of ``reach`` (the keys and
    values) and ask for transformers' ``"sdpa"`` attention: those whose queries can be
    restricted to a share (:func:`query_share_attention`)."""
    causal = {id(layers[name]) for name, kind in reach.items() if kind == "causal"}
    return [m for m in block.modules()
            if any(id(c) in causal for c in m.children())
            and getattr(getattr(m, "config", None), "_attn_implementation", None) == "sdpa"]


@contextmanager
def computing_share(layers: Mapping[str, nn.Module], reach: Mapping[str, str], share: range,
                    length: int, attention: Sequence[nn.Module] = ()) -> Iterator[None]:
    """Inside, each of ``layers`` computes only the token rows this process's ``share`` of the
    loss needs (:func:`layer_reach`): the share for ``"token"`` layers, every token up to the
    share's end for ``"causal"`` ones; ``"all"`` layers run whole. The ``attention`` modules
    (:func:`share_attention_candidates`) compute the share's queries only
    (:data:`QUERY_SHARE_ATTENTION`)."""
    saved: dict[str, object] = {}
    configs: list[tuple[nn.Module, Any]] = []
    try:
        for name, layer in layers.items():
            kind = reach.get(name, "all")
            if kind == "all":
                continue
            rows = share if kind == "token" else range(0, share.stop)
            saved[name] = layer.__dict__.get("forward")
            layer.forward = _rows_only(layer.forward, rows, length)
        if attention:
            from transformers import AttentionInterface

            AttentionInterface.register(QUERY_SHARE_ATTENTION, query_share_attention)
        for module in attention:
            configs.append((module, module.config))
            module.config = copy.deepcopy(module.config)
            module.config._attn_implementation = QUERY_SHARE_ATTENTION
            module._query_share = (share, length)
        yield
    finally:
        for module, config in configs:
            module.config = config
            del module._query_share
        for name, previous in saved.items():
            del layers[name].forward
            if previous is not None:
                layers[name].forward = previous


def attention_on_share(run: Callable[[], Tensor], layers: Mapping[str, nn.Module], reach: Mapping[str, str],
                       share: range, length: int, candidates: Sequence[nn.Module]) -> list[nn.Module]:
    """``candidates`` (:func:`share_attention_candidates`) if computing only the share's
    queries in them leaves the share's rows of the block's output ``run()`` (no gradient) as
    they are, up to rounding of their size; otherwise none."""
    if not candidates:
        return []
    whole = run()[..., share.start:share.stop, :].float()
    try:
        with computing_share(layers, reach, share, length, candidates):
            part = run()[..., share.start:share.stop, :].float()
    except (RuntimeError, ValueError, TypeError, IndexError):
        return []
    tolerance = 1e-4 * float(whole.abs().max()) + 1e-6
    return list(candidates) if part.shape == whole.shape and float((part - whole).abs().max()) <= tolerance else []


#: layers whose output at one token reaches later tokens (keys and values; fused ones too), by
#: name: :func:`layer_reach` measures them in a run; :func:`busiest_token_share` (the dry run,
#: which runs nothing) reads these names
CAUSAL_LAYERS = ("k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "Wqkv")


def busiest_token_share(shapes: Mapping[str, tuple[int, int]], ranks: int) -> float:
    """The part of a block's training step the busiest of ``ranks`` computes when the sample
    is shared by tokens (:func:`token_shares`), from the block's layers' ``(d_out, d_in)`` by
    full name: the keys' and values' layers (:data:`CAUSAL_LAYERS`) run on every token up to
    the end of a share, the other layers on the share alone."""
    if ranks < 2:
        return 1.0
    sizes = [(r * d, name.rsplit(".", 1)[-1] in CAUSAL_LAYERS) for name, (r, d) in shapes.items()]
    total = sum(size for size, _ in sizes)
    c = 1.0 - sum(size for size, causal in sizes if causal) / total if total else 1.0
    return 1.0 / ranks if c >= 1.0 else (1 - c) / (1 - c ** ranks)
