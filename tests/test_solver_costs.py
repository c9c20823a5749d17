"""A solver's cost lives with its registration (registry.register_method / register_refiner,
``cost=``) and is what distributed.job_cost prices a layer solve with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nmprune import methods, refiners
from nmprune.distributed import CUDA_SPEEDUP, TRITON_ENTRY_SPEEDUP, job_cost, plan_cost
from nmprune.registry import DEFAULT_COST, DEFAULT_ENTRY_COST, get_method, get_refiner, register_method, register_refiner

MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "solver_costs.json"


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


def test_builtin_costs_are_the_measured_fits():
    """Every built-in solver is registered with the two costs benchmarks/solver_costs.py fitted
    (to the two significant digits the registrations quote), and the default is the dearest."""
    measured = json.loads(MEASURED.read_text())["solvers"]
    assert {(r["kind"], r["name"]) for r in measured} == \
        {("method", m) for m in methods() if not m.startswith("test-")} | \
        {("refiner", r) for r in refiners() if not r.startswith("test-")}
    for row in measured:
        solver = (get_method if row["kind"] == "method" else get_refiner)(row["name"])
        for got, fitted in ((solver.cost, row["cost"]), (solver.entry_cost, row["entry_cost"])):
            assert got == pytest.approx(float(f"{fitted:.2g}"), rel=1e-12, abs=1e-30), row["name"]
    dearest = max(measured, key=lambda r: job_cost(576, 576, r["name"], None) if r["kind"] == "method" else 0.0)
    assert (DEFAULT_COST, DEFAULT_ENTRY_COST) == (get_method(dearest["name"]).cost, get_method(dearest["name"]).entry_cost)


def test_job_cost_adds_both_terms_of_the_method_and_refiner():
    method, refiner = get_method("prox"), get_refiner("exact")
    rows, d_in = 64, 32
    assert job_cost(rows, d_in, "prox", None) == pytest.approx(
        rows * d_in ** 2 * method.cost + rows * d_in * method.entry_cost, rel=1e-12)
    assert job_cost(rows, d_in, "prox", "exact") == pytest.approx(
        rows * d_in ** 2 * (method.cost + refiner.cost) + rows * d_in * (method.entry_cost + refiner.entry_cost),
        rel=1e-12)
    # the entry term makes small layers dearer than rows x d_in^2 alone says
    assert job_cost(512, 512, "prox", "exact") / job_cost(512, 1376, "prox", "exact") > (512 / 1376) ** 2


def test_a_registered_method_and_refiner_are_priced_with_their_own_cost():
    _register_once("method", "test-cost-method", cost=2.5e-9, entry_cost=1e-7)
    _register_once("refiner", "test-cost-refiner", cost=4e-10)
    _register_once("refiner", "test-cost-entries-refiner", entry_cost=3e-8)
    rows, d_in = 96, 48
    assert (get_method("test-cost-method").cost, get_method("test-cost-method").entry_cost) == (2.5e-9, 1e-7)
    # given one cost, the other is 0
    assert get_refiner("test-cost-refiner").entry_cost == 0.0 and get_refiner("test-cost-entries-refiner").cost == 0.0
    assert job_cost(rows, d_in, "test-cost-method", None) == \
        pytest.approx(rows * d_in ** 2 * 2.5e-9 + rows * d_in * 1e-7, rel=1e-12)
    assert job_cost(rows, d_in, "test-cost-method", "test-cost-refiner") == \
        pytest.approx(rows * d_in ** 2 * (2.5e-9 + 4e-10) + rows * d_in * 1e-7, rel=1e-12)
    assert job_cost(rows, d_in, "test-cost-method", "test-cost-entries-refiner") == \
        pytest.approx(rows * d_in ** 2 * 2.5e-9 + rows * d_in * (1e-7 + 3e-8), rel=1e-12)


def test_a_solver_registered_without_a_cost_gets_the_documented_default():
    _register_once("method", "test-cost-default")
    _register_once("refiner", "test-cost-default-refiner")
    for solver in (get_method("test-cost-default"), get_refiner("test-cost-default-refiner")):
        assert (solver.cost, solver.entry_cost) == (DEFAULT_COST, DEFAULT_ENTRY_COST)
    assert job_cost(10, 20, "test-cost-default", "test-cost-default-refiner") == \
        pytest.approx(2 * (10 * 20 ** 2 * DEFAULT_COST + 10 * 20 * DEFAULT_ENTRY_COST), rel=1e-12)
    assert "DEFAULT_COST" in register_method.__doc__ and "entry_cost" in register_refiner.__doc__


@pytest.mark.parametrize("bad", [-1e-9, math.nan, math.inf, True, "1e-9"])
@pytest.mark.parametrize("which", ["cost", "entry_cost"])
def test_a_cost_that_is_not_a_non_negative_finite_number_is_refused_on_registration(bad, which):
    with pytest.raises(ValueError, match=f"{which} must be a non-negative finite number"):
        register_method("test-cost-bad", **{which: bad})
    with pytest.raises(ValueError, match=f"{which} must be a non-negative finite number"):
        register_refiner("test-cost-bad", **{which: bad})
    assert "test-cost-bad" not in methods() and "test-cost-bad" not in refiners()


def test_a_solver_that_costs_nothing_is_refused():
    with pytest.raises(ValueError, match="cost and entry_cost cannot both be 0"):
        register_method("test-cost-free", cost=0, entry_cost=0)
    with pytest.raises(ValueError, match="cost and entry_cost cannot both be 0"):
        register_refiner("test-cost-free", cost=0)
    assert "test-cost-free" not in methods() and "test-cost-free" not in refiners()


def test_job_cost_of_an_unknown_solver_names_it():
    with pytest.raises(ValueError, match="unknown method 'no-such-method'"):
        job_cost(4, 4, "no-such-method", None)
    with pytest.raises(ValueError, match="unknown refiner 'no-such-refiner'"):
        job_cost(4, 4, "prox", "no-such-refiner")


def test_cuda_prices_each_term_at_its_own_speed_up_and_match_the_h200_times():
    products = 4096 * 14336 ** 2 * (get_method("prox").cost + get_refiner("exact").cost)
    entries = 4096 * 14336 * (get_method("prox").entry_cost + get_refiner("exact").entry_cost)
    assert job_cost(4096, 14336, "prox", "exact", "cuda") == pytest.approx(
        products / CUDA_SPEEDUP["products"] + entries / CUDA_SPEEDUP["entries"], rel=1e-12)
    assert job_cost(4096, 14336, "prox", "exact") == pytest.approx(products + entries, rel=1e-12)
    # the fit the speed-ups come from: prox + exact at Llama-3.1-8B's shapes on an H200
    h200 = json.loads((MEASURED.parent / "gpu.json").read_text())
    assert h200["device_name"] == "NVIDIA H200"
    timed = [r for r in h200["speed"] if (r["method"], r["refine"]) == ("prox", "exact")]
    assert len(timed) == 3
    for r in timed:
        assert job_cost(*r["shape"], "prox", "exact", "cuda") == pytest.approx(r["seconds_median"], rel=0.2), r


def test_the_triton_kernel_prices_the_prox_work_on_every_weight_at_its_estimate(monkeypatch):
    """Where the 2:4 prox runs in the Triton kernel (the prox method, 2:4, solver "reduced",
    triton installed) its work on every weight is priced at TRITON_ENTRY_SPEEDUP; every other
    plan, and the CPU, keep their prices."""
    from nmprune.algorithms import prox
    from nmprune.stages.plan import resolve_plan

    products = 4096 * 14336 ** 2 * (get_method("prox").cost + get_refiner("exact").cost)
    entries = 4096 * 14336 * (get_method("prox").entry_cost + get_refiner("exact").entry_cost)
    kernel = products / CUDA_SPEEDUP["products"] + entries / TRITON_ENTRY_SPEEDUP
    torch_chain = job_cost(4096, 14336, "prox", "exact", "cuda")
    assert job_cost(4096, 14336, "prox", "exact", "cuda", triton_prox=True) == pytest.approx(kernel, rel=1e-12)
    assert kernel < torch_chain
    shape = (4096, 14336)
    monkeypatch.setattr(prox, "triton_installed", lambda: True)
    assert plan_cost(shape, resolve_plan("prox", "exact", "2:4", {}, 0.01), "cuda") == pytest.approx(kernel)
    for method, pattern, options in (("prox", "2:4", {"solver": "newton"}), ("prox", "4:8", {}),
                                     ("prox-l1", "2:4", {})):
        plan = resolve_plan(method, "exact", pattern, options, 0.01)
        assert plan_cost(shape, plan, "cuda") == pytest.approx(job_cost(*shape, method, "exact", "cuda")), method
    assert plan_cost(shape, resolve_plan("prox", "exact", "2:4", {}, 0.01), "cpu") == job_cost(*shape, "prox", "exact")
    monkeypatch.setattr(prox, "triton_installed", lambda: False)
    assert plan_cost(shape, resolve_plan("prox", "exact", "2:4", {}, 0.01), "cuda") == pytest.approx(torch_chain)
