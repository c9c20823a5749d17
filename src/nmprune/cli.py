"""Command-line interface: ``nmprune prune``, ``nmprune eval``, ``nmprune methods``.

``nmprune prune`` with no arguments but ``--out`` prunes the packaged SmolLM2-135M-Instruct
to 2:4 with the default method, evaluates dense and pruned perplexity on the packaged
held-out text and saves the pruned model. Settings come from defaults, then a YAML file
(``--config``), then flags. See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from . import __version__
from .config import RunConfig, build_config, load_yaml, to_dict

REPORT_FILE = "nmprune_report.json"
#: Errors of the machine rather than of the input (a full disk, a failing device): exit code 1.
IO_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})


# ----------------------------------------------------------------------------- helpers

def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as YAML (numbers, booleans, lists...)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--option expects key=value, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def parse_override(text: str) -> tuple[str, Any]:
    """``GLOB=skip`` or ``GLOB=METHOD[+REFINE]`` (``+none`` for no refinement)."""
    glob, sep, spec = text.partition("=")
    if not sep or not glob or not spec:
        raise ValueError(f"--override expects GLOB=skip or GLOB=METHOD[+REFINE], got {text!r}")
    if spec == "skip":
        return glob, "skip"
    method, plus, refine = spec.partition("+")
    return glob, ({"method": method, "refine": refine} if plus else {"method": method})


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


def evaluate(model, tokenizer, datasets: list[str], seqlen: int, max_tokens: int | None,
             device: str | None, progress: bool, cache: dict[str, Any] | None = None) -> dict[str, float]:
    """Perplexity of ``model`` (loaded, or a :class:`~nmprune.streaming.StreamingModel`
    evaluated block by block) on each data set's held-out split (token streams cached)."""
    from .evaluate import perplexity
    from .streaming import StreamingModel
    from .streaming.evaluate import streaming_perplexity

    measure = streaming_perplexity if isinstance(model, StreamingModel) else perplexity
    cache = {} if cache is None else cache
    token_streams(tokenizer, datasets, seqlen, max_tokens, cache)
    return {name: measure(model, cache[name], seqlen=seqlen, device=device, progress=progress)
            for name in datasets}


def downstream_settings(config: RunConfig):
    """The lm-eval settings of a run (validated; no tasks: no downstream evaluation)."""
    from .downstream import DownstreamSettings, parse_task_list

    return DownstreamSettings(parse_task_list(config.eval_tasks), config.eval_num_fewshot,
                              config.eval_limit, config.eval_batch_size, tuple(config.eval_include_path))


def open_model(spec: str | None, gguf_file: str | None, dtype: str | None, offload: bool | None,
               allow_pickle: bool = False):
    """``(model, tokenizer, source)``: the model loaded whole, or a
    :class:`~nmprune.streaming.StreamingModel` whose blocks stream from its safetensors
    checkpoint when ``offload`` says so or the model does not fit in memory
    (:func:`nmprune.streaming.fit.choose_streaming`)."""
    from .memory import prefer_mmap
    from .models import check_causal, load_model, load_tokenizer, resolve_model
    from .streaming import StreamingModel
    from .streaming.fit import choose_streaming

    source = resolve_model(spec, gguf_file)
    config = check_causal(source)  # read once: a GGUF file's takes seconds to parse
    if not choose_streaming(source, dtype, offload, config):
        return load_model(spec, gguf_file=gguf_file, dtype=dtype, allow_pickle=allow_pickle, config=config)
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
    return f"{plan.method.name}{'+' + plan.refiner.name if plan.refiner else ''} {plan.pattern}"


# ----------------------------------------------------------------------------- prune run

def run_prune(config: RunConfig, *, progress: bool = True, on_block_done=None) -> dict[str, Any]:
    """The whole ``nmprune prune`` job; returns the report written next to the model.

    Order: the inputs that can be checked without the model (:mod:`nmprune.validate`) and
    the plans; load (a decoder-only causal LM with a tokenizer); tokenise the evaluation
    and calibration text; only then open the checkpoint; dense perplexity (kept in the
    checkpoint); :func:`prune_model` with a checkpoint after every block; pruned
    perplexity; save model + tokenizer + report into ``OUT.partial/`` renamed to ``out``
    (all three appear at once); delete the checkpoint. A rerun of the same command after a
    crash resumes from the checkpoint; a user error before the first block is finished
    leaves no checkpoint of this run behind. When the weights stream (:func:`open_model`),
    every stage runs block by block: the pruned blocks are written into
    ``OUT.partial/unfinished`` as they finish and the pruned model is evaluated from there.

    Under ``torchrun`` with several ranks (:mod:`nmprune.distributed`) every rank loads the
    model and takes part in :func:`prune_model`; rank 0 alone keeps the checkpoint, evaluates
    and saves, and the other ranks return the pruning report once pruning is done.
    """
    from . import distributed
    from .checkpoint import Checkpoint
    from .data import calibration_batch
    from .downstream import check_tasks
    from .identity import model_digest
    from .memory import release_memory
    from .models import resolve_model
    from .output import RunLock, remove_partial_save
    from .source import ModelBlocks
    from .streaming import StreamingModel
    from .validate import check_finite, check_positions, check_prune_inputs

    ranks = distributed.setup(config.device)
    main_rank = ranks is None or ranks.is_main
    phase = ranks.phase if ranks is not None else lambda name: contextlib.nullcontext()
    out = Path(config.out) if config.out else None
    ckpt_dir = Path(config.checkpoint_dir or f"{out}.checkpoint")
    # one lock per folder written: the default checkpoint is named after --out
    lock = RunLock(([out] + ([ckpt_dir] if config.checkpoint_dir else [])) if main_rank and out else [])
    with phase("checking the settings"):
        if main_rank:  # rank 0 alone writes --out and the checkpoint
            if out is not None and Checkpoint.discard_completed(ckpt_dir, out):
                lock.acquire().release()  # and the lock files of the run killed after its rename
                print(f"removed {ckpt_dir}, left by the completed run that saved {out}", file=sys.stderr)
            check_prune_inputs(config)
        downstream = downstream_settings(config)
        if downstream.tasks:
            check_tasks(downstream)
        config.prune.planner()  # every method, refiner, pattern and option, before the model loads
        digest = model_digest(resolve_model(config.model, config.gguf_file))
    if ranks is not None:  # every rank the same job, before any of them loads
        ranks.agree({"settings": config.identity(), "model files": digest})
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    with phase("loading the model"):
        model, tokenizer, source = open_model(config.model, config.gguf_file, config.dtype,
                                              config.offload, config.allow_pickle)
        streaming = isinstance(model, StreamingModel)
        if streaming and ranks is not None and ranks.world > 1:
            raise ValueError("a streamed run (--offload, or a model larger than memory) runs in "
                             "one process; run it without torchrun")
        if streaming and downstream.tasks:
            raise ValueError("--eval-tasks needs the model in memory; it cannot be combined with a "
                             "streamed run (--offload, or a model larger than memory)")
        if tokenizer is None:
            raise ValueError(f"{source} has no tokenizer; nmprune needs one for calibration and "
                             "evaluation text (save one next to the model)")
        check_positions((model.model if streaming else model).config, {"--seqlen": config.prune.seqlen, **(
            {"--eval-seqlen": config.eval_seqlen} if config.eval else {})})
        timings["load"] = time.perf_counter() - t0
        if not streaming:  # a streamed model's weights are read block by block later
            check_finite(model, source)
        with warnings.catch_warnings():  # prune_model warns about skipped layers itself
            warnings.simplefilter("ignore")
            config.prune.planner().plan_layers((model if streaming else ModelBlocks(model)).layer_shapes())
        # the text is tokenised before the checkpoint exists: a text too short is refused with
        # nothing written
        cache: dict[str, Any] = {}
        if main_rank:
            token_streams(tokenizer, config.eval, config.eval_seqlen, config.eval_max_tokens or None,
                          cache)
        p = config.prune
        try:
            calibration = calibration_batch(tokenizer, source=p.calib, nsamples=p.nsamples,
                                            seqlen=p.seqlen, seed=p.seed)
        except ValueError as e:
            raise ValueError(f"--calib {p.calib}: {e}") from e
        release_memory()  # the tokenised corpora, before the evaluation's activations
    ckpt = None
    try:
        with phase("opening the checkpoint"):
            if main_rank:  # only rank 0 keeps the checkpoint (and evaluates and saves)
                lock.acquire()  # another run on the same --out or checkpoint is refused here
                remove_partial_save(out)  # what a save killed in an earlier run left
                ckpt = Checkpoint.open(ckpt_dir, config.identity(), restart=config.restart)
                ckpt.bind("model files", digest)
        return _prune_and_save(config, model, tokenizer, source, ckpt, calibration, cache, timings,
                               t0, progress, on_block_done, ranks)
    except ValueError:
        if ckpt is not None and ckpt.created and ckpt.done_blocks == 0:
            ckpt.remove()  # refused before any progress: leave no checkpoint of this run
        raise
    finally:
        lock.release()


def _prune_and_save(config: RunConfig, model, tokenizer, source, ckpt, calibration, cache,
                    timings: dict[str, float], t0: float, progress: bool, on_block_done,
                    ranks) -> dict[str, Any]:
    """:func:`run_prune` after loading: dense perplexity and accuracy, pruning, pruned
    perplexity and accuracy, save (``ckpt`` is None on ranks other than 0, which return
    the pruning report once pruning is done)."""
    import torch

    from .downstream import accuracy_columns, evaluate_tasks
    from .evaluate import perplexity_table
    from .memory import release_memory
    from .output import save_pretrained_atomic
    from .pipeline import prune_model
    from .streaming import ShardedWriter, StreamingModel

    out = Path(config.out)
    main_rank = ranks is None or ranks.is_main
    downstream = downstream_settings(config)
    streaming = isinstance(model, StreamingModel)
    if ckpt is not None and ckpt.done_blocks:
        print(f"resuming from {ckpt.directory}: {ckpt.done_blocks} blocks already pruned", file=sys.stderr)
    device = ranks.device if ranks is not None else \
        (config.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    key = f"dense_perplexity/{config.eval_seqlen}/{config.eval_max_tokens}"
    dense = ckpt.get(key, {}) if ckpt is not None else {}
    missing = [d for d in config.eval if d not in dense]
    if main_rank and missing:
        t = time.perf_counter()
        dense.update(evaluate(model, tokenizer, missing, config.eval_seqlen,
                              config.eval_max_tokens or None, device, progress, cache))
        release_memory()
        ckpt.put(key, dense)
        timings["eval_dense"] = time.perf_counter() - t
    acc_key = "dense_downstream/" + json.dumps(downstream.to_dict(), sort_keys=True)
    dense_acc = ckpt.get(acc_key, {}) if ckpt is not None else {}
    if main_rank and downstream.tasks and not dense_acc:
        t = time.perf_counter()
        dense_acc = evaluate_tasks(model, tokenizer, downstream, device=device)
        release_memory()
        ckpt.put(acc_key, dense_acc)
        timings["downstream_dense"] = time.perf_counter() - t

    t = time.perf_counter()
    # streaming: each pruned block goes straight into a shard of OUT.partial/unfinished/
    sink = ShardedWriter(model, out) if streaming else None
    try:
        prune_report = prune_model(None if streaming else model, tokenizer, config.prune,
                                   calibration=calibration, device=device, checkpoint=ckpt,
                                   progress=progress, on_block_done=on_block_done,
                                   source=model if streaming else None, sink=sink)
        pruned_model = StreamingModel(sink.close(tokenizer), dtype=config.dtype) if streaming else model
    except BaseException:
        if sink is not None:
            sink.abandon()
        raise
    timings["prune"] = time.perf_counter() - t
    if not main_rank:
        return prune_report.to_dict()

    t = time.perf_counter()
    pruned = evaluate(pruned_model, tokenizer, config.eval, config.eval_seqlen,
                      config.eval_max_tokens or None, device, progress, cache) if config.eval else {}
    timings["eval_pruned"] = time.perf_counter() - t
    pruned_acc = {}
    if downstream.tasks:
        t = time.perf_counter()
        pruned_acc = evaluate_tasks(model, tokenizer, downstream, device=device)
        timings["downstream_pruned"] = time.perf_counter() - t
    table = perplexity_table({
        "dense": {**{d: dense[d] for d in config.eval}, **accuracy_columns(dense_acc)},
        _run_label(config): {**pruned, **accuracy_columns(pruned_acc)},
    }) if config.eval or downstream.tasks else ""

    layers = [r for r in prune_report.layers if not r.get("skipped")]
    ratios = [r["loss_vs_wanda"] for r in layers if r.get("loss_vs_wanda") is not None]
    report = {
        "model": str(source), "model_files": ckpt.get("model files"), "config": to_dict(config),
        "identity": config.identity(),
        "versions": versions(), "device": str(device), "streamed": streaming,
        "perplexity": {"dense": {d: dense[d] for d in config.eval}, "pruned": pruned,
                       "seqlen": config.eval_seqlen, "max_tokens": config.eval_max_tokens},
        "downstream": {"dense": dense_acc, "pruned": pruned_acc, "settings": downstream.to_dict()},
        "summary": {"layers_pruned": len(layers),
                    "layers_skipped": len(prune_report.layers) - len(layers),
                    "mean_loss_vs_wanda": sum(ratios) / len(ratios) if ratios else None},
        "resumed_from_block": prune_report.resumed_from_block,
        "ranks": prune_report.ranks, "per_rank": prune_report.per_rank,
        "seconds": {**timings, "pipeline": prune_report.seconds},
        "layers": prune_report.layers,
    }
    report["seconds"]["total_before_save"] = time.perf_counter() - t0
    # model, tokenizer and report go to OUT.partial/ and appear together under OUT by one rename
    extra = {REPORT_FILE: json.dumps(report, indent=1, default=str)}
    ckpt.put("published_to", str(out.resolve()))  # a kill after the rename: the next run cleans up
    if streaming:
        sink.publish(extra)
    else:
        save_pretrained_atomic(model, tokenizer, out, extra)
    ckpt.remove()
    if table:
        print(table)
    print(f"saved the pruned model to {out} (report: {out / REPORT_FILE})", file=sys.stderr)
    return report


# ----------------------------------------------------------------------------- parsers

def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory, .gguf file or hub id "
                   "(default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", dest="gguf_file", help="GGUF file inside --model DIR")
    p.add_argument("--dtype", help="auto (default), float32, bfloat16, float16, float64")
    p.add_argument("--device", help="compute device, e.g. cuda or cpu (default: cuda if available)")
    p.add_argument("--offload", action="store_true", default=None,
                   help="stream the weights block by block from the safetensors checkpoint instead "
                        "of loading the model whole (default: only when it does not fit in memory)")
    p.add_argument("--allow-pickle", dest="allow_pickle", action="store_true", default=None,
                   help="also load pickle weights (pytorch_model.bin), which can run code; "
                        "default: safetensors only")


def _add_task_args(p: argparse.ArgumentParser, prefix: str) -> None:
    """lm-eval flags; ``prefix`` "eval_" (prune) stores them under RunConfig's names."""
    tasks = "--eval-tasks" if prefix else "--tasks"
    p.add_argument(tasks, dest=f"{prefix}tasks", action="append", metavar="TASK[,TASK...]",
                   help="lm-eval tasks to report accuracy on (nmprune_wiki_cloze, nmprune_wiki_next, "
                        "nmprune_austen_cloze, nmprune_austen_next work offline; the tag nmprune names "
                        "all four); repeatable")
    p.add_argument("--num-fewshot", dest=f"{prefix}num_fewshot", type=int,
                   help="few-shot examples per lm-eval task (default: the task's own, 0 for ours)")
    p.add_argument("--limit", dest=f"{prefix}limit", type=int,
                   help="evaluate the first N items of each lm-eval task (default: all)")
    batch = "--eval-batch-size" if prefix else "--batch-size"
    p.add_argument(batch, dest=f"{prefix}batch_size", type=int, help="lm-eval batch size (default 8)")
    p.add_argument("--include-path", dest=f"{prefix}include_path", action="append", metavar="DIR",
                   help="folder of your own lm-eval task YAML files; repeatable")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmprune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"nmprune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prune", help="prune a causal LM to N:M, evaluate and save it")
    p.add_argument("--config", help="YAML file of settings (flags override it)")
    _add_model_args(p)
    p.add_argument("--out", help="output directory for the pruned model (must not exist)")
    p.add_argument("--method", help="layer pruning method (see `nmprune methods`; default prox, the paper's method)")
    p.add_argument("--refine", help="refiner after masking: exact (default), gd or none")
    p.add_argument("--pattern", help="N:M pattern (default 2:4)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="solver option (refiner options are prefixed refine_); repeatable")
    p.add_argument("--override", action="append", default=[], metavar="GLOB=SPEC",
                   help="per-layer override by name glob: GLOB=skip or GLOB=METHOD[+REFINE]")
    p.add_argument("--calib", help="calibration text source (default wiki)")
    p.add_argument("--nsamples", type=int, help="calibration sequences (default 64)")
    p.add_argument("--seqlen", type=int, help="calibration sequence length (default 512)")
    p.add_argument("--seed", type=int, help="calibration sampling seed (default 0)")
    p.add_argument("--batch-size", dest="batch_size", type=int,
                   help="calibration sequences per forward pass (default 2)")
    p.add_argument("--hessian-inputs", dest="hessian_inputs", choices=["dense", "pruned"],
                   help="block inputs from the dense model (default) or the pruned blocks")
    p.add_argument("--hessian-dtype", dest="hessian_dtype", choices=["float32", "float64"])
    p.add_argument("--damp", type=float,
                   help="Hessian dampening: solvers see H + DAMP * mean(diag H) * I (default 0.01; "
                        "0 = the paper's undamped loss)")
    p.add_argument("--strict", action="store_true", default=None,
                   help="error (instead of skipping) on layers whose d_in is not divisible by M")
    p.add_argument("--eval", action="append", metavar="DATA",
                   help="also evaluate on DATA (wiki, c4, wikitext2, austen, file.txt); repeatable")
    p.add_argument("--no-eval", action="store_true", help="skip the perplexity evaluation")
    p.add_argument("--eval-seqlen", dest="eval_seqlen", type=int, help="evaluation window (default 512)")
    p.add_argument("--eval-max-tokens", dest="eval_max_tokens", type=int,
                   help="evaluate on the first N held-out tokens (default 8192; 0 = all)")
    _add_task_args(p, "eval_")
    p.add_argument("--checkpoint-dir", dest="checkpoint_dir",
                   help="where progress is saved (default: OUT.checkpoint)")
    p.add_argument("--restart", action="store_true", default=None,
                   help="discard an existing checkpoint and start over")
    p.add_argument("--quiet", action="store_true", help="no progress bars")

    e = sub.add_parser("eval", help="perplexity on held-out text and accuracy on lm-eval tasks")
    _add_model_args(e)
    e.add_argument("--data", action="append", metavar="DATA",
                   help="wiki (default), c4, wikitext2, austen or a text file; repeatable")
    e.add_argument("--seqlen", type=int, default=512, help="evaluation window (default 512)")
    e.add_argument("--max-tokens", dest="max_tokens", type=int, default=8192,
                   help="first N held-out tokens (default 8192; 0 = all)")
    _add_task_args(e, "")
    e.add_argument("--quiet", action="store_true", help="no progress bars")

    sub.add_parser("methods", help="list the pruning methods and refiners with their options")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults < YAML (``--config``) < flags."""
    yaml_settings = load_yaml(args.config) if args.config else {}
    flags: dict[str, Any] = {k: getattr(args, k) for k in (
        "model", "gguf_file", "dtype", "device", "out", "method", "refine", "pattern", "calib",
        "nsamples", "seqlen", "seed", "batch_size", "hessian_inputs", "hessian_dtype", "damp", "strict",
        "eval_seqlen", "checkpoint_dir", "restart", "allow_pickle", "eval_tasks", "eval_num_fewshot",
        "eval_limit", "eval_batch_size", "eval_include_path", "offload")}
    if args.option:
        flags["options"] = dict(parse_option(o) for o in args.option)
    # YAML values of the wrong type are left as they are, for build_config to refuse by name
    base_overrides = yaml_settings.get("overrides") or {}
    if args.override and isinstance(base_overrides, dict):
        flags["overrides"] = {**base_overrides, **dict(parse_override(o) for o in args.override)}
    flags["eval_max_tokens"] = args.eval_max_tokens
    base_eval = yaml_settings.get("eval", ["wiki"])
    base_eval = [base_eval] if isinstance(base_eval, str) else base_eval or []
    if args.no_eval:
        flags["eval"] = []
    elif args.eval and isinstance(base_eval, list):
        flags["eval"] = base_eval + [d for d in args.eval if d not in base_eval]
    return build_config(yaml_settings, flags)


def _methods_text() -> str:
    from .registry import get_method, get_refiner, methods, refiners

    lines = ["methods:"]
    for name in methods():
        m = get_method(name)
        opts = ", ".join(m.option_names()) or "-"
        lines.append(f"  {name:<12} {m.description}  [options: {opts}]")
    lines.append("refiners (options prefixed refine_):")
    for name in refiners():
        r = get_refiner(name)
        opts = ", ".join(r.option_names()) or "-"
        lines.append(f"  {name:<12} {r.description}  [options: {opts}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .distributed import RankError, teardown

    args = build_parser().parse_args(argv)
    failure: BaseException | None = None
    code = 0
    try:
        if args.command == "methods":
            print(_methods_text())
        elif args.command == "prune":
            from .memory import prefer_mmap

            prefer_mmap()  # keeps the resident set flat over a long run (nmprune/memory.py)
            run_prune(config_from_args(args), progress=not args.quiet)
        elif args.command == "eval":
            from .evaluate import perplexity_table
            from .streaming import StreamingModel
            from .validate import check_eval_inputs, check_finite, check_finite_value, check_positions

            from .downstream import (DownstreamSettings, accuracy_columns, check_tasks,
                                     evaluate_tasks, parse_task_list)

            downstream = DownstreamSettings(parse_task_list(args.tasks), args.num_fewshot, args.limit,
                                            args.batch_size or 8, tuple(args.include_path or ()))
            data = args.data or ([] if downstream.tasks else ["wiki"])
            check_eval_inputs(data, args.device, args.dtype, args.seqlen, args.max_tokens)
            if downstream.tasks:
                check_tasks(downstream)
            model, tokenizer, source = open_model(args.model, args.gguf_file, args.dtype or "auto",
                                                  args.offload, bool(args.allow_pickle))
            streaming = isinstance(model, StreamingModel)
            if streaming and downstream.tasks:
                raise ValueError("--tasks needs the model in memory; it cannot be combined with "
                                 "--offload or a model larger than memory")
            if tokenizer is None:
                raise ValueError(f"{source} has no tokenizer; save one next to the model")
            check_positions((model.model if streaming else model).config, {"--seqlen": args.seqlen})
            if not streaming:
                check_finite(model, source)
            result = evaluate(model, tokenizer, data, args.seqlen, args.max_tokens or None,
                              args.device, not args.quiet)
            for name, value in result.items():
                check_finite_value(value, f"the perplexity of {source} on {name}")
            if downstream.tasks:
                result.update(accuracy_columns(evaluate_tasks(model, tokenizer, downstream,
                                                              device=args.device)))
            print(perplexity_table({str(source): result}))
    except (ValueError, OSError) as e:  # the user's input or environment; anything else is a bug
        print(f"nmprune: error: {' '.join(str(e).split())}", file=sys.stderr)
        failure, code = e, 1 if isinstance(e, OSError) and e.errno in IO_FAILURES else 2
    except RankError as e:
        print(f"nmprune: error: {e}", file=sys.stderr)
        failure, code = e, 1
    finally:
        teardown(failure)  # a bug's traceback goes on after it
    return code


if __name__ == "__main__":
    sys.exit(main())
