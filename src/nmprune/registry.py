"""Registries of layer pruning methods and mask-held refiners.

A method is added by writing one module in :mod:`nmprune.algorithms` that decorates its
solver with :func:`register_method`; the package imports every module it holds, so no
``if method == ...`` chain is ever edited. Solvers are pure tensor functions:

* method: ``fn(W, H, pattern, *, <statistics>, <options>) -> W_pruned``, exactly N:M along
  ``d_in``;
* refiner: ``fn(W, W_star, H, mask, *, <options>) -> W_refined`` with ``W_refined`` zero
  outside ``mask``.

``W`` is ``(d_out, d_in)``, ``H`` is ``(d_in, d_in)``; both arrive validated, on one device,
in float32 or float64. A method that needs more of its layer's inputs than ``H`` names those
statistics when it registers (``statistics=("input_mean",)``, see
:data:`nmprune.stages.statistics.STATISTICS`); the pipeline collects and passes them as keyword
arguments of the same names. Every other keyword-only parameter is a user option, resolved
and checked once by :mod:`nmprune.stages.plan` against its annotation: ``bool``, ``int``,
``float``, ``str``, ``None``, unions of them, ``Literal[...]`` choices, and
``Annotated[int | float, Range(...)]`` intervals.

Each registration also carries the solver's ``cost`` and ``entry_cost``: its seconds per
``rows x d_in^2`` and per ``rows x d_in`` (:data:`DEFAULT_COST` and
:data:`DEFAULT_ENTRY_COST` when neither is given), from which :func:`nmprune.distributed.job_cost`
estimates a layer's solve when spreading layers over ranks, and what it promises about its
rows (``rows``), which decides whether several ranks may solve one layer's rows between them
(:data:`ROWS`). The local loss is a sum over rows, so a solver that treats its rows alone
gives the same rows on any share of them; one whose loop reads a total over the rows (a mean
weight, a stopping rule) takes a keyword-only ``shards`` (:class:`RowShards`) and reads its
totals through it.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Annotated, Any, Callable, Protocol

from torch import Tensor

from .pattern import NMPattern


class RowShards(Protocol):
    """The rows of one layer split between processes, each solving its share: every total
    a solver reads over its rows is summed (or maximised) over all shares through this, so
    that all processes take the same decisions (every process calls it at the same points,
    with values of the same length). ``whole`` is the whole layer's ``W`` (as the solver's
    share of it: same dtype and device), for a statistic that must be bit for bit the one
    the whole layer gives (a float mean depends on its summation order)."""

    whole: Tensor

    def sum(self, values: Sequence[float]) -> list[float]: ...

    def max(self, values: Sequence[float]) -> list[float]: ...

    def sum_started(self, values: Sequence[float]) -> Callable[[], list[float]]:
        """:meth:`sum`, started now and finished by calling what it returns, so that the
        process computes meanwhile (every process still starts it at the same point)."""


#: What a solver promises about its rows, declared when it registers:
#: ``"independent"``: each output row is solved from its own weights and ``H`` alone, so any
#: share of the rows gives the same rows; ``"reduced"``: the same, given the totals its
#: ``shards`` parameter provides; ``"whole"`` (the default, for solvers that promise neither):
#: the layer is always solved whole by one process.
ROWS = ("independent", "reduced", "whole")


@dataclass(frozen=True)
class Range:
    """The interval a numeric option must lie in, declared in the solver's signature as
    ``Annotated[float, Range(low=0, low_open=True)]`` (checked by :mod:`nmprune.stages.plan`)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        lo_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        hi_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return lo_ok and hi_ok

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")


NonNegativeInt = Annotated[int, Range(0)]
PositiveInt = Annotated[int, Range(1)]
NonNegativeFloat = Annotated[float, Range(0)]
PositiveFloat = Annotated[float, Range(0, low_open=True)]

# A solver's ``cost`` and ``entry_cost``: seconds per ``rows x d_in^2`` (the products with H)
# and per ``rows x d_in`` (work on every weight: a prox iteration's cells, a score) of one layer
# solve on the reference CPU: non-negative least-squares fits over six layer shapes (SmolLM2's
# 576x576, 1536x576, 576x1536 and the scaling benchmark's 512x512, 1376x512, 512x1376) with
# synthetic correlated Hessians, 2:4, float32, the 2-core benchmark CPU, 2 threads
# (benchmarks/solver_costs.py, results/solver_costs.md). They decide how a block's
# layers are spread over ranks and whether ranks split their rows
# (:func:`nmprune.distributed.job_cost`, :func:`nmprune.distributed.split_rows`), and the dry
# run's solve time (:mod:`nmprune.resources`).
DEFAULT_COST = 4.1e-9
"""The ``cost`` of a solver registered with neither ``cost`` nor ``entry_cost``: that of the
most expensive built-in solver (``prox-l2``), with :data:`DEFAULT_ENTRY_COST`. Longest-job-first
scheduling suffers less from an overestimated job (scheduled early, alone if need be) than from
an underestimated one (left to the end, on top of a loaded rank); measure your solver and give
its own costs to do better."""
DEFAULT_ENTRY_COST = 1.1e-5
"""The ``entry_cost`` of a solver registered with neither cost: ``prox-l2``'s (:data:`DEFAULT_COST`)."""


def _costs(kind: str, name: str, cost: float | None, entry_cost: float | None) -> tuple[float, float]:
    """The checked ``(cost, entry_cost)`` of a registration: the defaults when neither is
    given, else 0 for the one left out."""
    if cost is None and entry_cost is None:
        return DEFAULT_COST, DEFAULT_ENTRY_COST
    checked = tuple(_check_cost(kind, name, label, 0.0 if value is None else value)
                    for label, value in (("cost", cost), ("entry_cost", entry_cost)))
    if not any(checked):
        raise ValueError(f"{kind} {name!r}: cost and entry_cost cannot both be 0")
    return checked


def _check_cost(kind: str, name: str, label: str, cost: float) -> float:
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) \
            or cost < 0:
        per = "rows x d_in^2" if label == "cost" else "rows x d_in"
        raise ValueError(f"{kind} {name!r}: {label} must be a non-negative finite number of seconds "
                         f"per {per}, got {cost!r}")
    return float(cost)


@dataclass(frozen=True)
class Registered:
    name: str
    fn: Callable[..., Any]
    description: str
    supports: Callable[[NMPattern], bool] = field(default=lambda p: True)
    statistics: tuple[str, ...] = ()
    cost: float = DEFAULT_COST  # seconds per rows x d_in^2 (see DEFAULT_COST)
    entry_cost: float = DEFAULT_ENTRY_COST  # seconds per rows x d_in
    rows: str = "whole"  # one of ROWS

    def option_names(self) -> list[str]:
        """The user options: keyword-only parameters that are neither declared statistics
        nor ``shards``."""
        params = inspect.signature(self.fn).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY
                and p.name not in self.statistics and p.name != "shards"]


_METHODS: dict[str, Registered] = {}
_REFINERS: dict[str, Registered] = {}


def _register(table: dict[str, Registered], kind: str, name: str, description: str,
              supports: Callable[[NMPattern], bool] | None, statistics: tuple[str, ...],
              cost: float | None, entry_cost: float | None, rows: str) -> Callable:
    cost, entry_cost = _costs(kind, name, cost, entry_cost)
    if rows not in ROWS:
        raise ValueError(f"{kind} {name!r}: rows must be one of {', '.join(ROWS)}, got {rows!r}")

    def deco(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"{kind} {name!r} is registered twice")
        params = inspect.signature(fn).parameters
        for stat in statistics:
            if stat not in params or params[stat].kind is not inspect.Parameter.KEYWORD_ONLY:
                raise ValueError(f"{kind} {name!r} declares statistic {stat!r} but has no "
                                 "keyword-only parameter of that name")
        takes = "shards" in params and params["shards"].kind is inspect.Parameter.KEYWORD_ONLY
        if (rows == "reduced") != takes:
            raise ValueError(f"{kind} {name!r}: a solver registered with rows='reduced' takes a "
                             "keyword-only parameter 'shards', and only such a solver does")
        table[name] = Registered(name, fn, description or (fn.__doc__ or "").strip().split("\n")[0],
                                 supports or (lambda p: True), tuple(statistics), cost, entry_cost, rows)
        return fn
    return deco


def register_method(name: str, *, description: str = "",
                    supports: Callable[[NMPattern], bool] | None = None,
                    statistics: tuple[str, ...] = (), cost: float | None = None,
                    entry_cost: float | None = None, rows: str = "whole") -> Callable:
    """Decorator registering a layer pruning method under ``name``.

    ``description`` (default: the first line of the docstring) is what ``nmprune methods``
    lists; ``supports(pattern)`` says which N:M patterns it handles (default: all);
    ``statistics`` names the input statistics beyond ``H`` it takes (keyword-only
    parameters of those names).

    ``cost`` and ``entry_cost`` are the method's seconds per ``rows x d_in^2`` and per
    ``rows x d_in`` of a layer on the reference CPU (see :data:`DEFAULT_COST`; a time measured
    elsewhere can be scaled by how a built-in method, e.g. ``prox`` at 3.5e-10 and 3.8e-7, runs
    there). :func:`nmprune.distributed.job_cost` prices a layer solved with this method as
    ``rows x d_in^2 x cost + rows x d_in x entry_cost``, plus its refiner's price, which decides
    how layers are spread over ranks. Left out (both), the method is priced like the most
    expensive built-in solver, :data:`DEFAULT_COST` = 4.1e-9 and :data:`DEFAULT_ENTRY_COST` =
    1.1e-5; given one, the other is 0. Measure your method's seconds on a few layer shapes and
    fit both.

    ``rows`` (:data:`ROWS`) says whether ranks may split a layer's rows between them; left
    out (``"whole"``), a layer solved with this method is always solved by one rank.
    """
    return _register(_METHODS, "method", name, description, supports, statistics, cost, entry_cost, rows)


def register_refiner(name: str, *, description: str = "", cost: float | None = None,
                     entry_cost: float | None = None, rows: str = "whole") -> Callable:
    """Decorator registering a mask-held refiner under ``name``. ``cost`` and ``entry_cost``
    (added to the method's by :func:`nmprune.distributed.job_cost`) and ``rows`` mean what they
    mean for :func:`register_method`, with the same defaults."""
    return _register(_REFINERS, "refiner", name, description, None, (), cost, entry_cost, rows)


def _load() -> None:
    """Import, and so register, every module of :mod:`nmprune.algorithms`."""
    importlib.import_module(f"{__package__}.algorithms")


def get_method(name: str) -> Registered:
    _load()
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def get_refiner(name: str) -> Registered:
    _load()
    if name not in _REFINERS:
        raise ValueError(f"unknown refiner {name!r}; registered refiners: {', '.join(sorted(_REFINERS))}")
    return _REFINERS[name]


def methods() -> list[str]:
    """Names of the registered layer pruning methods."""
    _load()
    return sorted(_METHODS)


def refiners() -> list[str]:
    """Names of the registered refiners."""
    _load()
    return sorted(_REFINERS)
