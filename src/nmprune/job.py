"""The jobs behind the command line, for a resolved configuration: :func:`run` is the whole
of ``nmprune prune`` (load, check, calibrate, prune block by block with a checkpoint,
evaluate, save), :func:`evaluate_model` the whole of ``nmprune eval``. In memory, streamed
(weights read block by block) and under ``torchrun`` alike; the command line only turns
flags and YAML into a :class:`~nmprune.config.RunConfig` and prints what these return.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from . import __version__
from .config import AUTO, RunConfig, to_dict

if TYPE_CHECKING:
    from .stages.source import BlockSource

REPORT_FILE = "nmprune_report.json"


def token_streams(tokenizer, datasets: list[str], seqlen: int, max_tokens: int | None,
                  cache: dict[str, Any]) -> None:
    """Tokenise each data set's held-out split into ``cache`` (name -> ids), refusing one
    too short for a single evaluation window."""
    from .data import eval_tokens

    for name in datasets:
        if name not in cache:
            tokens = eval_tokens(tokenizer, source=name, max_tokens=max_tokens, seqlen=seqlen)
            if tokens.shape[1] < seqlen:
                raise ValueError(f"evaluation text {name} has {tokens.shape[1]} tokens, fewer than "
                                 f"one window of {seqlen}; lower the evaluation seqlen or use a longer text")
            cache[name] = tokens


def evaluate(model: BlockSource, tokenizer, datasets: list[str], seqlen: int, max_tokens: int | None,
             device: str | None, progress: bool, cache: dict[str, Any] | None = None,
             label: str = "") -> dict[str, float]:
    """Perplexity of ``model`` (held in memory or streamed, as its block source measures it)
    on each data set's held-out split (token streams cached); ``label`` names the model on
    the progress bars ("dense", "pruned")."""
    from .data import window_prefix

    cache = {} if cache is None else cache
    token_streams(tokenizer, datasets, seqlen, max_tokens, cache)
    prefix = window_prefix(tokenizer)  # every window starts as the tokenizer starts a text (a BOS)
    return {name: model.perplexity(cache[name], seqlen=seqlen, device=device, progress=progress, prefix=prefix,
                                   desc=f"{label + ' ' if label else ''}perplexity on {name}")
            for name in datasets}


def downstream_settings(config: RunConfig):
    """The lm-eval settings of a run (validated; no tasks: no downstream evaluation)."""
    from .downstream import DownstreamSettings, parse_task_list

    return DownstreamSettings(parse_task_list(config.eval_tasks), config.eval_num_fewshot,
                              config.eval_limit, config.eval_batch_size, tuple(config.eval_include_path))


def open_model(spec: str | None, gguf_file: str | None, dtype: str | None, offload: bool | None,
               allow_pickle: bool = False, processes: int = 1, config=None):
    """``(model, tokenizer, source)``, the model as a block source: loaded whole
    (:class:`~nmprune.stages.source.ModelBlocks`), or a
    :class:`~nmprune.streaming.StreamingModel` whose blocks stream from its safetensors
    checkpoint when ``offload`` says so or ``processes`` copies of the model (one per rank
    on this machine) do not fit in memory (:func:`nmprune.streaming.fit.choose_streaming`).
    ``config``: the model's configuration when the caller has read it already
    (:func:`check_run`)."""
    from .memory import prefer_mmap
    from .models import check_causal, load_model, load_tokenizer, resolve_model
    from .stages.source import ModelBlocks
    from .streaming import StreamingModel
    from .streaming.fit import choose_streaming

    source = resolve_model(spec, gguf_file)
    if config is None:
        config = check_causal(source)  # read once: a GGUF file's takes seconds to parse
    if not choose_streaming(source, dtype, offload, config, processes):
        model, tokenizer, source = load_model(spec, gguf_file=gguf_file, dtype=dtype,
                                              allow_pickle=allow_pickle, config=config)
        return ModelBlocks(model, source), tokenizer, source
    print(f"streaming the weights of {source} block by block", file=sys.stderr)
    prefer_mmap(4 << 20)  # the lowest peak: weight-sized temporaries are mapped too (nmprune/memory.py)
    return StreamingModel(source.path, dtype=dtype), load_tokenizer(source), source


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"nmprune": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _run_label(config: RunConfig) -> str:
    """``method[+refiner] N:M`` of the run's global plan (as the planner resolved it)."""
    plan = config.prune.planner().default
    label = f"{plan.method.name}{'+' + plan.refiner.name if plan.refiner else ''} {plan.pattern}"
    return label if config.prune.reconstruct == "none" else f"{label} +{config.prune.reconstruct} reconstruction"


# ----------------------------------------------------------------------------- prune run

def _distill_fit(config: RunConfig, world: int, resolved, model_config) -> tuple[str | None, Any]:
    """Why ``distill_epochs: auto`` skips the pass on the compute device (the CPU: the memory
    available to this process), None where it runs or the run makes none, and how the pass
    holds its memory to fit (:class:`~nmprune.stages.distillation.PassMemory`;
    :func:`nmprune.resources.plan_distillation`, judged before any weight is read;
    ``distill_epochs: N`` that does not fit is refused)."""
    import torch

    from .devices import default_device
    from .resources import plan_distillation
    from .stages.distillation import PassMemory
    from .streaming.fit import available_memory

    device = default_device(config.device)
    available = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                 else available_memory())
    needs, shortfall = plan_distillation(config, world, (resolved, model_config), available)
    return shortfall, PassMemory(needs.distill_checkpointed, needs.distill_offloaded)


def _distill_windows(tokenizer, settings):
    """The global distillation's own calibration windows (:func:`nmprune.pipeline.distill_windows`),
    a text too short for them refused before the checkpoint exists."""
    from .pipeline import distill_windows

    try:
        return distill_windows(tokenizer, settings)
    except ValueError as e:
        raise ValueError(f"--calib {settings.calib}, the global distillation's {settings.distill_extra_windows()} "
                         f"windows of its own (--distill-nsamples): {e}") from e


def _auto_distillation(settings, shortfall: str | None, ranks) -> tuple[Any, str | None]:
    """The settings :func:`prune_model` runs with, and why the global distillation of
    ``distill_epochs: auto`` is skipped (None where it runs or was not asked for): where the
    pass does not fit (``shortfall``) on any rank. Explicit epochs were refused before."""
    if settings.distill_epochs != AUTO or not settings.distill_passes():
        return settings, None
    why = next((w for w in ranks.check("judging the global distillation", payload=shortfall) if w), None)
    return (settings, None) if why is None else (replace(settings, distill_epochs=0), why)


def check_run(config: RunConfig, writes: bool = True, device_here: bool = True):
    """Everything a prune run judges before it reads a weight, in the run's order: the
    settings and the folders it will write (:func:`nmprune.validate.check_prune_inputs`, on
    the process that writes them: ``writes``), the lm-eval tasks, every method, refiner,
    pattern and option, the model's configuration (a decoder-only causal LM whose sizes are
    stated and sane, :func:`nmprune.models.check_causal`) and the windows against its
    positions. ``--dry-run`` calls this same function before it plans, with ``device_here``
    False: it may plan a run on a device this machine lacks. Returns the model's
    :class:`~nmprune.models.ModelSource`, its configuration and the lm-eval settings."""
    from .downstream import check_tasks
    from .models import check_causal, resolve_model
    from .validate import check_positions, check_prune_inputs

    if writes:
        check_prune_inputs(config, device_here)
    downstream = downstream_settings(config)
    if downstream.tasks:
        check_tasks(downstream)
    config.prune.planner()  # every method, refiner, pattern and option
    resolved = resolve_model(config.model, config.gguf_file)
    model_config = check_causal(resolved)
    check_positions(model_config, {"--seqlen": config.prune.seqlen,
                                   **({"--eval-seqlen": config.eval_seqlen} if config.eval else {})})
    return resolved, model_config, downstream


@dataclass
class LoadedRun:
    """A prune run once its model is loaded and its text tokenised (what :func:`run` hands the
    rest of the job): the ``settings`` it prunes with (``config.prune`` with the run's choice of
    global distillation; ``distill_skipped``: why ``auto`` made none; ``distill_memory``:
    how the pass holds its memory to fit), the ``model``, its
    ``tokenizer`` and ``source``, the tokenised evaluation text (``cache``), the ``timings`` so
    far, when the run started (``t0``) and its ``device``."""

    settings: Any
    distill_skipped: str | None
    distill_memory: Any  # stages.distillation.PassMemory
    model: BlockSource
    tokenizer: Any
    source: Any
    cache: dict[str, Any]
    timings: dict[str, float]
    t0: float
    device: Any


class RunRole(Protocol):
    """What a rank of a prune run does beside pruning (:func:`run` calls these, whatever its
    rank): :class:`LeadRank` on rank 0, :class:`HelperRank` on every other rank."""

    writes: bool  # whether this rank writes --out and the checkpoint
    checkpoint: Any  # the run's Checkpoint once opened (None on the other ranks)

    def say(self, text: str) -> None:
        """Tell the user what the run does now."""

    def warn(self, text: str) -> None:
        """A line on stderr."""

    def clear_completed(self) -> None:
        """Remove what a completed run left beside ``--out``."""

    def tokenise(self, tokenizer, cache: dict[str, Any]) -> None:
        """Tokenise the evaluation text into ``cache``."""

    def open_checkpoint(self, digest: str) -> Any:
        """Lock the run's folders and open its checkpoint."""

    def release(self) -> None:
        """Let go of the lock."""

    def before_pruning(self, loaded: LoadedRun) -> None:
        """The dense model's results."""

    def pruned_model(self, sink, loaded: LoadedRun) -> BlockSource:
        """The pruned model, once pruning is done."""

    def publish(self, loaded: LoadedRun, prune_report, pruned_model: BlockSource, sink) -> dict[str, Any]:
        """What the rank returns: the report."""


class LeadRank:
    """What rank 0 of a prune run does beside pruning (the only rank of a run in one process):
    it speaks to the user, holds the lock on ``--out`` and the checkpoint folder
    (:class:`~nmprune.output.RunLock`), keeps the checkpoint, evaluates the dense and the
    pruned model and saves (:func:`run`). :class:`HelperRank` is every other rank's part: the
    same calls, doing nothing. :func:`run` calls them alike, whatever its rank."""

    writes = True

    def __init__(self, config: RunConfig, ckpt_dir: Path, progress: bool):
        from .output import RunLock, partial_save_dir

        self.config, self.ckpt_dir, self.progress = config, ckpt_dir, progress
        self.out = Path(config.out) if config.out else None
        # one lock per folder written, however it was named: a second run that names this run's
        # default checkpoint or its staged save (OUT.partial) as its --out or --checkpoint-dir is
        # refused too
        self.lock = RunLock([self.out, partial_save_dir(self.out), ckpt_dir] if self.out else [])
        self.checkpoint = None
        self.dense: tuple[dict[str, float], dict[str, Any]] = ({}, {})

    def say(self, text: str) -> None:
        from .progress import stage

        stage(text, enabled=self.progress)

    def warn(self, text: str) -> None:
        print(text, file=sys.stderr)

    def clear_completed(self) -> None:
        """Remove the checkpoint a completed run left beside its ``--out`` (killed after its rename)."""
        from .checkpoint import Checkpoint

        if self.out is not None and Checkpoint.discard_completed(self.ckpt_dir, self.out):
            self.lock.acquire().release()  # and the lock files of the run killed after its rename
            self.warn(f"removed {self.ckpt_dir}, left by the completed run that saved {self.out}")

    def tokenise(self, tokenizer, cache: dict[str, Any]) -> None:
        """The evaluation text, tokenised before the checkpoint exists: a text too short is
        refused with nothing written."""
        c = self.config
        token_streams(tokenizer, c.eval, c.eval_seqlen, c.eval_max_tokens or None, cache)

    def open_checkpoint(self, digest: str):
        """Lock the run's folders (another run on the same ``--out`` or checkpoint is refused
        here), clear what a killed save left and open the checkpoint, bound to the model's files."""
        from .checkpoint import Checkpoint
        from .output import remove_partial_save

        self.lock.acquire()
        remove_partial_save(self.out)
        self.checkpoint = Checkpoint.open(self.ckpt_dir, self.config.identity(blocks=True), restart=self.config.restart)
        self.checkpoint.bind("model files", digest)
        return self.checkpoint

    def release(self) -> None:
        self.lock.release()

    def before_pruning(self, loaded: LoadedRun) -> None:
        """Say where a resumed run starts, then :attr:`dense`: the dense model's perplexities and
        lm-eval results, from the checkpoint where a run before the resume measured them, else
        measured now and kept there. A perplexity that is not finite (the model overflows) is
        refused before any pruning."""
        from .downstream import evaluate_tasks
        from .memory import release_memory
        from .validate import check_finite_value

        config, ckpt = self.config, self.checkpoint
        model, tokenizer, device, timings = loaded.model, loaded.tokenizer, loaded.device, loaded.timings
        if ckpt.done_blocks:
            self.warn(f"resuming from {ckpt.directory}: {ckpt.done_blocks} blocks already pruned")
        downstream = downstream_settings(config)
        key = f"dense_perplexity/{config.eval_seqlen}/{config.eval_max_tokens}"
        dense = ckpt.get(key, {})
        missing = [d for d in config.eval if d not in dense]
        if missing:
            t = time.perf_counter()
            self.say(f"evaluating the dense model (perplexity on {', '.join(missing)})")
            dense.update(evaluate(model, tokenizer, missing, config.eval_seqlen,
                                  config.eval_max_tokens or None, device, self.progress, loaded.cache, "dense"))
            for name in missing:
                check_finite_value(dense[name], f"the dense model's perplexity on {name}")
            release_memory()
            ckpt.put(key, dense)
            timings["eval_dense"] = time.perf_counter() - t
        acc_key = "dense_downstream/" + json.dumps(downstream.to_dict(), sort_keys=True)
        dense_acc = ckpt.get(acc_key, {})
        if downstream.tasks and not dense_acc:
            t = time.perf_counter()
            self.say(f"evaluating the dense model (lm-eval: {', '.join(downstream.tasks)})")
            dense_acc = evaluate_tasks(model.whole_model("--eval-tasks"), tokenizer, downstream, device=device)
            release_memory()
            ckpt.put(acc_key, dense_acc)
            timings["downstream_dense"] = time.perf_counter() - t
        self.dense = dense, dense_acc

    def pruned_model(self, sink, loaded: LoadedRun) -> BlockSource:
        """The pruned model to evaluate: the sink's (in memory, the model itself)."""
        return sink.finish(loaded.tokenizer)

    def publish(self, loaded: LoadedRun, prune_report, pruned_model: BlockSource, sink) -> dict[str, Any]:
        """Evaluate the pruned model, then save it with its tokenizer and the report into
        ``OUT.partial/``, renamed to ``--out`` (all three appear at once); delete the
        checkpoint. Returns the report."""
        from .downstream import evaluate_tasks

        config, ckpt, out = self.config, self.checkpoint, self.out
        tokenizer, timings, device = loaded.tokenizer, loaded.timings, loaded.device
        downstream = downstream_settings(config)
        dense, dense_acc = self.dense
        t = time.perf_counter()
        if config.eval:
            self.say(f"evaluating the pruned model (perplexity on {', '.join(config.eval)})")
        pruned = evaluate(pruned_model, tokenizer, config.eval, config.eval_seqlen,
                          config.eval_max_tokens or None, device, self.progress, loaded.cache, "pruned") \
            if config.eval else {}
        timings["eval_pruned"] = time.perf_counter() - t
        pruned_acc = {}
        if downstream.tasks:
            t = time.perf_counter()
            self.say(f"evaluating the pruned model (lm-eval: {', '.join(downstream.tasks)})")
            pruned_acc = evaluate_tasks(pruned_model.whole_model("--eval-tasks"), tokenizer, downstream,
                                        device=device)
            timings["downstream_pruned"] = time.perf_counter() - t
        layers = [r for r in prune_report.layers if not r.get("skipped")]
        ratios = [r["loss_vs_wanda"] for r in layers if r.get("loss_vs_wanda") is not None]
        report = {
            "model": str(loaded.source), "run": _run_label(config), "model_files": ckpt.get("model files"),
            "config": to_dict(config), "identity": config.identity(),
            "versions": versions(), "device": str(device), "streamed": loaded.model.streamed,
            "perplexity": {"dense": {d: dense[d] for d in config.eval}, "pruned": pruned,
                           "seqlen": config.eval_seqlen, "max_tokens": config.eval_max_tokens},
            "downstream": {"dense": dense_acc, "pruned": pruned_acc, "settings": downstream.to_dict()},
            "summary": {"layers_pruned": len(layers),
                        "layers_skipped": len(prune_report.layers) - len(layers),
                        "mean_loss_vs_wanda": sum(ratios) / len(ratios) if ratios else None},
            "reconstruction": reconstruction_summary(loaded.settings, prune_report.blocks, prune_report.end_to_end),
            "distillation": prune_report.distillation if loaded.distill_skipped is None
            else {"skipped": loaded.distill_skipped},
            "resumed_from_block": prune_report.resumed_from_block,
            "ranks": prune_report.ranks, "per_rank": prune_report.per_rank,
            "seconds": {**timings, "pipeline": prune_report.seconds},
            "layers": prune_report.layers,
        }
        report["seconds"]["total_before_save"] = time.perf_counter() - loaded.t0
        # model, tokenizer and report go to OUT.partial/ and appear together under OUT by one rename
        extra = {REPORT_FILE: json.dumps(report, indent=1, default=str)}
        self.say(f"saving the pruned model to {out}")
        ckpt.put("published_to", str(out.resolve()))  # a kill after the rename: the next run cleans up
        sink.publish(extra)
        ckpt.remove()
        report["saved_to"] = str(out)  # for the caller; not in the saved report (the folder may move)
        return report


class HelperRank:
    """Every rank but 0 of a prune run (:class:`LeadRank`): it prunes its share, then returns
    the pruning report; it writes nothing, says nothing and keeps no checkpoint."""

    writes = False
    checkpoint = None

    def say(self, text: str) -> None:
        pass

    warn = say

    def clear_completed(self) -> None:
        pass

    def tokenise(self, tokenizer, cache: dict[str, Any]) -> None:
        pass

    def open_checkpoint(self, digest: str) -> None:
        return None

    release = clear_completed

    def before_pruning(self, loaded: LoadedRun) -> None:
        pass

    def pruned_model(self, sink, loaded: LoadedRun) -> BlockSource:
        return loaded.model

    def publish(self, loaded: LoadedRun, prune_report, pruned_model: BlockSource, sink) -> dict[str, Any]:
        return prune_report.to_dict()


def run(config: RunConfig, *, progress: bool = True, on_block_done=None) -> dict[str, Any]:
    """The whole ``nmprune prune`` job; returns the report written next to the model
    (:func:`result_table` makes its table of perplexities and accuracies).

    Order: the inputs that can be checked without the model (:mod:`nmprune.validate`:
    settings, ``--out`` and the checkpoint folder apart and nmprune's own if they exist) and
    the plans; the digest of the model's files (:mod:`nmprune.identity`; under ``torchrun``
    every rank must bring the same settings and digest); load (a decoder-only causal LM with
    a tokenizer, every tensor the checkpoint's); tokenise the evaluation and calibration text;
    only then lock ``--out`` and the checkpoint folder (:class:`~nmprune.output.RunLock`) and open the checkpoint,
    bound to the settings and the model digest; dense perplexity (kept in the
    checkpoint); :func:`prune_model` with a checkpoint after every block; pruned
    perplexity; save model + tokenizer + report into ``OUT.partial/`` renamed to ``out``
    (all three appear at once); delete the checkpoint. A rerun of the same command after a
    crash resumes from the checkpoint; a user error before the first block is finished
    leaves no checkpoint of this run behind. When the weights stream (:func:`open_model`),
    every stage runs block by block: the pruned blocks are written into
    ``OUT.partial/unfinished`` as they finish and the pruned model is evaluated from there.

    Under ``torchrun`` with several ranks (:mod:`nmprune.distributed`) every rank loads the
    model and takes part in :func:`prune_model`; rank 0 alone keeps the checkpoint, evaluates
    and saves (its report holds ``saved_to``), and the other ranks return the pruning report
    once pruning is done.
    """
    from . import distributed
    from .checks import NonFiniteModel
    from .data import calibration_batch
    from .identity import model_digest
    from .memory import release_memory
    from .stages.distillation import PassMemory
    from .streaming.fit import ranks_offload

    ranks = distributed.job_ranks(config.device)
    phase = ranks.phase
    ckpt_dir = Path(config.checkpoint_dir or f"{config.out}.checkpoint")
    role = LeadRank(config, ckpt_dir, progress) if ranks.is_main else HelperRank()
    with phase("checking the settings"):
        role.clear_completed()
        resolved, model_config, downstream = check_run(config, writes=role.writes)
        digest = model_digest(resolved)
        offload = ranks_offload(config.offload, ranks.world, resolved)
        shortfall, memory = (_distill_fit(config, ranks.world, resolved, model_config)
                             if config.prune.distill_passes() else (None, PassMemory()))
    # every rank the same job, before any of them loads
    ranks.agree({"settings": config.identity(), "model files": digest})
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    role.say(f"loading {resolved}" + (" (transformers de-quantises the GGUF file's tensors: its 'Converting and "
                                      "de-quantizing GGUF tensors' bar)" if resolved.gguf_file else ""))
    with phase("loading the model"):
        model, tokenizer, source = open_model(config.model, config.gguf_file, config.dtype, offload,
                                              config.allow_pickle, ranks.local_world,
                                              model_config)
        if downstream.tasks:
            model.whole_model("--eval-tasks")  # refused when streamed
        if tokenizer is None:
            raise ValueError(f"{source} has no tokenizer; nmprune needs one for calibration and "
                             "evaluation text (save one next to the model)")
        timings["load"] = time.perf_counter() - t0
        # every tensor the run will save, before any work (a streamed model reads each once)
        model.check_finite()
        # prune_model warns about skipped layers itself
        config.prune.planner().plan_layers(model.layer_shapes(), warn=False)
        # the text is tokenised before the checkpoint exists: a text too short is refused with
        # nothing written
        cache: dict[str, Any] = {}
        role.say("tokenising the evaluation and calibration text")
        role.tokenise(tokenizer, cache)
        p = config.prune
        try:
            calibration = calibration_batch(tokenizer, source=p.calib, nsamples=p.nsamples,
                                            seqlen=p.seqlen, seed=p.seed)
        except ValueError as e:
            raise ValueError(f"--calib {p.calib}: {e}") from e
        release_memory()  # the tokenised corpora, before the evaluation's activations
    settings, distill_skipped = _auto_distillation(config.prune, shortfall, ranks)
    if distill_skipped is not None:
        role.warn(f"nmprune: skipping the global distillation (distill_epochs: auto): {distill_skipped}")
    with phase("drawing the global distillation's windows"):
        own_windows = _distill_windows(tokenizer, settings) \
            if settings.distill_passes() else None
    try:
        with phase("opening the checkpoint"):
            role.open_checkpoint(digest)
        loaded = LoadedRun(settings, distill_skipped, memory, model, tokenizer, source, cache, timings, t0,
                           ranks.device)
        return _prune_and_save(config, loaded, role, (calibration, own_windows), progress, on_block_done, ranks,
                               ckpt_dir)
    except ValueError as e:
        # refused before any progress, or the model itself overflows (its corrected weights
        # are another model): leave no checkpoint of this run
        ckpt = role.checkpoint
        if ckpt is not None and (ckpt.created and ckpt.done_blocks == 0 or isinstance(e, NonFiniteModel)):
            ckpt.remove()
        raise
    finally:
        role.release()


def _prune_and_save(config: RunConfig, loaded: LoadedRun, role: RunRole, calibration, progress: bool,
                    on_block_done, ranks, ckpt_dir: Path) -> dict[str, Any]:
    """:func:`run` after loading: dense perplexity and accuracy, pruning with
    ``loaded.settings`` on ``calibration`` (the run's windows and the distillation's own, or
    None), pruned perplexity and accuracy, save: what ``role`` does of them (rank 0 all,
    the other ranks only the pruning, after which they return its report)."""
    from .pipeline import prune_model

    model, tokenizer = loaded.model, loaded.tokenizer
    role.before_pruning(loaded)
    t = time.perf_counter()
    # in memory, the model is pruned in place; streamed, each pruned block goes straight into
    # a shard of OUT.partial/unfinished/, written by rank 0 alone
    sink = model.output(Path(config.out), writes=role.writes)
    role.say(f"pruning block by block: {_run_label(config)}")
    try:
        prune_report = prune_model(None, tokenizer, loaded.settings, calibration=calibration[0],
                                   distill_calibration=calibration[1], device=ranks.device,
                                   checkpoint=role.checkpoint, progress=progress, on_block_done=on_block_done,
                                   source=model, sink=sink, scratch=ckpt_dir,
                                   distill_memory=loaded.distill_memory)
        pruned_model = role.pruned_model(sink, loaded)
    except BaseException:
        sink.abandon()
        raise
    loaded.timings["prune"] = time.perf_counter() - t
    return role.publish(loaded, prune_report, pruned_model, sink)


def reconstruction_summary(s, blocks: list[dict[str, Any]], end_to_end: dict[str, Any] | None) -> dict[str, Any]:
    """The reconstruction part of a run's report: its settings ``s``, one record per block (the
    channel-weighted squared error of the block's outputs relative to the dense model's,
    before and after, on the held-out and the training calibration batches), the means
    of those errors over the blocks, and the end-to-end check (held-out calibration
    perplexity of the dense, the solved and the reconstructed model)."""

    def mean(key: str) -> float | None:
        """The mean over the blocks; None unless every block has the error (``error_before``
        is known only where it is computed)."""
        values = [b[key] for b in blocks if b.get(key) is not None]
        return sum(values) / len(values) if values and len(values) == len(blocks) else None

    return {"granularity": s.reconstruct, "epochs": s.reconstruct_epochs, "lr": s.reconstruct_lr,
            "batch_size": s.reconstruct_batch_size or s.batch_size, "lanes": s.reconstruct_lanes,
            "mean_heldout_before": mean("heldout_before"), "mean_heldout_after": mean("heldout_after"),
            "mean_error_before": mean("error_before"), "mean_error_after": mean("error_after"),
            "end_to_end": end_to_end, "blocks": blocks}


def _judged(distilled: dict[str, Any]) -> str:
    """Which batches judged the pass, for the summary line."""
    return "training" if distilled.get("judged_on") == "training batches" else "held-out"


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def reconstruction_table(report: dict[str, Any]) -> str:
    """Each reconstructed block's output error relative to the dense model, before and after
    reconstruction, on the held-out calibration batches (what decides ``kept``) and on the
    training ones, as a Markdown table (empty without reconstruction)."""
    blocks = report.get("reconstruction", {}).get("blocks", [])
    if not blocks:
        return ""
    lines = [f"| block | held-out error before ({report['reconstruction']['granularity']}) | held-out after | "
             "training error before | training after | kept |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {b['block']} | {_error(b.get('heldout_before'))} | {_error(b.get('heldout_after'))} | "
              f"{_error(b['error_before'])} | {_error(b['error_after'])} | {b['kept']} |" for b in blocks]
    check = report["reconstruction"].get("end_to_end")
    if check and check.get("checked"):
        lines.append(f"\ncalibration text held out of the training, not of the layer statistics "
                     f"({check['tokens']} tokens): perplexity dense "
                     f"{check['dense']:.4g}, solved {check['solved']:.4g}, reconstructed "
                     f"{check['reconstructed']:.4g}; KL from dense: solved {check['kl_solved']:.4g}, "
                     f"reconstructed {check['kl_reconstructed']:.4g}")
        if check["kl_reconstructed"] > check["kl_solved"]:  # within the margin that stops a run
            lines.append(f"warning: reconstruction left the model {check['kl_reconstructed'] / check['kl_solved']:.3g}x "
                         "as far from the dense one as the solved weights alone on the held-out calibration "
                         "text; --reconstruct none may serve this model better")
    elif check:
        measured = (f"; calibration text held out of the training, not of the layer statistics ({check['tokens']} "
                    f"tokens): perplexity dense {check['dense']:.4g}, reconstructed {check['reconstructed']:.4g}; "
                    f"KL from dense {check['kl_reconstructed']:.4g}" if "dense" in check else "")
        lines.append(f"\nend-to-end check not made: {check['why']}{measured}")
    distilled = report.get("distillation")
    if distilled and "skipped" in distilled:
        lines.append(f"global distillation skipped: {distilled['skipped']}")
    elif distilled:
        resumed = (f", resumed after step {distilled['resumed_from_step']}"
                   if distilled.get("resumed_from_step") is not None else "")
        lines.append(f"global distillation ({distilled['epochs']} epoch(s), {distilled['steps']} steps{resumed}, "
                     f"{distilled['seconds']:.0f} s): {_judged(distilled)} KL from dense "
                     f"{_error(distilled['heldout_before'])} "
                     f"-> {_error(distilled['heldout_trained'])}, kept: {distilled['kept']}"
                     + (f" ({distilled['diverged']})" if distilled.get("diverged") else ""))
    return "\n".join(lines)


def result_table(report: dict[str, Any]) -> str:
    """The dense and pruned perplexities and accuracies of a :func:`run` report as a table
    (empty when the run evaluated nothing)."""
    from .downstream import accuracy_columns
    from .evaluate import perplexity_table

    ppl, acc = report["perplexity"], report["downstream"]
    if not ppl["dense"] and not acc["settings"]["tasks"]:
        return ""
    return perplexity_table({"dense": {**ppl["dense"], **accuracy_columns(acc["dense"])},
                             report["run"]: {**ppl["pruned"], **accuracy_columns(acc["pruned"])}})


def evaluate_model(spec: str | None, *, data: list[str], seqlen: int, max_tokens: int,
                   tasks=None, gguf_file: str | None = None, dtype: str | None = None,
                   device: str | None = None, offload: bool | None = None,
                   allow_pickle: bool = False, progress: bool = True) -> tuple[str, dict[str, float]]:
    """The whole ``nmprune eval`` job: ``(model name, {column: value})`` with the perplexity
    on each of ``data`` (held-out split, windows of ``seqlen``, the first ``max_tokens``
    tokens, 0 = all) and the accuracy on the lm-eval ``tasks``
    (:class:`~nmprune.downstream.DownstreamSettings`, ``None``: none). Every input that can
    be judged before the model loads is checked first."""
    from .downstream import accuracy_columns, check_tasks, evaluate_tasks
    from .validate import check_eval_inputs, check_finite_value, check_positions

    check_eval_inputs(data, device, dtype, seqlen, max_tokens)
    if tasks is not None and tasks.tasks:
        check_tasks(tasks)
    model, tokenizer, source = open_model(spec, gguf_file, dtype or "auto", offload, allow_pickle)
    lm_eval_model = model.whole_model("--tasks") if tasks is not None and tasks.tasks else None
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer; save one next to the model")
    check_positions(model.model.config, {"--seqlen": seqlen})
    if not model.streamed:  # a streamed model is checked tensor by tensor as it is read
        model.check_finite()
    result = evaluate(model, tokenizer, data, seqlen, max_tokens or None, device, progress)
    for name, value in result.items():
        check_finite_value(value, f"the perplexity of {source} on {name}")
    if lm_eval_model is not None:
        result.update(accuracy_columns(evaluate_tasks(lm_eval_model, tokenizer, tasks, device=device)))
    return str(source), result
