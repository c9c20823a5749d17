"""The reconstruction stage: after a block's layers are solved, train the kept weights of its
attention and MLP (``submodule``) or of the whole block (``block``) to reproduce the dense
model's activations (:mod:`nmprune.reconstruct`; docs/methods.md "Local reconstruction").

:class:`ReconstructingStatistics` is a statistics stage (:class:`~nmprune.stages.statistics.
StatisticsStage`) that carries two streams of hidden states through the model: the dense
model's (the targets, and the layers' statistics with ``hessian_inputs="dense"``) and the
pruned model's (the inputs of every reconstruction, and the statistics with ``"pruned"``).
:meth:`~ReconstructingStatistics.collect` records, while the dense block runs, the dense
output of every submodel it will fit (the one forward pass both share, docs/architecture.md);
:meth:`~ReconstructingStatistics.advance` fits them in order on the pruned stream
(:class:`~.block_fit.BlockFit`, whole blocks' steps shared by tokens over the processes by
:class:`~.block_fit.TokenSharedSteps`), keeps the fit only if it lowers the block's held-out
error, and moves that stream past the reconstructed block; after the last block
:meth:`~ReconstructingStatistics.end_to_end` checks the whole model
(:class:`~.end_to_end.EndToEndCheck`). The submodels of ``submodule`` are the block's direct
children that hold a pruned layer, in the order the block calls them (attention, then MLP, in
the Llama, Qwen2, Mistral and Gemma families; a family whose MLP matrices are direct children
of the block, such as OPT's ``fc1``/``fc2``, fits them one by one).
:func:`reconstruction_needs` states what the stage needs beyond the statistics it collects
(:mod:`.needs`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from ..checks import NonFiniteModel
from ..reconstruct import KeptEntries, ReconstructionDiverged, channel_weights, epoch_steps, lane_of
from .block_fit import BlockFit, CalibrationShare, FitBlock, FitUnit, ReconstructionSettings, TokenSharedSteps
from .block_runner import BlockCall, BlockInputs, block_hidden, run_block
from .end_to_end import EndToEndCheck, Head
from .needs import RunShape, StageNeeds
from .statistics import CalibrationStatistics, InputStats
from .token_shares import busiest_token_share

GRANULARITIES = ("none", "submodule", "block")
RECONSTRUCTION_TEXT = {  # what `nmprune methods` says of each granularity
    "none": "no reconstruction: the layers as the method and refiner solved them",
    "submodule": "train the kept weights of each block's attention, then of its MLP, to match the "
                 "dense model's outputs of each (Wagner et al. 2025, arXiv 2510.14444)",
    "block": "train the kept weights of each whole block to match the dense block's outputs "
             "(Wanda++ arXiv 2503.04992, EBFT arXiv 2402.12419)",
}

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


class ReconstructingStatistics:
    """The statistics stage with local reconstruction (module docstring).

    ``inputs`` holds the hidden states entering the first block to collect: dense and
    pruned alike at block 0 (after a resume, :attr:`hidden` is set from the checkpoint).
    ``dtype``, ``dense_inputs`` and ``reduce`` (which sums the layer statistics over
    processes) are the statistics' own (:class:`~nmprune.stages.statistics.CalibrationStatistics`);
    ``settings`` say how each block is reconstructed (:class:`~.block_fit.ReconstructionSettings`)
    and ``share`` which calibration batches this process holds and how the processes sum and
    share their work (:class:`~.block_fit.CalibrationShare`): every process takes the same
    optimiser steps. With token sharing, whole blocks with one lane share every step's sample
    by tokens (:class:`~.block_fit.TokenSharedSteps`); otherwise a step's samples train on the
    process that holds them.

    The batches of :func:`held_out_batches` are never trained on: a block's reconstruction is
    kept only if it lowers the block's error on them. Every error, in training and in the
    report, weighs each output channel by the inverse of its dense mean square
    (:func:`~nmprune.reconstruct.channel_weights`).
    """

    def __init__(self, inputs: BlockInputs, dtype: torch.dtype, dense_inputs: bool,
                 reduce: Callable[[list[InputStats]], None], settings: ReconstructionSettings,
                 share: CalibrationShare):
        if settings.granularity not in GRANULARITIES[1:]:
            raise ValueError(f"reconstruct must be one of {', '.join(GRANULARITIES[1:])} here, "
                             f"got {settings.granularity!r}")
        # the streams own the captured hidden states: ``inputs`` keeps only the blocks' other arguments
        self.inputs = replace(inputs, hidden=[])
        self.dtype, self.dense_inputs, self.reduce = dtype, dense_inputs, reduce
        self.granularity, self.options, self.scratch = settings.granularity, settings.options, settings.scratch
        self.positions, self.total, self.all_reduce = list(share.positions), share.total, share.all_reduce
        self.held = held_out_batches(share.total)
        self.held_local = [j for j, g in enumerate(self.positions) if g in self.held]
        self.block_fit = BlockFit(self.inputs, settings, share, self.held,
                                  TokenSharedSteps(self.inputs, share, settings.options.lanes))
        self.end_to_end_check = EndToEndCheck(self.inputs, inputs.hidden, self.held_local, len(self.held),
                                              share.all_reduce)
        self.dense: list[Tensor] = list(inputs.hidden)
        self.pruned: list[Tensor] = list(inputs.hidden)
        self._block: FitBlock | None = None  # what the collection found of the block to fit
        self._weight = torch.ones(())

    @property
    def hidden(self) -> list[list[Tensor]]:
        """The two streams entering the next block: the dense and the pruned hidden states."""
        return [self.dense, self.pruned]

    @hidden.setter
    def hidden(self, saved: list[list[Tensor]]) -> None:
        self.dense, self.pruned = (list(s) for s in saved)
        self.end_to_end_check.forget()

    def _call(self, index: int, hidden: Tensor) -> BlockCall:
        return self.inputs.call(index, hidden)

    def collect(self, index: int, block: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, InputStats]:
        """The statistics of ``layers`` (from the dense or the pruned stream, per
        ``dense_inputs``); meanwhile the dense block's outputs of every submodel to fit are
        recorded and the dense stream moves past the block."""
        active = dict(layers)
        # the block's dense inputs, for the residual targets of submodules (freed after the
        # collection unless the block is additive); block targets need none
        dense_in = list(self.dense) if self.granularity == "submodule" else []
        units = self._candidates(block, active)
        order: list[FitUnit] = []
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
        additive = self.granularity == "submodule" and self._is_additive(order, dense_in)
        # only the residual targets need the block's dense inputs
        self._block = FitBlock(index, block, order, active, additive, dense_in if additive else [])
        return stats

    def _is_additive(self, units: Sequence[FitUnit], dense_in: Sequence[Tensor]) -> bool:
        """Whether the block's output is its input (``dense_in``) plus the outputs of its
        submodels ``units`` (a pre-norm residual block: Llama, Qwen, Mistral, Phi-3, GPT-2, OPT;
        not Gemma 2's post-norms), to 1e-4 of the output's norm over every process's batches."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.dense[0].device if self.dense else "cpu")
        if any(u.targets[0].shape != self.dense[0].shape for u in units):
            sums[0] = float("inf")  # a submodel of another width (OPT's fc1): not a residual branch
        for j, (x, y) in enumerate(zip(dense_in, self.dense) if sums[0] == 0 else ()):
            rest = y.float() - x.float() - sum(u.targets[j].float() for u in units)
            sums += torch.stack([rest.square().sum().double(), y.float().square().sum().double()])
        self.all_reduce([sums])
        return bool(sums[0] <= 1e-8 * sums[1])

    def _candidates(self, block: nn.Module, layers: Mapping[str, nn.Module]) -> list[FitUnit]:
        """The submodels of ``block`` to fit: the block, or its direct children holding one of
        the pruned ``layers``."""
        if self.granularity == "block":
            return [FitUnit("", block, [])]
        active = {id(m) for m in layers.values()}
        return [FitUnit(name, child, []) for name, child in block.named_children()
                if any(id(m) in active for m in child.modules())]

    @staticmethod
    def _recorder(unit: FitUnit, order: list[FitUnit]) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            if unit not in order:
                order.append(unit)
            unit.targets.append(block_hidden(out).detach())
        return hook

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

    def _targets_kind(self, block: FitBlock) -> str:
        """What the submodels were fitted to (docs/methods.md "Local reconstruction")."""
        if self.granularity == "block":
            return "block output"
        return "residual stream" if block.additive else "submodule output"

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
        self.end_to_end_check.advance(index, block)  # the block holds its solved weights until the fit
        error_before, held_before = self._deciding_error(index, block)
        fitting = replace(self._block, index=index, module=block)
        weights = fitting.weights()
        # the solved weights, kept compact (their nonzeros and where they are) while training
        where = {id(w): KeptEntries(w) for w in weights}
        solved, entering = Spill(self.scratch), Spill(self.scratch)
        try:
            for w in weights:
                solved.append(where[id(w)].gather(w))
            try:
                training = self.block_fit.fit(fitting, where, self.pruned,
                                              self.dense[0].device if self.dense else torch.device("cpu"))
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
        self._block = None
        return {"block": index, "reconstruct": self.granularity, "targets": self._targets_kind(fitting),
                "error_before": error_before, "error_after": error_after,
                "heldout_before": held_before, "heldout_after": held_after,
                "error_trained": trained[0], "heldout_trained": trained[1],
                "heldout_batches": len(self.held), "kept": kept, **training,
                "seconds": time.perf_counter() - started}

    def end_to_end(self, head: Head) -> dict[str, Any] | None:
        """After the last block: how far the model is from the dense one on the held-out
        calibration batches, through the model's own head (``head(batches, last-block
        outputs)`` yields the ids and logits of each of this process's batches named), the
        solved weights alone beside it (:meth:`~.end_to_end.EndToEndCheck.check`: raises
        :class:`~.end_to_end.ReconstructionWorse` where reconstruction made the model worse).
        None without held-out batches."""
        return self.end_to_end_check.check(head, self.dense, self.pruned)


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
