"""The reconstruction stage: after a block's layers are solved, train the kept weights of its
attention and MLP (``submodule``) or of the whole block (``block``) to reproduce the dense
model's activations (:mod:`nmprune.reconstruct`; docs/methods.md "Local reconstruction").

:class:`ReconstructingStatistics` is a statistics stage (:class:`~nmprune.stages.statistics.
StatisticsStage`) that carries two streams of hidden states through the model: the dense
model's (the targets, and the layers' statistics with ``hessian_inputs="dense"``) and the
pruned model's (the inputs of every reconstruction, and the statistics with ``"pruned"``).
:meth:`~ReconstructingStatistics.collect` records, while the dense block runs, the dense
output of every submodel it will fit; :meth:`~ReconstructingStatistics.advance` fits them in
order on the pruned stream and moves that stream past the reconstructed block. The submodels
of ``submodule`` are the block's direct children that hold a pruned layer, in the order the
block calls them (attention, then MLP, in the Llama, Qwen2, Mistral and Gemma families; a
family whose MLP matrices are direct children of the block, such as OPT's ``fc1``/``fc2``,
fits them one by one). :func:`reconstruction_needs` states what the stage needs beyond the
statistics it collects (:mod:`.needs`).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from ..evaluate import perplexity_from_nll, window_kl, window_nll
from ..checks import NonFiniteModel
from ..progress import bar as progress_bar
from ..reconstruct import (FitData, FitOptions, FitSharing, KeptEntries, ReconstructionDiverged, channel_weights,
                           epoch_steps, fit_masked, lane_of)
from .block_runner import BlockCall, BlockInputs, block_hidden, run_block
from .needs import RunShape, StageNeeds
from .statistics import CalibrationStatistics, InputStats
from .token_shares import (TokenSharing, attention_on_share, busiest_token_share, computing_share, layer_reach,
                           share_attention_candidates, token_cost, token_shares, widest)

GRANULARITIES = ("none", "submodule", "block")
RECONSTRUCTION_TEXT = {  # what `nmprune methods` says of each granularity
    "none": "no reconstruction: the layers as the method and refiner solved them",
    "submodule": "train the kept weights of each block's attention, then of its MLP, to match the "
                 "dense model's outputs of each (Wagner et al. 2025, arXiv 2510.14444)",
    "block": "train the kept weights of each whole block to match the dense block's outputs "
             "(Wanda++ arXiv 2503.04992, EBFT arXiv 2402.12419)",
}


class ReconstructionWorse(ValueError):
    """Reconstruction left the model worse on held-out calibration text than the solved
    weights alone, although every block it kept lowered that block's held-out error."""


#: The end-to-end check stops a run whose reconstructed model is this many times further (KL
#: divergence from the dense model on the held-out calibration batches) than its solved weights
#: alone: a collapse is orders of magnitude, a few held-out batches vary by a few percent.
END_TO_END_MARGIN = 1.1

#: One calibration batch in this many is held out of training, to judge each reconstruction.
HOLD_OUT_EVERY = 8


def held_out_batches(total: int) -> frozenset[int]:
    """The calibration batches (indices among ``total``) that reconstruction never trains on:
    ``max(1, total // HOLD_OUT_EVERY)`` of them, evenly spaced, the last batch included
    (none with a single batch, which must be trained on)."""
    if total < 2:
        return frozenset()
    count = max(1, total // HOLD_OUT_EVERY)
    step = total // count
    return frozenset(step * i + step - 1 for i in range(count))


class _Stop(Exception):
    """Ends a forward pass once a submodel's inputs are recorded."""


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
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


class Spill:
    """Tensors set aside until they are needed again: with ``folder``, each is appended as a
    safetensors record to an unnamed temporary file there (it vanishes when closed, or with
    the process), so that they take no memory meanwhile; without a folder, or with one that
    cannot hold the file (missing on this machine), they stay in memory."""

    def __init__(self, folder: str | os.PathLike | None):
        self.file = None
        self.entries: list[Tensor | tuple[int, int, torch.device]] = []
        if folder is not None:
            try:
                self.file = tempfile.TemporaryFile(dir=folder)
            except OSError:
                pass

    @property
    def on_disk(self) -> bool:
        return self.file is not None

    def append(self, value: Tensor) -> None:
        if self.file is None:
            self.entries.append(value)
            return
        record = safetensors.torch.save({"t": value.detach().cpu().contiguous()})
        start = self.file.seek(0, os.SEEK_END)
        self.file.write(record)
        self.entries.append((start, len(record), value.device))

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> Tensor:
        entry = self.entries[i]
        if isinstance(entry, Tensor):
            return entry
        start, size, device = entry
        self.file.seek(start)
        return safetensors.torch.load(self.file.read(size))["t"].to(device)

    def close(self) -> None:
        self.entries = []
        if self.file is not None:
            self.file.close()


@dataclass(eq=False)
class _Unit:
    """One submodel to fit: its name in the block ('' for the block itself), the module
    and its dense outputs per batch."""

    name: str
    module: nn.Module
    targets: list[Tensor]


class ReconstructingStatistics:
    """The statistics stage with local reconstruction (module docstring).

    ``inputs`` holds the hidden states entering the first block to collect: dense and
    pruned alike at block 0 (after a resume, :attr:`hidden` is set from the checkpoint).
    ``reduce`` sums the layer statistics over processes and ``all_reduce`` sums tensors in
    place; ``positions`` are this process's batches among ``total`` (their order in the
    calibration split), so every process takes the same optimiser steps. ``progress``
    shows a bar of each block's steps. ``scratch``: a folder on disk where each block's solved
    weights wait while it trains, and its pruned inputs while its outputs are computed, in
    case the solve is restored (:class:`Spill`; None: in memory). ``sharing``: the processes
    that share every step's sample by tokens (:mod:`.token_shares`; None: one process), for
    whole blocks with one lane; otherwise a step's samples train on the process that holds them.

    The batches of :func:`held_out_batches` are never trained on: a block's reconstruction is
    kept only if it lowers the block's error on them. Every error, in training and in the
    report, weighs each output channel by the inverse of its dense mean square
    (:func:`~nmprune.reconstruct.channel_weights`).
    """

    def __init__(self, inputs: BlockInputs, dtype: torch.dtype, dense_inputs: bool,
                 reduce: Callable[[list[InputStats]], None], granularity: str, options: FitOptions,
                 positions: Sequence[int], total: int, all_reduce: Callable[[Sequence[Tensor]], None],
                 progress: bool = False, scratch: str | os.PathLike | None = None,
                 sharing: TokenSharing | None = None):
        if granularity not in GRANULARITIES[1:]:
            raise ValueError(f"reconstruct must be one of {', '.join(GRANULARITIES[1:])} here, got {granularity!r}")
        # the streams own the captured hidden states: ``inputs`` keeps only the blocks' other arguments
        self.inputs = replace(inputs, hidden=[])
        self.dtype, self.dense_inputs, self.reduce = dtype, dense_inputs, reduce
        self.granularity, self.options, self.all_reduce = granularity, options, all_reduce
        self.positions, self.total, self.progress = list(positions), total, progress
        self.scratch, self.sharing = scratch, sharing
        self.held = held_out_batches(total)
        self.held_local = [j for j, g in enumerate(self.positions) if g in self.held]
        # the held-out batches through the solved weights alone (what reconstruct="none" gives
        # with dense-input statistics): the reference of the end-to-end check; unknown after a resume
        self.solved: list[Tensor] | None = [inputs.hidden[j] for j in self.held_local] if inputs.hidden else None
        self.dense: list[Tensor] = list(inputs.hidden)
        self.pruned: list[Tensor] = list(inputs.hidden)
        self._units: list[_Unit] = []
        self._active: dict[str, nn.Module] = {}
        self._dense_in: list[Tensor] = []
        self._additive = False
        self._weight = torch.ones(())

    @property
    def hidden(self) -> list[list[Tensor]]:
        """The two streams entering the next block: the dense and the pruned hidden states."""
        return [self.dense, self.pruned]

    @hidden.setter
    def hidden(self, saved: list[list[Tensor]]) -> None:
        self.dense, self.pruned = (list(s) for s in saved)
        self.solved = None

    def _call(self, index: int, hidden: Tensor) -> BlockCall:
        return self.inputs.call(index, hidden)

    def collect(self, index: int, block: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, InputStats]:
        """The statistics of ``layers`` (from the dense or the pruned stream, per
        ``dense_inputs``); meanwhile the dense block's outputs of every submodel to fit are
        recorded and the dense stream moves past the block."""
        self._active = dict(layers)
        # the block's dense inputs, for the residual targets of submodules (freed after the
        # collection unless the block is additive); block targets need none
        self._dense_in = list(self.dense) if self.granularity == "submodule" else []
        units = self._candidates(block)
        order: list[_Unit] = []
        handles = [u.module.register_forward_hook(self._recorder(u, order)) for u in units]
        try:
            if self.dense_inputs:
                stage = CalibrationStatistics(BlockInputs(self.dense, self.inputs.calls), self.dtype,
                                              True, self.reduce)
                stats = stage.collect(index, block, layers)
                self.dense = stage.inputs.hidden
            else:  # in place: each batch's dense input is freed as its output comes
                for j, h in enumerate(self.dense):
                    self.dense[j] = run_block(block, h, self._call(index, h))
        finally:
            for h in handles:
                h.remove()
        if not self.dense_inputs:
            stats = CalibrationStatistics(BlockInputs(self.pruned, self.inputs.calls), self.dtype,
                                          False, self.reduce).collect(index, block, layers)
        self._weight = channel_weights(self.dense, self.all_reduce)
        missing = [u.name for u in units if u not in order]
        if missing:
            raise RuntimeError(f"block {index}: {', '.join(missing)} never ran in the block's forward pass")
        self._units = order
        self._additive = self.granularity == "submodule" and self._is_additive()
        if not self._additive:  # only the residual targets need the block's dense inputs
            self._dense_in = []
        return stats

    def _is_additive(self) -> bool:
        """Whether the block's output is its input plus the outputs of its submodels (a
        pre-norm residual block: Llama, Qwen, Mistral, Phi-3, GPT-2, OPT; not Gemma 2's
        post-norms), to 1e-4 of the output's norm over every process's batches."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.dense[0].device if self.dense else "cpu")
        if any(u.targets[0].shape != self.dense[0].shape for u in self._units):
            sums[0] = float("inf")  # a submodel of another width (OPT's fc1): not a residual branch
        for j, (x, y) in enumerate(zip(self._dense_in, self.dense) if sums[0] == 0 else ()):
            rest = y.float() - x.float() - sum(u.targets[j].float() for u in self._units)
            sums += torch.stack([rest.square().sum().double(), y.float().square().sum().double()])
        self.all_reduce([sums])
        return bool(sums[0] <= 1e-8 * sums[1])

    def _candidates(self, block: nn.Module) -> list[_Unit]:
        """The submodels of ``block`` to fit: the block, or its direct children holding a
        pruned layer."""
        if self.granularity == "block":
            return [_Unit("", block, [])]
        active = {id(m) for m in self._active.values()}
        return [_Unit(name, child, []) for name, child in block.named_children()
                if any(id(m) in active for m in child.modules())]

    @staticmethod
    def _recorder(unit: _Unit, order: list[_Unit]) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            if unit not in order:
                order.append(unit)
            unit.targets.append(block_hidden(out).detach())
        return hook

    def _weights(self, unit: _Unit) -> list[Tensor]:
        """The weights of the pruned layers inside ``unit``."""
        inside = {id(m) for m in unit.module.modules()}
        return [m.weight for m in self._active.values() if id(m) in inside]

    def _propagate(self, index: int, block: nn.Module, spill: Spill | None = None
                   ) -> tuple[list[Tensor], float, float | None]:
        """The block's outputs on the pruned stream and their squared error relative to the
        dense outputs, channel-weighted (summed over all processes' batches): on the training
        batches and on the held-out ones (None without). With ``spill``, each pruned input
        moves there once its output is computed, so that inputs and outputs are not held
        together."""
        outs = []
        train, held = self._errors(index, block, range(len(self.dense)), outs, spill)
        return outs, train, held if self.held else None

    def _deciding_error(self, index: int, block: nn.Module) -> tuple[float | None, float | None]:
        """The error (training, held-out) of the block's outputs on the batches that decide
        whether trained weights are kept (:meth:`_improved`): the held-out ones alone, the
        training error then unknown (None), or the training ones where none is held out."""
        train, held = self._errors(index, block, self.held_local if self.held else range(len(self.dense)))
        return (None, held) if self.held else (train, None)

    def _errors(self, index: int, block: nn.Module, batches: Iterable[int], outs: list[Tensor] | None = None,
                spill: Spill | None = None) -> tuple[float, float]:
        """The channel-weighted squared error of the block's outputs on this process's
        ``batches`` of the pruned stream relative to the dense outputs', summed over all
        processes: on the training batches and on the held-out ones (0 where there are none);
        each output appended to ``outs`` if given, and with ``spill``, each pruned input moved
        there (:meth:`_propagate`)."""
        sums = torch.zeros(2, 2, dtype=torch.float64, device=self.dense[0].device if self.dense else "cpu")
        weight = self._weight.to(sums.device)
        for j in batches:
            target, h = self.dense[j], self.pruned[j]
            out = run_block(block, h, self._call(index, h))
            part = int(self.positions[j] in self.held)
            sums[part, 0] += ((out.float() - target.float()).square() * weight).sum().double()
            sums[part, 1] += (target.float().square() * weight).sum().double()
            if outs is not None:
                outs.append(out)
            if spill is not None:
                spill.append(h)
                self.pruned[j] = None
            del h
        self.all_reduce([sums])
        train, held = (float(s[0] / s[1]) if s[1] > 0 else 0.0 for s in sums)
        return train, held

    def _unit_inputs(self, index: int, block: nn.Module, unit: _Unit, dtype: torch.dtype,
                     before: Sequence[_Unit] = ()) -> tuple[list[tuple[tuple, dict]], list[Tensor]]:
        """The arguments ``unit`` receives on each batch of the pruned stream (as ``dtype``),
        and the sum of the outputs of the submodels ``before`` it on each batch."""
        seen: list[tuple[tuple, dict]] = []
        earlier: list[Tensor] = []

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.append((_cast(args, dtype), _cast(kwargs, dtype)))
            raise _Stop

        def add(module: nn.Module, args: tuple, out: Any) -> None:
            earlier[-1] = earlier[-1] + block_hidden(out).float()

        handles = [unit.module.register_forward_pre_hook(hook, with_kwargs=True)]
        handles += [u.module.register_forward_hook(add) for u in before]
        try:
            with torch.no_grad():
                for h in self.pruned:
                    earlier.append(torch.zeros((), device=h.device))
                    try:
                        run_block(block, h.to(dtype), _cast(self._call(index, h), dtype))
                    except _Stop:
                        pass
        finally:
            for handle in handles:
                handle.remove()
        return seen, earlier

    def _residual_targets(self, k: int, earlier: list[Tensor], dense_sum: list[Tensor]) -> None:
        """Make submodel ``k``'s targets those of the residual stream after it: its dense
        output plus the dense minus the pruned residual stream entering it (block input plus
        the earlier submodels' outputs), so that training also cancels the drift the pruned
        model brought in. ``dense_sum`` (the dense residual entering ``k``) moves past ``k``."""
        unit = self._units[k]
        for j, target in enumerate(unit.targets):
            dense_out = target.float()
            unit.targets[j] = dense_out + dense_sum[j] - (self.pruned[j].float() + earlier[j])
            dense_sum[j] = dense_sum[j] + dense_out

    def _targets_kind(self) -> str:
        """What the submodels were fitted to (docs/methods.md "Local reconstruction")."""
        if self.granularity == "block":
            return "block output"
        return "residual stream" if self._additive else "submodule output"

    def _fit(self, index: int, block: nn.Module, where: Mapping[int, KeptEntries]) -> dict[str, Any]:
        """Train the kept weights of each submodel of block ``index`` in turn on its targets
        (``where``: each weight's kept entries, by ``id``). Returns what the block's record says
        of the training: the optimiser ``steps`` taken, how many processes computed each step
        (``token_shares``) and the ``train_dtype``."""
        done = {"steps": 0, "token_shares": 1, "train_dtype": "float32"}
        # this process's training batches, their ranks among all processes' training batches,
        # and the lane of each of those (lanes are shares of all batches, as the ranks')
        rank = {g: r for r, g in enumerate(g for g in range(self.total) if g not in self.held)}
        train = [j for j, g in enumerate(self.positions) if g not in self.held]
        lanes = [lane_of(g, self.total, self.options.lanes) for g in rank]
        per_unit = self.options.epochs * epoch_steps(lanes, self.options.batches_per_step)
        bar = progress_bar(total=per_unit * len(self._units), desc=f"reconstructing block {index}",
                           enabled=self.progress, nested=True)
        dense_sum = [x.float() for x in self._dense_in] if self._additive else []
        options = replace(self.options, seed=self.options.seed + index)
        try:
            with float32_training(block):
                for k, unit in enumerate(self._units):
                    trained = self._weights(unit)
                    kept = [where[id(w)] for w in trained]
                    shared = self._token_shared(index, block, unit, list(rank))
                    inputs: list[tuple[tuple, dict]] = []
                    if shared is not None:  # every process computes every batch, a share of its tokens
                        (run, targets), mine = shared, range(len(rank))
                        done["token_shares"] = self.sharing.world
                    else:
                        inputs, earlier = self._unit_inputs(index, block, unit, torch.float32,
                                                            self._units[:k] if self._additive else ())
                        if self._additive:
                            self._residual_targets(k, earlier, dense_sum)
                        del earlier
                        run = lambda i: block_hidden(unit.module(*inputs[train[i]][0],  # noqa: E731
                                                                 **inputs[train[i]][1]))
                        targets, mine = [unit.targets[j] for j in train], [rank[self.positions[j]] for j in train]
                    data = FitData(run, targets, mine, len(rank), channel_weights(unit.targets, self.all_reduce))
                    result = fit_masked(data, trained, options, FitSharing(self.all_reduce, lanes), bar.update, kept)
                    inputs = []  # the closure of run reads it: emptied, not deleted
                    del run, targets
                    done["steps"] += result.steps
                    done["train_dtype"] = result.dtype
                    unit.targets.clear()
        finally:
            bar.close()
        return done

    def _token_shared(self, index: int, block: nn.Module, unit: _Unit, train: list[int]
                      ) -> tuple[Callable[[int], Tensor], Sequence[Tensor]] | None:
        """With several processes, one lane and the whole block to fit, the batches of every
        step shared out by tokens (:mod:`.token_shares`): ``run(i)`` and ``targets[i]`` bring
        training batch ``train[i]`` from the process that holds it (collectives, called in the
        same order on every process) and give this process's token share of the block's output
        and of its dense output. None where the steps train on the process that holds their
        batch: one process, several lanes, submodules, or batches of different shapes or of
        fewer tokens than processes."""
        sharing = self.sharing
        if sharing is None or sharing.world < 2 or self.options.lanes != 1 or unit.name != "":
            return None
        local = {g: j for j, g in enumerate(self.positions)}
        shape = {tuple(self.pruned[local[g]].shape) for g in train if g in local}
        shapes = set().union(*sharing.gather(shape))
        if len(shapes) != 1 or len(next(iter(shapes))) < 2 or next(iter(shapes))[-2] < sharing.world:
            return None
        shape = next(iter(shapes))
        if not all(sharing.gather((index, shape) in self.inputs.calls)):
            return None
        length = shape[-2]
        device = self.dense[0].device if self.dense else torch.device("cpu")
        like = torch.empty(shape, dtype=torch.float32, device=device)
        call = self._call(index, like)
        call = BlockCall(_cast(call.args, torch.float32), _cast(call.kwargs, torch.float32), call.hidden_as_kwarg)
        layers = dict(self._active)
        mine = [g for g in train if g in local]
        with torch.no_grad():
            probe = self.pruned[local[mine[0]]].float() if mine else None
            reach = layer_reach(lambda: run_block(block, probe, call), layers, length) if mine else {}
        reach = widest([r for r in sharing.gather(reach) if r])
        share = token_shares(length, sharing.world, token_cost(layers, reach))[sharing.rank]
        with torch.no_grad():
            attention = attention_on_share(lambda: run_block(block, probe, call), layers, reach, share, length,
                                           share_attention_candidates(block, layers, reach)) if mine else []

        def fetch(values: list[Tensor], g: int) -> Tensor:
            j = local.get(g)
            t = values[j].float() if j is not None else torch.empty(shape, dtype=torch.float32, device=device)
            sharing.broadcast(t, sharing.owner(g))
            return t

        def run(i: int) -> Tensor:
            h = fetch(self.pruned, train[i])
            with computing_share(layers, reach, share, length, attention):
                return run_block(block, h, call)[..., share.start:share.stop, :]

        class Targets(Sequence):
            def __len__(self) -> int:
                return len(train)

            def __getitem__(self, i: int) -> Tensor:
                return fetch(unit.targets, train[i])[..., share.start:share.stop, :]

        return run, Targets()

    @staticmethod
    def _improved(before: tuple[float | None, float | None], after: tuple[float, float | None]) -> bool:
        """Whether trained weights with errors ``after`` (training, held-out) beat the solved
        ones with ``before`` (:meth:`_deciding_error`): on the held-out batches, or on the
        training ones without."""
        return after[1] < before[1] if before[1] is not None else after[0] < before[0]

    def advance(self, index: int, block: nn.Module) -> dict[str, Any]:
        """Fit the submodels of block ``index`` in order (pruned weights already in it),
        then move the pruned stream past it. Returns the block's record: the channel-weighted
        squared error of its outputs relative to the dense ones before and after, on the
        held-out batches (``heldout_before``, ``heldout_after``; None with a single batch) and
        on the training ones (``error_before``, ``error_after``; the solved weights' training
        error ``error_before`` is computed only where it decides, with a single batch, or
        where the solve is kept, and is None otherwise), the errors the
        trained weights reached (``error_trained``, ``heldout_trained``), and ``kept``:
        ``"reconstructed"``, or ``"solved"`` when training did not lower the held-out error
        (the training error with a single batch; the solved weights are then restored, and
        the block's outputs recomputed from its pruned inputs, which wait in a
        :class:`Spill` meanwhile), and ``token_shares``: how many processes computed each
        training step together (1: each step on the process holding its sample), and
        ``train_dtype``: the dtype training computed in (:func:`~nmprune.reconstruct.training_dtype`)."""
        started = time.perf_counter()
        if self.solved is not None:  # the block holds its solved weights until the fit
            self.solved = [run_block(block, h, self._call(index, h)) for h in self.solved]
        error_before, held_before = self._deciding_error(index, block)
        weights = [w for u in self._units for w in self._weights(u)]
        # the solved weights, kept compact (their nonzeros and where they are) while training
        where = {id(w): KeptEntries(w) for w in weights}
        solved, entering = Spill(self.scratch), Spill(self.scratch)
        try:
            for w in weights:
                solved.append(where[id(w)].gather(w))
            try:
                training = self._fit(index, block, where)
                after, error_after, held_after = self._propagate(index, block, spill=entering)
                if not error_after < float("inf") or (held_after is not None and not held_after < float("inf")):
                    raise ReconstructionDiverged(f"the reconstructed block's error is {error_after}; "
                                                 f"lower the learning rate (now {self.options.lr:g})")
            except (ReconstructionDiverged, NonFiniteModel) as e:
                raise type(e)(f"block {index}: {e}") from e
            kept, trained = "reconstructed", (error_after, held_after)
            if not self._improved((error_before, held_before), (error_after, held_after)):
                del after
                with torch.no_grad():
                    for i, w in enumerate(weights):
                        where[id(w)].scatter(solved[i], w.zero_())
                self.pruned = [entering[j] for j in range(len(entering))]
                after, error_after, held_after = self._propagate(index, block)
                error_before, kept = error_after, "solved"  # the solved weights' errors, now on every batch
        finally:
            solved.close()
            entering.close()
        self.pruned = after
        self._units, self._dense_in = [], []
        return {"block": index, "reconstruct": self.granularity, "targets": self._targets_kind(),
                "error_before": error_before, "error_after": error_after,
                "heldout_before": held_before, "heldout_after": held_after,
                "error_trained": trained[0], "heldout_trained": trained[1],
                "heldout_batches": len(self.held), "kept": kept, **training,
                "seconds": time.perf_counter() - started}

    def end_to_end(self, head: Callable[[list[int], list[Tensor]], Iterator[tuple[Tensor, Tensor]]]
                   ) -> dict[str, Any] | None:
        """After the last block: how far the model is from the dense one on the held-out
        calibration batches, through the model's own head (``head(batches, last-block
        outputs)`` yields the ids and logits of each of this process's batches named):
        perplexities of the dense model, the solved weights alone and the model as
        reconstructed, and the mean KL divergence of the latter two's next-token distributions
        from the dense model's, over all processes. Raises :class:`ReconstructionWorse` when
        the reconstructed model is further from the dense one than the solved weights alone,
        by more than :data:`END_TO_END_MARGIN` (a few held-out batches are noisy):
        the per-block guard cannot see what only the whole model shows (the way a plain
        squared error once hid Gemma-3's collapse). None without held-out batches. After a
        resume (the solved-only stream is not checkpointed) the comparison is not made, and the
        record says so, but the dense and reconstructed models are still measured and checked:
        a dense model whose head overflows is refused (:class:`~nmprune.checks.NonFiniteModel`)
        on a resumed run too."""
        if not self.held:
            return None
        device = self.dense[0].device if self.dense else "cpu"
        streams = 2 if self.solved is None else 3  # dense, (solved,) reconstructed
        sums = torch.zeros(streams, 4, dtype=torch.float64, device=device)  # per model: nll, tokens, kl, positions
        finals = [x for i, j in enumerate(self.held_local)
                  for x in (self.dense[j], *([] if self.solved is None else [self.solved[i]]), self.pruned[j])]
        reference = None
        for k, (ids, logits) in enumerate(head([j for j in self.held_local for _ in range(streams)], finals)):
            model = k % streams
            if model == 0:
                reference = logits
            nll, count = window_nll(logits, ids)
            kl, positions = window_kl(reference, logits)
            sums[model] += torch.tensor([float(nll), float(count), float(kl), float(positions)],
                                        dtype=torch.float64, device=device)
            del ids, logits, nll, kl
        del reference
        self.all_reduce([sums])
        ppl = [perplexity_from_nll(float(s[0] / s[1])) if s[1] > 0 else float("nan") for s in sums]
        kl = [float(s[2] / s[3]) if s[3] > 0 else float("nan") for s in sums]
        if not math.isfinite(ppl[0]):
            raise NonFiniteModel("the dense model's next-token distribution on the held-out calibration "
                                 f"text is not finite (perplexity {ppl[0]}): its last layers or head overflow "
                                 "(a weight too large for its dtype?); check the model's weights, or use "
                                 "--dtype float32")
        if self.solved is None:
            return {"checked": False, "why": "resumed: the held-out batches' stream through the solved weights "
                                             "alone is not in the checkpoint", "batches": len(self.held),
                    "tokens": int(sums[0, 1]), "dense": ppl[0], "reconstructed": ppl[1], "kl_reconstructed": kl[1]}
        record = {"checked": True, "batches": len(self.held), "tokens": int(sums[0, 1]),
                  "dense": ppl[0], "solved": ppl[1], "reconstructed": ppl[2],
                  "kl_solved": kl[1], "kl_reconstructed": kl[2]}
        if not kl[2] <= END_TO_END_MARGIN * kl[1]:
            raise ReconstructionWorse(
                f"reconstruction moved the model away from the dense one on the held-out calibration "
                f"batches: KL divergence {kl[2]:.4g} against {kl[1]:.4g} with the solved weights alone "
                f"(more than {END_TO_END_MARGIN:g}x) "
                f"(perplexity {ppl[2]:.4g} against {ppl[1]:.4g}, dense {ppl[0]:.4g}), although every "
                f"block it kept lowered its own held-out error; rerun with --reconstruct none --restart "
                f"for the solved model")
        return record


def reconstruction_needs(run: RunShape) -> StageNeeds:
    """What :class:`ReconstructingStatistics` needs on one rank beyond the statistics it
    collects (:func:`~nmprune.stages.statistics.statistics_needs`, whose two sets of hidden
    states it replaces). Its streams of the rank's hidden states: two with ``block`` (the dense
    stream, also the targets, and the pruned stream, whose states in wait on disk while its
    states out are computed), four with ``submodule`` (whose targets are their own), and the
    pruned stream in float32 besides for a model narrower than float32. While a block trains:
    the block in float32, 16 bytes per kept entry of its pruned weights (the position and
    :class:`~nmprune.reconstruct.CompactAdamW`'s compact gradient and two moments; the solved
    weights' backup waits on disk) and 4 more per lane the rank computes when there are
    several, one layer's dense gradient and autograd's activations of one batch. Its time: the
    pass before training over the held-out batches (:meth:`ReconstructingStatistics._deciding_error`;
    every batch where none is held out), the pass after it over all, each on the rank's share,
    and the training,
    3 passes' work per epoch at the training rate: for whole blocks in one lane (the default)
    every step's sample is shared by tokens, the busiest rank's share of the work
    (:func:`~nmprune.stages.token_shares.busiest_token_share`); otherwise a round runs the
    batches of every lane's step on the ranks that hold them, so ranks beyond the round's
    batches wait (:mod:`nmprune.reconstruct`). Every step costs each rank more than its
    products (:class:`~nmprune.stages.needs.StepCosts`): the passes' work on each trained
    weight, which token shares do not divide, the optimiser's step on the kept entries, and
    with several ranks the sum of the compact float32 gradients and, for token shares, the
    broadcast of the step's inputs and targets."""
    s, fit = run.settings, run.settings.fit_options()
    sets = {"block": 2, "submodule": 4}[s.reconstruct]
    streams = run.rank_tokens * run.hidden_size * (run.itemsize * sets + (4 if run.itemsize < 4 else 0))
    slots = 0 if fit.lanes == 1 else -(-fit.lanes // run.ranks)
    pruned = max(sum(block[n][0] * block[n][1] for n in run.pruned(block)) for block in run.per_block)
    training = ((4 - run.itemsize) * max(run.block_params) + pruned * (16 + 4 * slots) * run.kept
                + 4 * max(r * d for r, d in run.shapes.values())
                + run.batch_tokens * (16 * run.hidden_size + 4 * run.intermediate) * 4)
    tokens_shared = s.reconstruct == "block" and fit.lanes == 1
    if tokens_shared:
        share = busiest_token_share(run.shapes, run.ranks)
    else:
        batches = fit.lanes * fit.batches_per_step
        share = -(-batches // run.ranks) / batches
    work = 3 * fit.epochs * run.forward * share
    calibration_batches = -(-s.nsamples // s.batch_size)
    held = len(held_out_batches(calibration_batches))
    deciding = held / calibration_batches or 1.0
    # every step's costs beside its products, on every rank (each takes every step); the
    # weights' own passes on the ranks that compute the step's batches (all of them where
    # they share its tokens)
    train = calibration_batches - held
    steps = fit.epochs * epoch_steps([lane_of(g, train, fit.lanes) for g in range(train)], fit.batches_per_step)
    cost = run.step_costs
    stepping = 0.0
    for block in run.per_block:
        weights = sum(block[n][0] * block[n][1] for n in run.pruned(block))
        entries = weights * run.kept
        stepping += (weights * cost.per_parameter * (1.0 if tokens_shared else share) + entries * cost.per_entry
                     + cost.all_reduce(4 * entries, run.ranks)
                     + (cost.broadcast(2 * 4 * run.batch_tokens * run.hidden_size, run.ranks) if tokens_shared else 0))
    return StageNeeds(block_bytes=training, stream_bytes=streams,
                      seconds={"reconstruction": work / run.train_rate + steps * stepping
                               + (1 + deciding) * run.forward / run.ranks / run.rate})
