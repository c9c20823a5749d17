"""executor.run_job's per-layer record: the Wanda reference (``loss_wanda``, ``loss_vs_wanda``)
is the loss of plan.wanda_reference as prune.solve computes it, at the cost of at most one
loss product (none when the plan's method is Wanda)."""

from __future__ import annotations

import pytest
import torch

from nmprune.stages.executor import LayerJob, run_job, wanda_loss
from nmprune.loss import local_loss
from nmprune.stages.plan import resolve_plan, wanda_reference
from nmprune.solve import solve
from nmprune.stages.statistics import InputStats

RECORD_KEYS = {"method", "refine", "pattern", "damp", "loss_method", "loss_refined", "seconds_method",
               "seconds_refine", "loss_wanda", "loss_vs_wanda", "seconds_wanda_reference", "seconds",
               "cpu_seconds"}


def layer(d_out=12, d_in=32, n=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g) + 0.7 * torch.randn(n, 1, generator=g)
    return torch.randn(d_out, d_in, generator=g), x


def job(plan, w, x):
    stats = InputStats(x.T @ x, x.sum(0), x.shape[0])
    return LayerJob("layer", 0, w, stats, plan)


@pytest.mark.parametrize("method,refine", [("magnitude", None), ("magnitude", "exact"), ("sparsegpt", None),
                                           ("wanda", None), ("wanda", "exact"), ("wanda", "gd")])
@pytest.mark.parametrize("damp", [0.0, 0.05])
def test_the_record_compares_with_wanda_as_solve_does(method, refine, damp):
    w, x = layer()
    plan = resolve_plan(method, refine, "2:4", {"refine_steps": 5} if refine == "gd" else {}, damp)
    weight, record = run_job(job(plan, w, x), torch.device("cpu"))
    assert set(record) == RECORD_KEYS
    h = x.T @ x / x.shape[0]
    expected = local_loss(solve(w, h.clone(), wanda_reference(plan.pattern, damp)).weight, w, h)
    assert record["loss_wanda"] == pytest.approx(expected, rel=1e-5)
    final = record["loss_refined"] if refine else record["loss_method"]
    assert record["loss_vs_wanda"] == pytest.approx(final / record["loss_wanda"])
    if method == "wanda":  # its own method stage is the reference
        assert record["loss_wanda"] == record["loss_method"]
    assert 0 <= record["seconds_wanda_reference"] <= record["seconds"]


def test_wanda_loss_leaves_h_as_it_was_and_reuses_the_method_loss_only_for_wanda():
    w, x = layer(seed=1)
    h = x.T @ x / x.shape[0]
    before = h.clone()
    plan = resolve_plan("magnitude", None, "2:4", {}, 0.1)
    loss = wanda_loss(w, h, plan, loss_method=-1.0)  # not Wanda: the given loss is not used
    assert torch.equal(h, before)
    assert loss == pytest.approx(local_loss(solve(w, h, wanda_reference(plan.pattern, 0.1)).weight, w, h))
    assert wanda_loss(w, h, resolve_plan("wanda", "exact", "2:4", {}, 0.1), loss_method=7.0) == 7.0
    # without the method's loss it is computed, and is the Wanda plan's own loss
    wanda = resolve_plan("wanda", None, "1:4", {}, 0.2)
    assert wanda_loss(w, h, wanda) == pytest.approx(solve(w, h, wanda).loss_method, rel=1e-6)


def test_zero_wanda_loss_gives_no_ratio():
    w = torch.zeros(4, 8)  # every method's loss is 0, so is Wanda's
    _, x = layer(d_out=4, d_in=8)
    _, record = run_job(job(resolve_plan("magnitude", None, "2:4", {}, 0.01), w, x), torch.device("cpu"))
    assert record["loss_wanda"] == 0.0 and record["loss_vs_wanda"] is None
