"""Layer input statistics: ``H = X X^T / n`` and what else a method declares it needs.

The local problem of every linear layer (paper eq. ``squared_loss``) needs the Hessian of its
inputs ``X`` (``d_in x n`` over all calibration tokens), kept normalised by the token count
(the minimiser does not change). Running sums (``sum x x^T``, ``sum x``, ``n``) are kept until
every process's sums are added, so the reduction is exact. :func:`accumulate` is the pure
tensor code; the hooks of :class:`HessianCollector` route inputs to it, one accumulator per
distinct input tensor (q/k/v and gate/up share one). A method names the statistics beyond
``H`` it takes when it registers; :data:`STATISTICS` computes each from the sums. The
pipeline's statistics stage is :class:`CalibrationStatistics` or :class:`PrecomputedStatistics`;
:func:`statistics_needs` states what the first needs (:mod:`.needs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .block_runner import BlockInputs, run_block
from .needs import RunShape, StageNeeds


@dataclass
class InputStats:
    """Running sums of a layer input: ``sum x x^T``, ``sum x`` and the token count; after
    :meth:`average_`, their means (``averaged``)."""

    xtx: Tensor
    xsum: Tensor
    count: int = 0
    averaged: bool = False

    def hessian(self) -> Tensor:
        """``H = X X^T / n`` (the stored tensor itself once averaged, else a new one)."""
        return self.xtx if self._counted().averaged else self.xtx / self.count

    def mean(self) -> Tensor:
        """The mean input vector (``d_in``)."""
        return self.xsum if self._counted().averaged else self.xsum / self.count

    def average_(self) -> "InputStats":
        """Divide the sums by the count in place, once all processes' sums are added: the
        same values as :meth:`hessian` / :meth:`mean`, without a second ``d_in^2`` copy."""
        if not self._counted().averaged:
            self.xtx.div_(self.count)
            self.xsum.div_(self.count)
            self.averaged = True
        return self

    def _counted(self) -> "InputStats":
        if self.count == 0:
            raise ValueError("no inputs were accumulated")
        return self


def new_stats(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> InputStats:
    """Empty accumulators for inputs of dimension ``d`` (``dtype`` float32 or float64)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"Hessians accumulate in float32 or float64, got {dtype}")
    return InputStats(torch.zeros(d, d, dtype=dtype, device=device),
                      torch.zeros(d, dtype=dtype, device=device))


def accumulate(stats: InputStats, x: Tensor) -> InputStats:
    """Add the tokens of ``x`` (``(..., d)``) to ``stats`` in place and return it."""
    d = stats.xsum.shape[0]
    if stats.averaged:
        raise ValueError("these statistics are averaged already; accumulate before average_()")
    if x.shape[-1] != d:
        raise ValueError(f"input of width {x.shape[-1]} does not match accumulator of width {d}")
    rows = x.detach().reshape(-1, d).to(stats.xtx.dtype)
    stats.xtx.addmm_(rows.T, rows)
    stats.xsum.add_(rows.sum(0))
    stats.count += rows.shape[0]
    return stats


class HessianCollector:
    """Forward hooks accumulating :class:`InputStats` for the named layers of one block.

    Layers whose hooks receive the identical input tensor object within one forward call
    of ``block`` (q/k/v after one norm, gate/up) share the accumulator of the first of
    them. Use as a context manager; hooks are removed on exit.
    """

    def __init__(self, block: nn.Module, layers: dict[str, nn.Module], dtype: torch.dtype = torch.float32):
        self.block, self.layers, self.dtype = block, layers, dtype
        self.stats: dict[str, InputStats] = {}
        self.leader: dict[str, str] = {}
        self._seen: list[tuple[Tensor, str]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "HessianCollector":
        self._handles.append(self.block.register_forward_pre_hook(lambda *_: self._seen.clear()))
        self._handles.append(self.block.register_forward_hook(lambda *_: self._seen.clear()))
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._seen.clear()

    def _hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["input"]
            found = next((lead for t, lead in self._seen if t is x), None)
            lead = self.leader.setdefault(name, found or name)
            if (found or name) != lead:
                raise RuntimeError(f"layer {name} shared its input with {lead} in an earlier batch "
                                   "but not in this one")
            if lead == name and found is None:
                self._seen.append((x, name))
                if name not in self.stats:
                    self.stats[name] = new_stats(x.shape[-1], self.dtype, x.device)
                accumulate(self.stats[name], x)
        return hook

    def of(self, name: str) -> InputStats:
        """The accumulated input statistics of layer ``name``."""
        if name not in self.leader:
            raise RuntimeError(f"layer {name} was never called during the forward passes")
        return self.stats[self.leader[name]]


STATISTICS: dict[str, Callable[[InputStats], Tensor]] = {
    "input_mean": InputStats.mean,  # E[x], e.g. DSnoT's expected-output correction
}


def statistic_values(names: Sequence[str], stats: InputStats, device: torch.device | None = None
                     ) -> dict[str, Tensor]:
    """The statistics ``names`` (keys of :data:`STATISTICS`) of one layer's inputs."""
    unknown = [n for n in names if n not in STATISTICS]
    if unknown:
        raise ValueError(f"unknown statistic {unknown[0]!r}; known: {', '.join(sorted(STATISTICS))}")
    return {n: STATISTICS[n](stats).to(device) for n in names}


class StatisticsStage(Protocol):
    """What :func:`nmprune.pipeline.prune_model` asks of the statistics stage."""

    @property
    def hidden(self) -> list[list[Tensor]] | None:
        """The hidden states entering the next block to collect, as streams (one list of
        per-batch tensors each; what a checkpoint saves, each tensor as it is held, no copy;
        None when there are none); set from a checkpoint on resume."""

    @hidden.setter
    def hidden(self, saved: list[list[Tensor]]) -> None: ...

    def collect(self, index: int, block: nn.Module, layers: Mapping[str, nn.Module]
                ) -> dict[str, InputStats]:
        """The input statistics of ``layers`` (full name -> module) of block ``index``."""

    def advance(self, index: int, block: nn.Module) -> dict[str, Any] | None:
        """After block ``index`` is pruned: move the hidden states past it; the block's
        reconstruction record (:mod:`nmprune.stages.reconstruction`), None without one."""


class CalibrationStatistics:
    """The statistics stage from calibration activations.

    ``inputs.hidden`` holds the hidden states entering the current block (this process's
    share of the calibration batches). :meth:`collect` runs them through a block with
    :class:`HessianCollector` on its layers and hands the sums to ``reduce`` (identity in one
    process, an all-reduce across ranks) before they are averaged in place
    (:meth:`InputStats.average_`) and read. With ``dense_inputs``
    (the paper's default) each batch's dense output replaces its input at once, so only one
    set of activations is held; otherwise :meth:`advance` propagates the inputs through the
    pruned block (Appendix ``app:use_unpruned_inputs``).
    """

    def __init__(self, inputs: BlockInputs, dtype: torch.dtype, dense_inputs: bool,
                 reduce: Callable[[list[InputStats]], None]):
        self.inputs, self.dtype, self.dense_inputs, self.reduce = inputs, dtype, dense_inputs, reduce

    @property
    def hidden(self) -> list[list[Tensor]]:
        """The one stream of hidden states entering the next block to collect."""
        return [self.inputs.hidden]

    @hidden.setter
    def hidden(self, saved: list[list[Tensor]]) -> None:
        (self.inputs.hidden,) = saved

    def collect(self, index: int, block: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, InputStats]:
        """Run block ``index`` on every batch; the statistics of ``layers`` by their keys."""
        with HessianCollector(block, dict(layers), self.dtype) as collector:
            for j, h in enumerate(self.inputs.hidden):
                out = run_block(block, h, self.inputs.call(index, h))
                if self.dense_inputs:
                    self.inputs.hidden[j] = out
        stats = {name: collector.of(name) for name in layers}
        unique = list({id(s): s for s in stats.values()}.values())
        self.reduce(unique)
        for s in unique:
            s.average_()
        return stats

    def advance(self, index: int, block: nn.Module) -> None:
        """After block ``index`` is pruned: its outputs become the next block's inputs
        (nothing to do with dense inputs, whose outputs :meth:`collect` already kept)."""
        if not self.dense_inputs:
            self.inputs.hidden = [run_block(block, h, self.inputs.call(index, h))
                                  for h in self.inputs.hidden]


class PrecomputedStatistics:
    """The statistics stage from statistics collected beforehand, keyed by full layer name
    (:func:`nmprune.pipeline.collect_hessians`): no forward passes, nothing to propagate."""

    hidden = None  # nothing for a checkpoint to keep

    def __init__(self, stats: Mapping[str, InputStats]):
        self.stats = stats

    def collect(self, index: int, block: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, InputStats]:
        missing = [name for name in layers if name not in self.stats]
        if missing:
            raise ValueError(f"hessians has no entry for {', '.join(missing[:3])}; collect them "
                             "with collect_hessians on this model")
        return {name: self.stats[name] for name in layers}

    def advance(self, index: int, block: nn.Module) -> None:
        return None


#: layers that read one input tensor when they sit side by side in one module (q/k/v after one
#: norm, gate/up): :class:`HessianCollector` finds them by the tensor itself as the block runs,
#: :func:`hessian_inputs` (the dry run, which runs nothing) by these names
SHARED_INPUTS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"w1", "w3"})


def hessian_inputs(shapes: Mapping[str, tuple[int, int]]) -> list[int]:
    """``d_in`` of each distinct layer input of one block, whose layers' ``(d_out, d_in)`` are
    ``shapes`` by full name: one accumulator per input, as :class:`HessianCollector` keeps them
    (:data:`SHARED_INPUTS`)."""
    seen: dict[tuple[str, int], int] = {}
    widths = []
    for name, (_, d_in) in shapes.items():
        parent, _, leaf = name.rpartition(".")
        group = next((i for i, g in enumerate(SHARED_INPUTS) if leaf in g), None)
        key = (parent, group) if group is not None else (name, -1)
        if key not in seen:
            seen[key] = d_in
            widths.append(d_in)
    return widths


def statistics_needs(run: RunShape) -> StageNeeds:
    """What :class:`CalibrationStatistics` needs on one rank: while a block is worked on, its
    float32 Hessians (one per distinct input, :func:`hessian_inputs`) and the float32
    activations of one calibration batch through it; two sets of the rank's hidden states in the
    run's dtype (a block's inputs and its outputs); and the passes of every block over the
    calibration tokens, shared out between the ranks: the statistics and the propagation, and
    with pruned inputs (``hessian_inputs="pruned"``) one more for the pruned stream."""
    hessians = max(sum(4 * d * d for d in hessian_inputs(block)) for block in run.per_block)
    activations = run.batch_tokens * (3 * run.intermediate + 4 * run.hidden_size) * 4
    passes = 2 + (1 if run.settings.hessian_inputs == "pruned" else 0)
    streams = run.rank_tokens * run.hidden_size * run.itemsize * 2
    return StageNeeds(block_bytes=hessians + activations, stream_bytes=streams,
                      seconds={"calibration_passes": passes * run.forward / run.rate / run.ranks})
