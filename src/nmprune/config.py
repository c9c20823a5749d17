"""Run settings: dataclasses with validation, YAML loading and a stable hash for resume.

A YAML file holds the same flat keys as the command line (``method``, ``refine``,
``pattern``, ``options``, ``overrides``, ``nsamples`` ...); command-line flags override it.
Every setting must be of its annotated type, wherever it comes from (``strict: "no"`` in a
YAML file is an error, not a true string).
"""

from __future__ import annotations

import hashlib
import json
import math
import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from .reconstruct import TRAIN_PRECISIONS, FitOptions
from .stages.plan import Planner
from .stages.reconstruction import GRANULARITIES

HESSIAN_INPUTS = ("dense", "pruned")
HESSIAN_DTYPES = ("float32", "float64")
#: ``distill_epochs`` left to the run (:meth:`PruneSettings.distill_passes`)
AUTO = "auto"
#: the epochs of global distillation ``"auto"`` makes where it runs: one lowered SmolLM2's wiki
#: perplexity from 1.90x to 1.76x dense and Gemma-3-270M's from 1.62x to 1.55x
#: (benchmarks/results/reconstruct_sweep.md, reconstruct_gemma3_sweep.md)
AUTO_DISTILL_EPOCHS = 1
#: ``distill_nsamples: auto`` trains the global distillation on this many times the run's
#: ``nsamples`` calibration windows (the run's own and the rest drawn for it): the pass alone on
#: one pruned SmolLM2 gave wiki / Austen perplexity 22.37 / 100.1 on 64 windows, 20.39 / 94.97
#: on 128 and 19.88 / 94.21 on 192 (benchmarks/results/distill_sweep.md). Three times: with
#: 192 windows the SmolLM2 main job took 12.4 min against 10.4 for the default of c8021ee, the
#: job issue 45 bounds at 1.3x, run just before it (benchmarks/results/main_job*.md, AMD EPYC
#: znver5)
AUTO_DISTILL_WINDOWS = 3
#: the settings of the global distillation pass alone: they decide no block's weights, so a
#: checkpoint of finished blocks is not bound to them (:meth:`PruneSettings.fingerprint`)
PASS_SETTINGS = frozenset({"distill_epochs", "distill_lr", "distill_nsamples"})
#: the upper bound of each setting that sizes work, checked before anything is allocated or
#: read (in the run and the dry run alike): windows of calibration (2^20 windows, more than any
#: calibration text holds), epochs, window lengths (the model's positions are checked too,
#: :func:`nmprune.validate.check_positions`) and the evaluation's sizes
UPPER_BOUNDS: dict[str, int] = {
    "nsamples": 1 << 20, "distill_nsamples": 1 << 20, "batch_size": 1 << 20, "reconstruct_batch_size": 1 << 20,
    "seqlen": 1 << 20, "reconstruct_epochs": 1000, "distill_epochs": 1000,
    "eval_seqlen": 1 << 20, "eval_max_tokens": 1 << 32, "eval_batch_size": 1 << 16, "eval_limit": 1 << 30,
    "eval_num_fewshot": 1000}
#: the extra windows of the global distillation are drawn with the run's seed plus this, apart
#: from the run's own (which stay the same windows with or without the pass)
DISTILL_SEED_OFFSET = 1

# a value's type as an error message names it ("got 'no' (a string)")
_KINDS: dict[type, str] = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
                           list: "a list", dict: "a mapping", type(None): "null"}
# what a setting of an annotated type may be, one phrase per alternative ("true or false")
_EXPECTED: dict[Any, tuple[str, ...]] = {
    bool: ("true", "false"), int: ("an integer",), float: ("a finite number",), str: ("a string",),
    type(None): ("left out",), list[str]: ("a list of strings",),
    dict[str, Any]: ("a mapping with string keys",)}


def _kind(value: object) -> str:
    """``value``'s type as an error message names it."""
    return _KINDS.get(type(value), f"of type {type(value).__name__}")


def _expected(hint: Any) -> list[str]:
    """What a setting annotated ``hint`` may be, one phrase per alternative."""
    if get_origin(hint) in (Union, types.UnionType):
        return [phrase for alt in get_args(hint) for phrase in _expected(alt)]
    return list(_EXPECTED.get(hint, (f"a {hint.__name__}",)))


def _mismatch(value: object, hint: Any) -> str | None:
    """None when ``value`` is of the annotated type ``hint``, else what it is instead."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return None if any(_mismatch(value, alt) is None for alt in args) else _kind(value)
    if origin is list:
        if not isinstance(value, list):
            return _kind(value)
        bad = [item for item in value if _mismatch(item, args[0]) is not None]
        return f"its item {bad[0]!r} is {_kind(bad[0])}" if bad else None
    if origin is dict:
        if not isinstance(value, dict):
            return _kind(value)
        bad = [key for key in value if _mismatch(key, args[0]) is not None]
        # the values (Any: options, overrides) are checked by the Planner
        return f"its key {bad[0]!r} is {_kind(bad[0])}" if bad else None
    if isinstance(value, bool) and hint is not bool:
        return _kind(value)  # True is an int to Python, never an int or float setting
    if hint is float:  # an int is a number too (and always finite)
        number = isinstance(value, int) or isinstance(value, float) and math.isfinite(value)
        return None if number else _kind(value)
    return None if isinstance(value, hint) else _kind(value)


def _check_types(settings: PruneSettings | RunConfig) -> None:
    """Refuse any field of the dataclass ``settings`` whose value is not of its annotated type.

    A ``bool`` takes only True or False (never a string such as ``"no"``, nor 0 or 1), an
    ``int`` no bool, a ``float`` an int or a finite float (an int is stored as the float a
    flag would give, so ``damp: 0`` and ``--damp 0`` hash alike), a ``list[str]`` only a list of strings, a
    ``dict[str, Any]`` only a dict with string keys (its values are checked where they are
    used), ``X | None`` also None. The error is a one-line ValueError naming the setting, its
    value and the type expected, e.g. ``setting 'strict' must be true or false, got 'no' (a string)``.
    """
    hints = get_type_hints(type(settings))
    for f in fields(settings):
        value = getattr(settings, f.name)
        reason = _mismatch(value, hints[f.name])
        if reason is not None:
            *head, last = _expected(hints[f.name])
            expected = f"{', '.join(head)} or {last}" if head else last
            raise ValueError(f"setting {f.name!r} must be {expected}, got {value!r} ({reason})")
        if hints[f.name] is float:
            setattr(settings, f.name, float(value))


def _check_upper_bounds(settings: Any) -> None:
    """Refuse a value above its :data:`UPPER_BOUNDS` in the dataclass ``settings``."""
    for f in fields(settings):
        value, bound = getattr(settings, f.name), UPPER_BOUNDS.get(f.name)
        if bound is not None and isinstance(value, int) and value > bound:
            raise ValueError(f"{f.name} must be at most {bound:,}, got {value:,}")


@dataclass
class PruneSettings:
    """Everything that decides the pruned weights (and so the resume hash).

    ``method``, ``refine``, ``pattern``, ``options``, ``overrides`` (layer-name globs such as
    ``"*.mlp.down_proj"`` -> ``"skip"`` or some of those settings; :class:`~nmprune.stages.plan.Planner`),
    ``damp`` and ``strict`` are parsed and validated by :meth:`planner`, the others here.
    ``hessian_inputs`` is ``"dense"`` (every block sees the dense model's activations,
    the paper's default) or ``"pruned"`` (activations pass through the already pruned
    blocks; Appendix ``app:use_unpruned_inputs``).
    ``reconstruct`` (``"none"``, ``"submodule"`` or ``"block"``) trains each block's kept
    weights after its solve, ``reconstruct_epochs`` passes over the calibration set with
    AdamW at ``reconstruct_lr`` (relative to each weight's RMS) in steps of ``reconstruct_batch_size`` samples (a multiple
    of ``batch_size``; None: one calibration batch per step; :mod:`nmprune.stages.reconstruction`),
    the batches split into ``reconstruct_lanes`` lanes whose gradients of a round are computed at
    the same weights (:mod:`nmprune.reconstruct`; 1: every step's gradient at the latest weights).
    The result depends on the lanes, never on the number of ranks; with one lane per rank every
    rank trains, at a cost in quality (docs/distributed.md). ``distill_epochs`` passes of
    global distillation follow the last block: the kept weights of every pruned layer train
    towards the dense model's next-token distribution at ``distill_lr`` (relative to each
    weight's RMS; :mod:`nmprune.stages.distillation`), on the whole model (one process
    streaming it loads it whole for the pass; several ranks shard it over them,
    :mod:`nmprune.stages.sharded_pass`). 0: none; ``"auto"`` (the default):
    :data:`AUTO_DISTILL_EPOCHS` where the run reconstructs and the pass fits in memory, else
    none (:meth:`distill_passes`); a number of epochs is required (a run that cannot distill
    is refused). The pass trains on
    ``distill_nsamples`` calibration windows: the run's ``nsamples`` and the rest drawn for it
    alone (:meth:`distill_extra_windows`; ``"auto"``: :data:`AUTO_DISTILL_WINDOWS` times
    ``nsamples``). ``train_precision`` says in which
    dtype both train (:func:`nmprune.reconstruct.training_dtype`: ``auto`` is bfloat16 products
    where the device computes them natively and the blocks are wide enough to gain).
    """

    method: str = "prox"
    refine: str | None = "exact"
    pattern: str = "2:4"
    options: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    calib: str = "wiki"
    nsamples: int = 64
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 1
    hessian_inputs: str = "dense"
    hessian_dtype: str = "float32"
    damp: float = 0.01
    strict: bool = False
    reconstruct: str = "block"
    reconstruct_epochs: int = 2
    reconstruct_lr: float = 1.5e-2
    reconstruct_batch_size: int | None = None
    reconstruct_lanes: int = 1
    distill_epochs: int | str = AUTO
    distill_lr: float = 1e-3
    distill_nsamples: int | str = AUTO
    train_precision: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.pattern, int) and not isinstance(self.pattern, bool):
            raise ValueError(f"setting 'pattern' must be a string such as '2:4', got {self.pattern} "
                             "(YAML reads an unquoted 2:4 as the base-60 number 124: quote it)")
        _check_types(self)
        for key in ("nsamples", "seqlen", "batch_size"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.hessian_inputs not in HESSIAN_INPUTS:
            raise ValueError(f"hessian_inputs must be one of {', '.join(HESSIAN_INPUTS)}, "
                             f"got {self.hessian_inputs!r}")
        if self.hessian_dtype not in HESSIAN_DTYPES:
            raise ValueError(f"hessian_dtype must be one of {', '.join(HESSIAN_DTYPES)}, "
                             f"got {self.hessian_dtype!r}")
        if self.reconstruct not in GRANULARITIES:
            raise ValueError(f"reconstruct must be one of {', '.join(GRANULARITIES)}, got {self.reconstruct!r}")
        if not isinstance(self.reconstruct_epochs, int) or self.reconstruct_epochs < 1:
            raise ValueError(f"reconstruct_epochs must be a positive integer, got "
                             f"{self.reconstruct_epochs!r} (to skip reconstruction, set reconstruct to 'none')")
        if self.reconstruct_lr <= 0:
            raise ValueError(f"reconstruct_lr must be a positive number, got {self.reconstruct_lr!r}")
        step = self.reconstruct_batch_size
        if step is not None and (step < 1 or self.reconstruct != "none" and step % self.batch_size):
            raise ValueError(f"reconstruct_batch_size must be a positive multiple of batch_size "
                             f"({self.batch_size}), the calibration batches a step is made of; "
                             f"got {self.reconstruct_batch_size}")
        if self.reconstruct_lanes < 1:
            raise ValueError(f"reconstruct_lanes must be a positive integer, got {self.reconstruct_lanes}")
        if isinstance(self.distill_epochs, str) and self.distill_epochs != AUTO or \
                isinstance(self.distill_epochs, int) and self.distill_epochs < 0:
            raise ValueError(f"distill_epochs must be 'auto', 0 (no global distillation) or a positive "
                             f"integer, got {self.distill_epochs!r}")
        if isinstance(self.distill_nsamples, str) and self.distill_nsamples != AUTO or \
                isinstance(self.distill_nsamples, int) and self.distill_nsamples < self.nsamples:
            raise ValueError(f"distill_nsamples must be 'auto' ({AUTO_DISTILL_WINDOWS} x nsamples) or an integer "
                             f"of at least nsamples ({self.nsamples}): the global distillation trains on the "
                             f"run's calibration windows and distill_nsamples - nsamples more; got "
                             f"{self.distill_nsamples!r}")
        if self.train_precision not in TRAIN_PRECISIONS:
            raise ValueError(f"train_precision must be one of {', '.join(TRAIN_PRECISIONS)}, "
                             f"got {self.train_precision!r}")
        if self.distill_lr <= 0:
            raise ValueError(f"distill_lr must be a positive number, got {self.distill_lr!r}")
        if self.distill_epochs != AUTO and self.distill_epochs and self.reconstruct == "none":
            raise ValueError("distill_epochs needs reconstruction (reconstruct: block or submodule): the "
                             "global distillation learns from the dense model's outputs that reconstruction "
                             "carries to the last block")
        _check_upper_bounds(self)
        batches = -(-self.nsamples // self.batch_size)
        if self.reconstruct_lanes > batches:
            raise ValueError(f"reconstruct_lanes must be at most the number of calibration batches, {batches} "
                             f"(nsamples {self.nsamples} / batch_size {self.batch_size}): each lane trains on "
                             f"batches of its own; got {self.reconstruct_lanes}")

    def planner(self) -> Planner:
        """The layer plans of these settings, parsed and validated on first use and kept
        while the settings stay the same."""
        key = self.fingerprint()
        cached = self.__dict__.get("_planner")
        if cached is None or cached[0] != key:
            self.__dict__["_planner"] = cached = (key, Planner(self))
        return cached[1]

    def fit_options(self) -> FitOptions:
        """How each reconstruction trains (:func:`nmprune.reconstruct.fit_masked`)."""
        step = self.reconstruct_batch_size or self.batch_size
        return FitOptions(self.reconstruct_epochs, self.reconstruct_lr, step // self.batch_size, self.seed,
                          self.reconstruct_lanes, self.train_precision)

    def blocks_in_windows(self) -> bool:
        """Whether several consecutive blocks' layers may be solved together
        (:func:`nmprune.distributed.balance_window`): only with dense inputs and no
        reconstruction, where no block's statistics wait for an earlier block's solved weights;
        otherwise the blocks are solved one at a time."""
        return self.hessian_inputs == "dense" and self.reconstruct == "none"

    def distill_passes(self) -> int:
        """The epochs of global distillation a run makes: ``distill_epochs`` when it is a
        number; with ``"auto"``, :data:`AUTO_DISTILL_EPOCHS` for a run that reconstructs (the
        caller also judges that the pass fits), else 0."""
        if self.distill_epochs != AUTO:
            return self.distill_epochs
        return AUTO_DISTILL_EPOCHS if self.reconstruct != "none" else 0

    def distill_extra_windows(self) -> int:
        """How many calibration windows the global distillation trains on beyond the run's
        ``nsamples`` (drawn with the seed plus :data:`DISTILL_SEED_OFFSET`)."""
        total = AUTO_DISTILL_WINDOWS * self.nsamples if self.distill_nsamples == AUTO else self.distill_nsamples
        return total - self.nsamples

    def distill_options(self, epochs: int) -> FitOptions:
        """How ``epochs`` of the global distillation pass train
        (:mod:`nmprune.stages.distillation`): one calibration batch a step, in one lane."""
        return FitOptions(epochs, self.distill_lr, 1, self.seed, precision=self.train_precision)

    def fingerprint(self, blocks: bool = False) -> str:
        """A stable hash of the settings; with ``blocks``, of those that decide the blocks'
        weights only, the global distillation's (:data:`PASS_SETTINGS`) left out: a checkpoint
        of finished blocks resumes under another pass (issue 65 case 1)."""
        chosen = {k: v for k, v in asdict(self).items() if not (blocks and k in PASS_SETTINGS)}
        blob = json.dumps(chosen, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class RunConfig:
    """A whole ``nmprune prune`` run: the model, the pruning settings, output and evaluation.

    ``model=None`` is the packaged SmolLM2-135M-Instruct. ``eval`` lists the data sets to
    report perplexity on (dense and pruned); an empty list skips evaluation.
    ``eval_max_tokens`` caps each held-out token stream (0: the whole stream).
    ``eval_tasks`` lists lm-eval tasks to report accuracy on (dense and pruned), with
    ``eval_num_fewshot``, ``eval_limit``, ``eval_batch_size`` and ``eval_include_path``
    passed through (:class:`nmprune.downstream.DownstreamSettings`).
    ``allow_pickle`` lets pickle weight files (``pytorch_model.bin``) load; they can run code.
    ``offload``: stream the weights block by block from a safetensors checkpoint (True),
    load the model whole (False), or pick streaming when the model does not fit in the
    memory available (None; :func:`nmprune.streaming.fit.choose_streaming`). It does not
    change the result, so it is not part of :meth:`identity`.
    """

    model: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"
    device: str | None = None
    out: str | None = None
    eval: list[str] = field(default_factory=lambda: ["wiki"])
    eval_max_tokens: int = 8192
    eval_seqlen: int = 512
    eval_tasks: list[str] = field(default_factory=list)
    eval_num_fewshot: int | None = None
    eval_limit: int | None = None
    eval_batch_size: int = 8
    eval_include_path: list[str] = field(default_factory=list)
    checkpoint_dir: str | None = None
    restart: bool = False
    allow_pickle: bool = False
    offload: bool | None = None
    prune: PruneSettings = field(default_factory=PruneSettings)

    def __post_init__(self) -> None:
        _check_types(self)
        _check_upper_bounds(self)

    def identity(self, blocks: bool = False) -> str:
        """Hash of the settings that decide the pruned weights: the dtype and the pruning
        settings (what the ranks of a job compare); with ``blocks``, without the global
        distillation's (what a checkpoint of finished blocks is bound to: the pass's own
        progress is bound to its settings apart, :class:`~nmprune.stages.distillation.SavedPass`).
        The model is not named here: a checkpoint and the ranks of a job compare the digest of
        its files (:func:`nmprune.identity.model_digest`), never the string."""
        blob = json.dumps({"dtype": self.dtype, "prune": self.prune.fingerprint(blocks)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_RUN_KEYS = {f.name for f in fields(RunConfig)} - {"prune"}
_PRUNE_KEYS = {f.name for f in fields(PruneSettings)}


def build_config(*layers: dict[str, Any]) -> RunConfig:
    """Merge flat settings dictionaries (later ones win; ``None`` values are ignored)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key not in _RUN_KEYS | _PRUNE_KEYS:
                raise ValueError(f"unknown setting {key!r}; known settings: "
                                 f"{', '.join(sorted(_RUN_KEYS | _PRUNE_KEYS))}")
            if value is None:
                continue
            if key == "options" and isinstance(value, dict) and isinstance(merged.get(key), dict):
                value = {**merged[key], **value}
            merged[key] = value
    for key in ("eval", "eval_tasks", "eval_include_path"):
        if isinstance(merged.get(key), str):
            merged[key] = [merged[key]]
    prune = PruneSettings(**{k: v for k, v in merged.items() if k in _PRUNE_KEYS})
    return RunConfig(prune=prune, **{k: v for k, v in merged.items() if k in _RUN_KEYS})


#: An exponent number without a dot (``3e-3``, ``1E5``): YAML 1.2 reads it as a float, PyYAML
#: (YAML 1.1) as a string. Users write the defaults as the help prints them.
_EXPONENT_FLOAT = r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"


def read_yaml(text: str) -> Any:
    """``yaml.safe_load`` that also reads ``3e-3`` as a float, as YAML 1.2 does; a quoted
    ``'3e-3'`` stays a string."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_EXPONENT_FLOAT), list("-+0123456789."))
    return yaml.load(text, Loader=Loader)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a flat YAML mapping of settings (see :func:`build_config`; :func:`read_yaml`)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {p} does not exist")
    try:
        data = read_yaml(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"config file {p} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of settings, got {type(data).__name__}")
    return data


def to_dict(config: RunConfig) -> dict[str, Any]:
    """Flat dictionary of a :class:`RunConfig` (what a YAML file would hold)."""
    d = asdict(config)
    d.update(d.pop("prune"))
    return d
