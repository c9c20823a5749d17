"""Settings -> one resolved :class:`LayerPlan` per layer.

This is the only place where a pattern string, a method or refiner name, a solver option or
the dampening is parsed and validated; the solvers and the pipeline trust a plan. A plan
holds the parsed :class:`~nmprune.pattern.NMPattern`, the registry entries of its method and
refiner, their options (checked against the types, choices and ranges the solvers'
signatures declare, see :mod:`nmprune.registry`) and the dampening of
:func:`nmprune.solve.dampened`. :class:`Planner` does this once for the global settings and
every override of a :class:`~nmprune.config.PruneSettings`, then picks a layer's plan by
name and shape.
"""

from __future__ import annotations

import fnmatch
import math
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ..checks import check_non_negative
from ..pattern import NMPattern, parse_pattern
from ..registry import Range, Registered, get_method, get_refiner

if TYPE_CHECKING:
    from ..config import PruneSettings

SKIP = "skip"
NO_REFINER = ("", "none", "null")  # refine values (any case) meaning "no refinement"
REFINER_PREFIX = "refine_"  # options of the refiner are given as refine_<name>


@dataclass(frozen=True)
class LayerPlan:
    """What to do with one layer, fully resolved: prune to ``pattern`` with ``method`` and its
    ``method_options``, then (unless ``refiner`` is None) refine with the mask held; both
    solvers see ``H + damp * mean(diag H) * I``."""

    pattern: NMPattern
    method: Registered
    refiner: Registered | None
    method_options: Mapping[str, Any]
    refiner_options: Mapping[str, Any]
    damp: float

    @property
    def statistics(self) -> tuple[str, ...]:
        """The input statistics beyond ``H`` the method takes (its registration says which)."""
        return self.method.statistics

    @property
    def splits_rows(self) -> bool:
        """Whether processes may solve shares of the layer's rows: neither solver is
        registered ``rows="whole"`` (:data:`nmprune.registry.ROWS`)."""
        return all(s.rows != "whole" for s in (self.method, self.refiner) if s is not None)

    def describe(self) -> dict[str, Any]:
        """The plan as the per-layer report records it."""
        return {"method": self.method.name, "refine": self.refiner.name if self.refiner else None,
                "pattern": str(self.pattern), "damp": self.damp}


def parse_refine(refine: str | None) -> str | None:
    """A refiner name, or None for ``None`` and the words of :data:`NO_REFINER`."""
    if refine is None or (isinstance(refine, str) and refine.strip().lower() in NO_REFINER):
        return None
    if not isinstance(refine, str):
        raise ValueError(f"refine must be a refiner name or none, got {refine!r}")
    return refine


_PLAIN = (bool, int, float, str, type(None))


def _alternatives(annotation: Any) -> list[Any]:
    """The members of a union annotation (the annotation itself otherwise)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for member in typing.get_args(annotation) for a in _alternatives(member)]
    return [annotation]


def _describe(alternative: Any) -> str:
    if typing.get_origin(alternative) is typing.Literal:
        return " or ".join(repr(v) for v in typing.get_args(alternative))
    if typing.get_origin(alternative) is typing.Annotated:
        base, *extras = typing.get_args(alternative)
        return " ".join([_describe(base)] + [str(e) for e in extras if isinstance(e, Range)])
    return "None" if alternative is type(None) else getattr(alternative, "__name__", str(alternative))


def _typed(value: Any, annotation: Any, what: str) -> Any:
    """``value`` checked against a solver parameter's annotation (see
    :mod:`nmprune.registry`); an int given for a float becomes a float. Parameters without
    an annotation, or with one of other types, take any value."""
    alternatives = _alternatives(annotation)
    for alt in alternatives:
        ranges: list[Range] = []
        if typing.get_origin(alt) is typing.Annotated:
            alt, *extras = typing.get_args(alt)
            ranges = [e for e in extras if isinstance(e, Range)]
        if typing.get_origin(alt) is typing.Literal:
            if any(value == v and type(value) is type(v) for v in typing.get_args(alt)):
                return value
            continue
        if alt not in _PLAIN:
            return value
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if alt is type(None) and value is None or alt is bool and isinstance(value, bool) \
                or alt is str and isinstance(value, str):
            return value
        if alt is int and number and isinstance(value, int) or alt is float and number:
            converted = float(value) if alt is float else value
            if not math.isfinite(converted):
                raise ValueError(f"{what} must be a finite {_describe(alt)}, got {value!r}")
            bad = [r for r in ranges if converted not in r]
            if bad:
                raise ValueError(f"{what} must be {_describe(alt)} {bad[0]}, got {value!r}")
            return converted
    expected = " or ".join(_describe(a) for a in alternatives)
    raise ValueError(f"{what} must be {expected}, got {value!r}")


def _resolve_options(options: Mapping[str, Any], method: Registered,
                     refiner: Registered | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Route ``options`` to the method and ``refine_<name>`` ones to the refiner, each
    type-checked; an option neither takes is a ValueError listing the accepted ones."""
    if not isinstance(options, Mapping):
        raise ValueError(f"options must be a mapping of option names to values, got {options!r}")
    m_opts: dict[str, Any] = {}
    r_opts: dict[str, Any] = {}
    m_hints = typing.get_type_hints(method.fn, include_extras=True)
    r_hints = typing.get_type_hints(refiner.fn, include_extras=True) if refiner else {}
    m_names = set(method.option_names())
    r_names = set(refiner.option_names()) if refiner else set()
    for key, value in options.items():
        sub = key[len(REFINER_PREFIX):] if key.startswith(REFINER_PREFIX) else None
        if key in m_names:
            m_opts[key] = _typed(value, m_hints.get(key, Any),
                                 f"option {key!r} of method {method.name!r}")
        elif sub in r_names:
            r_opts[sub] = _typed(value, r_hints.get(sub, Any),
                                 f"option {key!r} of refiner {refiner.name!r}")
        else:
            accepted = sorted(m_names) + sorted(REFINER_PREFIX + n for n in r_names)
            hint = (f" ({key!r} is computed from the calibration data)"
                    if key in method.statistics else "")
            raise ValueError(f"unknown option {key!r} for method {method.name!r}"
                             + (f" with refine={refiner.name!r}" if refiner else "") + hint
                             + f"; accepted: {', '.join(accepted) or 'none'}")
    return m_opts, r_opts


def resolve_plan(method: str, refine: str | None, pattern: str | NMPattern | tuple[int, int],
                 options: Mapping[str, Any], damp: float) -> LayerPlan:
    """Parse and validate one layer's settings into a :class:`LayerPlan` (ValueError naming
    the first bad one)."""
    p = parse_pattern(pattern)
    damp = check_non_negative("damp", damp)
    if not isinstance(method, str):
        raise ValueError(f"method must be a method name, got {method!r}")
    m = get_method(method)
    if not m.supports(p):
        raise ValueError(f"method {method!r} does not support pattern {p}")
    refine = parse_refine(refine)
    r = get_refiner(refine) if refine is not None else None
    m_opts, r_opts = _resolve_options(options, m, r)
    return LayerPlan(p, m, r, m_opts, r_opts, damp)


@lru_cache(maxsize=None)
def wanda_reference(pattern: NMPattern, damp: float) -> LayerPlan:
    """The plan every layer's loss is compared with in the report: Wanda, same pattern and
    dampening, no refinement."""
    return resolve_plan("wanda", None, pattern, {}, damp)


class Planner:
    """The plans of a :class:`~nmprune.config.PruneSettings`.

    The global plan and the plan of every override (``glob -> "skip"`` or a mapping with any
    of ``method``, ``refine``, ``pattern``, ``options``) are resolved once, on construction.
    An override naming another method starts from empty options; otherwise its options are
    merged onto the global ones. The first matching glob wins.
    """

    def __init__(self, settings: PruneSettings):
        s = settings
        self.strict = bool(s.strict)
        self.default = resolve_plan(s.method, s.refine, s.pattern, s.options, s.damp)
        if not isinstance(s.overrides, Mapping):
            raise ValueError(f"overrides must map layer-name globs to settings, got {s.overrides!r}")
        self.overrides: list[tuple[str, LayerPlan | None]] = []
        for glob, value in s.overrides.items():
            if value == SKIP:
                self.overrides.append((glob, None))
                continue
            if not isinstance(value, Mapping) or set(value) - {"method", "refine", "pattern", "options"}:
                raise ValueError(f"override {glob!r} must be 'skip' or a mapping with keys method, "
                                 f"refine, pattern, options; got {value!r}")
            method = value.get("method", s.method)
            base = dict(s.options) if method == s.method else {}
            options = value.get("options", {})
            if not isinstance(options, Mapping):
                raise ValueError(f"override {glob!r}: options must be a mapping, got {options!r}")
            plan = resolve_plan(method, value.get("refine", s.refine), value.get("pattern", s.pattern),
                                {**base, **options}, s.damp)
            self.overrides.append((glob, plan))

    def plan(self, name: str) -> LayerPlan | None:
        """The plan for a layer by its full module name (None: it is skipped)."""
        for glob, plan in self.overrides:
            if fnmatch.fnmatchcase(name, glob):
                return plan
        return self.default

    def plan_layers(self, shapes: Mapping[str, tuple[int, int]],
                    warn: bool = True) -> dict[str, LayerPlan | None]:
        """The plan of every layer, given each full name's weight shape ``(d_out, d_in)``.

        Every override must match some layer. A layer whose ``d_in`` is not divisible by its
        pattern's M stays dense with a warning (when ``warn``; an error when ``strict``). A
        model of which no layer would be pruned is an error naming the patterns and the
        widths found.
        """
        for glob, _ in self.overrides:
            if not any(fnmatch.fnmatchcase(n, glob) for n in shapes):
                raise ValueError(f"override {glob!r} matches no layer; layer names look like "
                                 f"{', '.join(list(shapes)[:3])}")
        plans: dict[str, LayerPlan | None] = {}
        for name, (_, d_in) in shapes.items():
            plan = self.plan(name)
            if plan is not None and d_in % plan.pattern.m:
                message = f"layer {name} has d_in={d_in}, not divisible by M={plan.pattern.m}"
                if self.strict:
                    raise ValueError(message + "; skip it with an override or run without strict")
                if warn:
                    warnings.warn(message + "; it stays dense", stacklevel=2)
                plan = None
            plans[name] = plan
        if shapes and all(p is None for p in plans.values()):
            plans_given = [self.default] + [p for _, p in self.overrides if p is not None]
            patterns = sorted({str(p.pattern) for p in plans_given})
            widths = sorted({d_in for _, d_in in shapes.values()})
            raise ValueError(f"no layer would be pruned: pattern {', '.join(patterns)} needs input "
                             f"widths divisible by M, and the layers left to prune have widths "
                             f"{', '.join(map(str, widths))}")
        return plans
