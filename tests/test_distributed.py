"""Pruning on several ranks (nmprune/distributed.py): the assignment, and 2-rank gloo jobs
under ``torchrun`` against 1-rank runs on tiny models of two families (the command line on
Llama, ``prune_model`` from Python on OPT with propagation), a failing rank whose
checkpoint resumes on one rank, and a 1-rank checkpoint resumed on two."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
import torch
from test_models_tiny import token_batch

from nmprune.checkpoint import Checkpoint
from nmprune.cli import main
from nmprune.distributed import assign, balance_window, flat_buckets, job_cost, makespan, plan_cost
from nmprune.pattern import same_mask_cells
from nmprune.pipeline import prune_model

WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def torchrun(args: list[str], tmp_path: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """``nproc`` gloo ranks on a free port, a 60 s collective timeout, 2 minutes in all."""
    env = {**os.environ, "NMPRUNE_DIST_TIMEOUT": "60"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def agreement(a: dict, b: dict, names: list[str]) -> float:
    """Fraction of 2:4 cells with the same mask over the named layers."""
    same = [same_mask_cells(a[f"{n}.weight"], b[f"{n}.weight"], 4) for n in names]
    return float(sum(s.sum() for s in same)) / sum(s.numel() for s in same)


def total_loss(layers: list[dict]) -> float:
    return sum(r["loss_refined"] for r in layers if not r["skipped"])


def check_same_result(one: dict, two: dict, state_one: dict, state_two: dict) -> None:
    """The issue's bar: masks on >= 99.9% of cells, total local loss within 1e-4 relative,
    every rank busy and the ranks' layers a partition of the pruned ones."""
    names = [r["name"] for r in one["layers"] if not r["skipped"]]
    assert [r["name"] for r in two["layers"] if not r["skipped"]] == names
    assert agreement(state_one, state_two, names) >= 0.999
    assert total_loss(two["layers"]) == pytest.approx(total_loss(one["layers"]), rel=1e-4)
    assert one["ranks"] == 1 and two["ranks"] == 2 and len(two["per_rank"]) == 2
    solved = [set(p["layers"]) for p in two["per_rank"]]
    assert solved[0] and solved[1] and not solved[0] & solved[1] and solved[0] | solved[1] == set(names)
    for p in two["per_rank"]:
        assert p["busy_seconds"] > 0 and p["layer_cpu_seconds"] > 0
    assert {r["rank"] for r in two["layers"] if not r["skipped"]} == {0, 1}


# ----------------------------------------------------------------------------- assignment


def test_assignment_is_longest_first_to_least_loaded_and_near_optimal():
    torch.manual_seed(0)
    for world, n in [(2, 7), (3, 9), (4, 8)]:
        costs = torch.rand(n).tolist()
        owner = assign(costs, world)
        assert owner == assign(costs, world) and set(owner) <= set(range(world))
        load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(world)]
        best = min(max(sum(c for c, o in zip(costs, split) if o == r) for r in range(world))
                   for split in product(range(world), repeat=n))
        assert max(load) <= 4 / 3 * best + 1e-12
    # one job larger than all others together: it alone on one rank
    assert assign([10.0, 1.0, 1.0, 1.0], 2) == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="world"):
        assign([1.0], 0)


def test_job_cost_scales_with_rows_and_between_linearly_and_squared_with_input_width():
    base = job_cost(64, 32, "prox", "exact")
    assert job_cost(128, 32, "prox", "exact") == pytest.approx(2 * base)
    assert 2 * base < job_cost(64, 64, "prox", "exact") < 4 * base
    assert job_cost(64, 32, "prox", None) < base


def test_plan_cost_prices_a_plan_by_its_method_and_refiner():
    from nmprune.algorithms.prox import uses_triton_kernel
    from nmprune.stages.plan import resolve_plan

    for refine, device in (("exact", "cpu"), (None, "cuda")):
        plan = resolve_plan("prox", refine, "2:4", {}, 0.01)
        kernel = device == "cuda" and uses_triton_kernel(plan.pattern, {})  # tests/test_solver_costs.py
        assert plan_cost((64, 32), plan, device) == job_cost(64, 32, "prox", refine, device, kernel)


def test_balance_window_takes_the_fewest_blocks_that_balance():
    block = [1.0, 0.25, 0.25, 1.0, 3.5, 3.5, 12.25]  # Llama-3.1-8B's layers, units of 4096^3
    assert balance_window([block] * 32, 1) == 1
    for world in (2, 4, 8):
        k = balance_window([block] * 32, world)
        assert makespan(block * k, world) <= 1.1 * sum(block) * k / world
        assert k == 1 or makespan(block * (k - 1), world) > 1.1 * sum(block) * (k - 1) / world
    assert balance_window([block] * 32, 8) > balance_window([block] * 32, 2) > 1
    assert balance_window([[10.0, 1.0]] * 2, 3) == 2  # never balanced: all blocks
    assert balance_window([[1.0] * 4] * 3, 2) == 1


def test_sums_over_ranks_go_in_buckets_by_dtype_in_order():
    """One collective per bucket: tensors of one dtype and device, in order, up to the byte
    limit; a tensor over the limit, or not contiguous, alone."""
    a, b, c = torch.zeros(10), torch.zeros(20), torch.zeros(5)
    wide, big, strided = torch.zeros(3, dtype=torch.float64), torch.zeros(100), torch.zeros(4, 4).T
    groups = flat_buckets([a, wide, b, big, strided, c], limit=200)
    assert [[id(t) for t in g] for g in groups] == [[id(big)], [id(strided)], [id(a), id(b), id(c)], [id(wide)]]
    groups = flat_buckets([a, b, c], limit=100)  # 40 + 80 bytes exceed 100: b opens a new bucket
    assert [[id(t) for t in g] for g in groups] == [[id(a)], [id(b), id(c)]]


# ----------------------------------------------------------------------------- 2 ranks


def _load(out: Path) -> tuple[dict, dict]:
    """The report and the weights of a saved run (one file, or a streamed run's shards)."""
    from safetensors.torch import load_file

    state = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    return json.loads((out / "nmprune_report.json").read_text()), state


def test_command_line_on_two_ranks_matches_one_rank(tiny_dir, tmp_path):
    base, model_dir, text, yaml_file = tiny_dir
    args = ["prune", "--config", str(yaml_file), "--method", "sparsegpt", "--refine", "exact", "--quiet"]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    run = torchrun(["-m", "nmprune", *args, "--out", str(tmp_path / "two")], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (one, state_one), (two, state_two) = _load(tmp_path / "one"), _load(tmp_path / "two")
    check_same_result(one, two, state_one, state_two)
    # a safetensors model streams under torchrun (no rank holds a copy of the whole model);
    # rank 0 wrote the shards
    assert not one["streamed"] and two["streamed"] and state_one.keys() == state_two.keys()
    ppl_one, ppl_two = one["perplexity"]["pruned"][str(text)], two["perplexity"]["pruned"][str(text)]
    assert ppl_two == pytest.approx(ppl_one, rel=1e-3)
    assert not (tmp_path / "two.checkpoint").exists()


def test_default_job_on_two_ranks_gives_one_ranks_quality(tiny_dir, tmp_path):
    """The promise of docs/distributed.md for the default job (prox + exact + block
    reconstruction in one lane): 2 ranks against 1 give masks equal on at least 99.5% of
    cells (summation order flips near-ties, and an exact refinement then moves that row's kept
    weights), the same kept/solved decisions, block errors within 1%, total local loss within
    1e-3 and perplexity within 0.5%. The two ranks stream the model (as the one does, with
    --offload) and make the global distillation sharded over them, each reading the pruned
    weights from the shards rank 0 wrote: it starts where one process's does and lowers the
    divergence too."""
    base, model_dir, text, yaml_file = tiny_dir
    args = ["prune", "--model", str(model_dir), "--calib", str(text), "--nsamples", "8", "--seqlen", "64",
            "--eval", str(text), "--eval-seqlen", "16", "--eval-max-tokens", "256", "--quiet", "--distill-epochs", "2",
            "--distill-nsamples", "8"]
    assert main(args + ["--offload", "--out", str(tmp_path / "one")]) == 0
    run = torchrun(["-m", "nmprune", *args, "--out", str(tmp_path / "two")], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (one, state_one), (two, state_two) = _load(tmp_path / "one"), _load(tmp_path / "two")
    names = [r["name"] for r in one["layers"] if not r["skipped"]]
    assert agreement(state_one, state_two, names) >= 0.995
    assert total_loss(two["layers"]) == pytest.approx(total_loss(one["layers"]), rel=1e-3)
    blocks_one, blocks_two = one["reconstruction"]["blocks"], two["reconstruction"]["blocks"]
    assert [b["kept"] for b in blocks_one] == [b["kept"] for b in blocks_two]
    assert one["reconstruction"]["lanes"] == two["reconstruction"]["lanes"] == 1
    for a, b in zip(blocks_one, blocks_two):
        for key in ("heldout_before", "heldout_after", "error_before", "error_after"):
            assert b[key] == pytest.approx(a[key], rel=1e-2), (a["block"], key)
    for data, ppl in one["perplexity"]["pruned"].items():
        assert two["perplexity"]["pruned"][data] == pytest.approx(ppl, rel=5e-3), data
    assert one["streamed"] and two["streamed"]
    a, b = one["distillation"], two["distillation"]
    assert a["kept"] == b["kept"] == "distilled" and b["steps"] > 0
    assert b["heldout_before"] == pytest.approx(a["heldout_before"], rel=1e-2)
    assert b["heldout_trained"] < b["heldout_before"]


def worker_run(family: str, mode: str, out: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    out.mkdir()
    return torchrun([str(WORKER), family, mode, str(out), *extra], tmp_path)


def test_prune_model_in_a_process_group_matches_one_rank(tmp_path):
    """OPT, propagating through the pruned blocks: every rank needs every pruned weight."""
    run = worker_run("opt", "run", tmp_path / "two", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import SETTINGS, build

    model = build("opt")
    one = prune_model(model, calibration=token_batch(8, 16), device="cpu", progress=False,
                      hessian_inputs="pruned", **SETTINGS).to_dict()
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    state_two = torch.load(tmp_path / "two" / "state.pt")
    check_same_result(one, two, model.state_dict(), state_two)

    from nmprune.evaluate import perplexity

    stream = token_batch(1, 512, seed=5)
    ppl_one = perplexity(model, stream, seqlen=16, progress=False)
    model.load_state_dict(state_two)
    assert perplexity(model, stream, seqlen=16, progress=False) == pytest.approx(ppl_one, rel=1e-3)


@pytest.mark.parametrize("family,granularity,lanes", [("llama", "submodule", 2), ("opt", "block", 1),
                                                     ("llama", "block", 1), ("llama", "submodule", 1)])
def test_reconstruction_on_two_ranks_matches_one_process_with_as_many_lanes(family, granularity, lanes, tmp_path):
    """Data-parallel reconstruction: each rank holds half of the calibration batches, and the
    gradients are summed. With one lane (the default) two ranks take one rank's steps: a whole
    block's steps shared by tokens (every rank computes its share of each step's sample),
    submodules' on the rank holding the sample; with two lanes each rank's half is a lane,
    trained at once with the other's (delayed gradients), and two ranks end where one process
    with two lanes does; all up to float summation order."""
    run = worker_run(family, "run", tmp_path / "two", tmp_path, f"{granularity}:{lanes}")
    assert run.returncode == 0, run.stderr[-3000:]
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import RECONSTRUCT, SETTINGS, build

    model = build(family)
    one = prune_model(model, calibration=token_batch(8, 16), device="cpu", progress=False,
                      hessian_inputs="pruned" if family == "opt" else "dense",
                      **{**SETTINGS, "reconstruct": granularity, **RECONSTRUCT, "reconstruct_lanes": lanes}
                      ).to_dict()
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    state_one, state_two = model.state_dict(), torch.load(tmp_path / "two" / "state.pt")
    names = [r["name"] for r in one["layers"] if not r["skipped"]]
    assert agreement(state_one, state_two, names) >= 0.999
    assert [b["block"] for b in two["blocks"]] == [b["block"] for b in one["blocks"]] == [0, 1, 2]
    shared = 2 if granularity == "block" and lanes == 1 else 1
    for a, b in zip(one["blocks"], two["blocks"]):
        assert a["kept"] == b["kept"] and a["steps"] == b["steps"]
        assert a["token_shares"] == 1 and b["token_shares"] == shared
        assert b["heldout_before"] == pytest.approx(a["heldout_before"], rel=1e-3)
        assert b["heldout_after"] == pytest.approx(a["heldout_after"], rel=1e-3)
        assert b["error_after"] == pytest.approx(a["error_after"], rel=1e-3)
    assert any(b["kept"] == "reconstructed" for b in two["blocks"])
    for k in state_one:
        # Adam's steps amplify summation-order differences a little: within 0.1% per tensor
        assert float((state_one[k] - state_two[k]).norm()) <= 1e-3 * float(state_one[k].norm()), k


def test_global_distillation_on_two_in_memory_ranks_runs_sharded(tmp_path):
    """The pass after the last block on two in-memory ranks runs sharded over them
    (:mod:`nmprune.stages.sharded_pass`): it starts where one process does, takes a step per
    round of both ranks' batches (3 training batches: 2 rounds an epoch), and lowers the
    held-out divergence about as far as one process's steps; the mask holds."""
    run = worker_run("llama", "run", tmp_path / "two", tmp_path, "block:1:distill")
    assert run.returncode == 0, run.stderr[-3000:]
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import DISTILL, RECONSTRUCT, SETTINGS, build

    model = build("llama")
    one = prune_model(model, calibration=token_batch(8, 16), device="cpu", progress=False,
                      **{**SETTINGS, "reconstruct": "block", **RECONSTRUCT, **DISTILL}).to_dict()
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    a, b = one["distillation"], two["distillation"]
    assert a["kept"] == b["kept"] == "distilled" and a["steps"] == 2 * 3 and b["steps"] == 2 * 2
    assert b["heldout_before"] == pytest.approx(a["heldout_before"], rel=1e-3)
    assert b["heldout_before"] - b["heldout_trained"] >= 0.5 * (a["heldout_before"] - a["heldout_trained"]) > 0
    state_one, state_two = model.state_dict(), torch.load(tmp_path / "two" / "state.pt")
    for k in state_one:
        assert torch.equal(state_one[k] == 0, state_two[k] == 0) or state_one[k].ndim < 2, k


def test_failing_rank_ends_the_job_with_its_error_and_resumes_on_one_rank(tmp_path):
    out = tmp_path / "failed"
    run = worker_run("llama", "fail", out, tmp_path)
    assert run.returncode != 0
    # the worker's wide MLP made the ranks solve blocks 0 and 1 together
    assert "rank 1 failed during saving blocks 0-1: ValueError: injected failure on rank 1" in run.stderr
    assert "ValueError: injected failure on rank 1 after block 1" in run.stderr
    # the checkpoint rank 0 kept resumes on one rank, to the same result as a straight run
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import SETTINGS, WIDE_MLP, build

    resumed, straight = build("llama", WIDE_MLP), build("llama", WIDE_MLP)
    kwargs = dict(calibration=token_batch(8, 16), device="cpu", progress=False, **SETTINGS)
    report = prune_model(resumed, checkpoint=Checkpoint.open(out / "ckpt", "test"), **kwargs).to_dict()
    assert report["resumed_from_block"] == 2
    reference = prune_model(straight, **kwargs).to_dict()
    names = [r["name"] for r in reference["layers"] if not r["skipped"]]
    assert agreement(resumed.state_dict(), straight.state_dict(), names) >= 0.999
    assert total_loss(report["layers"]) == pytest.approx(total_loss(reference["layers"]), rel=1e-4)


def test_one_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    """A 1-process run stopped after block 0 continues under torchrun with 2 ranks."""
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import SETTINGS, build

    out = tmp_path / "two"
    out.mkdir()
    kwargs = dict(calibration=token_batch(8, 16), device="cpu", progress=False, **SETTINGS)

    def stop(i: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prune_model(build("llama"), checkpoint=Checkpoint.open(out / "ckpt", "test"),
                    on_block_done=stop, **kwargs)
    assert Checkpoint.open(out / "ckpt", "test").done_blocks == 1
    run = torchrun([str(WORKER), "llama", "resume", str(out)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    two = json.loads((out / "report.json").read_text())
    assert two["resumed_from_block"] == 1 and two["ranks"] == 2
    straight = build("llama")
    one = prune_model(straight, **kwargs).to_dict()
    names = [r["name"] for r in one["layers"] if not r["skipped"]]
    assert [r["name"] for r in two["layers"] if not r["skipped"]] == names
    assert agreement(torch.load(out / "state.pt"), straight.state_dict(), names) >= 0.999
    assert total_loss(two["layers"]) == pytest.approx(total_loss(one["layers"]), rel=1e-4)


def test_reduce_refuses_averaged_statistics():
    """Summing means over ranks (and adding the counts) would be wrong: only sums reduce."""
    from types import SimpleNamespace

    from nmprune.distributed import DistributedExecutor
    from nmprune.stages.statistics import accumulate, new_stats

    ranks = SimpleNamespace(device=torch.device("cpu"), rank=0, world=2, is_main=True,
                            check=lambda *args: [])
    stats = accumulate(new_stats(4), torch.randn(3, 4)).average_()
    with pytest.raises(ValueError, match="before they are averaged"):
        DistributedExecutor(ranks).reduce([stats])


# Runs the CLI on every rank, rank 1 with the extra arguments given after "--rank1".
SPLIT_ARGS = """
import os, sys
from nmprune.cli import main
common, _, extra = " ".join(sys.argv[1:]).partition(" --rank1 ")
argv = common.split() + (extra.split() if os.environ["RANK"] == "1" else [])
sys.exit(main(argv))
"""


@pytest.mark.parametrize("differ", ["settings", pytest.param("model files", marks=pytest.mark.slow)])
def test_ranks_started_on_different_jobs_all_stop_with_one_message(tiny_dir, tmp_path, differ):
    base, model_dir, text, yaml_file = tiny_dir
    script = tmp_path / "split.py"
    script.write_text(SPLIT_ARGS)
    if differ == "model files":  # the same layout, other weights (another node's copy, say)
        other = tmp_path / "other"
        shutil.copytree(model_dir, other)
        from test_models_tiny import tiny_model

        tiny_model("llama", layers=3, seed=1).save_pretrained(other)
    extra = ["--seed", "3"] if differ == "settings" else ["--model", str(other)]
    run = torchrun([str(script), "prune", "--config", str(yaml_file), "--quiet", "--out",
                    str(tmp_path / "o"), "--rank1", *extra], tmp_path)
    assert run.returncode != 0
    # one message from each rank (the two may share a line: both write to one pipe at once)
    errors = run.stderr.split("nmprune: error: ")[1:]
    assert len(errors) == 2, run.stderr[-3000:]
    assert all(e.startswith("the 2 ranks were not started on the same job") and f"{differ} (rank 0:" in e
               for e in errors)
    assert "nmprune/" not in run.stderr.replace(str(tmp_path), "")  # no nmprune frame (torchrun prints its own)
    assert not [p for p in tmp_path.iterdir() if p.name == "o" or p.name.startswith("o.")]


# The command line on every rank; rank 1 kills itself (SIGKILL) once block 1 is done.
KILL_RANK1 = """
import os, signal, sys
import nmprune.job as job
from nmprune.cli import main
run = job.run
kill = lambda i: i == 1 and os.environ["RANK"] == "1" and os.kill(os.getpid(), signal.SIGKILL)
job.run = lambda config, **kw: run(config, **kw, on_block_done=kill)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # several processes, killed and resumed: in `pytest -m slow`, beside the default suite
def test_streamed_ranks_killed_mid_run_resume_to_the_uninterrupted_model(tiny_dir, tmp_path):
    """Two ranks stream the model (each reads only its current block); rank 1 is killed with
    SIGKILL after block 1: torchrun fails, rank 0 says in one line that it lost its peer and
    what to do, the checkpoint stays consistent, and the same
    command resumes -- on 2 ranks to the uninterrupted model bit for bit, on 1 rank to the
    same masks."""
    base, model_dir, text, yaml_file = tiny_dir
    args = ["prune", "--config", str(yaml_file), "--quiet", "--method", "sparsegpt", "--refine", "exact",
            "--reconstruct", "block", "--reconstruct-lr", "5e-2"]
    straight = torchrun(["-m", "nmprune", *args, "--out", str(tmp_path / "straight")], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    script = tmp_path / "kill.py"
    script.write_text(KILL_RANK1)
    for out, ranks in [(tmp_path / "two", 2), (tmp_path / "one", 1)]:
        killed = torchrun([str(script), *args, "--out", str(out)], tmp_path)
        assert killed.returncode != 0 and not out.exists()
        # the survivor says so in one line of ours, with no traceback of nmprune's: it lost its
        # peer in a collective, or torchrun's agent, which saw rank 1 die, stopped it first (SIGTERM)
        assert (killed.stderr.count("nmprune: error: lost contact with another rank during")
                + killed.stderr.count("nmprune: error: stopped by SIGTERM")) == 1, killed.stderr
        assert "rerun the same torchrun command" in killed.stderr
        assert "nmprune/" not in killed.stderr.replace(str(tmp_path), ""), killed.stderr[-3000:]
        assert Path(f"{out}.checkpoint").is_dir()  # what rank 0 finished before it was stopped
        if ranks == 2:
            resumed = torchrun(["-m", "nmprune", *args, "--out", str(out)], tmp_path)
            assert resumed.returncode == 0, resumed.stderr[-3000:]
        else:
            assert main(args + ["--offload", "--out", str(out)]) == 0
    (a, state_a), (b, state_b), (c, state_c) = (_load(tmp_path / n) for n in ("straight", "two", "one"))
    assert a["streamed"] and b["streamed"] and b["resumed_from_block"] >= 1 and c["resumed_from_block"] >= 1
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    names = [r["name"] for r in a["layers"] if not r["skipped"]]
    assert agreement(state_a, state_c, names) >= 0.999


# Runs the CLI's job on every rank; rank 0 touches the model's weight file once block 0 is done.
TOUCH_WEIGHTS = """
import os, sys
from pathlib import Path
from nmprune.cli import build_parser, config_from_args, main
weights = Path(sys.argv[sys.argv.index("--model") + 1]) / "model.safetensors"
import nmprune.job as job
run = job.run
job.run = lambda config, **kw: run(config, **kw, on_block_done=lambda i: i == 0 and os.environ["RANK"] == "0"
                                   and os.utime(weights, ns=(1, 1)))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # streamed ranks stopped mid-run: in `pytest -m slow`
def test_a_shard_changed_under_streamed_ranks_stops_every_rank_with_one_message(tiny_dir, tmp_path):
    """The weights file changes after block 0 (another process rewrote it): every rank stops
    with exit code 2 and one message naming the file; the checkpoint keeps block 0, and once
    the file is restored the same command resumes."""
    base, model_dir, text, yaml_file = tiny_dir
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    stamp = (model / "model.safetensors").stat()
    script = tmp_path / "touch.py"
    script.write_text(TOUCH_WEIGHTS)
    args = ["prune", "--config", str(yaml_file), "--model", str(model), "--quiet", "--out", str(tmp_path / "o")]
    run = torchrun([str(script), *args], tmp_path)
    assert run.returncode != 0 and not (tmp_path / "o").exists()
    errors = run.stderr.split("nmprune: error: ")[1:]
    assert len(errors) == 2 and all("model.safetensors changed while the run was reading" in e or
                                    "failed during" in e for e in errors), run.stderr[-3000:]
    assert run.stderr.count("exitcode  : 2") >= 1 and "exitcode  : 1 " not in run.stderr
    assert (tmp_path / "o.checkpoint").is_dir()
    os.utime(model / "model.safetensors", ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    resumed = torchrun(["-m", "nmprune", *args], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "o" / "nmprune_report.json").read_text())["resumed_from_block"] >= 1


def test_pass_sharded_over_two_ranks_takes_the_steps_of_their_batches_together(tmp_path):
    """The global distillation sharded over two ranks with FSDP2 (each holding one window and
    half of every weight's rows): each step is one process's step on both windows at once
    (``batches_per_step=2``), up to float summation order; every rank held half the rows. The
    state offloaded to CPU memory between uses (FSDP2's CPUOffloadPolicy) trains the same
    weights, bit for bit."""
    out = tmp_path / "two"
    out.mkdir()
    worker = Path(__file__).resolve().parent / "sharded_pass_worker.py"
    run = torchrun([str(worker), str(out)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    sys.path.insert(0, str(worker.parent))
    from sharded_pass_worker import OPTIONS, pruned_model_and_windows, trained_names

    from nmprune.reconstruct import FitOptions
    from nmprune.stages.distillation import PassRuntime, PassWindows, distill
    from nmprune.stages.source import ModelBlocks

    model, batches, teachers = pruned_model_and_windows()
    source = ModelBlocks(model)
    names = trained_names(source)
    before = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    one = distill(model, [model.get_submodule(n).weight for n in names],
                  PassWindows([b[None] for b in batches], teachers, [0, 1], 2),
                  FitOptions(OPTIONS.epochs, OPTIONS.lr, 2, precision=OPTIONS.precision),
                  PassRuntime(lambda tensors: None, torch.device("cpu")))
    saved = json.loads((out / "record.json").read_text())
    two, shares = saved["record"], saved["rows"]
    assert one["kept"] == two["kept"] == "distilled" and one["steps"] == two["steps"] == OPTIONS.epochs
    assert two["heldout_before"] == pytest.approx(one["heldout_before"], rel=1e-5)
    assert two["heldout_trained"] == pytest.approx(one["heldout_trained"], rel=1e-4)
    saved_weights = torch.load(out / "weights.pt")
    weights = saved_weights["weights"]
    assert all(torch.equal(weights[n], saved_weights["offloaded"][n]) for n in names)
    for n in names:
        w = model.get_submodule(n).weight.detach()
        assert not torch.equal(w, before[n]), n  # trained
        assert torch.equal(weights[n] == 0, before[n] == 0), n  # the mask held
        assert float((weights[n] - w).norm()) <= 1e-4 * float(w.norm()), n
        assert [s[n][0] for s in shares] == [w.shape[0] // 2] * 2 and shares[0][n][1] == w.shape[1], n



# The command line on every rank: the pass saves its progress every round, and rank 1 kills
# itself (SIGKILL) once its part of the second save is written.
KILL_RANK1_IN_PASS = """
import os, signal, sys
import nmprune.stages.distillation as stage
from nmprune.cli import main
stage.SAVE_SECONDS = 0.0
save, calls = stage.SavedPass.save, []
def killing(self, state):
    save(self, state)
    calls.append(state.steps)
    if len(calls) == 2 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
stage.SavedPass.save = killing
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # several processes, killed and resumed: in `pytest -m slow`
def test_a_rank_lost_in_the_sharded_pass_ends_the_run_and_the_rerun_resumes_from_its_last_save(tiny_dir, tmp_path):
    """The global distillation sharded over two streamed ranks saves its progress (each rank
    its part, rank 0 the manifest); rank 1 is killed (SIGKILL) after the second save: rank 0
    says in one line that it lost its peer during the pass and what to do; the same command
    then takes the pass up at that save and publishes the uninterrupted run's model, bit for
    bit."""
    base, model_dir, text, yaml_file = tiny_dir
    args = ["prune", "--model", str(model_dir), "--calib", str(text), "--nsamples", "8", "--seqlen", "64",
            "--eval", str(text), "--eval-seqlen", "16", "--eval-max-tokens", "256", "--quiet", "--distill-epochs", "2",
            "--distill-nsamples", "8"]
    straight = torchrun(["-m", "nmprune", *args, "--out", str(tmp_path / "straight")], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    script = tmp_path / "kill.py"
    script.write_text(KILL_RANK1_IN_PASS)
    out = tmp_path / "two"
    killed = torchrun([str(script), *args, "--out", str(out)], tmp_path)
    assert killed.returncode != 0 and not out.exists()
    lost = [line for line in killed.stderr.splitlines() if line.startswith("nmprune: error: lost contact with")]
    assert len(lost) + killed.stderr.count("nmprune: error: stopped by SIGTERM") == 1, killed.stderr[-3000:]
    assert all("global distillation" in line and "rerun the same torchrun command" in line for line in lost)
    assert "nmprune/" not in killed.stderr.replace(str(tmp_path), ""), killed.stderr[-3000:]
    manifest = json.loads((Path(f"{out}.checkpoint") / "manifest.json").read_text())
    assert manifest["extra"]["distillation"]["ranks"] == 2 and manifest["extra"]["distillation"]["steps"] == 2
    assert sorted(f for f in manifest["files"] if f.startswith("distillation_")) == \
        ["distillation_1_rank000.safetensors", "distillation_1_rank001.safetensors"]
    resumed = torchrun(["-m", "nmprune", *args, "--out", str(out)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (a, state_a), (b, state_b) = _load(tmp_path / "straight"), _load(out)
    assert b["resumed_from_block"] == 3 and b["distillation"]["resumed_from_step"] == 2
    assert b["distillation"]["steps"] == a["distillation"]["steps"] > 2
    assert b["distillation"]["kept"] == a["distillation"]["kept"] == "distilled"
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not Path(f"{out}.checkpoint").exists()
