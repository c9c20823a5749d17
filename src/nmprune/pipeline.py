"""Prune a whole causal LM block by block: :func:`prune_model`.

Per decoder block (paper Section ``sec:llm_experiments``): the block source
(:mod:`nmprune.stages.source`) puts it on the compute device; the statistics stage
(:mod:`nmprune.stages.statistics`) runs this process's calibration batches through it, reduced across
processes by the executor; the executor (:mod:`nmprune.stages.executor`) solves each layer with the
plan made once for all layers (:mod:`nmprune.stages.plan`) and writes it into the block; the hidden
states move on (the dense block's outputs with ``hessian_inputs="dense"``, the paper's
default, or the pruned block's with ``"pruned"``, Appendix ``app:use_unpruned_inputs``); the
reconstruction stage (:mod:`nmprune.stages.reconstruction`, unless ``reconstruct="none"``)
trains the block's kept weights towards the dense model's activations; the
sink (:mod:`nmprune.stages.sink`) and the checkpoint keep the finished block, so a rerun resumes
after it. This module only wires the stages.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import distributed
from .checkpoint import Checkpoint
from .memory import frozen_heap, release_memory
from .config import DISTILL_SEED_OFFSET, PruneSettings
from .devices import default_device
from .distributed import DistributedExecutor, balance_window, plan_cost, split_rows, splittable
from .stages.executor import Executor, LayerJob, LocalExecutor
from .models import evaluating, set_weight_matrix, weight_matrix
from .progress import bar as progress_bar
from .progress import stage as say
from .stages.plan import LayerPlan
from .distill import DISTILL_TOPK, TeacherTopK, teacher_topk
from .stages.distillation import PassMemory, PassRuntime, PassWindows, SavedPass, distill, teacher
from .reconstruct import local_part, shard_of, training_dtype
from .stages.reconstruction import (CalibrationShare, ReconstructingStatistics, ReconstructionSettings,
                                    held_out_batches)
from .stages.sharded_pass import sharded_options
from .stages.sink import BlockSink, ModelSink
from .stages.source import BlockSource, ModelBlocks
from .stages.block_runner import BlockInputs
from .stages.statistics import CalibrationStatistics, InputStats, PrecomputedStatistics, StatisticsStage

@dataclass
class PruneReport:
    """What :func:`prune_model` did: settings, one record per layer, timings (seconds)."""

    settings: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    resumed_from_block: int = 0
    ranks: int = 1
    blocks: list[dict[str, Any]] = field(default_factory=list)
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    end_to_end: dict[str, Any] | None = None
    distillation: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_ids(calibration: Tensor) -> None:
    if not isinstance(calibration, Tensor) or calibration.ndim != 2 or calibration.dtype != torch.long:
        raise ValueError("calibration must be a LongTensor of token ids with shape (nsamples, seqlen)")


def _calibration(vocab: int, tokenizer: Any, settings: PruneSettings,
                 calibration: Tensor | None) -> Tensor:
    if calibration is None:
        if tokenizer is None:
            raise ValueError("prune_model needs a tokenizer (to build calibration text) or "
                             "calibration= token ids of shape (nsamples, seqlen)")
        from .data import calibration_batch

        calibration = calibration_batch(tokenizer, source=settings.calib, nsamples=settings.nsamples,
                                        seqlen=settings.seqlen, seed=settings.seed)
    _check_vocab(calibration, vocab, "calibration")
    return calibration


def _check_vocab(ids: Tensor, vocab: int, what: str) -> None:
    _check_ids(ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{what} token ids must lie in [0, {vocab}) (the model's vocabulary)")


def distill_windows(tokenizer: Any, settings: PruneSettings) -> Tensor | None:
    """The calibration windows the global distillation trains on besides the run's own
    (:meth:`~nmprune.config.PruneSettings.distill_extra_windows` of them, drawn from the
    calibration text with the seed plus :data:`~nmprune.config.DISTILL_SEED_OFFSET`), None
    where there are none."""
    count = settings.distill_extra_windows()
    if not count:
        return None
    from .data import calibration_batch

    return calibration_batch(tokenizer, source=settings.calib, nsamples=count, seqlen=settings.seqlen,
                             seed=settings.seed + DISTILL_SEED_OFFSET)


def _digest(t: Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


#: The blocks' bar before its ETA means anything (tqdm's default format without it).
_NO_ETA = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]"


def prune_model(model: nn.Module | None, tokenizer: Any = None, settings: PruneSettings | None = None, *,
                calibration: Tensor | None = None, device: str | torch.device | None = None,
                checkpoint: Checkpoint | None = None, progress: bool = True,
                on_block_done: Callable[[int], None] | None = None,
                hessians: dict[str, InputStats] | None = None, source: BlockSource | None = None,
                sink: BlockSink | None = None, scratch: str | os.PathLike | None = None,
                distill_calibration: Tensor | None = None, distill_memory: PassMemory = PassMemory(),
                **setting_kwargs: Any) -> PruneReport:
    """Prune every linear layer inside ``model``'s decoder blocks to N:M, in place.

    ``settings`` (or the same fields as keyword arguments: ``method``, ``refine``,
    ``pattern``, ``options``, ``overrides``, ``calib``, ``nsamples``, ``seqlen``,
    ``hessian_inputs`` ...) say how; see :class:`nmprune.config.PruneSettings`.
    ``calibration`` (token ids ``(nsamples, seqlen)``) replaces the text the tokenizer
    would make. ``device`` (default: CUDA when available) receives one block at a time;
    the model itself stays on the CPU. With ``checkpoint``, finished blocks are saved and a
    checkpoint holding finished blocks is resumed from. ``on_block_done(i)`` runs after
    block ``i`` is saved. Embeddings, norms, the LM head and tied weights are not touched.
    ``hessians`` (from :func:`collect_hessians`, dense inputs only) replaces the calibration
    forward passes, so several methods can be compared on one set of Hessians.
    ``source`` and ``sink`` replace the in-memory block source and sink built from ``model``
    (then ``None``): a :class:`nmprune.streaming.StreamingModel` and a
    :class:`nmprune.streaming.ShardedWriter` prune a model larger than memory.
    ``scratch``: a folder on disk where, with reconstruction, each block's solved weights
    wait in an unnamed temporary file while the block trains (default: in memory).
    ``distill_calibration``: token ids of the windows the global distillation trains on
    besides ``calibration`` (default: drawn from the text, :func:`distill_windows`, when
    ``calibration`` is not given; none when it is). ``distill_memory``: how the pass holds
    its memory (blocks checkpointed, state offloaded: what the run's plan decides where the
    pass would not fit without, :func:`nmprune.resources.plan_run`).

    Inside an initialised ``torch.distributed`` process group of several ranks (e.g. under
    ``torchrun``; :mod:`nmprune.distributed`) every rank calls this with the same model and
    settings: the calibration batches and layer solves are shared out, rank 0's
    ``checkpoint`` is the one used (the others' are ignored), and every rank ends with the
    same pruned model and report. ``device`` ``"cuda"`` then means ``cuda:LOCAL_RANK``.
    """
    if settings is None:
        settings = PruneSettings(**setting_kwargs)
    elif setting_kwargs:
        raise ValueError("give either settings or keyword settings, not both")
    planner = settings.planner()
    ranks = distributed.current(device)
    executor = DistributedExecutor(ranks) if ranks is not None else \
        LocalExecutor(default_device(device))
    if not executor.is_main:
        checkpoint = None
    if (model is None) == (source is None):
        raise ValueError("give either a model or a block source")
    source = source if source is not None else ModelBlocks(model)
    plans = planner.plan_layers(source.layer_shapes())
    if hessians is not None:
        _check_precomputed(settings)
    sink = sink if sink is not None else ModelSink(source)

    t_start = time.perf_counter()
    report = PruneReport(settings=asdict(settings), ranks=executor.world)
    batches, sizes, start, resumed = _setup(source, plans, settings, executor, tokenizer, calibration,
                                            checkpoint, hessians)
    report.layers, report.blocks, report.resumed_from_block = list(resumed[0]), list(resumed[1]), start
    shown = progress and executor.is_main
    saving = executor.broadcast_object(checkpoint is not None)
    loop = _BlockLoop(source, sink, plans, settings, executor, checkpoint, report, sizes, shown, on_block_done,
                      saving=saving, load=hessians is None)
    epochs = settings.distill_passes() if hessians is None else 0
    if epochs and distill_calibration is None and calibration is None:
        distill_calibration = distill_windows(tokenizer, settings)
    with evaluating(source.model), frozen_heap():
        own = None
        if epochs and distill_calibration is not None:
            _check_vocab(distill_calibration, source.vocab_size, "distill_calibration")
            with executor.phase("the dense distribution of the distillation's own windows"):
                own = _own_windows(source, plans, distill_calibration, settings, executor, checkpoint, saving,
                                   shown)
        # the finished blocks go in after the dense distribution above, which a resumed run
        # computes on the model still dense where its checkpoint holds none for these windows
        _restore(source, sink, checkpoint, start)
        if isinstance(sink, ModelSink):  # every rank's model holds them (a streaming sink holds them itself)
            executor.broadcast_tensors([m.weight for i in range(start) for m in source.layers(i).values()])
        stage = (PrecomputedStatistics(hessians) if hessians is not None else
                 _capture(source, batches, len(sizes), start, settings, executor, checkpoint, shown, scratch))
        t_capture = time.perf_counter() - t_start
        loop.run(stage, start)
        if isinstance(stage, ReconstructingStatistics):
            with executor.phase("end-to-end check of the reconstruction"):
                template = stage.inputs.output_template
                report.end_to_end = stage.end_to_end(lambda js, finals: source.head_logits(
                    template, [batches[j] for j in js], finals, executor.device))
            if epochs:
                with executor.phase("global distillation"):
                    report.distillation = _distill(source, sink, plans, stage, batches, own, epochs, settings,
                                                   executor, shown, scratch, distill_memory, checkpoint)
    report.per_rank = _per_rank(report.layers[len(resumed[0]):], executor, loop.busy["calibration_seconds"])
    report.seconds = {"capture": t_capture, "total": time.perf_counter() - t_start,
                      "layers": sum(r.get("seconds", 0.0) for r in report.layers)}
    return report


def _check_precomputed(settings: PruneSettings) -> None:
    """Refuse the settings that precomputed Hessians cannot serve."""
    if settings.hessian_inputs != "dense":
        raise ValueError("precomputed hessians come from the dense model; they cannot be used "
                         "with hessian_inputs='pruned'")
    if settings.reconstruct != "none":
        raise ValueError("reconstruction trains on calibration activations, which precomputed "
                         "hessians do not have: pass reconstruct='none' with hessians=")


def _setup(source: BlockSource, plans: dict[str, LayerPlan | None], settings: PruneSettings,
           executor: Executor, tokenizer: Any, calibration: Tensor | None, checkpoint: Checkpoint | None,
           hessians: dict[str, InputStats] | None
           ) -> tuple[list[Tensor], list[int], int, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """The calibration batches (this process's share) and every batch's size, and what a
    checkpoint resumes: the first block to prune, and the layer and block records before it
    (the finished blocks' weights are :func:`_restore`'s); the same on every rank."""
    batches: list[Tensor] = []
    sizes: list[int] = []
    with executor.phase("setup"):
        if hessians is None:
            calibration = _calibration(source.vocab_size, tokenizer, settings, calibration)
            all_batches = calibration.split(settings.batch_size)
            sizes = [b.shape[0] for b in all_batches]
            batches = executor.shard(all_batches)
            del all_batches
            release_memory()  # the tokenised corpus
        start, resumed, resumed_blocks = 0, [], []
        if checkpoint is not None:
            checkpoint.bind("calibration_sha256", _digest(calibration) if hessians is None
                            else _digest(torch.stack([hessians[n].hessian().trace() for n in plans
                                                      if n in hessians])))
            start, resumed, resumed_blocks = checkpoint.done_blocks, checkpoint.records, checkpoint.get("blocks", [])
    start, resumed, resumed_blocks = executor.broadcast_object((start, resumed, resumed_blocks))
    return batches, sizes, start, (resumed, resumed_blocks)


def _restore(source: BlockSource, sink: BlockSink, checkpoint: Checkpoint | None, start: int) -> None:
    """Write the ``start`` finished blocks' weights from rank 0's ``checkpoint`` to ``sink``."""
    if checkpoint is not None:
        for i in range(start):
            layers = source.layers(i)
            sink.write(i, checkpoint.block_weights(i, {n: m.weight.shape for n, m in layers.items()}))


@dataclass
class _BlockLoop:
    """The block loop of :func:`prune_model`: each group of blocks (:meth:`groups`) is
    collected, solved and fitted (:func:`_prune_blocks`), written to the sink and, with
    ``saving``, to rank 0's checkpoint with the streams' hidden states gathered from every
    rank; its records go into ``report``. ``load``: the blocks visit the compute device (not
    with precomputed statistics); ``busy`` accumulates this process's calibration seconds."""

    source: BlockSource
    sink: BlockSink
    plans: dict[str, LayerPlan | None]
    settings: PruneSettings
    executor: Executor
    checkpoint: Checkpoint | None
    report: PruneReport
    sizes: list[int]
    progress: bool
    on_block_done: Callable[[int], None] | None
    saving: bool
    load: bool
    busy: dict[str, float] = field(default_factory=lambda: {"calibration_seconds": 0.0})

    def groups(self, start: int) -> list[range]:
        """The groups of consecutive blocks solved together, from block ``start``: one block
        each, except with dense inputs and no reconstruction where the ranks solve whole
        layers: then as many blocks as it takes to balance them (:func:`balance_window`)."""
        shapes, plans, world = self.source.layer_shapes(), self.plans, self.executor.world
        active = [[n for n in self.source.layers(i) if plans[n] is not None] for i in range(len(self.source))]
        costs = [[plan_cost(shapes[n], plans[n], self.executor.device.type) for n in names] for names in active]
        windows = self.settings.blocks_in_windows()
        groups, i = [], start
        while i < len(self.source):
            alone = split_rows([shapes[n][0] for n in active[i]], costs[i], splittable([plans[n] for n in active[i]]),
                               world, self.executor.device.type)
            k = balance_window(costs[i:], world) if windows and not alone else 1
            groups.append(range(i, i + k))
            i += k
        return groups

    def run(self, stage: StatisticsStage, start: int) -> None:
        """Prune blocks ``start`` to the last with the statistics ``stage``."""
        # the ETA shows from the second block on: the first pays one-time costs (the
        # solvers' compilation, the first reads)
        bar = progress_bar(None, enabled=self.progress, desc="pruning blocks", initial=start,
                           total=len(self.source), bar_format=_NO_ETA)
        for group in self.groups(start):
            new, fitted = _prune_blocks(group, self.source, self.plans, stage, self.executor, self.load,
                                        self.progress, self.busy)
            self.report.layers += new
            self.report.blocks += fitted
            self._save(group, stage, new, fitted)
            bar.update(len(group))
            if group.stop - start >= 2:
                bar.bar_format = None  # tqdm's own, with the ETA
        bar.close()

    def _save(self, group: range, stage: StatisticsStage, new: list[dict[str, Any]],
              fitted: list[dict[str, Any]]) -> None:
        """Write ``group``'s blocks to the sink and the checkpoint, then release them."""
        streams = stage.hidden if self.saving else None
        hidden = [self.executor.gather_batches(s, self.sizes) for s in streams] if streams is not None else None
        del streams
        i = group.start
        with self.executor.phase(f"saving block {i}" if len(group) == 1 else f"saving blocks {i}-{group[-1]}"):
            weights = [{name: m.weight for name, m in self.source.layers(j).items()} for j in group]
            for j in group:  # no loop variable keeps the last block's weights alive
                self.sink.write(j, weights[j - i])
            if self.checkpoint is not None:
                self.checkpoint.save_blocks(i, weights, hidden, new, fitted)
            del hidden, weights
            for j in group:
                self.source.release(j)  # a streaming source drops the block's weights here
            release_memory()
            if self.on_block_done is not None:
                for j in group:
                    self.on_block_done(j)


def _capture(source: BlockSource, batches: list[Tensor], total: int, start: int, settings: PruneSettings,
             executor: Executor, checkpoint: Checkpoint | None, progress: bool,
             scratch: str | os.PathLike | None) -> StatisticsStage:
    """The statistics stage of the run (:func:`_statistics_stage`) holding this process's
    calibration ``batches`` (of ``total``) as they enter block ``start``: captured through the
    embeddings, or, resuming, the hidden states rank 0's ``checkpoint`` saved, shared out."""
    say(f"capturing the calibration inputs of block {start} ({total} batches through the embeddings)", progress)
    with executor.phase("capturing the block inputs"):
        inputs = source.capture(batches, executor.device, keep_hidden=start == 0 or executor.world > 1)
        saved = checkpoint.hidden() if start > 0 and checkpoint is not None else None
    stage = _statistics_stage(inputs, settings, executor, total, progress, scratch)
    del inputs  # the stage owns the hidden states now: each batch is freed once it moves on
    if start > 0:
        stage.hidden = [executor.scatter_batches(None if saved is None else [h.to(executor.device) for h in saved[k]],
                                                 local) for k, local in enumerate(stage.hidden)]
    return stage


def _per_rank(layers: list[dict[str, Any]], executor: Executor, calibration_seconds: float
              ) -> list[dict[str, Any]]:
    """Every rank's work in this run (resumed ``layers`` excluded): its calibration seconds
    and its share of the layer solves."""
    mine = [(r["name"], share) for r in layers if not r["skipped"]
            and (share := _my_share(r, executor.rank)) is not None]
    solve = sum(share["seconds"] for _, share in mine)
    return executor.per_rank({
        "rank": executor.rank, "busy_seconds": calibration_seconds + solve,
        "calibration_seconds": calibration_seconds, "solve_seconds": solve,
        "layer_cpu_seconds": sum(share["cpu_seconds"] for _, share in mine),
        "layers": [name for name, _ in mine]})


def _my_share(record: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """The part of a layer's solve rank ``rank`` did (seconds, CPU seconds): the whole
    layer's record, its share of the rows (``shares``), or None."""
    if record.get("shares"):
        return next((s for s in record["shares"] if s["rank"] == rank), None)
    return record if record["rank"] == rank else None


@dataclass
class _OwnWindows:
    """The global distillation's own calibration windows: this process's ``batches``, the
    dense distribution on each (``teachers``), their indices (``positions``) among all
    ``total`` of them."""

    batches: list[Tensor]
    teachers: list[TeacherTopK]
    positions: list[int]
    total: int


def _own_windows(source: BlockSource, plans: dict[str, LayerPlan | None], windows: Tensor,
                 settings: PruneSettings, executor: Executor, checkpoint: Checkpoint | None, saving: bool,
                 progress: bool) -> _OwnWindows:
    """This process's share of the distillation's own ``windows`` with the dense model's
    distribution on them (:func:`~nmprune.stages.distillation.dense_teachers`, in the dtype the
    pass trains the ``plans``' layers in), computed while the model is dense (before the
    first block is pruned, or a resumed run's finished blocks restored) and, with ``saving``,
    kept in rank 0's ``checkpoint`` (gathered from every rank) with the digest of the windows
    and the dtype; a resumed run on the same reads them from there, shared out to every rank,
    and one on others (a run that made no pass, streamed, or had other ``distill_nsamples``)
    computes them afresh."""
    every = list(windows.split(settings.batch_size))
    sizes, total = [b.shape[0] for b in every], len(every)
    batches, positions = executor.shard(every), list(executor.shard(range(total)))
    dtype = training_dtype(settings.train_precision, _pruned_weights(source.model, source, plans), executor.device)
    made_of = f"{_digest(windows)}/{dtype}"
    saved = checkpoint.teachers() if checkpoint is not None and checkpoint.get("teachers of") == made_of else None
    if executor.broadcast_object(saved is not None):
        k = min(DISTILL_TOPK, source.vocab_size)
        like = [teacher_topk(torch.zeros(*b.shape, k), k) for b in batches]  # shapes and dtypes to receive into
        logp = executor.scatter_batches(None if saved is None else [saved[f"logp_{j:06d}"] for j in range(total)],
                                        [t.logp for t in like])
        ids = executor.scatter_batches(None if saved is None else [saved[f"ids_{j:06d}"] for j in range(total)],
                                       [t.ids for t in like])
        return _OwnWindows(batches, [TeacherTopK(p.cpu(), i.cpu()) for p, i in zip(logp, ids)], positions, total)
    say(f"computing the dense model's distribution on the global distillation's {total} own windows", progress)
    teachers = source.dense_teachers(batches, DISTILL_TOPK, executor.device, dtype)
    if saving:
        logp = executor.gather_batches([t.logp for t in teachers], sizes)
        ids = executor.gather_batches([t.ids for t in teachers], sizes)
        if checkpoint is not None:
            checkpoint.save_teachers({**{f"logp_{j:06d}": t for j, t in enumerate(logp)},
                                      **{f"ids_{j:06d}": t for j, t in enumerate(ids)}}, made_of)
    return _OwnWindows(batches, teachers, positions, total)


def _distill(source: BlockSource, sink: BlockSink, plans: dict[str, LayerPlan | None], stage: ReconstructingStatistics,
             batches: list[Tensor], own: _OwnWindows | None, epochs: int, settings: PruneSettings,
             executor: Executor, progress: bool, scratch: str | os.PathLike | None,
             memory: PassMemory, checkpoint: Checkpoint | None) -> dict[str, Any]:
    """``epochs`` of the global distillation pass (:mod:`nmprune.stages.distillation`) on the
    whole pruned model (:meth:`~nmprune.stages.source.BlockSource.whole_pruned`: a streamed
    ``source`` loads it whole, with the weights ``sink`` wrote, and writes the trained ones
    back), which visits the compute device meanwhile, towards the dense distribution of
    the dense stream ``stage`` carried to the last block (freed once read) and on the pass's
    ``own`` windows, its memory held as ``memory`` says. The held-out batches are the
    reconstruction's and as large a share of the pass's own. Its progress is saved in rank 0's
    ``checkpoint`` now and then, and a pass of the same settings and windows resumes from it
    (:class:`~nmprune.stages.distillation.SavedPass`); the record says from which step."""
    say(f"global distillation: {epochs} epoch(s) over every pruned layer", progress)
    template = stage.inputs.output_template
    teachers = teacher(source.head_logits(template, batches, stage.dense, executor.device), DISTILL_TOPK)
    stage.dense = []
    dtype = training_dtype(settings.train_precision, _pruned_weights(source.model, source, plans), executor.device)
    with executor.training_model(source, sink, dtype, memory.offloaded) as model:
        return _train_whole(model, source, plans, stage, batches, teachers, own, epochs, settings, executor,
                            progress, scratch, memory.checkpointed, checkpoint)


def _train_whole(model: nn.Module, source: BlockSource, plans: dict[str, LayerPlan | None],
                 stage: ReconstructingStatistics, batches: list[Tensor], teachers: list[TeacherTopK],
                 own: _OwnWindows | None, epochs: int, settings: PruneSettings, executor: Executor, progress: bool,
                 scratch: str | os.PathLike | None, checkpointed: bool, checkpoint: Checkpoint | None
                 ) -> dict[str, Any]:
    """:func:`_distill`'s training of the whole ``model`` on the run's ``batches`` with their
    dense distribution (``teachers``) and the pass's ``own`` windows."""
    positions, total, held = list(stage.positions), stage.total, held_out_batches(stage.total)
    if own is not None:
        batches, teachers = batches + own.batches, teachers + own.teachers
        positions += [total + g for g in own.positions]
        held |= {total + g for g in held_out_batches(own.total)}
        total += own.total
    weights = _pruned_weights(model, source, plans)
    shard = shard_of(weights[0]) if weights else None
    options = settings.distill_options(epochs)
    if shard is not None:
        options = sharded_options(options, shard[1])
    key = json.dumps({"options": asdict(options), "total": total, "held": sorted(held),
                      "kept": [int(torch.count_nonzero(local_part(w))) for w in weights]})
    saved = SavedPass(checkpoint if executor.is_main else None, key, executor, sharded=shard is not None)
    record = distill(model, weights, PassWindows(batches, teachers, positions, total, held), options,
                     PassRuntime(executor.all_reduce, executor.device, scratch, progress), checkpointed, saved)
    return {**record, "resumed_from_step": saved.resumed_from}


def _pruned_weights(model: nn.Module, source: BlockSource, plans: dict[str, LayerPlan | None]) -> list[Tensor]:
    """The weights in ``model`` (``source``'s, or its copy sharded over the ranks) of every
    layer ``plans`` prunes, block by block: what the global distillation trains."""
    return [model.get_submodule(name).weight for i in range(len(source)) for name in source.layers(i)
            if plans.get(name) is not None]


def _statistics_stage(inputs: BlockInputs, settings: PruneSettings, executor: Executor,
                      batches: int, progress: bool, scratch: str | os.PathLike | None) -> StatisticsStage:
    """The statistics stage of ``settings`` on the captured ``inputs``: with reconstruction
    (``settings.reconstruct``), the one that also fits each block after its solve (and keeps
    each block's solved weights in ``scratch`` meanwhile)."""
    dtype, dense = getattr(torch, settings.hessian_dtype), settings.hessian_inputs == "dense"
    if settings.reconstruct == "none":
        return CalibrationStatistics(inputs, dtype, dense, executor.reduce)
    return ReconstructingStatistics(inputs, dtype, dense, executor.reduce,
                                    ReconstructionSettings(settings.reconstruct, settings.fit_options(), progress,
                                                           scratch),
                                    CalibrationShare(executor.shard(range(batches)), batches, executor.all_reduce,
                                                     executor.token_sharing(batches)))


def _prune_blocks(group: range, source: BlockSource, plans: dict[str, LayerPlan | None],
                  stage: StatisticsStage, executor: Executor, load: bool, progress: bool,
                  busy: dict[str, float]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Statistics and pruning of the consecutive blocks in ``group`` (several only with dense
    inputs, when balancing the ranks needs them; each then returns to the CPU once its
    statistics are in), each layer written into its module as soon as it is solved; then the
    hidden states move past the last of them (with reconstruction, after it is fitted).
    ``load``: the blocks visit the compute device (not with precomputed statistics). Returns
    the layer records, in block and layer order, and the block's reconstruction record (none
    without); ``busy`` accumulates this process's calibration seconds."""
    jobs, records, modules, blocks = [], {}, {}, {}
    for index in group:
        layers = source.layers(index)
        modules.update(layers)
        active = {name: m for name, m in layers.items() if plans[name] is not None}
        started = time.perf_counter()
        if load:
            blocks[index] = source.load(index, executor.device)
        else:  # the weights stay on the CPU (a streaming source reads them from its files)
            source.load(index, "cpu")
            blocks[index] = None
        with executor.phase(f"calibration of block {index}"):
            stats = stage.collect(index, blocks[index], active)
        busy["calibration_seconds"] += time.perf_counter() - started
        if load and len(group) > 1:
            source.offload(index)
        jobs += [LayerJob(name, index, weight_matrix(m), stats[name], plans[name]) for name, m in active.items()]
        del stats
        records.update({name: {"name": name, "block": index, "shape": list(weight_matrix(m).shape),
                               "method": None, "skipped": True} for name, m in layers.items()})

    def done(job: LayerJob, weight: Tensor, record: dict[str, Any]) -> None:
        set_weight_matrix(modules[job.name], weight)
        job.stats = None  # freed unless a later layer of the block shares them (q/k/v, gate/up)
        release_memory(collect=False)  # the solvers' temporaries: heap pages back to the system
        records[job.name] = {**records[job.name], **record, "skipped": False}

    label = f"block {group[0]}" if len(group) == 1 else f"blocks {group[0]}-{group[-1]}"
    bars = progress and len(jobs) > 1
    executor.solve(jobs, done, lambda it: progress_bar(it, enabled=bars, nested=True, desc=label))
    del jobs
    fitted = []
    if len(group) == 1:
        (index,) = group
        started = time.perf_counter()
        with executor.phase(f"propagation through block {index}"):
            record = stage.advance(index, blocks[index])
        busy["calibration_seconds"] += time.perf_counter() - started
        fitted = [record] if record is not None else []
        if load:
            source.offload(index)
    release_memory()
    return list(records.values()), fitted


def collect_hessians(model: nn.Module, calibration: Tensor, *, device: str | torch.device | None = None,
                     dtype: torch.dtype = torch.float32, batch_size: int = 1,
                     progress: bool = True) -> dict[str, InputStats]:
    """Input statistics (``H = X X^T / n`` and the mean, paper eq. ``squared_loss``) of every
    linear layer in ``model``'s decoder blocks, from the dense model's activations (the
    paper's default, Section ``sec:llm_experiments``), keyed by full layer name and kept on
    the CPU. Layers sharing an input (q/k/v, gate/up) share one :class:`InputStats`.
    Pass the result to :func:`prune_model` (``hessians=``) to prune with several methods
    without repeating the calibration forward passes. One block at a time visits ``device``.
    """
    _check_ids(calibration)
    device = default_device(device)
    source = ModelBlocks(model)
    result: dict[str, InputStats] = {}
    with evaluating(model):
        inputs = source.capture(calibration.split(batch_size), device)
        stage = CalibrationStatistics(inputs, dtype, dense_inputs=True, reduce=LocalExecutor(device).reduce)
        for i in progress_bar(range(len(source)), enabled=progress, desc="collecting Hessians"):
            stats = stage.collect(i, source.load(i, device), source.layers(i))
            on_cpu = {id(s): InputStats(s.xtx.cpu(), s.xsum.cpu(), s.count, s.averaged)
                      for s in stats.values()}  # layers sharing an input keep sharing it
            result.update({name: on_cpu[id(s)] for name, s in stats.items()})
            source.release(i)
    return result
