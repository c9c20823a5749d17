"""Hessian dampening (``prune_layer(..., damp=...)``, :func:`nmprune.prune.dampen`)."""

import pytest
import torch

from nmprune import local_loss
from nmprune.prune import dampen, prune_layer


def _few_token_problem(d_in: int = 64, d_out: int = 32, tokens: int = 24, seed: int = 0):
    """Correlated inputs ``x = L z``: a calibration ``H`` from fewer tokens than inputs (rank
    ``tokens``) and the population ``H = L L^T`` the layer meets on new text."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / d_in ** 0.5
    chol = torch.eye(d_in, dtype=torch.float64) * 0.3 + mix
    x = chol @ torch.randn(d_in, tokens, generator=gen, dtype=torch.float64)
    w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
    return w, x @ x.T / tokens, chol @ chol.T


def test_dampen_adds_a_multiple_of_the_mean_diagonal():
    h = torch.diag(torch.tensor([1.0, 3.0]))
    assert dampen(h, 0.0) is h
    torch.testing.assert_close(dampen(h, 0.5), torch.diag(torch.tensor([2.0, 4.0])))
    assert torch.equal(h, torch.diag(torch.tensor([1.0, 3.0])))  # not modified in place


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
