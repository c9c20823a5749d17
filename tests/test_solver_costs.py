"""A solver's cost lives with its registration (registry.register_method / register_refiner,
``cost=``) and is what distributed.job_cost prices a layer solve with."""

from __future__ import annotations

import math

import pytest

from nmprune import methods, refiners
from nmprune.distributed import job_cost
from nmprune.registry import DEFAULT_COST, get_method, get_refiner, register_method, register_refiner

# the factors distributed.COST_FACTORS held before they moved into the registrations: the
# same numbers, so the assignment of layers to ranks does not change
FORMER_FACTORS = {
    "magnitude": 1.1e-11, "wanda": 7.1e-12, "dsnot": 3.0e-11, "sparsegpt": 1.1e-10,
    "prox": 7.2e-10, "prox-l0": 7.3e-9, "prox-l1": 1.4e-9, "prox-l2": 1.5e-8,
}
FORMER_REFINER_FACTORS = {"exact": 1.3e-9, "gd": 1.1e-8}


def _toy_method(w, h, pattern):
    return get_method("magnitude").fn(w, h, pattern)


def _toy_refiner(w, w_star, h, mask):
    return w


def _register_once(kind: str, name: str, **kwargs) -> None:
    """Register a toy solver the first time (the registry lives for the whole session)."""
    if kind == "method" and name not in methods():
        register_method(name, description="test only: magnitude", **kwargs)(_toy_method)
    if kind == "refiner" and name not in refiners():
        register_refiner(name, description="test only: keeps W", **kwargs)(_toy_refiner)


def test_builtin_costs_are_the_former_factors():
    for name, factor in FORMER_FACTORS.items():
        assert get_method(name).cost == factor, name
        assert job_cost(64, 32, name, None) == pytest.approx(64 * 32 ** 2 * factor, rel=1e-12)
    for name, factor in FORMER_REFINER_FACTORS.items():
        assert get_refiner(name).cost == factor, name
    assert job_cost(64, 32, "prox", "exact") == pytest.approx(64 * 32 ** 2 * (7.2e-10 + 1.3e-9), rel=1e-12)
    # the default is the most expensive built-in solver, as an unlisted one was priced before
    assert DEFAULT_COST == max([*FORMER_FACTORS.values(), *FORMER_REFINER_FACTORS.values()])


def test_a_registered_method_and_refiner_are_priced_with_their_own_cost():
    _register_once("method", "test-cost-method", cost=2.5e-9)
    _register_once("refiner", "test-cost-refiner", cost=4e-10)
    rows, d_in = 96, 48
    assert get_method("test-cost-method").cost == 2.5e-9
    assert job_cost(rows, d_in, "test-cost-method", None) == pytest.approx(rows * d_in ** 2 * 2.5e-9, rel=1e-12)
    assert job_cost(rows, d_in, "test-cost-method", "test-cost-refiner") == \
        pytest.approx(rows * d_in ** 2 * (2.5e-9 + 4e-10), rel=1e-12)
    assert job_cost(rows, d_in, "prox", "test-cost-refiner") == \
        pytest.approx(rows * d_in ** 2 * (7.2e-10 + 4e-10), rel=1e-12)
    assert job_cost(rows, d_in, "test-cost-method", "exact") == \
        pytest.approx(rows * d_in ** 2 * (2.5e-9 + 1.3e-9), rel=1e-12)


def test_a_solver_registered_without_a_cost_gets_the_documented_default():
    _register_once("method", "test-cost-default")
    _register_once("refiner", "test-cost-default-refiner")
    assert get_method("test-cost-default").cost == DEFAULT_COST
    assert get_refiner("test-cost-default-refiner").cost == DEFAULT_COST
    assert job_cost(10, 20, "test-cost-default", "test-cost-default-refiner") == \
        pytest.approx(10 * 20 ** 2 * 2 * DEFAULT_COST, rel=1e-12)
    assert "DEFAULT_COST" in register_method.__doc__ and "cost" in register_refiner.__doc__


@pytest.mark.parametrize("bad", [0, -1e-9, math.nan, math.inf, True, "1e-9", None])
def test_a_cost_that_is_not_a_positive_finite_number_is_refused_on_registration(bad):
    with pytest.raises(ValueError, match="cost must be a positive finite number"):
        register_method("test-cost-bad", cost=bad)
    with pytest.raises(ValueError, match="cost must be a positive finite number"):
        register_refiner("test-cost-bad", cost=bad)
    assert "test-cost-bad" not in methods() and "test-cost-bad" not in refiners()


def test_job_cost_of_an_unknown_solver_names_it():
    with pytest.raises(ValueError, match="unknown method 'no-such-method'"):
        job_cost(4, 4, "no-such-method", None)
    with pytest.raises(ValueError, match="unknown refiner 'no-such-refiner'"):
        job_cost(4, 4, "prox", "no-such-refiner")
