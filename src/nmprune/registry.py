"""Registries of layer pruning methods and mask-held refiners.

A method is added by writing one module in :mod:`nmprune.algorithms` that decorates its
solver with :func:`register_method`; the package imports every module it holds, so no
``if method == ...`` chain is ever edited. Solvers are pure tensor functions:

* method: ``fn(W, H, pattern, *, <options>) -> W_pruned``, exactly N:M along ``d_in``;
* refiner: ``fn(W, W_star, H, mask, *, <options>) -> W_refined`` with ``W_refined`` zero
  outside ``mask``.

``W`` is ``(d_out, d_in)``, ``H`` is ``(d_in, d_in)``; both arrive validated, on one device,
in float32 or float64. Options are the solver's keyword-only parameters; an unknown option
is a ValueError naming it (see :func:`split_options`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from .pattern import NMPattern


@dataclass(frozen=True)
class Registered:
    name: str
    fn: Callable[..., Any]
    description: str
    supports: Callable[[NMPattern], bool] = field(default=lambda p: True)

    def option_names(self) -> list[str]:
        params = inspect.signature(self.fn).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


_METHODS: dict[str, Registered] = {}
_REFINERS: dict[str, Registered] = {}


def _register(table: dict[str, Registered], kind: str, name: str, description: str,
              supports: Callable[[NMPattern], bool] | None) -> Callable:
    def deco(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"{kind} {name!r} is registered twice")
        table[name] = Registered(name, fn, description or (fn.__doc__ or "").strip().split("\n")[0],
                                 supports or (lambda p: True))
        return fn
    return deco


def register_method(name: str, *, description: str = "",
                    supports: Callable[[NMPattern], bool] | None = None) -> Callable:
    """Decorator registering a layer pruning method under ``name``."""
    return _register(_METHODS, "method", name, description, supports)


def register_refiner(name: str, *, description: str = "") -> Callable:
    """Decorator registering a mask-held refiner under ``name``."""
    return _register(_REFINERS, "refiner", name, description, None)


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


def split_options(options: dict[str, Any], method: Registered,
                  refiner: Registered | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Route ``options`` to the method, and ``refine_<name>`` options to the refiner.

    Raises a ValueError naming any option neither accepts.
    """
    m_opts, r_opts = {}, {}
    m_names = set(method.option_names())
    r_names = set(refiner.option_names()) if refiner else set()
    for key, value in options.items():
        if key in m_names:
            m_opts[key] = value
        elif key.startswith("refine_") and key[len("refine_"):] in r_names:
            r_opts[key[len("refine_"):]] = value
        else:
            accepted = sorted(m_names) + sorted(f"refine_{n}" for n in r_names)
            raise ValueError(f"unknown option {key!r} for method {method.name!r}"
                             + (f" with refine={refiner.name!r}" if refiner else "")
                             + f"; accepted: {', '.join(accepted) or 'none'}")
    return m_opts, r_opts
