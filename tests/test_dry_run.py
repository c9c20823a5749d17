"""``nmprune prune --dry-run`` (nmprune/resources.py): the plan of a run from the model's
configuration alone, for any number of ranks and device, and the refusal of a device too
small for one block."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from nmprune.distributed import busiest_rank_cost, job_cost, makespan, split_cost
from nmprune.cli import main
from nmprune.config import AUTO_DISTILL_WINDOWS, build_config
from nmprune import resources
from nmprune.resources import BF16_TRAINING_SPEEDUP, CPU_THREAD_SCALING, cpu_threads, plan_run
from nmprune.stages.distillation import PASS_PARTS
from nmprune.stages.reconstruction import held_out_batches
from nmprune.stages.statistics import hessian_inputs
from nmprune.stages.token_shares import busiest_token_share, token_shares

GIB = 1 << 30


def llama_config_dir(path, blocks: int, hidden: int = 4096, intermediate: int = 14336,
                     sharded: bool = True):
    """A model directory holding an 8B-shaped Llama's config.json and no weights; ``sharded``
    adds an (empty) safetensors index, so that the run would take it for a model that streams."""
    LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=32,
                num_key_value_heads=8, num_hidden_layers=blocks, vocab_size=128256, dtype="bfloat16",
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    if sharded:
        (path / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}')
    return path


def test_dry_run_reads_only_the_configuration_and_writes_nothing(tmp_path, capsys):
    model = llama_config_dir(tmp_path / "llama", blocks=4)
    out = tmp_path / "out"
    assert main(["prune", "--dry-run", "--model", str(model), "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "| peak CPU memory per rank |" in printed and "| time: total |" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]  # no output, checkpoint or lock


def test_the_plan_scales_with_blocks_ranks_and_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # every rank one thread, as under torchrun
    small, large = (plan_run(build_config({"model": str(llama_config_dir(tmp_path / f"m{n}", n)),
                                           "device": "cpu"}), ranks=2) for n in (16, 32))
    assert small.streamed and large.streamed  # several ranks stream
    # streamed, the block phase holds one block: flat in the depth; disk and time grow with it
    assert large.block_phase == small.block_phase
    # the pass runs sharded over the ranks: each holds half of every parameter in float32 (2
    # bytes a parameter) and of the kept half's 16 bytes of position, gradient and moments (4)
    assert small.distill_epochs == large.distill_epochs == 1
    state = PASS_PARTS[0]
    grown = (large.distill_parts[state] - small.distill_parts[state]) / (large.parameters - small.parameters)
    assert 5.5 < grown < 6.0
    assert large.cpu_peak_per_rank == large.distill_peak_per_rank > large.block_phase
    flat = [plan_run(build_config({"model": str(tmp_path / f"m{n}"), "device": "cpu", "distill_epochs": 0}), ranks=2)
            for n in (16, 32)]
    assert flat[0].cpu_peak_per_rank == flat[1].cpu_peak_per_rank
    assert 1.5 < large.output_disk / small.output_disk < 2.0  # the blocks double, the embeddings stay
    assert sum(large.seconds.values()) > 1.8 * sum(small.seconds.values())
    one = plan_run(build_config({"model": str(tmp_path / "m16"), "device": "cpu"}), ranks=1)
    assert not one.streamed and one.cpu_peak_per_rank > small.output_disk  # the whole model in memory
    # reconstruction solves one block at a time: the busiest rank's share of each, as the
    # executor decides between whole layers and shares of rows (distributed.split_rows). On 2
    # CPU ranks the down projection alone is over half the block, and shares of rows cost more
    # than that; on 4 the ranks split every layer's rows
    costs = [job_cost(*shape, "prox", "exact") for shape in EIGHT_B_BLOCK.values()]
    rows = [r for r, _ in EIGHT_B_BLOCK.values()]
    for ranks, plan in ((2, small), (4, plan_run(build_config({"model": str(tmp_path / "m16"), "device": "cpu"}),
                                                  ranks=4))):
        busiest = busiest_rank_cost(costs, rows, True, ranks)
        assert busiest == (makespan(costs, ranks) if ranks == 2 else split_cost(costs, ranks))
        assert plan.seconds["layer_solves"] == pytest.approx(one.seconds["layer_solves"] * busiest / sum(costs))
    bare = plan_run(build_config({"model": str(tmp_path / "m16"), "device": "cpu", "reconstruct": "none"}),
                    ranks=2)
    assert "reconstruction" not in bare.seconds and bare.block_phase < small.block_phase
    assert bare.seconds["layer_solves"] == pytest.approx(one.seconds["layer_solves"] / 2)


def _reconstruction_passes(model: str) -> float:
    """The reconstruction's own passes in units of the two calibration passes: the pass after
    training over every batch, and the one before it over the held-out batches alone."""
    settings = build_config({"model": model}).prune
    batches = -(-settings.nsamples // settings.batch_size)
    return (1 + len(held_out_batches(batches)) / batches) / 2


EIGHT_B_BLOCK = {"a.q_proj": (4096, 4096), "a.k_proj": (1024, 4096), "a.v_proj": (1024, 4096),
                 "a.o_proj": (4096, 4096), "m.gate_proj": (14336, 4096), "m.up_proj": (14336, 4096),
                 "m.down_proj": (4096, 14336)}


def test_the_plan_shares_one_lane_block_training_by_tokens_and_lanes_by_batches(tmp_path, monkeypatch):
    """Whole blocks in one lane: every rank trains on its token share of each step, the
    busiest share priced as token_shares balances it (keys and values run up to the share's
    end); several lanes or submodules train a step's batches on the ranks holding them."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(resources.STEP_COSTS, "cpu", (0.0, 0.0, math.inf))  # the products alone (below: the rest)
    model = str(llama_config_dir(tmp_path / "m", 4))
    plans = {(r, k, lanes): plan_run(build_config({"model": model, "device": "cpu", "reconstruct": k,
                                                    "reconstruct_lanes": lanes}), ranks=r)
             for r in (1, 2, 4) for k in ("block", "submodule") for lanes in (1, 2)}
    passes = _reconstruction_passes(model)
    training = {key: p.seconds["reconstruction"] - passes * p.seconds["calibration_passes"] for key, p in plans.items()}
    # 8B shapes: k and v are 2 x 4096 x 1024 of 218M weights a block
    c = 1 - 2 * 4096 * 1024 / sum(r * d for r, d in EIGHT_B_BLOCK.values())
    for ranks in (2, 4):
        share = (1 - c) / (1 - c ** ranks)
        assert busiest_token_share(EIGHT_B_BLOCK, ranks) == pytest.approx(share)
        # the same share token_shares gives the busiest rank of a long sample
        ranges = token_shares(1 << 16, ranks, c)
        assert max(c * len(r) + (1 - c) * r.stop for r in ranges) / (1 << 16) == pytest.approx(share, rel=1e-3)
        assert training[(ranks, "block", 1)] == pytest.approx(training[(1, "block", 1)] * share)
        # submodules (one lane): a step's sample trains on one rank; lanes: one rank each
        assert training[(ranks, "submodule", 1)] == pytest.approx(training[(1, "submodule", 1)])
        assert training[(ranks, "block", 2)] == pytest.approx(training[(1, "block", 2)] / 2)


def test_every_training_step_prices_its_weights_optimiser_and_collectives(tmp_path, monkeypatch):
    """Beside its products, a step costs each rank its weights' own passes (whole on every
    rank that shares its tokens, the busiest rank's share of batches otherwise), the
    optimiser on the kept entries, and on several ranks the gradients' sum and, for token
    shares, the broadcast of the step's inputs and targets."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the reference threads: the constants as they are
    config = {"model": str(llama_config_dir(tmp_path / "m", 4)), "device": "cpu"}
    settings = build_config(config).prune
    batches = -(-settings.nsamples // settings.batch_size)
    steps = settings.reconstruct_epochs * (batches - len(held_out_batches(batches))) * 4  # 4 blocks
    weights = sum(r * d for r, d in EIGHT_B_BLOCK.values())
    entries = weights // 2  # 2:4
    tokens, hidden = settings.batch_size * settings.seqlen, 4096

    def extra(costs: tuple[float, float, float], ranks: int, **more) -> float:
        """The reconstruction's seconds with step costs ``costs`` over those without."""
        seconds = []
        for step_costs in (costs, (0.0, 0.0, math.inf)):
            monkeypatch.setitem(resources.STEP_COSTS, "cpu", step_costs)
            seconds.append(plan_run(build_config({**config, **more}), ranks=ranks).seconds["reconstruction"])
        return seconds[0] - seconds[1]

    for ranks in (1, 2, 4):
        assert extra((1e-9, 0.0, math.inf), ranks) == pytest.approx(steps * weights * 1e-9)  # token shares: whole
        assert extra((0.0, 1e-9, math.inf), ranks) == pytest.approx(steps * entries * 1e-9)
        gradients, step = 2 * (ranks - 1) / ranks * 4 * entries, (ranks - 1) / ranks * 2 * 4 * tokens * hidden
        assert extra((0.0, 0.0, 1e9), ranks) == pytest.approx(steps * (gradients + step) / 1e9)
    # two lanes on two ranks: each computes one of a round's two steps, and no inputs move
    two_lanes = {"reconstruct_lanes": 2}
    assert extra((1e-9, 0.0, math.inf), 2, **two_lanes) == pytest.approx(steps * weights * 1e-9 / 2)
    assert extra((0.0, 0.0, 1e9), 2, **two_lanes) == pytest.approx(steps * 4 * entries / 1e9)


def test_the_cpu_plan_follows_the_threads_each_rank_has(tmp_path, monkeypatch):
    """The reference constants are of 2 threads; torchrun gives each of several ranks one
    thread unless OMP_NUM_THREADS says otherwise."""
    config = build_config({"model": str(llama_config_dir(tmp_path / "m", 4)), "device": "cpu"})
    # the optimiser's step is bound by memory, not the threads: left out here
    per_parameter, _, link = resources.STEP_COSTS["cpu"]
    monkeypatch.setitem(resources.STEP_COSTS, "cpu", (per_parameter, 0.0, link))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads(2) == 1 and cpu_threads(1) == torch.get_num_threads()
    plans = {}
    for threads in ("1", "2", "4"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        assert cpu_threads(2) == int(threads)
        plans[threads] = plan_run(config, ranks=1).seconds
    for key in plans["2"]:
        assert plans["1"][key] == pytest.approx(plans["2"][key] * 2 ** CPU_THREAD_SCALING)
        assert plans["4"][key] == pytest.approx(plans["2"][key] / 2 ** CPU_THREAD_SCALING)


def test_ranks_plan_to_stream_only_a_model_that_can(tmp_path):
    """The run streams several ranks only from safetensors files (a GGUF file or a hub id
    loads whole, on every rank); the plan makes the same choice."""
    whole = plan_run(build_config({"model": str(llama_config_dir(tmp_path / "m", 16, sharded=False)),
                                   "device": "cpu"}), ranks=2)
    assert not whole.streamed and whole.cpu_peak_per_rank > whole.output_disk
    kept = plan_run(build_config({"model": str(llama_config_dir(tmp_path / "s", 16)), "device": "cpu",
                                  "offload": False}), ranks=2)
    assert not kept.streamed  # offload: false keeps every rank in memory


def test_hessians_are_counted_once_per_shared_input():
    shapes = {"l.0.self_attn.q_proj": (4096, 4096), "l.0.self_attn.k_proj": (1024, 4096),
              "l.0.self_attn.v_proj": (1024, 4096), "l.0.self_attn.o_proj": (4096, 4096),
              "l.0.mlp.gate_proj": (14336, 4096), "l.0.mlp.up_proj": (14336, 4096),
              "l.0.mlp.down_proj": (4096, 14336)}
    assert hessian_inputs(shapes) == [4096, 4096, 4096, 14336]


def test_a_device_too_small_for_one_block_is_refused_up_front(tmp_path, capsys):
    model = llama_config_dir(tmp_path / "llama", blocks=2)
    args = ["prune", "--dry-run", "--model", str(model), "--out", str(tmp_path / "o"), "--device", "cuda"]
    assert main(args + ["--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "| peak device memory per rank |" in out
    assert "| not yet measured on a GPU | the Triton 2:4 prox kernel's speed" in out
    assert main(args + ["--device-memory", "4"]) == 2
    err = capsys.readouterr().err
    assert "nmprune: error: one block's phase needs about" in err and "the device has 4.0 GiB" in err
    assert main(args + ["--ranks", "0"]) == 2
    assert "--ranks must be a number of ranks from 1" in capsys.readouterr().err


def test_the_plan_prices_the_global_distillation_pass(tmp_path):
    """The pass holds the whole model in float32 with its optimiser state: with it the peak is
    at least that, and its time is the whole model's forward and backward on every training
    window per epoch, after one forward pass of the dense model over the pass's own windows,
    and a forward pass over the held-out windows before and after training."""
    model = str(llama_config_dir(tmp_path / "m", 4, sharded=False))

    def plan(**settings):  # training and the forward pass at one rate
        return plan_run(build_config({"model": model, "device": "cpu", "train_precision": "full", **settings}),
                        ranks=1)

    base = plan(distill_epochs=0)
    one, two = (plan(distill_epochs=e) for e in (1, 2))
    # only the run's own windows (distill_nsamples = nsamples): no forward pass before, a
    # fraction of the tokens (auto: AUTO_DISTILL_WINDOWS times the run's 64)
    bare_one, bare_two = (plan(distill_epochs=e, distill_nsamples=64) for e in (1, 2))
    times = AUTO_DISTILL_WINDOWS
    assert one.distill_windows == 64 * times and bare_one.distill_windows == 64
    # one window's forward pass (batches of one window): an epoch is 3 on every training window
    held = {n: len(held_out_batches(n)) for n in (64, 64 * (times - 1))}
    forward = (bare_two.seconds["distillation"] - bare_one.seconds["distillation"]) / (3 * (64 - held[64]))
    assert bare_one.seconds["distillation"] == pytest.approx((3 * (64 - held[64]) + 2 * held[64]) * forward)
    epoch = two.seconds["distillation"] - one.seconds["distillation"]
    trained = 64 * times - held[64] - held[64 * (times - 1)]
    assert epoch == pytest.approx(3 * trained * forward)
    # the dense forward over the pass's own windows, and the held-out windows before and after
    assert one.seconds["distillation"] - epoch == pytest.approx(
        (64 * (times - 1) + 2 * (held[64] + held[64 * (times - 1)])) * forward)
    assert one.distill_peak_per_rank > bare_one.distill_peak_per_rank
    assert "distillation" not in base.seconds
    # the default, auto: one epoch on a model loaded whole, and on a model streamed in one
    # process (which loads it whole for the pass), none on a model streamed on several ranks
    auto = plan_run(build_config({"model": model, "device": "cpu", "train_precision": "full"}), ranks=1,
                    streamed=False)
    assert auto.distill_epochs == 1 and auto.seconds["distillation"] == pytest.approx(one.seconds["distillation"])
    streamed = plan_run(build_config({"model": model, "device": "cpu", "train_precision": "full"}), ranks=1,
                        streamed=True, available=1 << 40)
    assert streamed.distill_epochs == 1 and streamed.distill_peak_per_rank == pytest.approx(auto.distill_peak_per_rank)
    assert streamed.cpu_peak_per_rank >= streamed.distill_peak_per_rank
    # on two ranks, sharded over them (stages.sharded_pass): the pass's time is shared out, and
    # each rank holds under 0.6 of one process's pass
    on_ranks = plan_run(build_config({"model": model, "device": "cpu", "train_precision": "full"}), ranks=2,
                        streamed=True, available=1 << 40)
    assert on_ranks.distill_epochs == 1 and on_ranks.seconds["distillation"] < auto.seconds["distillation"]
    assert on_ranks.distill_peak_per_rank < 0.6 * streamed.distill_peak_per_rank
    assert one.cpu_peak_per_rank >= base.cpu_peak_per_rank and one.cpu_peak_per_rank > 4 * one.parameters


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_plan_prices_training_at_the_precision_the_run_trains_in(tmp_path, monkeypatch, device):
    """bfloat16 training (reconstruction and distillation) is priced BF16_TRAINING_SPEEDUP
    faster than float32; the calibration passes and the solves are not. ``auto`` trains in
    bfloat16 where the layers are wide enough and the device has it: this CPU as
    devices.fast_bfloat16 says, a CUDA device planned from elsewhere always."""
    monkeypatch.setattr("nmprune.devices.fast_bfloat16", lambda d: d.type == "cpu" and has_bf16)
    # a step's costs beside its products are priced alike in both precisions: left out
    monkeypatch.setitem(resources.STEP_COSTS, device, (0.0, 0.0, math.inf))
    wide, narrow = (str(llama_config_dir(tmp_path / name, 2, hidden=h, intermediate=4 * h, sharded=False))
                    for name, h in (("wide", 512), ("narrow", 64)))

    def seconds(model: str, precision: str) -> dict[str, float]:
        # the dense model's pass over the distillation's own windows runs in its dtype too
        return plan_run(build_config({"model": model, "device": device, "train_precision": precision}),
                        ranks=1, streamed=False).seconds

    full, bf16 = seconds(wide, "full"), seconds(wide, "bfloat16")
    speedup = BF16_TRAINING_SPEEDUP[device]
    for key in ("layer_solves", "calibration_passes", "evaluation"):
        assert bf16[key] == pytest.approx(full[key])
    passes = _reconstruction_passes(wide)
    training = {k: s["reconstruction"] - passes * s["calibration_passes"] for k, s in (("full", full), ("bf16", bf16))}
    assert training["bf16"] == pytest.approx(training["full"] / speedup)
    assert bf16["distillation"] == pytest.approx(full["distillation"] / speedup)
    for has_bf16 in (True, False):
        expected = bf16 if device == "cuda" or has_bf16 else full
        assert seconds(wide, "auto") == pytest.approx(expected)
    assert seconds(narrow, "auto") == pytest.approx(seconds(narrow, "full"))
    assert seconds(narrow, "bfloat16")["distillation"] < seconds(narrow, "full")["distillation"]


def test_the_plan_skips_the_auto_distillation_where_the_device_cannot_hold_it(tmp_path, capsys):
    """With ``distill_epochs: auto`` on a device that holds a block's phase but not the whole
    model's training, the plan is the run's: no distillation, and one line saying why; asked
    for explicitly, the same device is refused. Between the pass's peak with its blocks
    checkpointed and without, the pass runs checkpointed, at a second forward pass a step."""
    model = llama_config_dir(tmp_path / "llama", blocks=8)
    args = ["prune", "--dry-run", "--model", str(model), "--out", str(tmp_path / "o"), "--device", "cuda"]
    config = build_config({"model": str(model), "device": "cuda"})
    roomy = plan_run(config, ranks=1)
    tight = plan_run(config, ranks=1, available=roomy.distill_peak_per_rank - 1)
    block = plan_run(build_config({"model": str(model), "device": "cuda", "distill_epochs": 0}), ranks=1)
    assert not roomy.distill_checkpointed and tight.distill_checkpointed
    assert roomy.distill_peak_per_rank > tight.distill_peak_per_rank > block.device_peak_per_rank  # the pass is the peak
    assert tight.seconds["distillation"] > roomy.seconds["distillation"]
    between = f"{(tight.distill_peak_per_rank + block.device_peak_per_rank) / 2 / GIB:.3f}"
    assert main(args + ["--device-memory", between]) == 0
    out = capsys.readouterr().out
    assert "| global distillation | none |" in out and "is skipped: the global distillation pass needs" in out
    assert "its blocks checkpointed" in out
    assert main(args + ["--device-memory", f"{tight.distill_peak_per_rank * 1.01 / GIB:.3f}"]) == 0
    assert (f"| global distillation | 1 epoch(s) on {64 * AUTO_DISTILL_WINDOWS} windows, decoder blocks "
            "checkpointed |") in capsys.readouterr().out
    assert main(args + ["--device-memory", f"{roomy.distill_peak_per_rank * 1.01 / GIB:.3f}"]) == 0
    assert f"| global distillation | 1 epoch(s) on {64 * AUTO_DISTILL_WINDOWS} windows |" in capsys.readouterr().out
    assert main(args + ["--device-memory", between, "--distill-epochs", "1"]) == 2


def test_the_cpu_dry_run_judges_the_pass_on_the_cpus_memory_as_the_run_does(tmp_path, capsys):
    """On the CPU the dry run takes the pass's decision from the same function as the run, on
    ``--device-memory`` where given (it was ignored with ``--device cpu``) and this machine's
    available memory otherwise: a pass that cannot fit is refused when asked for and skipped,
    with its one line, under ``auto`` (the dry run planned it either way)."""
    model = llama_config_dir(tmp_path / "llama", blocks=2, hidden=256, intermediate=512, sharded=False)
    args = ["prune", "--dry-run", "--model", str(model), "--out", str(tmp_path / "o"), "--device", "cpu"]
    assert main(args + ["--device-memory", "0.01", "--distill-epochs", "1"]) == 2
    assert "the global distillation pass needs about" in capsys.readouterr().err
    assert main(args + ["--device-memory", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "| global distillation | none |" in out and "is skipped: the global distillation pass needs" in out
    assert main(args + ["--distill-nsamples", "1000000", "--distill-epochs", "1"]) == 2  # beyond this machine
    assert "the global distillation pass needs about" in capsys.readouterr().err
    assert main(args + ["--device-memory", "1000"]) == 0
    assert "| global distillation | 1 epoch(s) on" in capsys.readouterr().out


def test_a_pass_too_large_for_a_small_device_is_blamed_in_unrounded_sizes(tmp_path, capsys):
    """``--distill-epochs 1 --device-memory 0.03`` blamed one block's phase in "0.0 GiB" and
    advised ``--reconstruct none``, which the pass forbids (issue 65 case 9): now the pass is
    blamed, in MiB, with its parts; a block's phase that does not fit, without the pass, is
    blamed in MiB too, and only then is ``--reconstruct none`` advised."""
    model = llama_config_dir(tmp_path / "llama", blocks=2, hidden=256, intermediate=512)
    args = ["prune", "--dry-run", "--model", str(model), "--out", str(tmp_path / "o"), "--device", "cuda",
            "--device-memory", "0.03", "--nsamples", "8", "--seqlen", "256"]
    assert main(args + ["--distill-epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "the global distillation pass needs about" in err and "and 31 MiB are available" in err, err
    assert "0.0 GiB" not in err and "--reconstruct none" not in err and "one block's phase" not in err, err
    assert "the weights and their training state" in err, err
    assert main(args + ["--distill-epochs", "0", "--device-memory", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "one block's phase needs about" in err and "the device has 1 MiB" in err and "--reconstruct none" in err


def test_a_pass_refused_for_its_windows_says_so_and_suggests_fewer(tmp_path, capsys):
    """``--distill-nsamples 1000000`` was refused for "the whole model in float32", though most
    of the memory is the dense distribution of the windows (issue 65 case 12): the refusal
    names that part first and suggests fewer windows."""
    model = llama_config_dir(tmp_path / "llama", blocks=2, hidden=256, intermediate=512)
    assert main(["prune", "--dry-run", "--model", str(model), "--out", str(tmp_path / "o"), "--device", "cuda",
                 "--device-memory", "8", "--distill-epochs", "1", "--distill-nsamples", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "GiB (the dense distribution of its windows" in err, err
    assert "prune with fewer windows (--distill-nsamples, now 1000000)" in err, err


def test_the_plans_of_8b_on_one_gpu_and_70b_on_eight_make_the_pass(tmp_path):
    """Issue 63's plans (estimates: the CUDA constants are not yet measured): Llama-3.1-8B on
    one 80 GiB GPU makes the pass with its blocks checkpointed, the whole job in at most 20
    minutes; Llama-3.1-70B on 8 x 80 GiB shards it over the ranks, each rank's rows and
    training state in CPU memory (offloaded), the whole job in at most 60 minutes. Without
    the offload each rank would need more than its 80 GiB."""
    eight = llama_config_dir(tmp_path / "8b", 32)
    seventy = tmp_path / "70b"
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                num_hidden_layers=80, vocab_size=128256, dtype="bfloat16", tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(seventy)
    (seventy / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}')
    settings = {"device": "cuda", "nsamples": 128, "seqlen": 2048, "dtype": "bfloat16"}
    one, why = resources.plan_distillation(build_config({"model": str(eight), **settings}), 1, None, 80 * GIB)
    assert why is None and one.distill_epochs == 1 and one.distill_checkpointed and not one.distill_offloaded
    assert one.distill_peak_per_rank < 80 * GIB and sum(one.seconds.values()) <= 20 * 60
    node, why = resources.plan_distillation(build_config({"model": str(seventy), **settings}), 8, None, 80 * GIB)
    assert why is None and node.distill_epochs == 1 and node.distill_offloaded
    assert node.device_peak_per_rank < 80 * GIB and sum(node.seconds.values()) <= 60 * 60
    # the offloaded state is in each rank's CPU memory: about 4 bytes a parameter and 16 a kept
    # entry (half of them), over the ranks
    assert 0.9 < node.cpu_peak_per_rank / (12 * node.parameters / 8) < 1.3
    held = plan_run(build_config({"model": str(seventy), **settings}), ranks=8, available=1 << 50)
    assert not held.distill_offloaded and held.distill_peak_per_rank > 80 * GIB
