"""Hessian dampening (``prune_layer(..., damp=...)``, :func:`nmprune.solve.dampened`)."""

import pytest
import torch

import nmprune
from nmprune import local_loss
from nmprune.solve import dampened, prune_layer
from nmprune.registry import get_method


def _few_token_problem(d_in: int = 64, d_out: int = 32, tokens: int = 24, seed: int = 0):
    """Correlated inputs ``x = L z``: a calibration ``H`` from fewer tokens than inputs (rank
    ``tokens``) and the population ``H = L L^T`` the layer meets on new text."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / d_in ** 0.5
    chol = torch.eye(d_in, dtype=torch.float64) * 0.3 + mix
    x = chol @ torch.randn(d_in, tokens, generator=gen, dtype=torch.float64)
    w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
    return w, x @ x.T / tokens, chol @ chol.T


def test_dampened_adds_a_multiple_of_the_mean_diagonal_and_restores_it():
    h = torch.diag(torch.tensor([1.0, 3.0]))
    h[0, 1] = h[1, 0] = 0.25
    original = h.clone()
    with dampened(h, 0.0) as d:
        assert d is h
    with dampened(h, 0.5) as d:
        assert d is h  # in place: no second d_in x d_in matrix
        torch.testing.assert_close(d, original + torch.eye(2))
    assert torch.equal(h, original)
    with pytest.raises(RuntimeError, match="solver failed"):
        with dampened(h, 0.5):
            raise RuntimeError("solver failed")
    assert torch.equal(h, original)  # restored on an error too


@pytest.mark.parametrize("kind", ["transposed view", "inference", "requires grad"])
def test_dampened_copies_a_hessian_it_cannot_write(kind):
    base = torch.tensor([[1.0, 0.5, 0.0], [0.5, 3.0, 0.0], [0.0, 0.0, 2.0]])
    if kind == "transposed view":
        h = base.clone()[:, :2][:2].t()  # not contiguous
    elif kind == "inference":
        with torch.inference_mode():
            h = base.clone()
    else:
        h = base.clone().requires_grad_()
    original = h.detach().clone()
    with dampened(h, 0.5) as d:
        assert d is not h
        torch.testing.assert_close(d.detach(), original + original.diagonal().mean() * 0.5 * torch.eye(len(h)))
    assert torch.equal(h.detach(), original)


@pytest.mark.parametrize("method", sorted(nmprune.methods()))
@pytest.mark.parametrize("refine", ["gd", "exact"])
def test_solve_leaves_the_callers_weights_and_hessian_unchanged(method, refine):
    """The pipeline hands the module's own weight and the statistics' own H to the solvers
    (no copies): every method and refiner must leave both as they were, dampening included."""
    w, h, _ = _few_token_problem()
    w32, h32 = w.float(), h.float()
    w_before, h_before = w32.clone(), h32.clone()
    options = {name: torch.zeros(w.shape[1]) for name in get_method(method).statistics}
    refine_options = {"refine_max_iter": 20} if refine == "exact" else {"refine_steps": 20}
    prune_layer(w32, h32, method=method, refine=refine, damp=0.05, **refine_options, **options)
    assert torch.equal(w32, w_before) and torch.equal(h32, h_before)


def test_losses_are_reported_on_the_undamped_hessian():
    w, h, _ = _few_token_problem()
    res = prune_layer(w, h, method="prox", refine="exact", damp=0.05)
    assert res.loss_refined == pytest.approx(local_loss(res.weight, w, h), rel=1e-12)
    # the damped optimum is not the undamped one: with the same mask, exact refinement on H
    # itself reaches a lower loss on H
    undamped = prune_layer(res.weight, h, method="magnitude", refine="exact", refine_max_iter=500)
    assert torch.equal(undamped.mask, res.mask)
    assert undamped.loss_refined < 0.99 * res.loss_refined


def test_damping_keeps_an_under_determined_fit_from_overfitting():
    """Fewer tokens than inputs: undamped exact refinement drives the calibration loss to
    about zero and the loss on the population Hessian up; dampening trades a little
    calibration loss for a much lower population loss."""
    w, h, population = _few_token_problem()
    plain = prune_layer(w, h, method="wanda", refine="exact", refine_max_iter=500)
    damped = prune_layer(w, h, method="wanda", refine="exact", refine_max_iter=500, damp=0.01)
    assert plain.loss_refined < damped.loss_refined
    assert local_loss(damped.weight, w, population) < 0.8 * local_loss(plain.weight, w, population)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_bad_damp_is_a_value_error(bad):
    w, h, _ = _few_token_problem()
    with pytest.raises(ValueError, match="damp"):
        prune_layer(w, h, method="wanda", damp=bad)
