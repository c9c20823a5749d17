"""prune_model on tiny random models: exact N:M, nothing else touched, both Hessian input
modes against a manual computation, overrides, errors, checkpoints and bit-exact resume."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from nmprune.checkpoint import Checkpoint, CheckpointError
from nmprune.config import PruneSettings
from nmprune.models import find_blocks, find_linears, weight_matrix
from nmprune.output import NotOwnedError
from nmprune.pattern import is_nm_sparse, topn_mask
from nmprune.pipeline import prune_model
from nmprune.registry import register_method
from test_models_tiny import FAMILIES, tiny_model, token_batch

RECORDED: list[dict] = []


@register_method("test-record", description="test only: Wanda's mask, records H and the input mean",
                 statistics=("input_mean",))
def _record(w, h, pattern, *, input_mean=None, scale: float = 1.0):
    RECORDED.append({"h": h.clone(), "mean": None if input_mean is None else input_mean.clone()})
    return w * topn_mask(w.abs() * h.diagonal().clamp_min(0).sqrt(), pattern)


def _block_linears(model):
    _, blocks = find_blocks(model)
    return {f"{i}.{n}": m for i, b in enumerate(blocks) for n, m in find_linears(b).items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_block_layer_is_exactly_nm_and_nothing_else_changes(family):
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = prune_model(model, calibration=token_batch(4, 12), method="wanda", refine=None,
                         batch_size=3, progress=False)
    layers = _block_linears(model)
    assert len(report.layers) == len(layers)
    pruned_params = set()
    for rec in report.layers:
        assert rec["method"] == "wanda" and not rec["skipped"]
        assert rec["loss_vs_wanda"] == pytest.approx(1.0)
    for name, module in layers.items():
        w = weight_matrix(module)
        assert is_nm_sparse(w, "2:4"), name
        assert (w == 0).sum() == w.numel() // 2, name  # 2:4 exactly, no extra zeros
        pruned_params.add(id(module.weight))
    # everything that is not a block linear weight is bit-identical
    params = dict(model.named_parameters(remove_duplicate=False))
    for key, value in model.state_dict().items():
        if key in params and id(params[key]) in pruned_params:
            continue
        assert torch.equal(value, before[key]), key


def test_layer_records_and_refinement():
    model = tiny_model("llama")
    report = prune_model(model, calibration=token_batch(4, 12), method="magnitude", refine="exact",
                         progress=False)
    rec = report.layers[0]
    assert rec["name"] == "model.layers.0.self_attn.q_proj" and rec["shape"] == [32, 32]
    assert rec["refine"] == "exact" and rec["loss_refined"] <= rec["loss_method"] * (1 + 1e-6)
    assert rec["loss_vs_wanda"] == pytest.approx(rec["loss_refined"] / rec["loss_wanda"])
    json.dumps(report.to_dict())  # the report is JSON-serialisable


def manual_hessians(model, ids, layer_names):
    """X X^T / n of each named layer's inputs in one forward pass of ``model`` (float64)."""
    modules = dict(model.named_modules())
    xs = {n: [] for n in layer_names}
    hs = [modules[n].register_forward_pre_hook(lambda m, a, n=n: xs[n].append(a[0].detach()))
          for n in layer_names]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    out = {}
    for n, parts in xs.items():
        x = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]).double()
        out[n] = (x.T @ x / x.shape[0], x.mean(0))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dense_and_pruned_hessian_inputs_match_manual_computation(family):
    ids = token_batch(4, 12)
    dense_model = tiny_model(family, layers=3)
    names = [n for n, m in dense_model.named_modules()
             if isinstance(m, (nn.Linear, Conv1D)) and n != "lm_head"]
    results = {}
    for mode in ("dense", "pruned"):  # no global distillation: it would change the blocks afterwards
        model = copy.deepcopy(dense_model)
        RECORDED.clear()
        report = prune_model(model, calibration=ids, method="test-record", refine=None,
                             hessian_inputs=mode, hessian_dtype="float64", damp=0.0, batch_size=4,
                             distill_epochs=0, progress=False)
        assert [r["name"] for r in report.layers] == names
        results[mode] = (model, {n: rec for n, rec in zip(names, RECORDED)})

    # dense: every Hessian comes from the unpruned model's forward pass
    ref = manual_hessians(dense_model, ids, names)
    for n in names:
        torch.testing.assert_close(results["dense"][1][n]["h"], ref[n][0])
        torch.testing.assert_close(results["dense"][1][n]["mean"], ref[n][1])

    # pruned: block i's Hessians come from a model whose blocks < i are the pruned ones
    pruned_model = results["pruned"][0]
    manual = copy.deepcopy(dense_model)
    _, mblocks = find_blocks(manual)
    _, pblocks = find_blocks(pruned_model)
    for i in range(len(mblocks)):
        ref = manual_hessians(manual, ids, names)
        for n in names:
            if f".{i}." in n:
                torch.testing.assert_close(results["pruned"][1][n]["h"], ref[n][0])
        mblocks[i].load_state_dict(pblocks[i].state_dict())
    first, later = names[0], [n for n in names if ".1." in n][0]
    assert torch.equal(results["dense"][1][first]["h"], results["pruned"][1][first]["h"])
    assert not torch.allclose(results["dense"][1][later]["h"], results["pruned"][1][later]["h"])


def test_overrides_skip_and_other_method():
    model = tiny_model("llama")
    down_before = model.model.layers[0].mlp.down_proj.weight.clone()
    report = prune_model(model, calibration=token_batch(4, 12), method="magnitude", refine=None,
                         overrides={"*.mlp.down_proj": "skip",
                                    "*.self_attn.o_proj": {"method": "wanda", "refine": "gd"}},
                         progress=False)
    by_name = {r["name"]: r for r in report.layers}
    assert by_name["model.layers.0.mlp.down_proj"]["skipped"]
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, down_before)
    assert by_name["model.layers.1.self_attn.o_proj"]["method"] == "wanda"
    assert by_name["model.layers.1.self_attn.o_proj"]["refine"] == "gd"
    assert by_name["model.layers.1.self_attn.q_proj"]["method"] == "magnitude"


def test_input_mean_goes_to_methods_that_take_it():
    model = tiny_model("llama")
    RECORDED.clear()
    prune_model(model, calibration=token_batch(4, 12), method="test-record", refine=None,
                options={"scale": 2.0}, progress=False)
    assert all(r["mean"] is not None and r["mean"].shape == r["h"].shape[:1] for r in RECORDED)


def test_indivisible_d_in_is_skipped_with_warning_or_strict_error():
    model = tiny_model("llama", intermediate=66)  # down_proj has d_in = 66
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp\.down_proj.*not divisible"):
        report = prune_model(model, calibration=token_batch(2, 8), method="wanda", refine=None,
                             progress=False)
    skipped = [r["name"] for r in report.layers if r["skipped"]]
    assert skipped == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="not divisible"):
        prune_model(tiny_model("llama", intermediate=66), calibration=token_batch(2, 8),
                    method="wanda", refine=None, strict=True, progress=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "nope"}, "unknown method"),
    ({"method": "wanda", "options": {"bogus": 1}}, "unknown option 'bogus'"),
    ({"method": "wanda", "refine": "nope"}, "unknown refiner"),
    ({"method": "wanda", "overrides": {"*.nothing": "skip"}}, "matches no layer"),
    ({"method": "wanda", "overrides": {"*.q_proj": {"method": "wanda", "options": {"x": 1}}}},
     "unknown option 'x'"),
    ({"method": "wanda", "hessian_inputs": "sideways"}, "hessian_inputs"),
    ({"method": "wanda", "pattern": "4:2"}, "N:M"),
])
def test_bad_settings_fail_before_any_work(kwargs, match):
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        prune_model(model, calibration=token_batch(2, 8), progress=False, **kwargs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_bad_calibration_is_a_clear_error():
    with pytest.raises(ValueError, match="tokenizer"):
        prune_model(tiny_model("llama"), method="wanda", progress=False)
    with pytest.raises(ValueError, match="vocabulary"):
        prune_model(tiny_model("llama"), calibration=token_batch(2, 8) + 10_000, method="wanda",
                    progress=False)


class Stop(Exception):
    pass


def fail_after(k):
    def callback(i):
        if i == k:
            raise Stop
    return callback


@pytest.mark.parametrize("mode", ["dense", "pruned"])
def test_resume_after_crash_gives_bit_identical_weights(tmp_path, mode):
    ids = token_batch(4, 12)
    settings = PruneSettings(method="magnitude", refine="exact", hessian_inputs=mode, batch_size=3)
    reference = tiny_model("llama", layers=3)
    prune_model(reference, settings=settings, calibration=ids, progress=False)

    ckpt_dir = tmp_path / "ck"
    model = tiny_model("llama", layers=3)
    with pytest.raises(Stop):
        prune_model(model, settings=settings, calibration=ids, progress=False,
                    checkpoint=Checkpoint.open(ckpt_dir, "id"), on_block_done=fail_after(1))
    assert Checkpoint.open(ckpt_dir, "id").done_blocks == 2
    fresh = tiny_model("llama", layers=3)  # a new process would start from the dense model
    report = prune_model(fresh, settings=settings, calibration=ids, progress=False,
                         checkpoint=Checkpoint.open(ckpt_dir, "id"))
    assert report.resumed_from_block == 2
    assert len(report.layers) == 3 * 7
    for key, value in reference.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_checkpoint_errors(tmp_path):
    ids = token_batch(2, 8)
    d = tmp_path / "ck"
    model = tiny_model("llama")
    with pytest.raises(Stop):
        prune_model(model, calibration=ids, method="wanda", refine=None, progress=False,
                    checkpoint=Checkpoint.open(d, "run-a"), on_block_done=fail_after(0))
    with pytest.raises(CheckpointError, match="other settings.*--restart"):
        Checkpoint.open(d, "run-b")
    # other calibration data with the same identity
    with pytest.raises(CheckpointError, match="calibration"):
        prune_model(tiny_model("llama"), calibration=token_batch(2, 8, seed=5), method="wanda",
                    refine=None, progress=False, checkpoint=Checkpoint.open(d, "run-a"))
    # truncated block file
    block = d / "block_0000.safetensors"
    block.write_bytes(block.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="corrupt.*block_0000"):
        Checkpoint.open(d, "run-a")
    # unreadable manifest
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        Checkpoint.open(d, "run-a")
    # --restart discards it
    assert Checkpoint.open(d, "run-a", restart=True).done_blocks == 0
    # a directory that is not a checkpoint
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("x")
    for restart in (False, True):  # never deleted, not even with --restart
        with pytest.raises(NotOwnedError, match="not made by nmprune"):
            Checkpoint.open(other, "run-a", restart=restart)
    assert [p.name for p in other.iterdir()] == ["x"]


def test_methods_see_the_dampened_hessian():
    ids = token_batch(4, 12)
    model = tiny_model("llama", layers=1)
    RECORDED.clear()
    prune_model(copy.deepcopy(model), calibration=ids, method="test-record", refine=None,
                hessian_dtype="float64", damp=0.0, batch_size=4, progress=False)
    undamped = [r["h"] for r in RECORDED]
    RECORDED.clear()
    damped_report = prune_model(copy.deepcopy(model), calibration=ids, method="test-record", refine=None,
                                hessian_dtype="float64", damp=0.25, batch_size=4, progress=False)
    for h, rec in zip(undamped, RECORDED):
        expected = h + 0.25 * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
        torch.testing.assert_close(rec["h"], expected)
    assert all(r["damp"] == 0.25 for r in damped_report.layers)


def test_a_solved_layers_statistics_and_result_are_freed_before_the_next_layer(monkeypatch):
    """While a block's last layer is solved, no statistics of its other layers are held
    (q/k/v and gate/up share theirs until the last of them is solved), and no earlier
    layer's pruned result (written into its module) is held while a layer is solved."""
    import weakref

    from nmprune.stages import executor

    model = tiny_model("llama", 1)
    stats: dict[str, weakref.ref] = {}
    alive: dict[str, list[str]] = {}
    real = executor.run_job

    results: list[weakref.ref] = []
    results_alive: list[bool] = []

    def watching(job, device):
        alive[job.name] = [n for n, r in stats.items() if r() is not None]
        stats[job.name] = weakref.ref(job.stats)
        results_alive.append(any(r() is not None for r in results))
        weight, record = real(job, device)
        results.append(weakref.ref(weight))
        return weight, record

    monkeypatch.setattr(executor, "run_job", watching)
    prune_model(model, calibration=token_batch(4, 12), method="wanda", refine=None, progress=False)
    names = list(stats)
    assert [n.rsplit(".", 1)[1] for n in names] == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]
    assert alive[names[1]] == names[:1] and alive[names[2]] == names[:2]  # q/k/v share one
    assert alive[names[3]] == []  # ... freed once v_proj is done
    assert alive[names[5]] == names[4:5]  # gate/up share theirs
    assert alive[names[6]] == []
    assert len(results_alive) == 7 and not any(results_alive)
