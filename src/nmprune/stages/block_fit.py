"""The block fit of local reconstruction: train the kept weights of each submodel of a block in
turn, the mask held, to reproduce the dense model's outputs of the submodel
(:func:`~nmprune.reconstruct.fit_masked`; docs/methods.md "Local reconstruction").

:class:`BlockFit` fits the submodels of a :class:`FitBlock` (the block, what the statistics
stage's forward pass recorded of it) on the pruned stream: each submodel's inputs are captured
by running the pruned block up to it, and with ``submodule`` on a residual block (Llama, Qwen,
Mistral) its targets are those of the residual stream after it (:meth:`BlockFit.residual_targets`).
:class:`TokenSharedSteps` lets several processes compute every step of a whole block together,
each on a share of the sample's tokens (:mod:`.token_shares`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..progress import bar as progress_bar
from ..reconstruct import (FitData, FitOptions, FitSharing, KeptEntries, channel_weights, epoch_steps, fit_masked,
                           lane_of)
from .block_runner import BlockCall, BlockInputs, block_hidden, run_block
from .token_shares import (TokenSharing, attention_on_share, computing_share, layer_reach, share_attention_candidates,
                           token_cost, token_shares, widest)


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


@contextmanager
def float32_training(block: nn.Module, widen: bool = True) -> Iterator[None]:
    """Gradients on for the body, but off for every parameter of ``block`` (``fit_masked``
    turns them on for the weights it trains); with ``widen``, every floating parameter of
    ``block`` is float32 meanwhile (the same tensor objects) and returns to its own dtype
    afterwards (without, the global distillation's lean pass: each keeps its dtype, and the
    trained weights are :func:`~nmprune.reconstruct.narrowed`). Buffers are left as they are."""
    flags = {p: (p.requires_grad, p.dtype) for p in block.parameters()}
    for p, (_, dtype) in flags.items():
        p.requires_grad_(False)
        if widen and dtype.is_floating_point and dtype != torch.float32:
            p.data = p.data.float()
    try:
        with torch.enable_grad():
            yield
    finally:
        for p, (flag, dtype) in flags.items():
            if widen and p.dtype != dtype:
                p.data = p.data.to(dtype)
            p.requires_grad_(flag)


@dataclass(frozen=True)
class ReconstructionSettings:
    """How each block is reconstructed: ``granularity`` (``submodule`` or ``block``,
    :data:`~nmprune.stages.reconstruction.GRANULARITIES`), how each fit trains (``options``),
    whether a bar shows each block's steps (``progress``), and ``scratch``: a folder on disk
    where each block's solved weights wait while it trains, and its pruned inputs while its
    outputs are computed (:class:`~nmprune.stages.reconstruction.Spill`; None: in memory)."""

    granularity: str
    options: FitOptions
    progress: bool = False
    scratch: str | os.PathLike | None = None


@dataclass(frozen=True)
class CalibrationShare:
    """This process's share of the calibration batches: ``positions``, the indices of its
    batches among all processes' ``total`` (their order in the calibration split), so that
    every process takes the same optimiser steps; ``all_reduce`` sums tensors over the
    processes in place; ``sharing``: the processes that share every step's sample by tokens
    (:class:`TokenSharedSteps`; None: one process)."""

    positions: Sequence[int]
    total: int
    all_reduce: Callable[[Sequence[Tensor]], None]
    sharing: TokenSharing | None = None


@dataclass(eq=False)
class FitUnit:
    """One submodel to fit: its name in the block ('' for the block itself), the module
    and its dense outputs per batch."""

    name: str
    module: nn.Module
    targets: list[Tensor]


@dataclass(eq=False)
class FitBlock:
    """Block ``index`` (``module``) as the statistics stage's forward pass found it: its
    submodels to fit in the order the block calls them (``units``, with their dense outputs),
    the pruned layers inside it by name (``layers``), whether its output is its input plus
    its submodels' outputs (``additive``: the submodels then fit the residual stream), and
    then its dense inputs (``dense_in``)."""

    index: int
    module: nn.Module
    units: list[FitUnit]
    layers: dict[str, nn.Module]
    additive: bool = False
    dense_in: list[Tensor] = field(default_factory=list)

    def weights(self, unit: FitUnit | None = None) -> list[Tensor]:
        """The weights of the pruned layers inside ``unit`` (every unit's where None)."""
        if unit is None:
            return [w for u in self.units for w in self.weights(u)]
        inside = {id(m) for m in unit.module.modules()}
        return [m.weight for m in self.layers.values() if id(m) in inside]


class _Stop(Exception):
    """Ends a forward pass once a submodel's inputs are recorded."""


@dataclass(frozen=True)
class _TokenShare:
    """How this process computes its share of a block's steps: the ``reach`` of each of the
    block's pruned ``layers`` (:func:`~.token_shares.layer_reach`), its ``share`` of the
    ``length`` tokens, and the ``attention`` modules that compute the share's queries only."""

    layers: dict[str, nn.Module]
    reach: dict[str, str]
    share: range
    length: int
    attention: list[nn.Module]


class _SharedBatches:
    """Training batches ``train`` (indices among all processes') of one shape, brought from the
    process that holds each (a broadcast, in the same order on every process)."""

    def __init__(self, sharing: TokenSharing, local: Mapping[int, int], train: list[int], shape: tuple,
                 device: torch.device):
        self.sharing, self.local, self.train, self.shape, self.device = sharing, local, train, shape, device

    def fetch(self, values: Sequence[Tensor], i: int) -> Tensor:
        """Training batch ``i``'s tensor of ``values`` (this process's, by local index), float32."""
        g = self.train[i]
        j = self.local.get(g)
        t = values[j].float() if j is not None else torch.empty(self.shape, dtype=torch.float32, device=self.device)
        self.sharing.broadcast(t, self.sharing.owner(g))
        return t


class _SharedTargets(Sequence):
    """The dense outputs of every training batch, this process's token share of each."""

    def __init__(self, batches: _SharedBatches, targets: list[Tensor], share: range):
        self.batches, self.targets, self.share = batches, targets, share

    def __len__(self) -> int:
        return len(self.batches.train)

    def __getitem__(self, i: int) -> Tensor:
        return self.batches.fetch(self.targets, i)[..., self.share.start:self.share.stop, :]


class TokenSharedSteps:
    """Token shares across ranks: with several processes, one lane and the whole block to fit,
    the batches of every step are shared out by tokens (:mod:`.token_shares`), so that every
    process computes every step, each on its share of the sample's tokens: one-sample steps
    train at every process's pace."""

    def __init__(self, inputs: BlockInputs, share: CalibrationShare, lanes: int):
        self.inputs, self.sharing, self.lanes = inputs, share.sharing, lanes
        self.local = {g: j for j, g in enumerate(share.positions)}

    @property
    def world(self) -> int:
        return self.sharing.world if self.sharing is not None else 1

    def steps(self, block: FitBlock, unit: FitUnit, train: list[int], pruned: list[Tensor], device: torch.device
              ) -> tuple[Callable[[int], Tensor], Sequence[Tensor]] | None:
        """``run(i)`` and ``targets[i]``: training batch ``train[i]`` (of the ``pruned``
        stream) brought from the process that holds it (collectives, called in the same order
        on every process), and this process's token share of the block's output and of its
        dense output. None where the steps train on the process that holds their batch: one
        process, several lanes, submodules, or batches of different shapes or of fewer tokens
        than processes."""
        sharing = self.sharing
        if sharing is None or sharing.world < 2 or self.lanes != 1 or unit.name != "":
            return None
        shape = self._common_shape(block.index, train, pruned)
        if shape is None:
            return None
        like = torch.empty(shape, dtype=torch.float32, device=device)
        call = self.inputs.call(block.index, like)
        call = BlockCall(cast_floats(call.args, torch.float32), cast_floats(call.kwargs, torch.float32),
                         call.hidden_as_kwarg)
        mine = [g for g in train if g in self.local]
        with torch.no_grad():
            probe = pruned[self.local[mine[0]]].float() if mine else None
        plan = self._measure(block, call, probe, shape[-2])
        batches = _SharedBatches(sharing, self.local, train, shape, device)

        def run(i: int) -> Tensor:
            h = batches.fetch(pruned, i)
            with computing_share(plan.layers, plan.reach, plan.share, plan.length, plan.attention):
                return run_block(block.module, h, call)[..., plan.share.start:plan.share.stop, :]

        return run, _SharedTargets(batches, unit.targets, plan.share)

    def _common_shape(self, index: int, train: list[int], pruned: list[Tensor]) -> tuple | None:
        """The one shape of every process's training batches, of a block call every process
        holds and of at least as many tokens as processes; None otherwise."""
        sharing = self.sharing
        shape = {tuple(pruned[self.local[g]].shape) for g in train if g in self.local}
        shapes = set().union(*sharing.gather(shape))
        if len(shapes) != 1 or len(next(iter(shapes))) < 2 or next(iter(shapes))[-2] < sharing.world:
            return None
        shape = next(iter(shapes))
        if not all(sharing.gather((index, shape) in self.inputs.calls)):
            return None
        return shape

    def _measure(self, block: FitBlock, call: BlockCall, probe: Tensor | None, length: int) -> _TokenShare:
        """What this process computes of each step: the pruned layers' reach, measured on
        ``probe`` (a training batch of this process; None where it holds none) and widened over
        the processes, its token share, and whether attention runs on the share's queries
        (checked on ``probe``)."""
        sharing, layers = self.sharing, dict(block.layers)
        with torch.no_grad():
            reach = layer_reach(lambda: run_block(block.module, probe, call), layers, length) \
                if probe is not None else {}
        reach = widest([r for r in sharing.gather(reach) if r])
        share = token_shares(length, sharing.world, token_cost(layers, reach))[sharing.rank]
        with torch.no_grad():
            attention = attention_on_share(lambda: run_block(block.module, probe, call), layers, reach, share, length,
                                           share_attention_candidates(block.module, layers, reach)) \
                if probe is not None else []
        return _TokenShare(layers, reach, share, length, attention)


@dataclass
class _BlockTraining:
    """What every submodel's fit of one block shares: each training batch's index among all
    processes' training batches (``rank``), this process's training batches (``train``, local
    indices), the lane of each training batch, the block's fit options, the ``pruned`` stream
    entering the block and where it is (``device``), and with residual targets the dense
    residual stream entering the next submodel (``dense_sum``)."""

    rank: dict[int, int]
    train: list[int]
    lanes: list[int]
    options: FitOptions
    pruned: list[Tensor]
    device: torch.device
    dense_sum: list[Tensor]


class BlockFit:
    """The block fit: the kept weights of each submodel of a block trained in turn on its
    dense targets (:func:`~nmprune.reconstruct.fit_masked`), never on the ``held``
    batches (indices among all processes'), each output channel's error weighed by the
    inverse of its dense mean square (:func:`~nmprune.reconstruct.channel_weights`).
    ``inputs`` holds the blocks' other arguments; ``shared`` shares the steps of whole blocks
    by tokens where it can."""

    def __init__(self, inputs: BlockInputs, settings: ReconstructionSettings, share: CalibrationShare,
                 held: frozenset[int], shared: TokenSharedSteps):
        self.inputs, self.options, self.progress = inputs, settings.options, settings.progress
        self.positions, self.total, self.all_reduce = list(share.positions), share.total, share.all_reduce
        self.held, self.shared = held, shared

    def fit(self, block: FitBlock, where: Mapping[int, KeptEntries], pruned: list[Tensor], device: torch.device
            ) -> dict[str, Any]:
        """Train the kept weights of each submodel of ``block`` in turn on its targets, from
        the ``pruned`` stream entering it (on ``device``; ``where``: each weight's kept
        entries, by ``id``). Returns what the block's record says of the training: the
        optimiser ``steps`` taken, how many processes computed each step (``token_shares``)
        and the ``train_dtype``."""
        done = {"steps": 0, "token_shares": 1, "train_dtype": "float32"}
        # this process's training batches, their ranks among all processes' training batches,
        # and the lane of each of those (lanes are shares of all batches, as the ranks')
        rank = {g: r for r, g in enumerate(g for g in range(self.total) if g not in self.held)}
        train = [j for j, g in enumerate(self.positions) if g not in self.held]
        lanes = [lane_of(g, self.total, self.options.lanes) for g in rank]
        per_unit = self.options.epochs * epoch_steps(lanes, self.options.batches_per_step)
        bar = progress_bar(total=per_unit * len(block.units), desc=f"reconstructing block {block.index}",
                           enabled=self.progress, nested=True)
        dense_sum = [x.float() for x in block.dense_in] if block.additive else []
        options = replace(self.options, seed=self.options.seed + block.index)
        training = _BlockTraining(rank, train, lanes, options, pruned, device, dense_sum)
        try:
            with float32_training(block.module):
                for k, unit in enumerate(block.units):
                    trained = block.weights(unit)
                    kept = [where[id(w)] for w in trained]
                    data, shared = self._unit_data(block, k, training)
                    if shared:
                        done["token_shares"] = self.shared.world
                    result = fit_masked(data, trained, options, FitSharing(self.all_reduce, lanes), bar.update, kept)
                    del data  # its run holds the unit's inputs
                    done["steps"] += result.steps
                    done["train_dtype"] = result.dtype
                    unit.targets.clear()
        finally:
            bar.close()
        return done

    def _unit_data(self, block: FitBlock, k: int, training: _BlockTraining) -> tuple[FitData, bool]:
        """What submodel ``k`` of ``block`` fits, and whether its steps are shared by tokens:
        then every process computes every batch, a share of its tokens; otherwise each batch
        trains on the process that holds it."""
        unit = block.units[k]
        shared = self.shared.steps(block, unit, list(training.rank), training.pruned, training.device)
        if shared is not None:
            (run, targets), mine = shared, range(len(training.rank))
        else:
            run, targets, mine = self._own_batches(block, k, training)
        return FitData(run, targets, mine, len(training.rank), channel_weights(unit.targets, self.all_reduce)), \
            shared is not None

    def _own_batches(self, block: FitBlock, k: int, training: _BlockTraining
                     ) -> tuple[Callable[[int], Tensor], list[Tensor], list[int]]:
        """Submodel ``k``'s fit on this process's training batches: ``run(i)`` its output on
        training batch ``i`` from the inputs it receives in the pruned block (float32), its
        targets (the residual stream's with residual targets), and the batches' indices among
        all processes' training batches."""
        unit, train = block.units[k], training.train
        inputs, earlier = self.unit_inputs(block, unit, training.pruned, block.units[:k] if block.additive else ())
        if block.additive:
            self.residual_targets(unit, earlier, training.dense_sum, training.pruned)
        del earlier

        def run(i: int) -> Tensor:
            return block_hidden(unit.module(*inputs[train[i]][0], **inputs[train[i]][1]))

        return run, [unit.targets[j] for j in train], [training.rank[self.positions[j]] for j in train]

    def unit_inputs(self, block: FitBlock, unit: FitUnit, pruned: list[Tensor], before: Sequence[FitUnit] = ()
                    ) -> tuple[list[tuple[tuple, dict]], list[Tensor]]:
        """The arguments ``unit`` receives on each batch of the ``pruned`` stream (as
        float32), and the sum of the outputs of the submodels ``before`` it on each batch."""
        dtype = torch.float32
        seen: list[tuple[tuple, dict]] = []
        earlier: list[Tensor] = []

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.append((cast_floats(args, dtype), cast_floats(kwargs, dtype)))
            raise _Stop

        def add(module: nn.Module, args: tuple, out: Any) -> None:
            earlier[-1] = earlier[-1] + block_hidden(out).float()

        handles = [unit.module.register_forward_pre_hook(hook, with_kwargs=True)]
        handles += [u.module.register_forward_hook(add) for u in before]
        try:
            with torch.no_grad():
                for h in pruned:
                    earlier.append(torch.zeros((), device=h.device))
                    try:
                        # the block's other arguments as captured (the unit's own are cast by the hook)
                        run_block(block.module, h.to(dtype), self.inputs.call(block.index, h))
                    except _Stop:
                        pass
        finally:
            for handle in handles:
                handle.remove()
        return seen, earlier

    @staticmethod
    def residual_targets(unit: FitUnit, earlier: list[Tensor], dense_sum: list[Tensor], pruned: list[Tensor]
                         ) -> None:
        """Make ``unit``'s targets those of the residual stream after it: its dense output
        plus the dense minus the pruned residual stream entering it (the ``pruned`` block input
        plus the earlier submodels' outputs, ``earlier``), so that training also cancels the
        drift the pruned model brought in. ``dense_sum`` (the dense residual entering the
        unit) moves past it."""
        for j, target in enumerate(unit.targets):
            dense_out = target.float()
            unit.targets[j] = dense_out + dense_sum[j] - (pruned[j].float() + earlier[j])
            dense_sum[j] = dense_sum[j] + dense_out
