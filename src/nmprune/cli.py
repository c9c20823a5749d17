"""Command-line interface: ``nmprune prune``, ``nmprune eval``, ``nmprune methods``.

``nmprune prune`` with no arguments but ``--out`` prunes the packaged SmolLM2-135M-Instruct
to 2:4 with the default method, evaluates dense and pruned perplexity on the packaged
held-out text and saves the pruned model. Settings come from defaults, then a YAML file
(``--config``), then flags. See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from . import __version__
from .config import AUTO, RunConfig, build_config, load_yaml
from .output import IO_FAILURES, os_error
from .reconstruct import TRAIN_PRECISIONS
from .stages.reconstruction import GRANULARITIES, RECONSTRUCTION_TEXT

#: The exit code after Ctrl-C (SIGINT), as shells report a process it ended: 128 + 2.
INTERRUPTED = 130
#: The exit code after SIGTERM (torchrun stops every rank with it once one fails): 128 + 15.
TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM during ``nmprune prune``: stopped like Ctrl-C, the checkpoint kept."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def _hard_exit(code: int) -> Callable[[int, Any], None]:
    """A signal handler that ends the process at once with ``code``: a second Ctrl-C or
    SIGTERM while a stopped run exits (torch's atexit handlers, say) prints no traceback."""
    def handler(signum: int, frame: Any) -> None:
        os._exit(code)
    return handler


def _stop_quietly(code: int) -> None:
    """At the exit of a stopped run: a further Ctrl-C or SIGTERM ends the process with ``code``."""
    signal.signal(signal.SIGINT, _hard_exit(code))
    signal.signal(signal.SIGTERM, _hard_exit(code))


def going_on(config: RunConfig | None) -> str:
    """How a stopped ``prune`` run of ``config`` goes on, from what its checkpoint holds: the
    finished blocks kept, or, before the first, nothing to resume."""
    from .checkpoint import MANIFEST

    if config is None or not config.out:
        return ""
    directory = Path(config.checkpoint_dir or f"{config.out}.checkpoint")
    try:
        done = int(json.loads((directory / MANIFEST).read_text())["done_blocks"])
    except (OSError, ValueError, KeyError, TypeError):
        done = 0
    if done:
        return f"rerun the same command to resume from the checkpoint {directory} ({done} finished blocks are kept)"
    return "no block was finished, so nothing is kept: the same command starts the run again"


def io_next_step(error: OSError) -> str:
    """What to do about a failed write or read of the machine's (:data:`~nmprune.output.IO_FAILURES`)."""
    if error.errno == errno.EROFS:
        return "the file system is read-only: choose another --out or --checkpoint-dir"
    if error.errno == errno.EIO:
        return "the disk failed: check it"
    return "free space there, or choose another --out or --checkpoint-dir"


# ----------------------------------------------------------------------------- parsing

def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as YAML (numbers, ``1e-3`` included, booleans, lists...)."""
    from .config import read_yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--option expects key=value, got {text!r}")
    return key.strip(), read_yaml(value)


def parse_override(text: str) -> tuple[str, Any]:
    """``GLOB=skip`` or ``GLOB=METHOD[+REFINE]`` (``+none`` for no refinement)."""
    glob, sep, spec = text.partition("=")
    if not sep or not glob or not spec:
        raise ValueError(f"--override expects GLOB=skip or GLOB=METHOD[+REFINE], got {text!r}")
    if spec == "skip":
        return glob, "skip"
    method, plus, refine = spec.partition("+")
    return glob, ({"method": method, "refine": refine} if plus else {"method": method})


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
                   help="calibration sequences per forward pass and per reconstruction step (default 1)")
    p.add_argument("--hessian-inputs", dest="hessian_inputs", choices=["dense", "pruned"],
                   help="block inputs from the dense model (default) or the pruned blocks")
    p.add_argument("--hessian-dtype", dest="hessian_dtype", choices=["float32", "float64"])
    p.add_argument("--reconstruct", dest="reconstruct", choices=list(GRANULARITIES),
                   help="after each block's solve, train its kept weights (mask held) to match the "
                        "dense model's activations: of its attention and MLP one after the other "
                        "(submodule), or of the whole block (block); default block")
    p.add_argument("--reconstruct-epochs", dest="reconstruct_epochs", type=int,
                   help="passes over the calibration set per reconstruction (default 2; docs/methods.md)")
    p.add_argument("--reconstruct-lr", dest="reconstruct_lr", type=float,
                   help="AdamW learning rate of the reconstruction, relative to each weight's RMS (a step "
                        "moves a weight by about this fraction of its typical entry), decayed linearly to 0 "
                        "(default 0.015)")
    p.add_argument("--reconstruct-batch-size", dest="reconstruct_batch_size", type=int,
                   help="calibration samples per reconstruction step, a multiple of --batch-size "
                        "(default: --batch-size, one calibration batch per step)")
    p.add_argument("--reconstruct-lanes", dest="reconstruct_lanes", type=int,
                   help="split the calibration batches into this many lanes; each round, every lane "
                        "computes one step's gradient at the same weights, and the steps follow one "
                        "another (gradients up to lanes-1 steps old), so that with a lane per rank "
                        "every rank trains; the result depends on the lanes, not on the ranks; more "
                        "lanes cost quality: 2 lanes took SmolLM2 from 24.17 to 24.80 wiki perplexity, "
                        "8 made it worse than no reconstruction (default 1)")
    p.add_argument("--distill-epochs", dest="distill_epochs", type=_count_or_auto, metavar="{auto,N}",
                   help="after the last block, passes of global distillation: the kept weights of every "
                        "pruned layer train towards the dense model's next-token distribution on the "
                        "calibration set (KL divergence, masks held); for models held whole in memory; "
                        "needs reconstruction. auto (default): one epoch where the model is held whole "
                        "and the pass fits in memory, else skipped with one line; N: N epochs, refused "
                        "where it cannot run; 0: none")
    p.add_argument("--train-precision", dest="train_precision", choices=TRAIN_PRECISIONS,
                   help="the dtype of the reconstruction's and the distillation's forward and backward "
                        "passes (weights, optimiser and loss stay float32): auto (default) computes in "
                        "bfloat16 where the device does so natively (CUDA; CPUs with AVX512-BF16 or AMX) "
                        "and the blocks are at least 256 wide, full keeps float32, bfloat16 always")
    p.add_argument("--distill-lr", dest="distill_lr", type=float,
                   help="AdamW learning rate of the global distillation, relative to each weight's RMS, "
                        "decayed linearly to 0 (default 0.001)")
    p.add_argument("--distill-nsamples", dest="distill_nsamples", type=_count_or_auto, metavar="{auto,N}",
                   help="calibration windows the global distillation trains on: the run's --nsamples and "
                        "N - nsamples more drawn for it alone (at least --nsamples; default auto: three "
                        "times --nsamples: 64, 128 and 192 windows gave SmolLM2 22.37, 20.39 and 19.88 wiki "
                        "perplexity; each further 64 windows add about 1.5 min to the main job)")
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
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print what the run will need (memory per rank, disk, time) from the "
                   "model's configuration and the settings, read no weights, and stop")
    p.add_argument("--ranks", type=int, help="with --dry-run: the number of torchrun ranks to plan "
                   "for (default WORLD_SIZE, else 1)")
    p.add_argument("--device-memory", dest="device_memory", type=float, metavar="GIB",
                   help="with --dry-run: the device's memory, the CPU's with --device cpu (default: "
                   "the CUDA device's, or the memory this machine has available on the CPU, as the run "
                   "judges it)")

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


def _count_or_auto(text: str) -> int | str:
    """``auto`` or a whole number (:class:`~nmprune.config.PruneSettings` judges its range)."""
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults < YAML (``--config``) < flags."""
    yaml_settings = load_yaml(args.config) if args.config else {}
    flags: dict[str, Any] = {k: getattr(args, k) for k in (
        "model", "gguf_file", "dtype", "device", "out", "method", "refine", "pattern", "calib",
        "nsamples", "seqlen", "seed", "batch_size", "hessian_inputs", "hessian_dtype", "damp", "strict",
        "reconstruct", "reconstruct_epochs", "reconstruct_lr", "reconstruct_batch_size", "reconstruct_lanes",
        "distill_epochs", "distill_lr", "distill_nsamples", "train_precision", "eval_seqlen", "checkpoint_dir", "restart", "allow_pickle", "eval_tasks", "eval_num_fewshot",
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
    lines.append("reconstruction after each block's solve (--reconstruct; --reconstruct-epochs, "
                 "--reconstruct-lr, --reconstruct-batch-size, --reconstruct-lanes):")
    lines += [f"  {name:<12} {text}" for name, text in RECONSTRUCTION_TEXT.items()]
    return "\n".join(lines)


def check_plan_flags(args: argparse.Namespace) -> None:
    """``--ranks`` and ``--device-memory`` describe the run a dry run plans: without
    ``--dry-run`` they would be ignored, so they are refused; with it, they are sane."""
    given = [flag for flag, value in (("--ranks", args.ranks), ("--device-memory", args.device_memory))
             if value is not None]
    if given and not args.dry_run:
        raise ValueError(f"{' and '.join(given)} describe the run that --dry-run plans; a run takes "
                         "its ranks from torchrun (--nproc-per-node) and its device's memory from the "
                         "device: add --dry-run, or drop them")
    if args.ranks is not None and not 1 <= args.ranks <= 65536:
        raise ValueError(f"--ranks must be a number of ranks from 1 to 65536, got {args.ranks}")
    if args.device_memory is not None and not (math.isfinite(args.device_memory) and
                                               0 < args.device_memory <= 1 << 20):
        raise ValueError(f"--device-memory must be the device's memory in GiB, a positive number "
                         f"(at most 1048576), got {args.device_memory:g}")


def _dry_run(config: RunConfig, ranks: int | None, device_memory: float | None) -> str:
    """``prune --dry-run``: the run's own checks (:func:`nmprune.job.check_run`), then the
    estimates of :mod:`nmprune.resources` as a table; a device too small for one block is
    refused (ValueError)."""
    import os

    import torch

    from .devices import default_device
    from .job import check_run
    from .resources import GIB, check_device_fits, needs_table, plan_distillation, plan_run
    from .streaming.fit import available_memory

    resolved, model_config, _ = check_run(config, device_here=False)
    ranks = ranks if ranks is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if device_memory is not None:  # the device's memory, or the CPU's on the CPU
        device_bytes = int(device_memory * GIB)
    elif default_device(config.device).type == "cuda":
        device_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    else:
        device_bytes = available_memory()  # as the run judges it on this machine
    needs, skipped = plan_distillation(config, ranks, (resolved, model_config), device_bytes)
    if skipped is not None:  # the run skips it (nmprune.job)
        config = replace(config, prune=replace(config.prune, distill_epochs=0))
        needs = plan_run(config, ranks, model=(resolved, model_config), available=device_bytes)
    check_device_fits(needs, device_bytes)
    return needs_table(needs) + (f"\n\nThe global distillation (distill_epochs: auto) is skipped: {skipped}."
                                 if skipped is not None else "")


def main(argv: list[str] | None = None) -> int:
    from .distributed import RankError, teardown

    args = build_parser().parse_args(argv)
    failure: BaseException | None = None
    config: RunConfig | None = None
    previous_int = None
    code, previous = 0, None
    try:
        if args.command == "methods":
            print(_methods_text())
        elif args.command == "prune":
            from .job import REPORT_FILE, reconstruction_table, result_table, run
            from .memory import prefer_mmap

            prefer_mmap()  # keeps the resident set flat over a long run (nmprune/memory.py)
            # torchrun stops the other ranks with SIGTERM once one fails: end as after Ctrl-C
            previous = signal.signal(signal.SIGTERM, _terminate)
            check_plan_flags(args)
            config = config_from_args(args)
            if args.dry_run:
                print(_dry_run(config, args.ranks, args.device_memory))
                return 0
            report = run(config, progress=not args.quiet)
            if "saved_to" in report:  # the process that saved the model (rank 0 under torchrun)
                for table in (reconstruction_table(report), result_table(report)):
                    if table:
                        print(table)
                print(f"saved the pruned model to {report['saved_to']} (report: "
                      f"{report['saved_to']}/{REPORT_FILE})", file=sys.stderr)
        elif args.command == "eval":
            from .downstream import DownstreamSettings, parse_task_list
            from .evaluate import perplexity_table
            from .job import evaluate_model

            tasks = DownstreamSettings(parse_task_list(args.tasks), args.num_fewshot, args.limit,
                                       args.batch_size or 8, tuple(args.include_path or ()))
            name, result = evaluate_model(
                args.model, data=args.data or ([] if tasks.tasks else ["wiki"]), seqlen=args.seqlen,
                max_tokens=args.max_tokens, tasks=tasks, gguf_file=args.gguf_file, dtype=args.dtype,
                device=args.device, offload=args.offload, allow_pickle=bool(args.allow_pickle),
                progress=not args.quiet)
            print(perplexity_table({name: result}))
    except (ValueError, OSError, SafetensorError) as e:  # the user's input or environment; anything else is a bug
        if isinstance(e, SafetensorError) and (e := os_error(e)) is None:
            raise
        machine = isinstance(e, OSError) and e.errno in IO_FAILURES
        text = ' '.join(str(e).split())
        if machine:  # what failed, where, and how to go on
            where = f" writing {e.filename}" if e.filename else ""
            resume = going_on(config) if args.command == "prune" and not args.dry_run else ""
            text = f"{e.strerror}{where}: {io_next_step(e)}" + (f"; then {resume}" if resume else "")
        print(f"nmprune: error: {text}", file=sys.stderr)
        failure, code = e, 1 if machine else 2
    except RankError as e:  # another rank's error: its code when it was the user's input
        print(f"nmprune: error: {e}", file=sys.stderr)
        failure, code = e, 2 if e.user_error else 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the checkpoint holds every finished block
        code = TERMINATED if isinstance(e, Terminated) else INTERRUPTED
        # a second Ctrl-C or SIGTERM ends the process at once, while it stops and while it exits
        previous_int = signal.signal(signal.SIGINT, _hard_exit(code))
        signal.signal(signal.SIGTERM, _hard_exit(code))
        atexit.register(_stop_quietly, code)  # runs before torch's own atexit handlers
        resume = going_on(config) if args.command == "prune" and not args.dry_run else ""
        if isinstance(e, Terminated) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            print("nmprune: error: stopped by SIGTERM (torchrun stops every rank once one fails: see its "
                  "report for the root cause)" + (f"; {resume.replace('same command', 'same torchrun command')}"
                                                  if resume else ""), file=sys.stderr)
        elif isinstance(e, Terminated):  # a scheduler's stop, or kill
            print("nmprune: error: stopped by SIGTERM" + (f"; {resume}" if resume else ""), file=sys.stderr)
        else:
            print("nmprune: interrupted" + (f"; {resume}" if resume else ""), file=sys.stderr)
        failure = e
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        try:
            teardown(failure)  # a bug's traceback goes on after it
        finally:
            if previous_int is not None:
                signal.signal(signal.SIGINT, previous_int)
    return code


if __name__ == "__main__":
    sys.exit(main())
