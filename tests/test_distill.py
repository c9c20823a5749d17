"""Global distillation (nmprune.distill, nmprune.stages.distillation): the top-k divergence
against a float64 KL over the whole vocabulary, and the pass on tiny models of several
families -- masks held, only pruned layers moved, kept only when the held-out divergence falls,
the weights from before restored otherwise -- and its settings refused before any work."""

from __future__ import annotations

import copy

import pytest
import torch
from test_models_tiny import FAMILIES, tiny_model, token_batch

from nmprune.config import PruneSettings
from nmprune.distill import teacher_topk, topk_kl
from nmprune.models import find_blocks, find_linears
from nmprune.pipeline import prune_model
from nmprune.reconstruct import FitResult

SETTINGS = dict(method="wanda", refine=None, pattern="2:4", batch_size=2, reconstruct="block",
                reconstruct_batch_size=2, reconstruct_epochs=2, reconstruct_lr=5e-2)


def _full_kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position over the whole vocabulary, in float64."""
    logp, logq = torch.log_softmax(teacher.double(), -1), torch.log_softmax(student.double(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def _coarse_kl(teacher: torch.Tensor, student: torch.Tensor, k: int) -> torch.Tensor:
    """KL of the two distributions coarsened to the teacher's top k tokens plus the rest, float64."""
    logp, logq = torch.log_softmax(teacher.double(), -1), torch.log_softmax(student.double(), -1)
    top = logp.topk(k, -1).indices
    p, q = logp.exp().gather(-1, top), logq.exp().gather(-1, top)
    # with every token among the top k the rest is empty (up to rounding)
    bins_p = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp(min=0)], -1)
    bins_q = torch.cat([q, (1 - q.sum(-1, keepdim=True)).clamp(min=1e-300)], -1)
    return (torch.xlogy(bins_p, bins_p) - bins_p * bins_q.log()).sum(-1)


@pytest.mark.parametrize("k", [1, 5, 40])
def test_topk_kl_is_the_kl_of_the_coarsened_distributions_and_exact_with_the_whole_vocabulary(k):
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(2, 7, 40, generator=g) * 3, torch.randn(2, 7, 40, generator=g) * 3
    kl, count = topk_kl(student, teacher_topk(teacher, k))
    assert count == 14
    assert float(kl) == pytest.approx(float(_coarse_kl(teacher, student, k).sum()), rel=1e-4, abs=1e-5)
    assert float(kl) <= float(_full_kl(teacher, student).sum()) + 1e-4  # coarsening never adds divergence
    if k == 40:
        assert float(kl) == pytest.approx(float(_full_kl(teacher, student).sum()), rel=1e-4)
    same, _ = topk_kl(teacher, teacher_topk(teacher, k))
    assert abs(float(same)) < 1e-4


@pytest.mark.parametrize("k", [1, 5, 40])
@pytest.mark.parametrize("chunk", [1 << 20, 50])
def test_topk_kl_and_its_closed_form_gradient_match_float64_autograd(k, chunk, monkeypatch):
    """The fused loss against autograd through the float64 reference, whole and read in
    chunks of one row and a bit (50 entries of 40-wide rows)."""
    import nmprune.distill as distill

    monkeypatch.setattr(distill, "ROW_CHUNK_ENTRIES", chunk)
    g = torch.Generator().manual_seed(1)
    teacher, base = torch.randn(2, 7, 40, generator=g) * 3, torch.randn(2, 7, 40, generator=g) * 3
    student = base.clone().requires_grad_(True)
    reference = base.double().requires_grad_(True)
    kl, _ = topk_kl(student, teacher_topk(teacher, k))
    kl.backward()
    _coarse_kl(teacher, reference, k).sum().backward()
    assert float(kl.detach()) == pytest.approx(float(_coarse_kl(teacher, base, k).sum()), rel=1e-4, abs=1e-5)
    assert torch.allclose(student.grad.double(), reference.grad, rtol=1e-4, atol=1e-5)
    # bfloat16 logits: the gradient comes back in their dtype, computed in float32
    low = base.bfloat16().requires_grad_(True)
    kl_low, _ = topk_kl(low, teacher_topk(teacher, k))
    kl_low.backward()
    assert low.grad.dtype == torch.bfloat16
    assert torch.allclose(low.grad.double(), reference.grad, rtol=5e-2, atol=5e-3)


def test_teacher_topk_reads_the_logits_in_chunks_as_whole(monkeypatch):
    import nmprune.distill as distill

    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2)) * 3
    whole = teacher_topk(logits, 6)
    monkeypatch.setattr(distill, "ROW_CHUNK_ENTRIES", 90)
    parts = teacher_topk(logits, 6)
    assert torch.equal(whole.ids, parts.ids) and torch.equal(whole.logp, parts.logp)
    reference = torch.log_softmax(logits.double(), -1).topk(6, -1)
    assert torch.equal(whole.ids.long(), reference.indices)
    assert torch.allclose(whole.logp.double(), reference.values, atol=1e-5)


def test_topk_kl_gradient_is_finite_where_the_top_tokens_hold_all_the_mass():
    teacher = torch.full((1, 3, 10), -1e4)
    teacher[..., 0] = 10.0  # one certain token: the rest holds no mass at all
    student = torch.randn(1, 3, 10, requires_grad=True)
    kl, _ = topk_kl(student, teacher_topk(teacher, 3))
    kl.backward()
    assert torch.isfinite(kl) and torch.isfinite(student.grad).all()
    # the student learns to put its mass on the certain token
    assert (student.grad[..., 0] < 0).all()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pass_attention_is_eager_only_for_short_bfloat16_windows_on_the_cpu_and_computes_the_same_model(family):
    from nmprune.stages.distillation import EAGER_ATTENTION_MAX_TOKENS, pass_attention

    model = tiny_model(family, layers=2)
    try:
        model.set_attn_implementation("sdpa")  # what a loaded model asks for (the tiny ones ask for eager)
    except ValueError:
        assert family == "gemma2"  # eager only in transformers
    cpu, asked = torch.device("cpu"), model.config._attn_implementation
    ids = token_batch(2, 16, seed=3)  # longer than Mistral's and Gemma 2's sliding windows
    with torch.no_grad():
        reference = model(ids).logits
    with torch.no_grad(), pass_attention(model, cpu, torch.bfloat16, 16):
        assert model.config._attn_implementation == "eager"
        # the model's own causal (and sliding-window) masks, whichever path computes them
        assert torch.allclose(model(ids).logits, reference, rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == asked
    for dtype, tokens in ((None, 16), (torch.bfloat16, EAGER_ATTENTION_MAX_TOKENS + 1)):
        with pass_attention(model, cpu, dtype, tokens):
            assert model.config._attn_implementation == asked


def test_teacher_topk_refuses_no_tokens():
    with pytest.raises(ValueError, match="at least one token"):
        teacher_topk(torch.zeros(1, 2, 5), 0)


def _pruned(model) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": m.weight.detach().clone() for i, b in enumerate(find_blocks(model)[1])
            for n, m in find_linears(b).items()}


def _kl_to(dense, model, ids) -> float:
    with torch.no_grad():
        return float(_full_kl(dense(ids).logits, model(ids).logits).mean())


@pytest.mark.parametrize("family", ["llama", "gemma2", "opt"])
def test_distillation_holds_the_masks_and_brings_the_model_closer_to_the_dense_one(family):
    dense = tiny_model(family, layers=2)
    calib = token_batch(16, 16)
    reconstructed, distilled = copy.deepcopy(dense), copy.deepcopy(dense)
    prune_model(reconstructed, calibration=calib, device="cpu", progress=False, distill_epochs=0, **SETTINGS)
    report = prune_model(distilled, calibration=calib, device="cpu", progress=False, distill_epochs=3,
                         distill_lr=1e-2, **SETTINGS)
    record = report.distillation
    assert record["epochs"] == 3 and record["steps"] == 3 * 7 and record["heldout_batches"] == 1  # 8 batches of 2, 1 held out
    assert record["kept"] == "distilled" and record["heldout_after"] < record["heldout_before"]
    before, after = _pruned(reconstructed), _pruned(distilled)
    assert sum(not torch.equal(before[n], after[n]) for n in before) == len(before)  # every layer trained
    for n, w in after.items():
        assert torch.equal(w[before[n] == 0], torch.zeros_like(w[before[n] == 0])), n  # masks held
    pruned_names = {f"{n}.weight" for b in find_blocks(distilled)[1] for n, m in distilled.named_modules()
                    if any(m is x for x in find_linears(b).values())}
    for (n, p), (_, q) in zip(distilled.named_parameters(), reconstructed.named_parameters()):
        if n not in pruned_names:
            assert torch.equal(p, q), n  # only the pruned layers move
    assert _kl_to(dense, distilled, calib) < _kl_to(dense, reconstructed, calib)


def test_a_distillation_that_made_the_model_worse_gets_the_weights_from_before_back(monkeypatch):
    import nmprune.stages.distillation as stage

    def worsen(data, weights, *args, **kwargs) -> FitResult:
        with torch.no_grad():
            for w in weights:
                w.mul_(torch.where(w != 0, 3.0, 0.0))
        return FitResult(steps=1, first_epoch_mse=1.0, last_epoch_mse=1.0, seconds=0.0)

    dense = tiny_model("llama", layers=2)
    calib = token_batch(16, 16)
    plain, restored = copy.deepcopy(dense), copy.deepcopy(dense)
    prune_model(plain, calibration=calib, device="cpu", progress=False, distill_epochs=0, **SETTINGS)
    monkeypatch.setattr(stage, "fit_masked", worsen)
    report = prune_model(restored, calibration=calib, device="cpu", progress=False, distill_epochs=1, **SETTINGS)
    assert report.distillation["kept"] == "solved"
    assert report.distillation["heldout_trained"] > report.distillation["heldout_before"]
    assert report.distillation["heldout_after"] == report.distillation["heldout_before"]
    for (n, p), q in zip(restored.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("bad,message", [
    (dict(distill_epochs=-1), "distill_epochs must be 'auto', 0"),
    (dict(distill_epochs="always"), "distill_epochs must be 'auto', 0"),
    (dict(distill_epochs=True), "setting 'distill_epochs' must be an integer or a string"),
    (dict(distill_lr=0.0), "distill_lr must be a positive number"),
    (dict(distill_lr=float("nan")), "distill_lr. must be a finite number"),
    (dict(distill_epochs=1, reconstruct="none"), "distill_epochs needs reconstruction"),
    (dict(nsamples=64, distill_nsamples=32), "distill_nsamples must be 'auto' .* of at least nsamples"),
    (dict(distill_nsamples="more"), "distill_nsamples must be 'auto'"),
])
def test_bad_distillation_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        PruneSettings(**bad)


def test_auto_distills_one_epoch_in_memory_and_none_without_reconstruction():
    """``distill_epochs: auto`` (the default) makes one epoch for a model held whole that
    reconstructs, none without reconstruction (the pass needs its dense stream)."""
    assert PruneSettings().distill_epochs == "auto"
    assert PruneSettings().distill_passes() == 1
    assert PruneSettings(reconstruct="none").distill_passes() == 0
    assert PruneSettings(distill_epochs=2).distill_passes() == 2
    calib = token_batch(16, 16)
    report = prune_model(tiny_model("llama", layers=2), calibration=calib, device="cpu", progress=False, **SETTINGS)
    assert report.distillation is not None and report.distillation["epochs"] == 1
    plain = prune_model(tiny_model("llama", layers=2), calibration=calib, device="cpu", progress=False,
                        **{**SETTINGS, "reconstruct": "none"})
    assert plain.distillation is None


def test_the_pass_also_trains_on_windows_of_its_own_with_the_dense_models_distribution():
    """``distill_calibration`` windows join the run's: their dense distribution is the dense
    model's, taken before any block is pruned, and an eighth of them is held out besides the
    reconstruction's held-out batches (16 + 8 windows in batches of 2: 8 + 4, held out 1 + 1)."""
    import nmprune.pipeline as pipeline

    dense = tiny_model("llama", layers=2)
    calib, own = token_batch(16, 16), token_batch(8, 16, seed=2)
    with torch.no_grad():
        expected = [teacher_topk(dense(b).logits, 64) for b in own.split(2)]
    seen = {}

    def spy(model, weights, windows, *args, **kwargs):
        seen.update(batches=windows.batches, teachers=windows.teachers, positions=windows.positions,
                    total=windows.total, held=windows.held)
        return distill(model, weights, windows, *args, **kwargs)

    distill = pipeline.distill
    model = copy.deepcopy(dense)
    try:
        pipeline.distill = spy
        report = prune_model(model, calibration=calib, distill_calibration=own, device="cpu", progress=False,
                             distill_epochs=1, distill_lr=1e-2, **SETTINGS)
    finally:
        pipeline.distill = distill
    assert seen["total"] == 12 and seen["positions"] == list(range(12)) and seen["held"] == {7, 11}
    for t, e, b in zip(seen["teachers"][8:], expected, own.split(2)):
        assert torch.equal(t.logp, e.logp) and torch.equal(t.ids, e.ids)
    assert all(torch.equal(a, b) for a, b in zip(seen["batches"][8:], own.split(2)))
    record = report.distillation
    assert record["batches"] == 12 and record["heldout_batches"] == 2 and record["steps"] == 10
    with pytest.raises(ValueError, match="distill_calibration token ids must lie in"):
        prune_model(copy.deepcopy(dense), calibration=calib, distill_calibration=own + 10**6, device="cpu",
                    progress=False, distill_epochs=1, **SETTINGS)


def test_the_own_windows_teachers_are_computed_in_the_dtype_the_pass_trains_in(monkeypatch):
    """The dense model's distribution on the pass's own windows comes from products in the
    pass's training dtype (bfloat16 under ``train_precision: bfloat16``, the weights' own under
    ``full``); in bfloat16 it stays close to float32's, far inside the gap the pass closes."""
    from nmprune.stages.distillation import dense_teachers

    dense = tiny_model("llama", layers=2)
    own = token_batch(4, 16, seed=2)
    full = dense_teachers(dense, own.split(2), 64, torch.device("cpu"))
    low = dense_teachers(dense, own.split(2), 64, torch.device("cpu"), torch.bfloat16)
    with torch.no_grad():
        logits = [dense(b).logits for b in own.split(2)]
    assert all(torch.equal(t.logp, teacher_topk(x, 64).logp) for t, x in zip(full, logits))
    assert not all(torch.equal(a.logp, b.logp) for a, b in zip(full, low))  # bfloat16 products did run
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        drift = sum(topk_kl(dense(b).logits.float(), t)[0] for b, t in zip(own.split(2), full))
    assert 0 < float(drift) / own.numel() < 0.05
    seen = []

    def spy(model, batches, k, device, dtype=None):
        seen.append(dtype)
        return dense_teachers(model, batches, k, device, dtype)

    import nmprune.stages.source as source

    monkeypatch.setattr(source, "dense_teachers", spy)
    for precision in ("bfloat16", "full"):
        prune_model(copy.deepcopy(dense), calibration=token_batch(16, 16), distill_calibration=own, device="cpu",
                    progress=False, distill_epochs=1, train_precision=precision, **SETTINGS)
    assert seen == [torch.bfloat16, None]


def test_the_held_out_divergence_computes_in_the_training_dtype():
    """The pass's held-out judgement runs its products in the dtype training runs in: close
    to float32's, and bfloat16 products did run."""
    from nmprune.stages.distillation import mean_divergence, dense_teachers

    dense, student = tiny_model("llama", layers=2), tiny_model("llama", layers=2, seed=1)
    own = list(token_batch(4, 16, seed=2).split(2))
    teachers = dense_teachers(dense, own, 64, torch.device("cpu"))
    args = (student, own, teachers, [0, 1], lambda tensors: None, torch.device("cpu"))
    full, low = mean_divergence(*args), mean_divergence(*args, torch.bfloat16)
    assert full > 0 and low != full and abs(low - full) < 0.05 * full


def test_auto_draws_as_many_windows_again_for_the_pass_apart_from_the_runs():
    """``distill_nsamples: auto``: AUTO_DISTILL_WINDOWS times the run's windows; a number says
    the total; the pass's own windows are none where they would add nothing."""
    from nmprune.config import AUTO_DISTILL_WINDOWS
    from nmprune.pipeline import distill_windows

    assert AUTO_DISTILL_WINDOWS > 1
    assert PruneSettings(nsamples=64).distill_extra_windows() == 64 * (AUTO_DISTILL_WINDOWS - 1)
    assert PruneSettings(nsamples=64, distill_nsamples=96).distill_extra_windows() == 32
    assert PruneSettings(nsamples=64, distill_nsamples=64).distill_extra_windows() == 0
    assert distill_windows(None, PruneSettings(nsamples=4, distill_nsamples=4)) is None


def test_the_default_reconstructs_two_epochs_with_or_without_the_pass():
    """Two reconstruction epochs by default, whether the global distillation follows or not
    (one before the pass lost on both real models: docs/methods.md); ``auto`` is no longer a
    number of epochs."""
    assert PruneSettings().fit_options().epochs == 2
    assert PruneSettings(reconstruct_epochs=3).fit_options().epochs == 3
    with pytest.raises(ValueError, match="setting 'reconstruct_epochs' must be an integer, got 'auto'"):
        PruneSettings(reconstruct_epochs="auto")
    calib = token_batch(16, 16)
    settings = {k: v for k, v in SETTINGS.items() if k != "reconstruct_epochs"}
    with_pass = prune_model(tiny_model("llama", layers=2), calibration=calib, device="cpu", progress=False,
                            distill_epochs=1, **settings)
    alone = prune_model(tiny_model("llama", layers=2), calibration=calib, device="cpu", progress=False,
                        distill_epochs=0, **settings)
    # 8 batches of 2, one held out: 7 steps an epoch
    assert [b["steps"] for b in with_pass.blocks] == [14, 14] == [b["steps"] for b in alone.blocks]


def test_a_narrowed_weight_adds_steps_below_bfloat16s_resolution_as_float32_does():
    from nmprune.reconstruct import KeptEntries, narrowed

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g) * (torch.rand(8, 64, generator=g) > 0.5)
    reference, lost = w.clone(), w.clone().bfloat16()
    where = KeptEntries(w)
    steps = [torch.randn(where.count, generator=g) * 1e-5 for _ in range(200)]  # each far below bf16's 2**-8
    with narrowed([w], [where], torch.bfloat16):
        assert w.dtype == torch.bfloat16 and where.residual.dtype == torch.bfloat16
        for change in steps:
            for kept, positions in where.chunks():
                where.add(kept, positions, change[kept], w)
                KeptEntries(reference).add(kept, positions, change[kept], reference)
                KeptEntries(lost).add(kept, positions, change[kept], lost)  # no residual: plain bfloat16
    assert w.dtype == torch.float32 and where.residual is None
    assert torch.equal(w == 0, reference == 0)  # the pruned entries stay zero
    # the residual's own rounding, 2**-18 of an entry a step, walks at random: 16 bits at the start
    # and about sqrt(steps) times 2**-18 after them
    bound = 4 * len(steps) ** 0.5 * 2 ** -18 * reference.abs() + 1e-30
    assert bool(((w - reference).abs() <= bound).all())
    assert float(((lost.float() - reference).abs() / bound).max()) > 10  # what bfloat16 alone loses
    assert float(torch.stack(steps).sum(0).abs().max()) > 1e-4  # the steps did add up to something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrowing_a_weight_keeps_its_value_and_its_own_dtype(dtype):
    from nmprune.reconstruct import KeptEntries, narrowed

    w = (torch.randn(4, 32) * (torch.rand(4, 32) > 0.5)).to(dtype)
    original, where = w.clone(), KeptEntries(w)
    with narrowed([w], [where], torch.bfloat16):
        assert w.dtype == torch.bfloat16
    assert w.dtype == dtype
    assert torch.allclose(w.float(), original.float(), rtol=2 ** -15, atol=0)
    if dtype == torch.bfloat16:
        assert torch.equal(w, original)


def _distilled(checkpoint_blocks: bool, precision: str):
    from nmprune.reconstruct import FitOptions
    from nmprune.stages.distillation import PassRuntime, PassWindows, distill

    model = tiny_model("llama", layers=2)
    weights = [m.weight for b in find_blocks(model)[1] for m in find_linears(b).values()]
    with torch.no_grad():
        for w in weights:
            w.view(-1, 4)[:, :2] = 0
    batches = list(token_batch(8, 16).split(1))
    with torch.no_grad():
        teachers = [teacher_topk(tiny_model("llama", layers=2, seed=5)(b).logits, 8) for b in batches]
    record = distill(model, weights, PassWindows(batches, teachers, list(range(8)), 8, frozenset({7})),
                     FitOptions(2, 1e-2, 1, precision=precision), PassRuntime(lambda t: None, torch.device("cpu")),
                     checkpoint_blocks=checkpoint_blocks)
    return model, record


@pytest.mark.parametrize("precision", ["full", "bfloat16"])
def test_block_checkpointing_gives_the_pass_the_same_weights(precision):
    plain, record = _distilled(False, precision)
    recomputed, again = _distilled(True, precision)
    assert record["train_dtype"] == ("float32" if precision == "full" else "bfloat16")
    assert record["last_epoch_kl"] < record["first_epoch_kl"]
    assert again["last_epoch_kl"] == record["last_epoch_kl"]
    for (n, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q), n
    assert all(not hasattr(b.forward, "func") for b in find_blocks(recomputed)[1])  # the blocks' own forward back


def _fit_kl(lean: bool):
    """Two epochs of the pass's training on a tiny 2:4 Llama, its products in bfloat16: with the
    weights narrowed (the lean pass), or float32 under autocast (the pass before it was lean)."""
    from contextlib import nullcontext

    from nmprune.reconstruct import FitData, FitOptions, KeptEntries, fit_masked, narrowed
    from nmprune.stages.block_fit import float32_training

    model = tiny_model("llama", layers=2)
    weights = [m.weight for b in find_blocks(model)[1] for m in find_linears(b).values()]
    with torch.no_grad():
        for w in weights:
            w.view(-1, 4)[:, :2] = 0
    batches = token_batch(8, 16).split(1)
    with torch.no_grad():
        teachers = [teacher_topk(tiny_model("llama", layers=2, seed=5)(b).logits, 8) for b in batches]
    where = [KeptEntries(w) for w in weights]
    with float32_training(model, widen=not lean), narrowed(weights, where, torch.bfloat16) if lean else nullcontext():
        result = fit_masked(FitData(lambda i: model(batches[i], use_cache=False).logits, teachers, range(8), 8,
                                    loss=topk_kl), weights, FitOptions(2, 1e-2, 1, precision="bfloat16"), entries=where)
    return model, result


def test_the_lean_bfloat16_pass_trains_as_the_float32_weights_with_autocast_do():
    """The lean pass's products see the bfloat16 weights autocast made of the float32 ones; its
    Kahan-compensated steps differ from float32's by the rounding of the compensation alone."""
    lean, result = _fit_kl(True)
    full, reference = _fit_kl(False)
    assert result.dtype == reference.dtype == "bfloat16"
    assert result.last_epoch_mse < result.first_epoch_mse
    assert result.first_epoch_mse == pytest.approx(reference.first_epoch_mse, rel=1e-4)
    assert result.last_epoch_mse == pytest.approx(reference.last_epoch_mse, rel=1e-4)
    for (n, p), q in zip(lean.named_parameters(), full.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p == 0, q == 0), n
        assert float((p - q).detach().norm()) < 2e-3 * float(q.detach().norm()), n


class _Saves:
    """A FitProgress in memory: saves after every round; resumes from ``start`` if given."""

    def __init__(self, start=None):
        self.states, self.start = [], start

    def resume(self, like):
        if self.start is None:
            return None
        assert set(self.start.tensors) == set(like)
        return self.start

    def due(self):
        return True

    def save(self, state):
        self.states.append(copy.deepcopy(state))


@pytest.mark.parametrize("lanes,narrow", [(1, False), (2, True)])
def test_a_fit_resumed_from_any_saved_round_takes_the_uninterrupted_fits_steps(lanes, narrow):
    from contextlib import nullcontext

    from nmprune.reconstruct import FitData, FitOptions, KeptEntries, fit_masked, narrowed

    def fit(progress):
        torch.manual_seed(0)
        weights = [torch.randn(8, 16) * (torch.rand(8, 16) > 0.5) for _ in range(2)]
        x = torch.randn(6, 4, 16)
        targets = [torch.randn(4, 8) for _ in range(6)]
        where = [KeptEntries(w) for w in weights]
        with narrowed(weights, where, torch.bfloat16) if narrow else nullcontext():
            result = fit_masked(FitData(lambda j: x[j] @ (weights[0] + weights[1]).t(), targets, range(6), 6), weights,
                                FitOptions(3, 1e-2, 1, lanes=lanes, precision="bfloat16" if narrow else "full"),
                                entries=where, progress=progress)
        return weights, result

    saves = _Saves()
    reference, result = fit(saves)
    assert [(s.epoch, s.round) for s in saves.states] == [(e, r) for e in range(3) for r in range(1, 6 // lanes)]
    for state in saves.states:
        weights, again = fit(_Saves(state))
        assert again.first_epoch_mse == result.first_epoch_mse and again.last_epoch_mse == result.last_epoch_mse
        for w, v in zip(weights, reference):
            assert torch.equal(w, v), (state.epoch, state.round)


def test_a_pass_on_a_single_batch_is_judged_on_it_and_kept_where_it_helped():
    """With one batch nothing can be held out: the pass was always reverted ("- -> -, kept:
    solved"); now the training batch judges it, and the record says so."""
    from nmprune.reconstruct import FitOptions
    from nmprune.stages.distillation import PassRuntime, PassWindows, distill

    model = tiny_model("llama", layers=2)
    weights = [m.weight for b in find_blocks(model)[1] for m in find_linears(b).values()]
    with torch.no_grad():
        for w in weights:
            w.view(-1, 4)[:, :2] = 0
    batch = token_batch(2, 16)
    with torch.no_grad():
        teacher = teacher_topk(tiny_model("llama", layers=2, seed=5)(batch).logits, 8)
    record = distill(model, weights, PassWindows([batch], [teacher], [0], 1), FitOptions(1, 1e-2, 1),
                     PassRuntime(lambda t: None, torch.device("cpu")))
    assert record["judged_on"] == "training batches" and record["heldout_batches"] == 0
    assert record["heldout_trained"] < record["heldout_before"] and record["kept"] == "distilled"


def test_a_pass_that_diverges_keeps_the_solved_weights_and_says_why():
    """At a learning rate so high that the loss overflows (1e300) the pass used to end the run
    ("the reconstruction loss became nan"); now, as at 1e6, the solved weights stand and the
    record says why (issue 65 case 1)."""
    from nmprune.reconstruct import FitOptions
    from nmprune.stages.distillation import PassRuntime, PassWindows, distill

    model = tiny_model("llama", layers=2)
    weights = [m.weight for b in find_blocks(model)[1] for m in find_linears(b).values()]
    with torch.no_grad():
        for w in weights:
            w.view(-1, 4)[:, :2] = 0
    solved = [w.detach().clone() for w in weights]
    batches = [token_batch(2, 16, seed=s) for s in range(3)]
    with torch.no_grad():
        teachers = [teacher_topk(tiny_model("llama", layers=2, seed=5)(b).logits, 8) for b in batches]
    record = distill(model, weights, PassWindows(batches, teachers, [0, 1, 2], 3, frozenset({2})),
                     FitOptions(1, 1e300, 1), PassRuntime(lambda t: None, torch.device("cpu")))
    assert record["kept"] == "solved" and "diverged" in record["diverged"]
    assert all(torch.equal(w, s) for w, s in zip(weights, solved))
