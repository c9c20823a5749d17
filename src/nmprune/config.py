"""Run settings: dataclasses with validation, YAML loading and a stable hash for resume.

A YAML file holds the same flat keys as the command line (``method``, ``refine``,
``pattern``, ``options``, ``overrides``, ``nsamples`` ...); command-line flags override it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .plan import Planner

HESSIAN_INPUTS = ("dense", "pruned")
HESSIAN_DTYPES = ("float32", "float64")


@dataclass
class PruneSettings:
    """Everything that decides the pruned weights (and so the resume hash).

    ``method``, ``refine``, ``pattern``, ``options``, ``overrides`` (layer-name globs such as
    ``"*.mlp.down_proj"`` -> ``"skip"`` or some of those settings; :class:`~nmprune.plan.Planner`),
    ``damp`` and ``strict`` are parsed and validated by :meth:`planner`, the others here.
    ``hessian_inputs`` is ``"dense"`` (every block sees the dense model's activations,
    the paper's default) or ``"pruned"`` (activations pass through the already pruned
    blocks; Appendix ``app:use_unpruned_inputs``).
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
    batch_size: int = 2
    hessian_inputs: str = "dense"
    hessian_dtype: str = "float32"
    damp: float = 0.01
    strict: bool = False

    def __post_init__(self) -> None:
        for key in ("nsamples", "seqlen", "batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.hessian_inputs not in HESSIAN_INPUTS:
            raise ValueError(f"hessian_inputs must be one of {', '.join(HESSIAN_INPUTS)}, "
                             f"got {self.hessian_inputs!r}")
        if self.hessian_dtype not in HESSIAN_DTYPES:
            raise ValueError(f"hessian_dtype must be one of {', '.join(HESSIAN_DTYPES)}, "
                             f"got {self.hessian_dtype!r}")

    def planner(self) -> Planner:
        """The layer plans of these settings, parsed and validated on first use and kept
        while the settings stay the same."""
        key = self.fingerprint()
        cached = self.__dict__.get("_planner")
        if cached is None or cached[0] != key:
            self.__dict__["_planner"] = cached = (key, Planner(self))
        return cached[1]

    def fingerprint(self) -> str:
        """A stable hash of the settings (checkpoints only resume under the same one)."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str)
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
        if self.offload is not None and not isinstance(self.offload, bool):
            raise ValueError(f"offload must be true, false or left out, got {self.offload!r}")

    def identity(self) -> str:
        """Hash of what decides the pruned weights: the model, its dtype and the settings."""
        blob = json.dumps({"model": self.model, "gguf_file": self.gguf_file, "dtype": self.dtype,
                           "prune": self.prune.fingerprint()}, sort_keys=True)
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


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a flat YAML mapping of settings (see :func:`build_config`)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
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
