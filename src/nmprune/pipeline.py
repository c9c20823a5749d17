"""Prune a whole causal LM block by block: :func:`prune_model`.

For each decoder block (paper Section ``sec:llm_experiments``) the stages run in order:

1. block source (:mod:`nmprune.source`): the block's modules on the compute device;
2. statistics (:mod:`nmprune.statistics`): every layer's input sums from this process's
   calibration batches, reduced across processes by the executor;
3. plans (:mod:`nmprune.plan`): made once for all layers before the first block;
4. solver (:mod:`nmprune.executor`): each layer pruned to N:M with its plan, written into the
   block as soon as it is done;
5. the hidden states move on to the next block: the dense block's outputs
   (``hessian_inputs="dense"``, the paper's default, every layer's Hessian comes from the
   unpruned model) or the pruned block's (``"pruned"``, Appendix ``app:use_unpruned_inputs``);
6. sink (:mod:`nmprune.sink`) and checkpoint: the finished block is kept, and progress saved
   so that a rerun resumes after it.

This module only wires the stages; it writes no files except through the checkpoint.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ._memory import release_memory
from .checkpoint import Checkpoint, CheckpointError
from .config import PruneSettings
from .executor import LayerJob, LocalExecutor
from .models import set_weight_matrix, weight_matrix
from .plan import LayerPlan
from .sink import ModelSink
from .source import ModelBlocks
from .statistics import CalibrationStatistics, InputStats, PrecomputedStatistics

@dataclass
class PruneReport:
    """What :func:`prune_model` did: settings, one record per layer, timings (seconds)."""

    settings: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    resumed_from_block: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _calibration(vocab: int, tokenizer: Any, settings: PruneSettings,
                 calibration: Tensor | None) -> Tensor:
    if calibration is None:
        if tokenizer is None:
            raise ValueError("prune_model needs a tokenizer (to build calibration text) or "
                             "calibration= token ids of shape (nsamples, seqlen)")
        from .data import calibration_batch

        calibration = calibration_batch(tokenizer, source=settings.calib, nsamples=settings.nsamples,
                                        seqlen=settings.seqlen, seed=settings.seed)
    if not isinstance(calibration, Tensor) or calibration.ndim != 2 or calibration.dtype != torch.long:
        raise ValueError("calibration must be a LongTensor of token ids with shape (nsamples, seqlen)")
    if calibration.numel() and (int(calibration.min()) < 0 or int(calibration.max()) >= vocab):
        raise ValueError(f"calibration token ids must lie in [0, {vocab}) (the model's vocabulary)")
    return calibration


def _digest(t: Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def _progress(iterable, progress: bool, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not progress, **kwargs)


def prune_model(model: nn.Module | None, tokenizer: Any = None, settings: PruneSettings | None = None, *,
                calibration: Tensor | None = None, device: str | torch.device | None = None,
                checkpoint: Checkpoint | None = None, progress: bool = True,
                on_block_done: Callable[[int], None] | None = None,
                hessians: dict[str, InputStats] | None = None, source=None, sink=None,
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
    """
    if settings is None:
        settings = PruneSettings(**setting_kwargs)
    elif setting_kwargs:
        raise ValueError("give either settings or keyword settings, not both")
    planner = settings.planner()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if (model is None) == (source is None):
        raise ValueError("give either a model or a block source")
    source = source if source is not None else ModelBlocks(model)
    plans = planner.plan_layers(source.layer_shapes())
    if hessians is not None and settings.hessian_inputs != "dense":
        raise ValueError("precomputed hessians come from the dense model; they cannot be used "
                         "with hessian_inputs='pruned'")
    executor = LocalExecutor(device)
    sink = sink if sink is not None else ModelSink(source)

    t_start = time.perf_counter()
    if hessians is None:
        calibration = _calibration(source.vocab_size, tokenizer, settings, calibration)
        batches = executor.shard(calibration.split(settings.batch_size))
        release_memory()  # the tokenised corpus
    report = PruneReport(settings=asdict(settings))
    start = 0
    if checkpoint is not None:
        checkpoint.bind("calibration_sha256", _digest(calibration) if hessians is None
                        else _digest(torch.stack([hessians[n].xtx.trace() for n in plans
                                                  if n in hessians])))
        start = checkpoint.done_blocks
        report.layers = checkpoint.records
        report.resumed_from_block = start
        for i in range(start):
            sink.write(i, _saved_block(checkpoint, i, source.layers(i)))

    was_training = source.model.training
    source.model.eval()
    try:
        with torch.no_grad():
            if hessians is None:
                inputs = source.capture(batches, device, keep_hidden=start == 0)
                if start > 0:
                    inputs.hidden = [h.to(device) for h in checkpoint.hidden()]
                stage = CalibrationStatistics(inputs, getattr(torch, settings.hessian_dtype),
                                              settings.hessian_inputs == "dense", executor.reduce)
            else:
                stage = PrecomputedStatistics(hessians)
            t_capture = time.perf_counter() - t_start
            bar = _progress(range(start, len(source)), progress, desc="pruning blocks",
                            initial=start, total=len(source))
            for i in bar:
                layers = source.layers(i)
                block = source.load(i, device)
                report.layers += _prune_block(i, block, layers, plans, stage, executor, progress)
                stage.advance(i, block)
                weights = {name: m.weight for name, m in layers.items()}
                sink.write(i, weights)
                if checkpoint is not None:
                    checkpoint.save_block(i, weights, stage.hidden,
                                          [r for r in report.layers if r["block"] == i])
                del weights
                source.release(i)  # a streaming source drops the block's weights here
                release_memory()
                if on_block_done is not None:
                    on_block_done(i)
    finally:
        source.model.train(was_training)
    report.seconds = {"capture": t_capture, "total": time.perf_counter() - t_start,
                      "layers": sum(r.get("seconds", 0.0) for r in report.layers)}
    return report


def _saved_block(checkpoint: Checkpoint, index: int, layers: dict[str, nn.Module]) -> dict[str, Tensor]:
    """Block ``index``'s weights from ``checkpoint``; a layer missing there is corruption."""
    saved = checkpoint.block_weights(index)
    missing = [name for name in layers if name not in saved]
    if missing:
        raise CheckpointError(f"the checkpoint in {checkpoint.directory} is corrupt "
                              f"(block_{index:04d}.safetensors has no tensor {missing[0]}); "
                              "delete the directory or pass --restart to start over")
    return saved


def _prune_block(index: int, block: nn.Module, layers: dict[str, nn.Module],
                 plans: dict[str, LayerPlan | None], stage, executor: LocalExecutor,
                 progress: bool) -> list[dict[str, Any]]:
    """Statistics and pruning of one block's layers, each written into its module as soon as
    it is solved. Returns the block's layer records, in layer order."""
    active = {name: m for name, m in layers.items() if plans[name] is not None}
    stats = stage.collect(index, block, active)
    jobs = [LayerJob(name, index, weight_matrix(m), stats[name], plans[name]) for name, m in active.items()]
    del stats
    records = {name: {"name": name, "block": index, "shape": list(weight_matrix(m).shape),
                      "method": None, "skipped": True} for name, m in layers.items()}
    started = time.perf_counter()

    def done(job: LayerJob, weight: Tensor, record: dict[str, Any]) -> None:
        nonlocal started
        set_weight_matrix(layers[job.name], weight)
        del weight
        release_memory(collect=False)  # the solvers' temporaries: heap pages back to the system
        records[job.name] = {**records[job.name], **record, "skipped": False,
                             "seconds": time.perf_counter() - started}
        started = time.perf_counter()

    executor.solve(jobs, done, lambda it: _progress(it, progress and len(jobs) > 1,
                                                    desc=f"block {index}", leave=False))
    return list(records.values())


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
    if not isinstance(calibration, Tensor) or calibration.ndim != 2 or calibration.dtype != torch.long:
        raise ValueError("calibration must be a LongTensor of token ids with shape (nsamples, seqlen)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    source = ModelBlocks(model)
    result: dict[str, InputStats] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = source.capture(calibration.split(batch_size), device)
            stage = CalibrationStatistics(inputs, dtype, dense_inputs=True, reduce=LocalExecutor(device).reduce)
            for i in _progress(range(len(source)), progress, desc="collecting Hessians"):
                stats = stage.collect(i, source.load(i, device), source.layers(i))
                on_cpu: dict[int, InputStats] = {}
                for name, s in stats.items():
                    result[name] = on_cpu.setdefault(id(s), InputStats(s.xtx.cpu(), s.xsum.cpu(), s.count))
                source.release(i)
    finally:
        model.train(was_training)
    return result
