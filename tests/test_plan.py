"""The planner: settings parsed and validated once into resolved layer plans."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
import torch

from nmprune.config import PruneSettings
from nmprune.pattern import NMPattern
from nmprune.stages.plan import parse_refine, resolve_plan
from nmprune.pattern import topn_mask
from nmprune.registry import PositiveFloat, Range, register_method


@register_method("test-plan-opts", description="test only: magnitude with typed options")
def _typed_method(w, h, pattern, *, steps: int = 3, scale: PositiveFloat = 1.0,
                  mode: Annotated[float, Range(0, 1)] | Literal["auto", "off"] = "auto",
                  flag: bool = False, extra=None):
    return w * topn_mask(w.abs(), pattern)


def test_resolve_plan_routes_method_and_refiner_options():
    plan = resolve_plan("test-plan-opts", "gd", "2:4", {"steps": 2, "refine_steps": 5}, 0.0)
    assert plan.pattern == NMPattern(2, 4)
    assert plan.method.name == "test-plan-opts" and plan.refiner.name == "gd"
    assert plan.method_options == {"steps": 2} and plan.refiner_options == {"steps": 5}
    with pytest.raises(ValueError, match="unknown option 'bogus'.*accepted: extra, flag, mode, "
                                         "scale, steps, refine_scaled, refine_step_size, refine_steps"):
        resolve_plan("test-plan-opts", "gd", "2:4", {"bogus": 1}, 0.0)
    with pytest.raises(ValueError, match="unknown option 'refine_steps'"):
        resolve_plan("test-plan-opts", None, "2:4", {"refine_steps": 1}, 0.0)


@pytest.mark.parametrize("options, match", [
    ({"steps": "abc"}, "option 'steps' of method 'test-plan-opts' must be int, got 'abc'"),
    ({"steps": 2.5}, "must be int"),
    ({"steps": True}, "must be int"),
    ({"scale": "abc"}, "option 'scale' of method 'test-plan-opts' must be float > 0, got 'abc'"),
    ({"scale": 0}, "must be float > 0, got 0"),
    ({"scale": float("nan")}, "must be a finite float"),
    ({"flag": 1}, "option 'flag' .* must be bool"),
    ({"mode": [1]}, r"must be float in \[0, 1\] or 'auto' or 'off', got \[1\]"),
    ({"mode": 1.5}, r"must be float in \[0, 1\], got 1.5"),
    ({"mode": "on"}, "got 'on'"),
    ({"refine_steps": "x"}, "option 'refine_steps' of refiner 'gd' must be int"),
])
def test_option_types_come_from_the_solver_signature(options, match):
    with pytest.raises(ValueError, match=match):
        resolve_plan("test-plan-opts", "gd", "2:4", options, 0.0)


def test_typed_options_are_converted_and_untyped_ones_pass():
    plan = resolve_plan("test-plan-opts", None, "2:4", {"scale": 2, "mode": 1, "extra": [1, 2]}, 0.0)
    assert plan.method_options == {"scale": 2.0, "mode": 1.0, "extra": [1, 2]}
    assert resolve_plan("test-plan-opts", None, "2:4", {"mode": "off"}, 0.0).method_options == {"mode": "off"}
    assert isinstance(plan.method_options["scale"], float)


def test_statistics_are_declared_not_options():
    with pytest.raises(ValueError, match="unknown option 'input_mean'.*computed from the calibration"):
        resolve_plan("dsnot", None, "2:4", {"input_mean": 1}, 0.0)
    assert resolve_plan("dsnot", None, "2:4", {}, 0.0).statistics == ("input_mean",)
    assert resolve_plan("wanda", None, "2:4", {}, 0.0).statistics == ()


@pytest.mark.parametrize("word", [None, "none", "None", "", "null", " NONE "])
def test_no_refiner_words(word):
    assert parse_refine(word) is None
    assert PruneSettings(refine=word).planner().default.refiner is None


@pytest.mark.parametrize("settings, match", [
    ({"options": {"beta": "abc"}}, "option 'beta' of method 'prox' must be float > 1, got 'abc'"),
    ({"options": {"refine_tol": "abc"}}, "option 'refine_tol' of refiner 'exact' must be float >= 0"),
    ({"options": {"solver": "fast"}}, "option 'solver' of method 'prox' must be 'reduced' or 'newton' or 'gd'"),
    ({"method": "wanda", "refine": "gd", "options": {"refine_steps": -3}}, "must be int >= 0, got -3"),
    ({"overrides": {"*.q": {"options": {"lambda0": -1}}}}, "option 'lambda0' of method 'prox' must be float > 0"),
    ({"damp": -1.0}, "damp must be a non-negative number"),
    ({"pattern": "4:2"}, "N:M"),
    ({"method": "nope"}, "unknown method 'nope'"),
    ({"refine": "nope"}, "unknown refiner 'nope'"),
])
def test_bad_settings_are_refused_when_planning(settings, match):
    with pytest.raises(ValueError, match=match):
        PruneSettings(**settings).planner()


def test_planner_is_made_once_per_settings_and_redone_when_they_change():
    s = PruneSettings(method="wanda", refine=None)
    first = s.planner()
    assert s.planner() is first
    s.pattern = "1:4"
    assert s.planner() is not first and s.planner().default.pattern == NMPattern(1, 4)


def test_plan_layers_overrides_divisibility_and_nothing_to_prune():
    settings = PruneSettings(method="wanda", refine=None,
                             overrides={"*.down": "skip", "*.up": {"pattern": "1:4", "refine": "gd"}})
    shapes = {"b.0.q": (8, 16), "b.0.up": (8, 16), "b.0.down": (8, 16), "b.0.odd": (8, 18)}
    with pytest.warns(UserWarning, match=r"b\.0\.odd has d_in=18, not divisible by M=4"):
        plans = settings.planner().plan_layers(shapes)
    assert plans["b.0.down"] is None and plans["b.0.odd"] is None
    assert plans["b.0.q"].describe() == {"method": "wanda", "refine": None, "pattern": "2:4", "damp": 0.01}
    assert plans["b.0.up"].describe()["pattern"] == "1:4" and plans["b.0.up"].refiner.name == "gd"
    with pytest.raises(ValueError, match="override '\\*.nothing' matches no layer"):
        PruneSettings(method="wanda", overrides={"*.nothing": "skip"}).planner().plan_layers(shapes)
    with pytest.raises(ValueError, match="no layer would be pruned: pattern 2:3.*widths 16, 20"):
        PruneSettings(method="wanda", pattern="2:3").planner().plan_layers(
            {"a": (8, 16), "b": (8, 20)})


def test_plans_are_hashable_values():
    a = resolve_plan("wanda", "none", "2:4", {}, 0.0)
    b = resolve_plan("wanda", None, (2, 4), {}, 0)
    assert a.describe() == b.describe()
    assert torch.equal(torch.tensor(a.damp), torch.tensor(b.damp))
