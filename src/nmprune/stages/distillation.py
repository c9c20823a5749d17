"""The optional global distillation stage: once every block is pruned (and reconstructed),
train the kept weights of every pruned layer of the whole model, the masks held, towards the
dense model's next-token distribution on the calibration set (:mod:`nmprune.distill`;
docs/methods.md "Global distillation").

The pass trains on the run's calibration windows and on windows drawn for it alone
(``distill_nsamples``). On the run's windows the dense distribution comes from the dense hidden
states the reconstruction carries to the last block, through the model's head
(:func:`teacher`): no second model is held. On its own windows it comes from the whole dense
model before the first block is pruned (:func:`dense_teachers`). Training is
:func:`~nmprune.reconstruct.fit_masked` on the whole model with the top-k KL divergence as its
loss, one sample a step, data-parallel over processes like the reconstruction. The batches
that reconstruction holds out (:func:`~nmprune.stages.reconstruction.held_out_batches`) are
held out here too, with as large a share of the pass's own windows: the trained weights are
kept only if they lower the divergence there; otherwise every pruned layer gets its weights
from before the pass back.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from functools import partial
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..checkpoint import pass_part_name, write_tensors
from ..checks import NonFiniteModel
from ..devices import products_in
from ..distill import DISTILL_TOPK, TeacherTopK, teacher_topk, topk_kl
from ..progress import bar as progress_bar
from ..models import find_blocks
from ..reconstruct import (FitData, FitOptions, FitProgress, FitResult, FitSharing, FitState, KeptEntries,
                           ReconstructionDiverged, epoch_steps, fit_masked, local_part, most_over_processes, narrowed,
                           shard_of, training_dtype)
from .block_fit import float32_training
from .needs import RunShape, StageNeeds
from .reconstruction import Spill, held_out_batches


#: the longest windows for which the pass computes attention by transformers' eager path,
#: on the CPU with products in bfloat16, where the model asks for sdpa: through SmolLM2 on 512
#: tokens, eager's training step (forward and backward) takes 1.00 s against sdpa's 1.22 s and
#: its forward without gradients 308 ms against 374 (medians, AMD EPYC znver5, 2 threads); at
#: 1,024 tokens torch's flash kernel runs one attention twice as fast as eager's products. Eager
#: holds each block's attention probabilities for the backward pass (:func:`distill_bytes`).
EAGER_ATTENTION_MAX_TOKENS = 512


def uses_eager_attention(device: str, bfloat16: bool, tokens: int) -> bool:
    """Whether the pass computes attention by the eager path on a ``device`` kind, with its
    products in bfloat16 or not, on windows of ``tokens`` (:data:`EAGER_ATTENTION_MAX_TOKENS`)."""
    return device == "cpu" and bfloat16 and tokens <= EAGER_ATTENTION_MAX_TOKENS


@contextmanager
def pass_attention(model: nn.Module, device: torch.device, dtype: torch.dtype | None,
                   tokens: int) -> Iterator[None]:
    """Inside, ``model`` computes attention by transformers' eager path where
    :func:`uses_eager_attention` says so and the model asks for sdpa; as before afterwards."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    switch = current == "sdpa" and uses_eager_attention(device.type, dtype == torch.bfloat16, tokens)
    if switch:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(current)


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextmanager
def checkpointed(model: nn.Module) -> Iterator[None]:
    """Inside, each decoder block of ``model`` keeps only its inputs for the backward pass and
    computes its activations again there (activation checkpointing, ``torch.utils.checkpoint``,
    Chen et al., arXiv 1604.06174): autograd then holds one block's activations and every
    block's input, at the cost of a second forward pass per step. The model must be called
    with ``use_cache=False`` (a cache would grow in the recomputation)."""
    blocks = find_blocks(model)[1]
    for block in blocks:
        block.forward = partial(_recomputed, block.forward)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


@dataclass(frozen=True)
class PassMemory:
    """How the pass holds its memory, as the run's plan decides
    (:func:`nmprune.resources.plan_run`): each decoder block's activations recomputed in the
    backward pass (``checkpointed``, :func:`checkpointed`); sharded over several ranks, each
    rank's rows of the weights and of their training state kept in CPU memory between uses
    (``offloaded``: FSDP2's ``CPUOffloadPolicy``, :mod:`~nmprune.stages.sharded_pass`)."""

    checkpointed: bool = False
    offloaded: bool = False


#: the parts of the pass's memory (:func:`distill_parts`), as its refusal names them
PASS_PARTS = ("the weights and their training state", "one batch's activations and logits",
              "the dense distribution of its windows")


#: seconds of training between two saves of the pass's progress (:class:`SavedPass`): a kill
#: loses at most this much of it; each save writes about 12 bytes a kept entry (SmolLM2: 0.6 GB)
SAVE_SECONDS = 600.0


class SavedPass:
    """The pass's progress in the run's checkpoint (:class:`~nmprune.reconstruct.FitProgress`):
    saved every :data:`SAVE_SECONDS` of training (by rank 0's clock), between two rounds. Every
    rank holds the same weights and optimiser state: rank 0 saves them, and a resumed run's
    ranks take them from rank 0. ``sharded`` over the ranks
    (:mod:`~nmprune.stages.sharded_pass`), each rank holds its rows: each writes its part
    into rank 0's checkpoint folder (:func:`~nmprune.checkpoint.pass_part_name`; the ranks
    share a file system, as for the streamed shards), and rank 0 records every part in one
    manifest write (:meth:`~nmprune.checkpoint.Checkpoint.save_pass_parts`); a resumed run on
    as many ranks takes each rank's part up again. A saved state is taken up only by a pass
    of the same ``key`` (its settings and windows) on as many ranks; another starts afresh."""

    def __init__(self, checkpoint: Any, key: str, executor: Any, sharded: bool = False):
        self.checkpoint, self.key, self.executor, self.sharded = checkpoint, key, executor, sharded
        self.last = time.monotonic()
        self.resumed_from: int | None = None
        # where every rank writes its part: rank 0's checkpoint folder (None: no checkpoint)
        self.folder = executor.broadcast_object(None if checkpoint is None else str(checkpoint.directory)) \
            if sharded else None

    def _resume_parts(self, like: dict[str, Tensor]) -> FitState | None:
        """:meth:`resume` of a sharded pass: each rank's part of the saved turn, if every rank
        finds its own (the files rank 0's checkpoint listed and checked when it was opened)."""
        state = self.checkpoint.get("distillation") if self.checkpoint is not None else None
        fits = state is not None and state.get("key") == self.key and state.get("ranks") == self.executor.world
        state = self.executor.broadcast_object(state if fits else None)
        if state is None or self.folder is None:
            return None
        path = Path(self.folder) / pass_part_name(state["turn"], self.executor.rank)
        tensors = load_file(str(path)) if path.is_file() else {}
        whole = set(tensors) == set(like) and all(tensors[k].shape == like[k].shape for k in like)
        if not all(self.executor.per_rank(whole)):
            return None
        self.resumed_from = state["steps"]
        return FitState(state["epoch"], state["round"], state["epoch_steps"], state["steps"], state["epoch_mse"],
                        {k: v.to(like[k].device) for k, v in tensors.items()})

    def resume(self, like: dict[str, Tensor]) -> FitState | None:
        if self.sharded:
            return self._resume_parts(like)
        saved = self.checkpoint.saved_pass() if self.checkpoint is not None else None
        state = saved[1] if saved is not None and saved[1].get("key") == self.key else None
        state = self.executor.broadcast_object(state)
        if state is None:
            return None
        tensors = {k: v.to(like[k].device) for k, v in saved[0].items()} if saved is not None else \
            {k: torch.empty_like(v) for k, v in like.items()}
        self.executor.broadcast_tensors([tensors[k] for k in sorted(like)])
        self.resumed_from = state["steps"]
        return FitState(state["epoch"], state["round"], state["epoch_steps"], state["steps"], state["epoch_mse"],
                        tensors)

    def due(self) -> bool:
        due = self.checkpoint is not None and time.monotonic() - self.last >= SAVE_SECONDS
        # sharded, every rank saves its part at once
        return self.executor.broadcast_object(due) if self.sharded and self.folder is not None else due

    def save(self, state: FitState) -> None:
        record = {"key": self.key, "epoch": state.epoch, "round": state.round, "epoch_steps": state.epoch_steps,
                  "steps": state.steps, "epoch_mse": state.epoch_mse}
        if self.sharded:
            turn = self.executor.broadcast_object(self.checkpoint.next_pass_turn() if self.checkpoint else None)
            name = pass_part_name(turn, self.executor.rank)
            parts = self.executor.per_rank((name, write_tensors(Path(self.folder) / name, state.tensors)))
            if self.checkpoint is not None:
                self.checkpoint.save_pass_parts(dict(parts), {**record, "turn": turn, "ranks": self.executor.world})
        else:
            self.checkpoint.save_pass(state.tensors, record)
        self.last = time.monotonic()


def _tokens(batches: Sequence[Tensor]) -> int:
    return max((b.shape[-1] for b in batches), default=0)


def teacher(logits: Iterable[tuple[Tensor, Tensor]], k: int) -> list[TeacherTopK]:
    """The dense model's ``k`` most likely tokens per position of each batch, from its
    ``(ids, logits)`` (one batch at a time: only ``k`` entries a position are kept)."""
    return [teacher_topk(batch_logits, k) for _, batch_logits in logits]


def dense_teachers(model: nn.Module, batches: Sequence[Tensor], k: int, device: torch.device,
                   dtype: torch.dtype | None = None) -> list[TeacherTopK]:
    """The ``k`` most likely tokens per position of each of ``batches`` (token ids) under the
    whole ``model`` (still dense), which visits ``device`` meanwhile; kept on the CPU. With
    ``dtype`` (the dtype the pass trains in, :func:`~nmprune.reconstruct.training_dtype`) the
    products run under autocast to it: on SmolLM2 bfloat16 moves the teacher by a KL divergence
    of 0.0007 per position from float32's, beside the 0.5 the pass starts from, at half the time
    (and attention as :func:`pass_attention` computes it)."""
    model.to(device)
    try:
        with torch.no_grad(), products_in(device, dtype), pass_attention(model, device, dtype, _tokens(batches)):
            return [teacher_topk(model(b.to(device)).logits, k).to("cpu") for b in batches]
    finally:
        model.to("cpu")


def mean_divergence(model: nn.Module, batches: Sequence[Tensor], teachers: Sequence[TeacherTopK],
                    which: Sequence[int], all_reduce: Callable[[Sequence[Tensor]], None], device: torch.device,
                    dtype: torch.dtype | None = None) -> float:
    """The mean top-k KL divergence per position over this process's batches ``which`` and
    every other process's (no gradient), the products under autocast to ``dtype`` if given.
    A ``model`` sharded over the processes (:mod:`~nmprune.stages.sharded_pass`) runs as many
    batches on each (its first batch again, not counted, where it has fewer): FSDP's
    collectives must pair up."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    shard = shard_of(next(model.parameters()))
    rounds = len(which) if shard is None else most_over_processes(len(which), shard, all_reduce, device)
    with torch.no_grad(), products_in(device, dtype):
        for r in range(rounds):
            j = which[r] if r < len(which) else 0
            kl, count = topk_kl(model(batches[j].to(device), use_cache=False).logits, teachers[j].to(device))
            if r < len(which):
                sums += torch.tensor([float(kl), float(count)], dtype=torch.float64, device=device)
    all_reduce([sums])
    return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")


@dataclass(frozen=True)
class PassWindows:
    """The windows of the pass on this process: ``batches`` (token ids) and ``teachers``,
    their dense distribution; ``positions``, their indices among all processes' ``total``;
    and ``held``, the indices among ``total`` held out of training to judge it."""

    batches: Sequence[Tensor]
    teachers: Sequence[TeacherTopK]
    positions: Sequence[int]
    total: int
    held: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PassRuntime:
    """What the pass runs with: ``all_reduce`` sums tensors over the processes in place,
    ``device`` computes, ``scratch`` is a folder where the solved weights wait while the pass
    trains (:class:`~nmprune.stages.reconstruction.Spill`; None: in memory), and ``progress``
    shows a bar of the steps."""

    all_reduce: Callable[[Sequence[Tensor]], None]
    device: torch.device
    scratch: str | os.PathLike | None = None
    progress: bool = False


class _PassRun:
    """One call of :func:`distill`: which of the windows train and which judge, the kept
    entries of the trained weights, and the three steps: judge, train, restore."""

    def __init__(self, model: nn.Module, weights: Sequence[Tensor], windows: PassWindows, options: FitOptions,
                 runtime: PassRuntime):
        self.model, self.weights, self.windows, self.options, self.runtime = model, weights, windows, options, runtime
        held, positions = windows.held, windows.positions
        held_local = [j for j, g in enumerate(positions) if g in held]
        self.train = [j for j, g in enumerate(positions) if g not in held]
        # each training window's index among all processes' training windows
        self.order = {g: r for r, g in enumerate(g for g in range(windows.total) if g not in held)}
        self.low = training_dtype(options.precision, weights)  # the held-out judgement computes as training does
        # sharded over processes (:mod:`~nmprune.stages.sharded_pass`), each trains its rows
        self.sharded = bool(weights) and shard_of(weights[0]) is not None
        self.where = [KeptEntries(local_part(w)) for w in weights]
        # nothing held out (a single batch, trained on): the training batches judge the pass
        self.judge = held_local if held else self.train

    def divergence(self) -> float:
        """The mean divergence on the judging windows, over all processes (:func:`mean_divergence`)."""
        w, rt = self.windows, self.runtime
        return mean_divergence(self.model, w.batches, w.teachers, self.judge, rt.all_reduce, rt.device, self.low)

    def fit(self, checkpoint_blocks: bool, saved: FitProgress | None) -> tuple[FitResult, str | None]:
        """Train the weights (:func:`~nmprune.reconstruct.fit_masked`, the top-k KL divergence
        its loss), lean where the products run in bfloat16 on one process
        (:func:`~nmprune.reconstruct.narrowed`). Returns the result and why training failed
        (a learning rate too high; None where it did not)."""
        w, rt, options = self.windows, self.runtime, self.options
        rounds = len(self.order) if not self.sharded else most_over_processes(
            len(self.train), shard_of(self.weights[0]), rt.all_reduce, rt.device)
        steps = options.epochs * epoch_steps([0] * rounds, options.batches_per_step)
        bar = progress_bar(total=steps, desc="distilling the whole model", enabled=rt.progress, nested=True)
        result, diverged = FitResult(0, math.nan, math.nan, 0.0), None
        lean = self.low is not None and not self.sharded
        try:
            with float32_training(self.model, widen=self.low is None), \
                    narrowed(self.weights, self.where, self.low) if lean else nullcontext(), \
                    checkpointed(self.model) if checkpoint_blocks else nullcontext():
                data = FitData(lambda i: self.model(w.batches[self.train[i]].to(rt.device), use_cache=False).logits,
                               [w.teachers[j].to(rt.device) for j in self.train],
                               [self.order[w.positions[j]] for j in self.train], len(self.order), loss=topk_kl)
                result = fit_masked(data, self.weights, options, FitSharing(rt.all_reduce), bar.update, self.where,
                                    saved)
        except ReconstructionDiverged as e:  # the pass's own failing: the solved weights stand
            diverged = f"training diverged ({e})"
        except NonFiniteModel as e:
            raise NonFiniteModel(f"global distillation: {e}") from e
        finally:
            bar.close()
        return result, diverged

    def restore(self, solved: Spill) -> None:
        """Give every trained weight its kept entries from before the pass (``solved``) back."""
        with torch.no_grad():
            for i, (w, entries) in enumerate(zip(self.weights, self.where)):
                entries.scatter(solved[i], local_part(w).zero_())

    def record(self, result: FitResult, before: float, after: float, kept: str, diverged: str | None
               ) -> dict[str, Any]:
        """The pass's record (:func:`distill`), without its seconds."""
        options, held = self.options, self.windows.held
        return {"epochs": options.epochs, "lr": options.lr, "batches": self.windows.total, "steps": result.steps,
                "heldout_batches": len(held), "judged_on": "held-out batches" if held else "training batches",
                "heldout_before": before, "heldout_trained": after,
                "heldout_after": after if kept == "distilled" else before,
                "first_epoch_kl": result.first_epoch_mse, "last_epoch_kl": result.last_epoch_mse,
                "kept": kept, "diverged": diverged, "train_dtype": result.dtype}


def distill(model: nn.Module, weights: Sequence[Tensor], windows: PassWindows, options: FitOptions,
            runtime: PassRuntime, checkpoint_blocks: bool = False, saved: FitProgress | None = None
            ) -> dict[str, Any]:
    """Train the kept entries of ``weights`` (every pruned layer of ``model``, on
    ``runtime.device``) so that ``model``'s next-token distribution on this process's
    calibration windows (:class:`PassWindows`) approaches their teachers'; the windows
    ``windows.held`` are not trained on, and the result is kept only if it lowers the
    divergence on them. Returns the record: windows, held-out divergence before and after
    (``heldout_before``, ``heldout_after``, ``heldout_trained``: what training reached; on the
    training batches where none is held out, a single batch: ``judged_on`` says which),
    training divergence of the first and last epoch, steps, ``kept`` (``"distilled"`` or
    ``"solved"``), ``diverged`` (why the pass's training failed: a non-finite loss or
    judgement, the learning rate too high; the solved weights are then kept, None otherwise)
    and seconds. Attention is computed as :func:`pass_attention` says. A model whose own
    weights or activations are not finite (:class:`~nmprune.checks.NonFiniteModel`) is an error.

    Where the products run in bfloat16 (:func:`~nmprune.reconstruct.training_dtype`), the pass
    is lean: the trained weights are held in bfloat16 with their kept entries' rounding error
    beside them (:func:`~nmprune.reconstruct.narrowed`) and the other parameters keep their
    dtype; otherwise every parameter is float32 meanwhile. With ``checkpoint_blocks`` each
    decoder block's activations are recomputed in the backward pass (:func:`checkpointed`).
    With ``saved`` (:class:`SavedPass`) training resumes from, and saves, its progress.

    ``weights`` may be sharded over the processes with ``model``
    (:mod:`~nmprune.stages.sharded_pass`): each process then trains and restores its rows,
    the steps are data-parallel (:func:`~nmprune.reconstruct.fit_masked`), and FSDP gathers
    each block's weights in the training dtype where the lean pass would narrow them."""
    started = time.perf_counter()
    run = _PassRun(model, weights, windows, options, runtime)
    solved = Spill(runtime.scratch)
    try:
        with pass_attention(model, runtime.device, run.low, _tokens(windows.batches)):
            before = run.divergence()
            for w, entries in zip(weights, run.where):
                solved.append(entries.gather(local_part(w)))
            result, diverged = run.fit(checkpoint_blocks, saved)
            after = math.nan if diverged else run.divergence()
        if diverged is None and not after < float("inf"):
            diverged = (f"the {'held-out' if windows.held else 'training'} divergence became {after}; lower the "
                        f"learning rate (now {options.lr:g})")
        kept = "distilled" if diverged is None and after < before else "solved"
        if kept == "solved":
            run.restore(solved)
    finally:
        solved.close()
    return {**run.record(result, before, after, kept, diverged), "seconds": time.perf_counter() - started}


def distill_bytes(*args: Any, **kwargs: Any) -> int:
    """Memory of the pass on its device: the sum of :func:`distill_parts` (same arguments)."""
    return sum(distill_parts(*args, **kwargs).values())


def _gathered_bytes(block_params: int, bfloat16: bool) -> int:
    """What a pass sharded over ranks holds of whole blocks of ``block_params``: two gathered
    in the training dtype (the one computing and the next, which FSDP fetches ahead) and one
    block's float32 gradient before its reduce-scatter."""
    return block_params * (2 * (2 if bfloat16 else 4) + 4)


@dataclass(frozen=True)
class PassModelSize:
    """The sizes of the model the pass trains, as :func:`distill_parts` reads them: ``params``
    parameters, ``pruned`` of them in the trained weights, ``kept`` of those kept (a fraction),
    in the run's dtype of ``itemsize`` bytes; ``blocks`` decoder blocks of ``hidden_size``
    and MLP width ``intermediate``, the largest of ``block_params`` parameters (read only
    sharded over ranks); ``vocab`` tokens."""

    params: int
    pruned: int
    kept: float
    itemsize: int
    blocks: int
    hidden_size: int
    intermediate: int
    vocab: int
    block_params: int = 0


@dataclass(frozen=True)
class PassBatch:
    """What the pass holds of its windows on a rank, as :func:`distill_parts` reads it: the
    ``tokens`` of one batch, the ``positions`` of all the rank's windows (their dense
    distribution), and ``attention`` bytes of attention probabilities per block of one batch
    (eager attention's, :func:`pass_attention`; 0 else)."""

    tokens: int
    positions: int = 0
    attention: int = 0


def distill_parts(model: PassModelSize, batch: PassBatch, lean: bool, checkpointed: bool, ranks: int = 1
                  ) -> dict[str, int]:
    """Memory of the pass on its device by part (:data:`PASS_PARTS`: the weights and the
    training state, one batch's activations and logits, the dense distribution of the rank's
    windows), for a model of ``model``'s sizes and ``batch``'s windows. The weights: the lean
    pass (``lean``, products in bfloat16, :func:`distill`) holds the trained ones in bfloat16
    and the others in their dtype, else every one is float32.
    Each kept entry: its position (4 bytes), compact gradient and AdamW's first moment (in the
    trained weights' dtype), second moment (float32) and, lean, its rounding error (bfloat16):
    14 bytes lean, 16 else (the solved values the pass may restore go to disk,
    :class:`~nmprune.stages.reconstruction.Spill`). Autograd's activations of one batch:
    through every block, with the batch's attention probabilities per block, or,
    ``checkpointed``, every block's input and one block's activations (:func:`checkpointed`).
    Its logits twice over (they and their gradient, float32 at most;
    :func:`~nmprune.distill.topk_kl` reads them a few rows at a time), and the dense
    distribution of the rank's positions (DISTILL_TOPK tokens of 8 bytes each).

    Sharded over ``ranks`` > 1 (:mod:`~nmprune.stages.sharded_pass`): the rank's rows of every
    parameter in float32, and of each kept entry's position, compact gradient and two
    moments (16 bytes, float32), beside two blocks of ``block_params`` gathered whole in the
    training dtype (the one computing and the next, which FSDP fetches ahead) and one
    block's whole float32 gradient before its reduce-scatter."""
    params, pruned, itemsize = model.params, model.pruned, model.itemsize
    if ranks > 1:
        weights, lean = 4 * params // ranks + _gathered_bytes(model.block_params, lean), False
        pruned = pruned / ranks
    else:
        weights = pruned * 2 + (params - pruned) * itemsize if lean else 4 * params
    tokens = batch.tokens
    block = tokens * (16 * model.hidden_size + 4 * model.intermediate) * 4 + batch.attention
    activations = block + model.blocks * tokens * model.hidden_size * 4 if checkpointed else model.blocks * block
    state, logits, windows = PASS_PARTS
    return {state: int(weights + pruned * model.kept * (14 if lean else 16)),
            logits: int(activations + 2 * tokens * model.vocab * 4),
            windows: int(batch.positions * min(DISTILL_TOPK, model.vocab) * 8)}


#: bytes a second between CPU and device memory for a pass whose state is offloaded
#: (:class:`PassMemory`; an estimate for PCIe 4 x16, not yet measured)
OFFLOAD_BYTES_PER_SECOND = 2.0e10
#: seconds of an offloaded step on the CPU per kept entry of the rank (AdamW on the compact
#: state; an estimate from the CPU's reconstruction step, resources.STEP_COSTS, not yet measured)
OFFLOADED_SECONDS_PER_ENTRY = 4e-9


def distillation_needs(run: RunShape, epochs: int, windows: int, checkpointed: bool = False,
                       offloaded: bool = False) -> StageNeeds:
    """What ``epochs`` of the pass on ``windows`` calibration windows (the run's and its own)
    need on one rank, its decoder blocks ``checkpointed`` or not (:func:`checkpointed`): its
    own peak (:func:`distill_bytes`, on the rank's share of the windows), and its time at the
    training rate, shared out between the ranks: the dense model's forward pass on the pass's
    own windows, the forward pass on the held-out batches before and after training (the
    reconstruction's and as large a share of the pass's own,
    :func:`~nmprune.stages.reconstruction.held_out_batches`), and the forward and backward
    passes on every other batch each epoch (with a second forward pass, checkpointed).
    ``offloaded`` (sharded over several ranks, :class:`PassMemory`): the weights and their
    training state move to the rank's CPU memory (``host_bytes``), and each step also moves
    the rank's rows of the parameters to the device twice (forward and backward) and its
    gradients back, and takes its optimiser step on the CPU
    (:data:`OFFLOAD_BYTES_PER_SECOND`, :data:`OFFLOADED_SECONDS_PER_ENTRY`)."""
    s = run.settings
    pruned = sum(block[n][0] * block[n][1] for block in run.per_block for n in run.pruned(block))
    # eager attention's probabilities of one batch: in float32 and their bfloat16 copy
    eager = uses_eager_attention(run.device, run.trains_in_bfloat16, s.seqlen)
    attention = 6 * s.batch_size * run.attention_heads * s.seqlen ** 2 if eager else 0
    sizes = PassModelSize(run.params, pruned, run.kept, run.itemsize, len(run.per_block), run.hidden_size,
                          run.intermediate, run.vocab_size, max(run.block_params))
    parts = distill_parts(sizes, PassBatch(run.batch_tokens, -(-windows // run.ranks) * s.seqlen, attention),
                          run.trains_in_bfloat16, checkpointed, run.ranks)
    own_tokens = s.distill_extra_windows() * s.seqlen
    run_batches, own_batches = -(-s.nsamples // s.batch_size), -(-(windows - s.nsamples) // s.batch_size)
    held = len(held_out_batches(run_batches)) + len(held_out_batches(own_batches))
    per_step = 4 if checkpointed else 3  # forward passes' worth of one batch's training step
    passes = per_step * epochs * (run_batches + own_batches - held) + 2 * held  # of one batch, forward
    seconds = (2.0 * run.params * own_tokens + passes * 2.0 * run.params * run.batch_tokens) / run.train_rate / run.ranks
    host = 0
    if offloaded:
        state = PASS_PARTS[0]
        gathered = _gathered_bytes(max(run.block_params), run.trains_in_bfloat16)
        host, parts = parts[state] - gathered, {**parts, state: gathered}
        steps = epochs * -(-(run_batches + own_batches - held) // run.ranks)
        seconds += steps * (12 * run.params / run.ranks / OFFLOAD_BYTES_PER_SECOND
                            + pruned * run.kept / run.ranks * OFFLOADED_SECONDS_PER_ENTRY)
    return StageNeeds(peak_bytes=sum(parts.values()), seconds={"distillation": seconds}, peak_parts=parts,
                      host_bytes=int(host))
