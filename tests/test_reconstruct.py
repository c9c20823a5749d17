"""Local reconstruction (nmprune/reconstruct.py, nmprune/stages/reconstruction.py): the training
loop against the exact masked least-squares optimum, the mask held exactly, the block errors
it reports, every model family, bfloat16, resume, streaming, bad settings and divergence."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from test_models_tiny import FAMILIES, tiny_model, token_batch

from nmprune.checkpoint import Checkpoint
from nmprune.config import PruneSettings
from nmprune.models import find_blocks, find_linears, weight_matrix
from nmprune.pipeline import prune_model
from nmprune.reconstruct import (BF16_MIN_WIDTH, FitData, FitOptions, FitSharing, KeptEntries, ReconstructionDiverged,
                                 epoch_steps, fit_masked, lane_of, training_dtype)

# distill_epochs 0: these tests judge the blocks' reconstruction, without the global pass after it
FIT = dict(reconstruct_batch_size=2, reconstruct_epochs=3, reconstruct_lr=5e-2, distill_epochs=0)
SOLVE = dict(method="wanda", refine=None, pattern="2:4", batch_size=2)


def _masked_optimum(w_mask: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean squared error of the best weights on the mask ``w_mask`` (float64 least squares,
    row by row: row ``i`` uses only the inputs its mask keeps)."""
    err = 0.0
    for i in range(w_mask.shape[0]):
        keep = w_mask[i]
        sol = torch.linalg.lstsq(x[:, keep], y[:, i:i + 1]).solution
        err += float((x[:, keep] @ sol - y[:, i:i + 1]).square().sum())
    return err / y.numel()


def test_fit_masked_approaches_the_masked_least_squares_optimum_and_keeps_zeros():
    torch.manual_seed(0)
    d_in, d_out, n = 16, 6, 8
    dense = torch.randn(d_out, d_in, dtype=torch.float64)
    xs = [torch.randn(32, d_in, dtype=torch.float64) for _ in range(n)]
    targets = [x @ dense.T for x in xs]
    w = dense.clone()
    w[:, ::2] = 0  # a 2:4 mask (every other entry)
    mask = w != 0
    start = sum(float((x @ w.T - t).square().sum()) for x, t in zip(xs, targets)) / sum(t.numel() for t in targets)
    best = _masked_optimum(mask, torch.cat(xs), torch.cat(targets))
    result = fit_masked(FitData(lambda j: xs[j] @ w.T, targets, list(range(n)), n), [w],
                        FitOptions(epochs=300, lr=3e-2, batches_per_step=2))
    assert torch.equal(w != 0, mask)  # zeros stayed exactly zero, nothing else became zero
    final = sum(float((x @ w.T - t).square().sum()) for x, t in zip(xs, targets)) / sum(t.numel() for t in targets)
    assert best < start
    assert final - best <= 0.02 * (start - best)  # 98% of the possible improvement
    assert result.steps == 300 * 4 and result.last_epoch_mse < result.first_epoch_mse
    assert not w.requires_grad and w.grad is None


def test_fit_masked_takes_the_same_steps_however_the_batches_are_split():
    """Two 'processes' holding half the batches each, summed by a shared all_reduce, end with
    the weights one process gets: the sums, not the split, decide every step."""
    torch.manual_seed(1)
    xs = [torch.randn(8, 8, dtype=torch.float64) for _ in range(6)]
    targets = [x @ torch.randn(4, 8, dtype=torch.float64).T for x in xs]
    start = torch.randn(4, 8, dtype=torch.float64)
    options = FitOptions(epochs=3, lr=1e-2, batches_per_step=4, seed=3)
    one = start.clone()
    fit_masked(FitData(lambda j: xs[j] @ one.T, targets, range(6), 6), [one], options)

    # Process 0 holds batches 0-2; its all_reduce adds what process 1 (batches 3-5, the same
    # weights: every process takes the same steps) would send for the same step.
    halves = [start.clone()]
    own = [[0, 1, 2], [3, 4, 5]]
    partial: list = []

    def all_reduce(tensors):
        grads, error = tensors[:-1], tensors[-1]
        with torch.enable_grad():
            w = halves[0].detach().clone().requires_grad_(True)
            for j in partial.pop(0):
                if j in own[1]:
                    diff = xs[j] @ w.T - targets[j]
                    loss = diff.square().sum()
                    loss.backward()
                    error += torch.tensor([float(loss.detach()), float(diff.numel())], dtype=torch.float64)
        if w.grad is not None:
            grads[0] += w.grad[halves[0] != 0]  # the gradients are summed compact: the kept entries

    gen = torch.Generator().manual_seed(options.seed)
    for _ in range(options.epochs):
        order = torch.randperm(6, generator=gen).tolist()
        partial += [order[s * 4:(s + 1) * 4] for s in range(math.ceil(6 / 4))]
    fit_masked(FitData(lambda j: xs[j] @ halves[0].T, [targets[j] for j in own[0]], own[0], 6), [halves[0]],
               options, FitSharing(all_reduce))
    assert torch.allclose(halves[0], one, rtol=1e-8, atol=1e-8)  # summation order only (Adam amplifies it)


@pytest.mark.parametrize("chunk", [5, 16, 1 << 22])
def test_kept_entries_move_the_nonzeros_in_order_across_chunks(monkeypatch, chunk):
    """Chunked gather and scatter agree with whole-tensor boolean indexing, chunk borders
    falling inside rows included; the positions take one int32 per kept entry."""
    monkeypatch.setattr(KeptEntries, "CHUNK", chunk)
    torch.manual_seed(3)
    w = torch.randn(7, 12)
    w[torch.rand(7, 12) < 0.5] = 0
    where = KeptEntries(w)
    assert where.count == int((w != 0).sum())
    assert where.index.dtype == torch.int32 and where.index.numel() == where.count
    assert torch.equal(where.gather(w), w[w != 0])
    other = torch.randn(7, 12)
    into = torch.ones(where.count)
    assert where.gather(other, into=into) is into and torch.equal(into, 1 + other[w != 0])
    values = torch.arange(where.count, dtype=torch.float32)
    target = torch.full((7, 12), -1.0)
    where.scatter(values, target)
    assert torch.equal(target[w != 0], values) and bool((target[w == 0] == -1).all())


@pytest.mark.parametrize("chunk", [5, 1 << 22])
def test_fit_masked_steps_as_adamw_on_the_whole_weight_with_masked_gradients(monkeypatch, chunk):
    """The optimiser holds only the kept entries; the reference is torch's AdamW on the dense
    weights with the pruned entries' gradients zeroed and the weights masked after each step,
    each weight at the learning rate times the RMS of its kept entries (float64 weights, two
    layers, gradients accumulated over 2 batches per step, 3 epochs;
    the kept entries in slices of 5, whose borders fall inside cells, or in one slice)."""
    monkeypatch.setattr(KeptEntries, "CHUNK", chunk)
    torch.manual_seed(2)
    xs = [torch.randn(8, 12, dtype=torch.float64) for _ in range(5)]
    targets = [torch.tanh(x @ torch.randn(12, 6, dtype=torch.float64)) for x in xs]
    first, second = torch.randn(8, 12, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    first[:, 1::4] = 0
    first[:, 2::4] = 0
    second[:, ::2] = 0
    options = FitOptions(epochs=3, lr=5e-2, batches_per_step=2, seed=4)
    ours = [first.clone(), second.clone()]
    fit_masked(FitData(lambda j: torch.tanh(xs[j] @ ours[0].T) @ ours[1].T, targets, range(5), 5), ours, options)

    ref = [first.clone().requires_grad_(True), second.clone().requires_grad_(True)]
    masks = [w.detach() != 0 for w in ref]
    rms = [float(w.detach().square().sum() / m.sum()) ** 0.5 for w, m in zip(ref, masks)]
    optimiser = torch.optim.AdamW([{"params": [w], "lr": options.lr * s} for w, s in zip(ref, rms)],
                                  weight_decay=0.0)
    steps = 3 * 3
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda k: 1.0 - k / steps)
    gen = torch.Generator().manual_seed(options.seed)
    for _ in range(options.epochs):
        order = torch.randperm(5, generator=gen).tolist()
        for step in range(3):
            optimiser.zero_grad()
            batch = order[2 * step:2 * step + 2]
            for j in batch:  # the error in float32, as fit_masked's
                ((torch.tanh(xs[j] @ ref[0].T) @ ref[1].T).float() - targets[j].float()).square().sum().backward()
            for w, m in zip(ref, masks):
                w.grad.div_(sum(targets[j].numel() for j in batch)).mul_(m)
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                for w, m in zip(ref, masks):
                    w.mul_(m)
    for a, b, m in zip(ours, ref, masks):
        assert torch.equal(a != 0, m)
        torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lanes,per_step", [(3, 1), (2, 2)])
def test_fit_masked_lanes_step_through_gradients_taken_at_the_rounds_weights(lanes, per_step):
    """With lanes, each round computes every lane's next step's gradient at the same weights,
    then steps through them in lane order (each lane's batches in its own seeded order): the
    reference is torch's AdamW on the dense weight with masked gradients, fed gradients
    computed from a copy of the weights frozen at the round's start (7 batches, lanes of 2, 2
    and 3 batches or of 3 and 4; steps of one batch, or of two with a short last step)."""
    torch.manual_seed(6)
    n = 7
    xs = [torch.randn(5, 12, dtype=torch.float64) for _ in range(n)]
    targets = [torch.tanh(x @ torch.randn(12, 6, dtype=torch.float64)) for x in xs]
    start = torch.randn(6, 12, dtype=torch.float64)
    start[:, ::2] = 0
    options = FitOptions(epochs=2, lr=5e-2, batches_per_step=per_step, seed=7, lanes=lanes)
    lane = [lane_of(g, n, lanes) for g in range(n)]
    ours = [start.clone()]
    result = fit_masked(FitData(lambda j: torch.tanh(xs[j] @ ours[0].T), targets, range(n), n), ours, options,
                        FitSharing(lanes=lane))
    derived = [start.clone()]  # without a table, the lanes are options.lanes contiguous shares
    fit_masked(FitData(lambda j: torch.tanh(xs[j] @ derived[0].T), targets, range(n), n), derived, options)
    assert torch.equal(derived[0], ours[0])

    members = [[g for g in range(n) if lane[g] == k] for k in range(lanes)]
    assert [len(m) for m in members] == ([2, 2, 3] if lanes == 3 else [3, 4])
    steps = options.epochs * epoch_steps(lane, per_step)
    assert result.steps == steps == options.epochs * sum(-(-len(m) // per_step) for m in members)
    w = start.clone().requires_grad_(True)
    mask = start != 0
    rms = float(start.square().sum() / mask.sum()) ** 0.5
    optimiser = torch.optim.AdamW([w], lr=options.lr * rms, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda k: 1.0 - k / steps)
    gen = torch.Generator().manual_seed(options.seed)
    for _ in range(options.epochs):
        orders = [[m[i] for i in torch.randperm(len(m), generator=gen).tolist()] for m in members]
        for r in range(max(-(-len(m) // per_step) for m in members)):
            frozen = w.detach().clone().requires_grad_(True)
            grads = []
            for order in orders:
                batch = order[r * per_step:(r + 1) * per_step]
                if not batch:
                    continue
                frozen.grad = None
                for j in batch:
                    (torch.tanh(xs[j] @ frozen.T).float() - targets[j].float()).square().sum().backward()
                grads.append(frozen.grad.div(sum(targets[j].numel() for j in batch)).mul(mask))
            for grad in grads:
                w.grad = grad
                optimiser.step()
                schedule.step()
                with torch.no_grad():
                    w.mul_(mask)
    assert torch.equal(ours[0] != 0, mask)
    torch.testing.assert_close(ours[0], w.detach(), rtol=1e-10, atol=1e-12)


def test_one_lane_is_one_step_at_a_time():
    """One lane (the default) is the plain loop: every step's gradient at the latest weights,
    whatever the lane table says; and lanes change the result (the gradients are delayed)."""
    torch.manual_seed(7)
    xs = [torch.randn(4, 8, dtype=torch.float64) for _ in range(6)]
    targets = [x @ torch.randn(8, 3, dtype=torch.float64) for x in xs]
    start = torch.randn(3, 8, dtype=torch.float64)
    results = []
    for lanes in (None, [0] * 6, [lane_of(g, 6, 2) for g in range(6)]):
        w = [start.clone()]
        fit_masked(FitData(lambda j: xs[j] @ w[0].T, targets, range(6), 6), w,
                   FitOptions(epochs=2, lr=2e-2, batches_per_step=1), FitSharing(lanes=lanes))
        results.append(w[0])
    assert torch.equal(results[0], results[1])
    assert not torch.allclose(results[0], results[2])
    assert [lane_of(g, 10, 3) for g in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]


def test_fit_masked_steps_are_relative_to_each_weights_scale():
    """A layer whose weights are c times larger, fed inputs c times smaller, computes the same
    function: trained alike, it ends c times the other's weights (the steps are relative to
    each weight's RMS), for a c of 1/5 (Gemma-3's weights against SmolLM2's) and of 8."""
    torch.manual_seed(5)
    xs = [torch.randn(6, 16, dtype=torch.float64) for _ in range(4)]
    targets = [x @ torch.randn(16, 4, dtype=torch.float64) for x in xs]
    w = torch.randn(4, 16, dtype=torch.float64)
    w[:, ::2] = 0
    options = FitOptions(epochs=2, lr=2e-2, batches_per_step=1)
    base = [w.clone()]
    fit_masked(FitData(lambda j: xs[j] @ base[0].T, targets, range(4), 4), base, options)
    assert not torch.allclose(base[0], w)
    for c in (0.2, 8.0):
        scaled = [c * w]
        fit_masked(FitData(lambda j: (xs[j] / c) @ scaled[0].T, targets, range(4), 4), scaled, options)
        torch.testing.assert_close(scaled[0] / c, base[0], rtol=1e-4, atol=1e-6)  # Adam's eps is absolute


@pytest.mark.parametrize("bad, message", [
    (dict(epochs=0), "at least one epoch"), (dict(lr=0.0), "positive"), (dict(lr=-1e-3), "positive"),
    (dict(lr=float("nan")), "positive"), (dict(batches_per_step=0), "at least 1"),
    (dict(lanes=0), "at least one lane")])
def test_fit_options_refuse_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        FitOptions(**{**dict(epochs=1, lr=1e-3, batches_per_step=1), **bad})


def test_fit_masked_raises_on_a_diverging_learning_rate():
    x = [torch.randn(4, 8) for _ in range(4)]
    t = [torch.randn(4, 3) for _ in range(4)]
    w = torch.randn(3, 8)
    with pytest.raises(ReconstructionDiverged, match="lower the learning rate"):
        fit_masked(FitData(lambda j: (x[j] @ w.T) ** 8, t, range(4), 4), [w],
                   FitOptions(epochs=50, lr=1e30, batches_per_step=1))


def _pruned_layers(model) -> dict[str, torch.Tensor]:
    name, blocks = find_blocks(model)
    return {f"{i}.{sub}": weight_matrix(m).detach().clone()
            for i, b in enumerate(blocks) for sub, m in find_linears(b).items()}


def _logit_error(model, dense, ids) -> float:
    with torch.no_grad():
        return float((model(ids).logits - dense(ids).logits).square().mean())


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("granularity", ["submodule", "block"])
def test_reconstruction_holds_the_mask_and_brings_the_model_closer_to_the_dense_one(family, granularity):
    dense = tiny_model(family, layers=3)
    solved, fitted = copy.deepcopy(dense), copy.deepcopy(dense)
    calib = token_batch(8, 16)
    prune_model(solved, calibration=calib, device="cpu", progress=False, reconstruct="none", **SOLVE)
    report = prune_model(fitted, calibration=calib, device="cpu", progress=False, reconstruct=granularity,
                         **FIT, **SOLVE)
    before, after = _pruned_layers(solved), _pruned_layers(fitted)
    changed = 0
    for name, w in after.items():
        assert torch.equal(w[before[name] == 0], torch.zeros_like(w[before[name] == 0])), name
        # the saved layer is 2:4: at most two nonzeros in every cell of four inputs
        assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) <= 2, name
        changed += not torch.equal(w, before[name])
    assert changed == len(after)  # every pruned layer trained
    # everything outside the pruned layers is untouched
    layer_params = {f"{n}.weight" for n, m in fitted.named_modules() if m in set(
        m for b in find_blocks(fitted)[1] for m in find_linears(b).values())}
    for (n, p), q in zip(fitted.named_parameters(), dense.parameters()):
        if n not in layer_params:
            assert torch.equal(p, q), n
    assert [b["block"] for b in report.blocks] == [0, 1, 2]
    # pre-norm residual blocks fit each submodule to the dense residual stream after it;
    # Gemma 2's post-norms and OPT's bare fc1/fc2 to the submodule's own dense output
    targets = "block output" if granularity == "block" else \
        "submodule output" if family in ("gemma2", "opt") else "residual stream"
    for b in report.blocks:
        assert b["reconstruct"] == granularity and b["steps"] > 0 and b["targets"] == targets
        assert b["heldout_after"] <= b["heldout_before"]
        # the solved weights' training error is known only where the solve is kept
        assert (b["error_before"] is None) == (b["kept"] == "reconstructed")
    assert any(b["kept"] == "reconstructed" and b["heldout_after"] < 0.9 * b["heldout_before"] for b in report.blocks)
    ids = token_batch(4, 16, seed=7)
    assert _logit_error(fitted, dense, calib) < _logit_error(solved, dense, calib)
    assert _logit_error(fitted, dense, ids) < 1.5 * _logit_error(solved, dense, ids)


@pytest.mark.parametrize("scratch", ["memory", "folder", "missing folder"])
def test_a_block_that_training_made_worse_gets_its_solved_weights_back(monkeypatch, tmp_path, scratch):
    """When a fit raises a block's output error, the block is restored from the compact copy
    of its solved weights and its outputs recomputed from its pruned inputs (both set aside
    in memory, or in unnamed files in the scratch folder, which leave nothing there; a folder
    that does not exist keeps them in memory): every block worsened gives, bit for bit, the
    model without reconstruction (its solves see the dense model's inputs either way)."""
    import nmprune.stages.block_fit as block_fit
    import nmprune.stages.reconstruction as stage
    from nmprune.reconstruct import FitResult

    folder = {"memory": None, "folder": tmp_path, "missing folder": tmp_path / "absent"}[scratch]

    def worsen(data, weights, *args, **kwargs) -> FitResult:
        with torch.no_grad():
            for w in weights:
                w.mul_(3.0)  # the zeros stay zeros; the kept weights are far off
        return FitResult(1, 1.0, 1.0, 0.0)

    monkeypatch.setattr(block_fit, "fit_masked", worsen)
    dense = tiny_model("llama", layers=3)
    solved, fitted = copy.deepcopy(dense), copy.deepcopy(dense)
    calib = token_batch(8, 16)
    prune_model(solved, calibration=calib, device="cpu", progress=False, reconstruct="none", **SOLVE)
    spills = []
    spill = stage.Spill.__init__

    def watch(self, where):
        spill(self, where)
        spills.append(self)

    monkeypatch.setattr(stage.Spill, "__init__", watch)
    report = prune_model(fitted, calibration=calib, device="cpu", progress=False, reconstruct="block",
                         scratch=folder, **FIT, **SOLVE)
    # per block, the solved weights and the block's pruned inputs; on disk only in a folder that exists
    assert [s.on_disk for s in spills] == [scratch == "folder"] * 6
    assert all(len(s) == 0 for s in spills)  # closed
    if folder is not None and folder.exists():
        assert os.listdir(folder) == []
    assert [b["kept"] for b in report.blocks] == ["solved"] * 3
    assert all(b["heldout_after"] == b["heldout_before"] < b["heldout_trained"] for b in report.blocks)
    assert all(b["error_after"] == b["error_before"] is not None for b in report.blocks)
    for (n, p), q in zip(fitted.named_parameters(), solved.parameters()):
        assert torch.equal(p, q), n


def test_the_captured_block_inputs_are_freed_once_the_first_block_moves_them_on(monkeypatch):
    """Nothing keeps the hidden states entering block 0 after both streams have moved past it
    (they were once held for the whole run, one activation set more than the stage needs)."""
    import gc
    import weakref

    import nmprune.stages.reconstruction as stage

    captured = []
    init = stage.ReconstructingStatistics.__init__

    def watch(self, inputs, *args, **kwargs):
        captured.extend(weakref.ref(h) for h in inputs.hidden)
        init(self, inputs, *args, **kwargs)

    def after_block(i: int) -> None:
        gc.collect()
        alive.append(sum(r() is not None for r in captured))

    alive: list[int] = []
    monkeypatch.setattr(stage.ReconstructingStatistics, "__init__", watch)
    prune_model(tiny_model("llama", layers=2), calibration=token_batch(8, 16), device="cpu", progress=False,
                reconstruct="block", on_block_done=after_block, **FIT, **SOLVE)
    assert len(captured) == 4 and alive == [0, 0]


def test_reconstruction_is_reproducible_and_resumes_to_the_uninterrupted_result(tmp_path):
    calib = token_batch(8, 16)
    kwargs = dict(calibration=calib, device="cpu", progress=False, reconstruct="submodule", **FIT, **SOLVE)
    straight = tiny_model("llama", layers=3)
    report = prune_model(straight, **kwargs)
    again = tiny_model("llama", layers=3)
    prune_model(again, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), again.state_dict().values()))

    def stop(i: int) -> None:
        if i == 1:
            raise KeyboardInterrupt

    interrupted = tiny_model("llama", layers=3)
    with pytest.raises(KeyboardInterrupt):
        prune_model(interrupted, checkpoint=Checkpoint.open(tmp_path / "ck", "t"), on_block_done=stop, **kwargs)
    ck = Checkpoint.open(tmp_path / "ck", "t")
    assert ck.done_blocks == 2 and [b["block"] for b in ck.get("blocks")] == [0, 1]
    dense, pruned = ck.hidden()  # the two streams as held, not copied side by side
    width = straight.config.hidden_size
    assert len(dense) == len(pruned) == 4 and all(h.shape == (2, 16, width) for h in dense + pruned)
    assert not all(torch.equal(d, p) for d, p in zip(dense, pruned))
    resumed = tiny_model("llama", layers=3)
    rep2 = prune_model(resumed, checkpoint=ck, **kwargs)
    assert rep2.resumed_from_block == 2
    for (n, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n
    assert [b["error_after"] for b in rep2.blocks] == [b["error_after"] for b in report.blocks]


def test_a_diverging_reconstruction_names_the_block_and_never_reaches_the_checkpoint(tmp_path):
    ck = Checkpoint.open(tmp_path / "ck", "t")
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match=r"block 0: .*lower the learning rate"):
        prune_model(model, calibration=token_batch(8, 16), device="cpu", progress=False, checkpoint=ck,
                    reconstruct="block", reconstruct_lr=1e30, reconstruct_epochs=5, reconstruct_batch_size=2,
                    **SOLVE)
    assert Checkpoint.open(tmp_path / "ck", "t").done_blocks == 0


def test_reconstruction_of_a_bfloat16_model_trains_in_float32_and_keeps_the_mask():
    dense = tiny_model("llama", layers=2).to(torch.bfloat16)
    model = copy.deepcopy(dense)
    report = prune_model(model, calibration=token_batch(8, 16), device="cpu", progress=False,
                         reconstruct="submodule", **FIT, **SOLVE)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for w in _pruned_layers(model).values():
        assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) <= 2
    assert all(b["heldout_after"] <= b["heldout_before"] for b in report.blocks)
    assert any(b["kept"] == "reconstructed" for b in report.blocks)


@pytest.mark.parametrize("bad, message", [
    (dict(reconstruct="layer"), "reconstruct must be one of none, submodule, block"),
    (dict(reconstruct_lr=0.0), "reconstruct_lr must be a positive number"),
    (dict(reconstruct_lr=-1.0), "reconstruct_lr must be a positive number"),
    (dict(reconstruct_epochs=-1), "reconstruct_epochs must be a positive integer"),
    (dict(reconstruct_epochs="many"), "setting .reconstruct_epochs. must be an integer"),
    (dict(reconstruct_epochs=0), "set reconstruct to 'none'"),
    (dict(reconstruct="block", batch_size=2, reconstruct_batch_size=3), "multiple of batch_size"),
    (dict(reconstruct_batch_size=0), "multiple of batch_size"),
    (dict(reconstruct_lr=float("nan")), "setting 'reconstruct_lr' must be a finite number"),
    (dict(reconstruct_epochs=1.5), "setting 'reconstruct_epochs' must be an integer")])
def test_bad_reconstruction_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        PruneSettings(**bad)


def test_precomputed_hessians_cannot_be_reconstructed():
    model = tiny_model("llama", layers=2)
    from nmprune.pipeline import collect_hessians

    hessians = collect_hessians(model, token_batch(4, 16), device="cpu", progress=False)
    with pytest.raises(ValueError, match="reconstruct='none'"):
        prune_model(model, hessians=hessians, reconstruct="block", **SOLVE)


def test_train_precision_auto_follows_the_hardware_and_the_width(monkeypatch):
    """``auto`` computes in bfloat16 only where the device does so natively and the submodel
    is at least ``BF16_MIN_WIDTH`` wide (the tests' tiny models train in float32 everywhere)."""
    wide, narrow = torch.zeros(BF16_MIN_WIDTH, BF16_MIN_WIDTH), torch.zeros(BF16_MIN_WIDTH - 1, 4 * BF16_MIN_WIDTH)
    for bf16, amx, expected in ((False, False, None), (True, False, torch.bfloat16), (False, True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert training_dtype("auto", [wide]) is expected
        assert training_dtype("auto", [narrow]) is None  # its narrow side decides
        assert training_dtype("auto", [narrow, wide]) is expected  # the widest weight decides
        assert training_dtype("full", [wide]) is None
        assert training_dtype("bfloat16", [narrow]) is torch.bfloat16


def test_fit_masked_in_bfloat16_computes_under_autocast_and_keeps_float32_weights():
    """With ``precision="bfloat16"`` the products run in bfloat16 (the submodel sees its
    inputs cast by autocast), the weights and their zeros stay float32 and exact, and training
    still lowers the error to within a few percent of float32 training."""
    torch.manual_seed(0)
    d_in, d_out, n = 16, 6, 8
    dense = torch.randn(d_out, d_in)
    xs = [torch.randn(32, d_in) for _ in range(n)]
    targets = [x @ dense.T for x in xs]
    start = dense.clone()
    start[:, ::2] = 0
    results, weights, seen = {}, {}, []
    for precision in ("full", "bfloat16"):
        w = start.clone()

        def run(j, w=w):
            out = torch.nn.functional.linear(xs[j], w)
            seen.append(out.dtype)
            return out

        results[precision] = fit_masked(FitData(run, targets, list(range(n)), n), [w],
                                        FitOptions(epochs=100, lr=3e-2, batches_per_step=2, precision=precision))
        weights[precision] = w
    assert set(seen[:len(seen) // 2]) == {torch.float32} and set(seen[len(seen) // 2:]) == {torch.bfloat16}
    assert results["full"].dtype == "float32" and results["bfloat16"].dtype == "bfloat16"
    for w in weights.values():
        assert w.dtype == torch.float32 and torch.equal(w != 0, start != 0)
    assert not torch.equal(weights["full"], weights["bfloat16"])
    first, full, low = results["full"].first_epoch_mse, results["full"].last_epoch_mse, results["bfloat16"].last_epoch_mse
    assert full < first and abs(low - full) <= 0.05 * (first - full), (first, full, low)


def test_bad_train_precision_is_refused():
    with pytest.raises(ValueError, match="train_precision must be one of auto, full, bfloat16"):
        PruneSettings(train_precision="half")
    with pytest.raises(ValueError, match="train_precision must be one of"):
        FitOptions(epochs=1, lr=1e-3, batches_per_step=1, precision="fp8")
