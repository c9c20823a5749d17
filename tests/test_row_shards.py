"""Ranks solving shares of one layer's rows (issue: every GPU pulls its weight): every
built-in solver gives, on 2 and 3 gloo ranks, bit for bit the rows it gives the whole layer;
the choice between shares of rows and whole layers; the registrations that allow it; and a
2-rank ``prune_model`` that splits every layer against one rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import WORKER, agreement, torchrun, total_loss, worker_run
from test_models_tiny import token_batch

from nmprune.distributed import (MIN_SHARE_ROWS, SPLIT_OVERHEAD, busiest_rank_cost, job_cost, makespan,
                                 merge_records, row_share, split_rows)
from nmprune.pipeline import prune_model
from nmprune.registry import register_method, register_refiner
from nmprune.solve import solve
from nmprune.stages.plan import resolve_plan

ROWS_WORKER = Path(__file__).resolve().parent / "row_shards_worker.py"


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: in `pytest -m slow`
def test_every_solver_gives_the_whole_layers_rows_bit_for_bit(world, tmp_path):
    """The worker's layers have 203 rows (unequal shares), dominant inputs or a singular H;
    prox's lambda_adapt mean comes from the whole layer, its stopping count from the ranks."""
    run = torchrun([str(ROWS_WORKER), str(tmp_path)], tmp_path, nproc=world)
    assert run.returncode == 0, run.stderr[-3000:]
    results = torch.load(tmp_path / f"rows-{world}.pt")
    sys.path.insert(0, str(ROWS_WORKER.parent))
    from row_shards_worker import SOLVERS

    assert len(results) == 2 * len(SOLVERS)
    kinds = set()
    for name, r in results.items():
        kinds.update(r["rows_kind"])
        assert torch.equal(r["rows"], r["whole"]), name
        assert r["loss_rows"] == pytest.approx(r["loss_whole"], rel=1e-6), name
    assert kinds == {"independent", "reduced"}


def test_row_shares_cover_the_rows_once():
    for world, rows in [(2, 203), (3, 203), (8, 4096)]:
        shares = [row_share(r, world, rows) for r in range(world)]
        assert [i for s in shares for i in s] == list(range(rows))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_rows_are_split_where_it_beats_whole_layers():
    # Llama-3.1-8B's block, (rows, d_in) of q, k, v, o, gate, up, down, priced as the default solves
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    rows = [r for r, _ in shapes]
    llama_8b = [job_cost(r, d, "prox", "exact") for r, d in shapes]
    on_cuda = [job_cost(r, d, "prox", "exact", "cuda") for r, d in shapes]
    # 8 ranks: whole layers would leave the down projection's rank with several fair shares
    assert split_rows(rows, llama_8b, True, 8) and split_rows(rows, on_cuda, True, 8, "cuda")
    # 2 CPU ranks: the down projection alone is over half the block, below a split share
    # with the CPU's round trips
    assert max(llama_8b) > sum(llama_8b) / 2 and not split_rows(rows, llama_8b, True, 2)
    # on CUDA the work on every weight dominates: the MLP's three projections cost about the
    # same, so 2 ranks balance whole layers within the split's overhead, 4 do not
    assert max(on_cuda) < 0.35 * sum(on_cuda)
    assert not split_rows(rows, on_cuda, True, 2, "cuda") and split_rows(rows, on_cuda, True, 4, "cuda")
    # the plan prices a block as the executor solves it
    share = sum(llama_8b) / 8 * (1 + SPLIT_OVERHEAD["cpu"])
    assert busiest_rank_cost(llama_8b, rows, True, 8) == pytest.approx(share)
    assert busiest_rank_cost(llama_8b, rows, False, 8) == makespan(llama_8b, 8) > 2 * share
    assert busiest_rank_cost(llama_8b, rows, True, 2) == makespan(llama_8b, 2)
    # the scaling benchmark's Llama (hidden 512) on 2 CPU ranks: whole layers balance well
    small = [(512, 512)] * 4 + [(1376, 512)] * 2 + [(512, 1376)]
    small_costs = [job_cost(r, d, "prox", "exact") for r, d in small]
    assert makespan(small_costs, 2) < 1.1 * sum(small_costs) / 2
    assert not split_rows([r for r, _ in small], small_costs, True, 2)
    # one rank, a solver that solves layers whole, or too few rows: whole layers
    assert not split_rows(rows, llama_8b, True, 1)
    assert not split_rows(rows, llama_8b, False, 8)
    assert not split_rows([8 * MIN_SHARE_ROWS - 1] + rows[1:], llama_8b, True, 8)
    assert split_rows([8 * MIN_SHARE_ROWS] + rows[1:], llama_8b, True, 8)


def test_merged_record_adds_losses_and_takes_the_slowest_share():
    parts = [{"method": "prox", "loss_method": 2.0, "loss_refined": 1.0, "loss_wanda": 4.0, "loss_vs_wanda": 0.0,
              "seconds_method": s, "seconds_refine": s, "seconds_wanda_reference": s, "seconds": 3 * s,
              "cpu_seconds": s} for s in (1.0, 2.0)]
    record = merge_records(parts, [range(0, 5), range(5, 9)])
    assert record["loss_method"] == 4.0 and record["loss_refined"] == 2.0 and record["loss_wanda"] == 8.0
    assert record["loss_vs_wanda"] == 0.25 and record["seconds"] == 6.0 and record["cpu_seconds"] == 3.0
    assert record["rank"] is None
    assert record["shares"] == [{"rank": 0, "rows": [0, 5], "seconds": 3.0, "cpu_seconds": 1.0},
                                {"rank": 1, "rows": [5, 9], "seconds": 6.0, "cpu_seconds": 2.0}]


def test_registration_states_what_it_promises_about_rows():
    def no_shards(w, h, pattern):
        return w

    def with_shards(w, h, pattern, *, shards=None):
        return w

    with pytest.raises(ValueError, match="rows must be one of"):
        register_method("test-rows-bad", rows="some")(no_shards)
    with pytest.raises(ValueError, match="keyword-only parameter 'shards'"):
        register_method("test-rows-reduced", rows="reduced")(no_shards)
    with pytest.raises(ValueError, match="keyword-only parameter 'shards'"):
        register_refiner("test-rows-independent", rows="independent")(with_shards)


def test_a_solver_that_solves_layers_whole_refuses_a_share(tmp_path):
    @register_method("test-rows-whole")
    def whole_only(w, h, pattern):
        return w * (torch.arange(w.shape[1]) % 4 < 2)

    plan = resolve_plan("test-rows-whole", None, "2:4", {}, 0.0)
    assert "shards" not in plan.method.option_names() and plan.method.rows == "whole"
    w, h = torch.randn(8, 8), torch.eye(8)
    solve(w, h, plan)  # whole: fine
    with pytest.raises(ValueError, match="only whole"):
        solve(w, h, plan, shards=object())


def test_prune_model_on_two_ranks_splitting_every_layer_matches_whole_layers(tmp_path):
    """Llama with prox + exact, propagating through the pruned blocks. The same two ranks
    solving whole layers, or shares of every layer's rows (the worker lets them split layers
    of any size), give the same model bit for bit; against one rank, the statistics' sums
    over two ranks' batches flip a few near-ties, as docs/distributed.md promises."""
    for extra in ("rows", "prox"):
        run = worker_run("llama", "run", tmp_path / extra, tmp_path, extra)
        assert run.returncode == 0, run.stderr[-3000:]
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import PROX, build

    rows, layers = (json.loads((tmp_path / e / "report.json").read_text()) for e in ("rows", "prox"))
    state_rows, state_layers = (torch.load(tmp_path / e / "state.pt") for e in ("rows", "prox"))
    names = [r["name"] for r in layers["layers"] if not r["skipped"]]
    assert {r["rank"] for r in layers["layers"] if not r["skipped"]} == {0, 1}
    solved = [r for r in rows["layers"] if not r["skipped"]]
    assert [r["name"] for r in solved] == names
    assert all(r["rank"] is None and [s["rank"] for s in r["shares"]] == [0, 1] for r in solved)
    for p in rows["per_rank"]:  # every rank solved a share of every layer
        assert p["layers"] == names and p["solve_seconds"] > 0 and p["layer_cpu_seconds"] > 0
    assert all(torch.equal(state_rows[k], state_layers[k]) for k in state_layers)
    assert total_loss(rows["layers"]) == pytest.approx(total_loss(layers["layers"]), rel=1e-6)

    model = build("llama")
    one = prune_model(model, calibration=token_batch(8, 16), device="cpu", progress=False, **PROX).to_dict()
    assert agreement(model.state_dict(), state_rows, names) >= 0.995
    assert total_loss(rows["layers"]) == pytest.approx(total_loss(one["layers"]), rel=1e-3)
