"""Checks at the command line's edge: every input that can be judged before a model loads.

Each check raises a ValueError (or FileNotFoundError) whose one-line message names the
offending flag and value, and writes nothing: a run refused here leaves the disk as it
found it. :func:`check_prune_inputs` and :func:`check_eval_inputs` gather them for the two
commands; :func:`check_finite` and :func:`check_finite_value` judge a loaded model and a
computed perplexity.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from .checks import NonFiniteModel

#: Compute backends nmprune runs on, with the test of whether this machine has one.
_BACKENDS = {
    "cpu": lambda: True,
    "cuda": lambda: torch.cuda.is_available(),
    "mps": lambda: torch.backends.mps.is_available(),
    "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
}
_DEVICE_COUNT = {"cuda": lambda: torch.cuda.device_count(),
                 "xpu": lambda: torch.xpu.device_count()}


def check_device(spec: str | None, flag: str = "--device", here: bool = True) -> None:
    """``spec`` names a backend nmprune computes on (cpu, cuda[:N], mps, xpu[:N]) that this
    machine has (``here``; else, for a plan of a run elsewhere, only that it is one);
    ``None`` (the default device) always passes."""
    if spec is None:
        return
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{flag} {spec!r} is not a device; use cpu, cuda, cuda:N, mps or xpu ({e})") from None
    if device.type not in _BACKENDS:
        raise ValueError(f"{flag} {spec!r}: nmprune computes on {', '.join(_BACKENDS)}, not {device.type}")
    if not here:
        return
    if not _BACKENDS[device.type]():
        raise ValueError(f"{flag} {spec!r}: this machine has no {device.type.upper()} device "
                         f"(torch {torch.__version__} reports it unavailable); use --device cpu")
    count = _DEVICE_COUNT.get(device.type)
    if count is not None and device.index is not None and device.index >= count():
        raise ValueError(f"{flag} {spec!r}: this machine has {count()} {device.type.upper()} "
                         f"device(s), numbered from 0")


def check_creatable_dir(path: str | os.PathLike, flag: str, *, must_not_exist: bool) -> None:
    """``path`` can be made a directory: it does not exist (when ``must_not_exist``) or is a
    directory, and its nearest existing ancestor is a directory this process can create
    entries in (tried with a probe directory that is removed at once)."""
    p = Path(path).expanduser().absolute()
    if p.exists():
        if must_not_exist:
            raise ValueError(f"{flag} {path} already exists; choose another {flag} or delete it")
        if not p.is_dir():
            raise ValueError(f"{flag} {path} exists and is not a directory")
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path} cannot be created: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".nmprune-probe-", dir=parent))
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be created: {parent} does not accept new "
                         f"directories ({e.strerror})") from None


def check_apart(out: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> None:
    """``--out`` and ``--checkpoint-dir`` are two directories, neither inside the other
    (the checkpoint is deleted once the output is complete, and the output must not exist)."""
    a, b = (Path(p).expanduser().resolve() for p in (out, checkpoint_dir))
    if a == b or a in b.parents or b in a.parents:
        raise ValueError(f"--checkpoint-dir {checkpoint_dir} and --out {out} overlap (the same "
                         "directory, or one inside the other); give them separate directories")


def check_positions(model_config, seqlens: dict[str, int]) -> None:
    """Every sequence length (flag -> tokens) fits the positions the model was trained on
    (``max_position_embeddings``, when its configuration has one): longer windows either
    fail inside the model (learned position embeddings) or run where it never learned to."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    for flag, seqlen in seqlens.items():
        if seqlen > limit:
            raise ValueError(f"{flag} {seqlen} is longer than the {limit} positions the model "
                             f"knows (max_position_embeddings); use {flag} {limit} or less")


def check_text_sources(sources: Iterable[str], flag: str, split: str) -> None:
    """Every text source exists and its ``split`` can be read and decoded
    (:func:`nmprune.data.sources.check_readable`); the message names the flag."""
    from .data.sources import check_readable

    for source in sources:
        try:
            check_readable(source, split)
        except (ValueError, OSError) as e:
            raise ValueError(f"{flag}: {e}" if source in str(e) else f"{flag} {source}: {e}") from None


def _check_window(seqlen: object, max_tokens: object, flags: tuple[str, str]) -> None:
    if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 2:
        raise ValueError(f"{flags[0]} must be an integer >= 2, got {seqlen!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise ValueError(f"{flags[1]} must be a non-negative integer (0 = all), got {max_tokens!r}")


def check_prune_inputs(config, device_here: bool = True) -> None:
    """Everything about a ``nmprune prune`` run (a :class:`nmprune.config.RunConfig`) that
    can be judged before the model loads: ``--out``, ``--checkpoint-dir`` (apart from
    ``--out``; it and ``OUT.partial`` are nmprune's or empty when they exist), ``--device``
    (present on this machine unless ``device_here`` is False: a plan of a run elsewhere),
    ``--dtype``, the evaluation window, the calibration source and the evaluation sources."""
    from .models import parse_dtype

    from .output import check_owned, partial_save_dir

    if not config.out:
        raise ValueError("--out DIR is required (where the pruned model is saved)")
    check_creatable_dir(config.out, "--out", must_not_exist=True)
    if config.checkpoint_dir:
        check_creatable_dir(config.checkpoint_dir, "--checkpoint-dir", must_not_exist=False)
        check_apart(config.out, config.checkpoint_dir)
    check_owned(partial_save_dir(config.out), "partial", "--out")  # replaced by the save
    check_owned(Path(config.checkpoint_dir or f"{config.out}.checkpoint"), "checkpoint", "--checkpoint-dir")
    check_device(config.device, here=device_here)
    parse_dtype(config.dtype)
    _check_window(config.eval_seqlen, config.eval_max_tokens, ("--eval-seqlen", "--eval-max-tokens"))
    check_text_sources([config.prune.calib], "--calib", "calib")
    check_text_sources(config.eval, "--eval", "eval")


def check_eval_inputs(data: list[str], device: str | None, dtype: str | None, seqlen: object,
                      max_tokens: object) -> None:
    """The ``nmprune eval`` inputs that can be judged before the model loads."""
    from .models import parse_dtype

    check_device(device)
    parse_dtype(dtype)
    _check_window(seqlen, max_tokens, ("--seqlen", "--max-tokens"))
    check_text_sources(data, "--data", "eval")


def non_finite(named: Iterable[tuple[str, Tensor]]) -> list[str]:
    """The names of the floating tensors among ``named`` that hold NaN or Inf."""
    from .checks import all_finite

    return [name for name, t in named if t.is_floating_point() and t.numel() and not all_finite(t)]


def check_finite_tensors(named: Iterable[tuple[str, Tensor]], source: object) -> None:
    """Refuse NaN or Inf in any of the named tensors of the model ``source``, naming every
    offending one: the one check of the weights a run will save, whether a model loaded
    whole (:func:`check_finite`) or a streamed one as it reads each tensor
    (:meth:`nmprune.streaming.StreamingModel.load`), pruned, skipped or outside the blocks."""
    bad = non_finite(named)
    if bad:
        raise ValueError(f"{source} has NaN or Inf in {len(bad)} tensor(s): {', '.join(bad)}")


def check_finite(model: nn.Module, source: object) -> None:
    """Refuse a model with NaN or Inf weights, naming every offending tensor."""
    check_finite_tensors(list(model.named_parameters()) + list(model.named_buffers()), source)


def check_finite_value(value: float, what: str) -> float:
    """Refuse a NaN or infinite result (e.g. a perplexity), saying what it is."""
    if not math.isfinite(value):
        raise NonFiniteModel(f"{what} is {value} (the model's outputs overflow or hold NaN; "
                         "try --dtype float32)")
    return value
