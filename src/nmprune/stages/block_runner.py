"""Running a causal LM one decoder block at a time.

Block inputs are captured with a SparseGPT-style catcher: the decoder blocks are swapped
for recorders that store the hidden states entering the first block and the keyword
arguments (attention masks, position embeddings, ...) every block receives, and stop the
forward pass. The blocks are then run one at a time (:func:`run_block`), so only one block
needs to be on the compute device (paper Section ``sec:llm_experiments``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch
from torch import Tensor, nn

class _Stop(Exception):
    """Raised by the recorders to end the model's forward pass early."""


@dataclass
class BlockCall:
    """Everything except the hidden states that one block receives in one forward call."""

    args: tuple
    kwargs: dict
    hidden_as_kwarg: bool


@dataclass
class BlockInputs:
    """Hidden states entering the current block (one tensor per calibration batch), and
    the other arguments of every block per batch shape."""

    hidden: list[Tensor]
    calls: dict[tuple[int, tuple[int, ...]], BlockCall] = field(default_factory=dict)
    output_template: Any = None

    def call(self, index: int, hidden: Tensor) -> BlockCall:
        return self.calls[(index, tuple(hidden.shape))]


class Recorder(nn.Module):
    """Stands in for block ``index`` during capture; attribute lookups fall through to the
    real block (models read e.g. ``layer.attention_type``), which is not registered as a
    submodule so moving the model does not move it."""

    def __init__(self, index: int, block: nn.Module, sink: Callable):
        super().__init__()
        self.index = index
        self.__dict__["_real"] = block
        self.__dict__["_sink"] = sink

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_sink"](self.index, args, kwargs)


def block_hidden(out: Any) -> Tensor:
    """The hidden states in a block's output (a tensor, or the first item of a tuple)."""
    return out if isinstance(out, Tensor) else out[0]


def output_like(template: Any, hidden: Tensor) -> Any:
    return hidden if isinstance(template, Tensor) else (hidden, *template[1:])


def run_block(block: nn.Module, hidden: Tensor, call: BlockCall) -> Tensor:
    """Run one block on ``hidden`` with the arguments the model gave it."""
    if call.hidden_as_kwarg:
        return block_hidden(block(*call.args, hidden_states=hidden, **call.kwargs))
    return block_hidden(block(hidden, *call.args, **call.kwargs))


def capture_block_inputs(model: nn.Module, blocks_name: str, blocks: nn.ModuleList,
                         batches: list[Tensor], device: torch.device, *,
                         keep_hidden: bool = True, place: bool = True) -> BlockInputs:
    """Run ``model`` on each token batch up to its first decoder block.

    Returns the hidden states entering block 0 (on ``device``, unless ``keep_hidden`` is
    False) and, for every block and batch shape, the other arguments the model passes it.
    Only the modules outside ``blocks`` (embeddings, rotary tables, ...) and block 0 visit
    ``device``; they return to the CPU afterwards. With ``place=False`` nothing is moved:
    the caller has put those modules and block 0 on ``device`` (a streaming source).
    """
    parent_name, _, attr = blocks_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    result = BlockInputs(hidden=[])
    recording = {"all": False}

    def sink(index: int, args: tuple, kwargs: dict) -> Any:
        as_kwarg = not args
        hidden = kwargs.pop("hidden_states") if as_kwarg else args[0]
        rest = args if as_kwarg else args[1:]
        if index == 0 and keep_hidden:
            result.hidden.append(hidden.detach())
        if not recording["all"]:
            raise _Stop
        result.calls[(index, tuple(hidden.shape))] = BlockCall(rest, dict(kwargs), as_kwarg)
        if result.output_template is None:
            if place:
                blocks[0].to(device)
            result.output_template = blocks[0](*args, **kwargs) if not as_kwarg else \
                blocks[0](*rest, hidden_states=hidden, **kwargs)
            if place:
                blocks[0].to("cpu")
        if index == len(blocks) - 1:
            raise _Stop
        return output_like(result.output_template, hidden)

    recorders = nn.ModuleList([Recorder(i, b, sink) for i, b in enumerate(blocks)])
    setattr(parent, attr, recorders)
    try:
        if place:
            model.to(device)
        with torch.no_grad():
            for ids in batches:
                recording["all"] = not any(k[1][:2] == tuple(ids.shape) for k in result.calls)
                try:
                    model(ids.to(device), use_cache=False)
                except _Stop:
                    pass
                else:
                    raise RuntimeError("the model's forward pass never reached its decoder blocks")
    finally:
        setattr(parent, attr, blocks)
        if place:
            model.to("cpu")
    return result


def head_logits(model: nn.Module, blocks_name: str, blocks: nn.ModuleList, template: Any,
                batches: Sequence[Tensor], finals: Sequence[Tensor], device: torch.device, *,
                place: bool = True) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield each token batch's ids (on ``device``) and logits from its last-block output
    ``finals[k]``: the model's own forward pass runs with the blocks replaced by stand-ins
    that hand back that output, so its final norm, LM head and any logit post-processing
    make the logits. One tuple per batch and no local holds the logits, so a consumer that
    drops them frees them before the next batch's are made. ``place``: the modules outside
    the blocks visit ``device`` for the call (as in :func:`capture_block_inputs`); without,
    the caller has put them there."""
    parent_name, _, attr = blocks_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    current: dict[str, Tensor] = {}

    def replay(index: int, args: tuple, kwargs: dict) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return output_like(template, current["final"] if index == 0 else hidden)

    setattr(parent, attr, nn.ModuleList([Recorder(i, b, replay) for i, b in enumerate(blocks)]))
    try:
        if place:
            model.to(device)
        for ids, final in zip(batches, finals):
            current["final"] = final
            ids = ids.to(device)
            yield ids, model(input_ids=ids, use_cache=False).logits
    finally:
        setattr(parent, attr, blocks)
        if place:
            model.to("cpu")
