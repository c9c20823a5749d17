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
:data:`nmprune.statistics.STATISTICS`); the pipeline collects and passes them as keyword
arguments of the same names. Every other keyword-only parameter is a user option, resolved
and checked once by :mod:`nmprune.plan` against its annotation: ``bool``, ``int``,
``float``, ``str``, ``None``, unions of them, ``Literal[...]`` choices, and
``Annotated[int | float, Range(...)]`` intervals.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

from .pattern import NMPattern


@dataclass(frozen=True)
class Range:
    """The interval a numeric option must lie in, declared in the solver's signature as
    ``Annotated[float, Range(low=0, low_open=True)]`` (checked by :mod:`nmprune.plan`)."""

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


@dataclass(frozen=True)
class Registered:
    name: str
    fn: Callable[..., Any]
    description: str
    supports: Callable[[NMPattern], bool] = field(default=lambda p: True)
    statistics: tuple[str, ...] = ()

    def option_names(self) -> list[str]:
        """The user options: keyword-only parameters that are not declared statistics."""
        params = inspect.signature(self.fn).parameters.values()
        return [p.name for p in params
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in self.statistics]


_METHODS: dict[str, Registered] = {}
_REFINERS: dict[str, Registered] = {}


def _register(table: dict[str, Registered], kind: str, name: str, description: str,
              supports: Callable[[NMPattern], bool] | None, statistics: tuple[str, ...]) -> Callable:
    def deco(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"{kind} {name!r} is registered twice")
        params = inspect.signature(fn).parameters
        for stat in statistics:
            if stat not in params or params[stat].kind is not inspect.Parameter.KEYWORD_ONLY:
                raise ValueError(f"{kind} {name!r} declares statistic {stat!r} but has no "
                                 "keyword-only parameter of that name")
        table[name] = Registered(name, fn, description or (fn.__doc__ or "").strip().split("\n")[0],
                                 supports or (lambda p: True), tuple(statistics))
        return fn
    return deco


def register_method(name: str, *, description: str = "",
                    supports: Callable[[NMPattern], bool] | None = None,
                    statistics: tuple[str, ...] = ()) -> Callable:
    """Decorator registering a layer pruning method under ``name``; ``statistics`` names the
    input statistics beyond ``H`` it takes (keyword-only parameters of those names)."""
    return _register(_METHODS, "method", name, description, supports, statistics)


def register_refiner(name: str, *, description: str = "") -> Callable:
    """Decorator registering a mask-held refiner under ``name``."""
    return _register(_REFINERS, "refiner", name, description, None, ())


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
