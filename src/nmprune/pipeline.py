"""Prune a whole causal LM block by block: :func:`prune_model`.

For each decoder block (paper Section ``sec:llm_experiments``): run the calibration
hidden states through it with hooks collecting every linear layer's Hessian
``H = X X^T / n`` (:mod:`nmprune.hessian`), prune each layer to N:M with its planned
method and refiner (:func:`nmprune.prune.prune_layer`), then pass the hidden states on to
the next block: the dense block's outputs (``hessian_inputs="dense"``, the paper's
default, every layer's Hessian comes from the unpruned model) or the pruned block's
(``"pruned"``, Appendix ``app:use_unpruned_inputs``). Only the current block sits on the
compute device. With a checkpoint, progress is saved after every block and a rerun resumes.

This module only orchestrates; it writes no files except through the checkpoint.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from . import distributed
from .checkpoint import Checkpoint
from .config import LayerPlan, PruneSettings
from .distributed import DistributedExecutor, LayerJob, balance_window, job_cost
from ._memory import release_memory
from .hessian import HessianCollector, InputStats, capture_block_inputs, run_block
from .loss import local_loss
from .models import find_blocks, find_linears, set_weight_matrix, shared_weight_ptrs, weight_matrix
from .pattern import parse_pattern
from .registry import get_method, get_refiner, split_options

INPUT_MEAN = "input_mean"


@dataclass
class PruneReport:
    """What :func:`prune_model` did: settings, one record per layer, timings (seconds)."""

    settings: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    resumed_from_block: int = 0
    ranks: int = 1
    per_rank: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate_plans(settings: PruneSettings) -> None:
    """Check every method, refiner, pattern and option (global and overrides) up front."""
    for plan in settings.all_plans():
        method = get_method(plan.method)
        refiner = get_refiner(plan.refine) if plan.refine is not None else None
        if INPUT_MEAN in plan.options:
            raise ValueError(f"option {INPUT_MEAN!r} is computed from the calibration data; "
                             "do not set it")
        split_options(plan.options, method, refiner)
        if not method.supports(parse_pattern(plan.pattern)):
            raise ValueError(f"method {plan.method!r} does not support pattern {plan.pattern}")


def _layer_names(blocks_name: str, index: int, layers: dict[str, nn.Module]) -> dict[str, str]:
    return {sub: f"{blocks_name}.{index}.{sub}" for sub in layers}


def _plans_for_block(settings: PruneSettings, blocks_name: str, index: int,
                     layers: dict[str, nn.Module]) -> dict[str, LayerPlan | None]:
    plans: dict[str, LayerPlan | None] = {}
    for sub, full in _layer_names(blocks_name, index, layers).items():
        plan = settings.plan(full)
        d_in = weight_matrix(layers[sub]).shape[1]
        if plan is not None and d_in % parse_pattern(plan.pattern).m:
            message = (f"layer {full} has d_in={d_in}, not divisible by M="
                       f"{parse_pattern(plan.pattern).m}")
            if settings.strict:
                raise ValueError(message + "; skip it with an override or run without strict")
            warnings.warn(message + "; it stays dense", stacklevel=4)
            plan = None
        plans[sub] = plan
    return plans


def prune_one(w: Tensor, h: Tensor, plan: LayerPlan, input_mean: Tensor | None) -> tuple[Tensor, dict[str, Any]]:
    """Prune one weight matrix ``(d_out, d_in)`` with ``plan``; returns the pruned matrix
    (float, on ``h``'s device) and its record: local losses (paper eq. ``squared_loss``)
    after the method and after refinement, relative to Wanda's with the same dampening, all
    on the undamped ``H``."""
    from .prune import prune_layer, prune_matrix

    w32 = w.detach().to(device=h.device, dtype=h.dtype, copy=True)
    options = dict(plan.options)
    if input_mean is not None and INPUT_MEAN in get_method(plan.method).option_names():
        options[INPUT_MEAN] = input_mean
    result = prune_layer(w32, h, method=plan.method, pattern=plan.pattern, refine=plan.refine,
                         damp=plan.damp, **options)
    start = time.perf_counter()
    loss_wanda = local_loss(prune_matrix(w32, h, "wanda", plan.pattern, damp=plan.damp), w32, h)
    seconds_wanda = time.perf_counter() - start
    final = result.loss_refined if result.loss_refined is not None else result.loss_method
    record = {
        "method": plan.method, "refine": plan.refine, "pattern": plan.pattern, "damp": plan.damp,
        "loss_method": result.loss_method, "loss_refined": result.loss_refined,
        "loss_wanda": loss_wanda,
        "loss_vs_wanda": final / loss_wanda if loss_wanda > 0 else None,
        "seconds_method": result.seconds_method, "seconds_refine": result.seconds_refine,
        "seconds_wanda_reference": seconds_wanda,
    }
    return result.weight, record


def _calibration(model: nn.Module, tokenizer: Any, settings: PruneSettings,
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
    vocab = model.get_input_embeddings().weight.shape[0]
    if calibration.numel() and (int(calibration.min()) < 0 or int(calibration.max()) >= vocab):
        raise ValueError(f"calibration token ids must lie in [0, {vocab}) (the model's vocabulary)")
    return calibration


def _digest(t: Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def _progress(**kwargs):
    from tqdm.auto import tqdm

    return tqdm(**kwargs)


class _LocalExecutor:
    """The one-process executor: all calibration batches, no reduction, every layer here."""

    rank, world, is_main = 0, 1, True

    def share(self, n: int) -> range:
        return range(n)

    def phase(self, name: str):
        return nullcontext()

    def broadcast_object(self, value: Any) -> Any:
        return value

    def broadcast_tensors(self, tensors: Sequence[Tensor]) -> None:
        pass

    def reduce(self, stats: Sequence[InputStats]) -> None:
        pass

    def solve(self, jobs: Sequence[LayerJob], solve_one, phase: str) -> list[dict[str, Any]]:
        return [{**solve_one(job), "rank": 0} for job in jobs]

    def gather_batches(self, local: list[Tensor], sizes: Sequence[int]) -> list[Tensor]:
        return local

    def scatter_batches(self, batches: list[Tensor], local_like: list[Tensor]) -> list[Tensor]:
        return batches

    def per_rank(self, value: Any) -> list[Any]:
        return [value]


def prune_model(model: nn.Module, tokenizer: Any = None, settings: PruneSettings | None = None, *,
                calibration: Tensor | None = None, device: str | torch.device | None = None,
                checkpoint: Checkpoint | None = None, progress: bool = True,
                on_block_done: Callable[[int], None] | None = None,
                hessians: dict[str, InputStats] | None = None, **setting_kwargs: Any) -> PruneReport:
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

    Inside an initialised ``torch.distributed`` process group of several ranks (e.g. under
    ``torchrun``; :mod:`nmprune.distributed`) every rank calls this with the same model and
    settings: the calibration batches and layer solves are shared out, rank 0's
    ``checkpoint`` is the one used (the others' are ignored), and every rank returns the
    same pruned model and report. ``device`` ``"cuda"`` then means ``cuda:LOCAL_RANK``.
    """
    if settings is None:
        settings = PruneSettings(**setting_kwargs)
    elif setting_kwargs:
        raise ValueError("give either settings or keyword settings, not both")
    validate_plans(settings)
    ranks = distributed.current(device)
    executor = _LocalExecutor() if ranks is None else DistributedExecutor(ranks)
    device = ranks.device if ranks is not None else \
        torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not executor.is_main:
        checkpoint = None
    hdtype = {"float32": torch.float32, "float64": torch.float64}[settings.hessian_dtype]
    blocks_name, blocks = find_blocks(model)
    tied = shared_weight_ptrs(model, blocks)
    block_layers = [find_linears(b, tied) for b in blocks]
    all_names = [n for i, ls in enumerate(block_layers) for n in _layer_names(blocks_name, i, ls).values()]
    import fnmatch
    for glob in settings.overrides:
        if not any(fnmatch.fnmatchcase(n, glob) for n in all_names):
            raise ValueError(f"override {glob!r} matches no layer; layer names look like "
                             f"{', '.join(all_names[:3])}")

    if hessians is not None and settings.hessian_inputs != "dense":
        raise ValueError("precomputed hessians come from the dense model; they cannot be used "
                         "with hessian_inputs='pruned'")
    t_start = time.perf_counter()
    report = PruneReport(settings=asdict(settings), ranks=executor.world)
    sizes: list[int] = []
    with executor.phase("setup"):
        if hessians is None:
            calibration = _calibration(model, tokenizer, settings, calibration)
            all_batches = list(calibration.split(settings.batch_size))
            sizes = [b.shape[0] for b in all_batches]
            batches = [all_batches[j] for j in executor.share(len(all_batches))]
            del all_batches
            release_memory()  # the tokenised corpus
        start, records = 0, []
        if checkpoint is not None:
            checkpoint.bind("calibration_sha256", _digest(calibration) if hessians is None
                            else _digest(torch.stack([hessians[n].xtx.trace() for n in all_names
                                                      if n in hessians])))
            start, records = checkpoint.done_blocks, checkpoint.records
    saving, start, records = executor.broadcast_object((checkpoint is not None, start, records))
    report.layers, report.resumed_from_block = list(records), start
    with executor.phase("loading the checkpoint"):
        for i in range(start):
            saved = checkpoint.block_weights(i) if checkpoint is not None else {}
            for sub, module in block_layers[i].items():
                if sub in saved:
                    with torch.no_grad():
                        module.weight.copy_(saved[sub])
    executor.broadcast_tensors([m.weight for i in range(start) for m in block_layers[i].values()])

    busy = {"calibration_seconds": 0.0, "solve_seconds": 0.0, "layer_cpu_seconds": 0.0}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if hessians is None:
                with executor.phase("capturing the block inputs"):
                    inputs = capture_block_inputs(model, blocks_name, blocks, batches, device,
                                                  keep_hidden=start == 0 or executor.world > 1)
                if start > 0:
                    with executor.phase("loading the block inputs"):
                        saved_hidden = checkpoint.hidden() if checkpoint is not None else None
                    inputs.hidden = executor.scatter_batches(
                        None if saved_hidden is None else [h.to(device) for h in saved_hidden],
                        inputs.hidden)
                    del saved_hidden
            else:
                inputs = _PrecomputedInputs(hessians)
            t_capture = time.perf_counter() - t_start
            plans = [_plans_for_block(settings, blocks_name, i, block_layers[i]) for i in range(len(blocks))]
            costs = [[job_cost(*weight_matrix(block_layers[i][sub]).shape, p.method, p.refine)
                      for sub, p in plans[i].items() if p is not None] for i in range(len(blocks))]
            bar = _progress(total=len(blocks), initial=start, disable=not (progress and executor.is_main),
                            desc="pruning blocks")
            i = start
            while i < len(blocks):
                # dense inputs: solve as many blocks together as balancing the ranks needs
                k = balance_window(costs[i:], executor.world) if settings.hessian_inputs == "dense" else 1
                group = range(i, i + k)
                new = _prune_blocks(group, blocks, block_layers, plans, blocks_name, settings, inputs,
                                    device, hdtype, executor, busy)
                report.layers += new
                hidden = None if not saving or inputs.hidden is None else \
                    executor.gather_batches(inputs.hidden, sizes)
                with executor.phase(f"saving blocks {i}-{i + k - 1}"):
                    if checkpoint is not None:
                        checkpoint.save_blocks(i, [{sub: m.weight for sub, m in block_layers[j].items()}
                                                   for j in group], hidden, new)
                    del hidden
                    if on_block_done is not None:
                        for j in group:
                            on_block_done(j)
                bar.update(k)
                i += k
            bar.close()
    finally:
        model.train(was_training)
    solved = [r["name"] for r in report.layers[len(records):] if not r.get("skipped")
              and r.get("rank") == executor.rank]
    report.per_rank = executor.per_rank({"rank": executor.rank, **busy,
                                         "busy_seconds": busy["calibration_seconds"] + busy["solve_seconds"],
                                         "layers": solved})
    report.seconds = {"capture": t_capture, "total": time.perf_counter() - t_start,
                      "layers": sum(r.get("seconds", 0.0) for r in report.layers)}
    return report


def _prune_blocks(group: range, blocks: nn.ModuleList, block_layers: list[dict[str, nn.Module]],
                  plans: list[dict[str, LayerPlan | None]], blocks_name: str, settings: PruneSettings,
                  inputs, device: torch.device, hdtype: torch.dtype, executor,
                  busy: dict[str, float]) -> list[dict[str, Any]]:
    """Hessians, pruning and output propagation of the consecutive blocks in ``group`` (one
    block unless dense inputs make several worth balancing together); ``inputs.hidden``
    becomes the next block's input. Returns the blocks' layer records. ``executor`` runs
    this process's share; ``busy`` accumulates its calibration and solve seconds."""
    collectors, names, where = {}, {}, {}
    for index in group:
        layers = block_layers[index]
        names[index] = _layer_names(blocks_name, index, layers)
        start = time.perf_counter()
        if isinstance(inputs, _PrecomputedInputs):
            collectors[index] = inputs.for_block(names[index])
        else:
            active = {sub: layers[sub] for sub, p in plans[index].items() if p is not None}
            with executor.phase(f"calibration of block {index}"):
                blocks[index].to(device)
                collectors[index] = _block_statistics(blocks[index], active, index, inputs, hdtype,
                                                      propagate=settings.hessian_inputs == "dense")
                blocks[index].to("cpu")
            executor.reduce([collectors[index].stats[k] for k in sorted(collectors[index].stats)])
        busy["calibration_seconds"] += time.perf_counter() - start
        where.update({names[index][sub]: (index, sub) for sub, p in plans[index].items() if p is not None})

    def solve_one(job: LayerJob) -> dict[str, Any]:
        index, sub = where[job.name]
        stats = collectors[index].of(sub)
        layer = block_layers[index][sub]
        t0, c0 = time.perf_counter(), time.process_time()
        pruned, rec = prune_one(weight_matrix(layer), stats.hessian().to(device), plans[index][sub],
                                stats.mean().to(device))
        set_weight_matrix(layer, pruned)
        del pruned
        release_memory(collect=False)  # the solvers' temporaries: heap pages back to the system
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        busy["solve_seconds"] += seconds
        busy["layer_cpu_seconds"] += cpu
        return {**rec, "skipped": False, "seconds": seconds, "cpu_seconds": cpu}

    jobs = []
    for name, (index, sub) in where.items():
        plan, layer = plans[index][sub], block_layers[index][sub]
        jobs.append(LayerJob(name, job_cost(*weight_matrix(layer).shape, plan.method, plan.refine),
                             layer.weight))
    label = f"block {group[0]}" if len(group) == 1 else f"blocks {group[0]}-{group[-1]}"
    solved = dict(zip(where, executor.solve(jobs, solve_one, f"the layers of {label}")))
    del collectors
    records = []
    for index in group:
        for sub, layer in block_layers[index].items():
            name = names[index][sub]
            record = {"name": name, "block": index, "shape": list(weight_matrix(layer).shape)}
            records.append({**record, **solved[name]} if name in solved else
                           {**record, "method": None, "skipped": True})
    if settings.hessian_inputs != "dense" and not isinstance(inputs, _PrecomputedInputs):
        (index,) = group  # propagate through the pruned block
        start = time.perf_counter()
        with executor.phase(f"propagation through block {index}"):
            blocks[index].to(device)
            inputs.hidden = [run_block(blocks[index], h, inputs.call(index, h)) for h in inputs.hidden]
            blocks[index].to("cpu")
        busy["calibration_seconds"] += time.perf_counter() - start
    release_memory()
    return records


def _block_statistics(block: nn.Module, layers: dict[str, nn.Module], index: int, inputs,
                      hdtype: torch.dtype, propagate: bool) -> HessianCollector:
    """Run ``block`` on every calibration batch with hooks on ``layers``; returns the collector
    holding each layer's input statistics. With ``propagate`` (dense-input mode) each batch's
    dense output replaces its input in ``inputs.hidden`` at once (the input is not needed
    again), so only one set of activations is held."""
    with HessianCollector(block, layers, hdtype) as collector:
        for j, h in enumerate(inputs.hidden):
            out = run_block(block, h, inputs.call(index, h))
            if propagate:
                inputs.hidden[j] = out
    return collector


class _PrecomputedInputs:
    """Stands in for block inputs when :func:`collect_hessians` already gave every layer's
    statistics: ``for_block`` serves them by sub-layer name."""

    hidden = None  # nothing to propagate or checkpoint

    def __init__(self, hessians: dict[str, InputStats]):
        self.hessians = hessians

    def for_block(self, names: dict[str, str]) -> "_Lookup":
        missing = [full for full in names.values() if full not in self.hessians]
        if missing:
            raise ValueError(f"hessians has no entry for {', '.join(missing[:3])}; collect them "
                             "with collect_hessians on this model")
        return _Lookup({sub: self.hessians[full] for sub, full in names.items()})


@dataclass
class _Lookup:
    stats: dict[str, InputStats]

    def of(self, sub: str) -> InputStats:
        return self.stats[sub]


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
    blocks_name, blocks = find_blocks(model)
    tied = shared_weight_ptrs(model, blocks)
    result: dict[str, InputStats] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = capture_block_inputs(model, blocks_name, blocks, list(calibration.split(batch_size)),
                                          device)
            for i in _progress(iterable=range(len(blocks)), disable=not progress, desc="collecting Hessians"):
                layers = find_linears(blocks[i], tied)
                blocks[i].to(device)
                collector = _block_statistics(blocks[i], layers, i, inputs, dtype, propagate=True)
                moved: dict[int, InputStats] = {}
                for sub, full in _layer_names(blocks_name, i, layers).items():
                    stats = collector.of(sub)
                    result[full] = moved.setdefault(id(stats), InputStats(stats.xtx.cpu(), stats.xsum.cpu(),
                                                                          stats.count))
                blocks[i].to("cpu")
    finally:
        model.train(was_training)
    return result
