"""Paper Section 4.1 toy experiments: the 2-cell example and the synthetic Hessians."""

import pytest
import torch

from nmprune.solve import prune_layer

W_TOY = torch.tensor([[0.0, 5, 3, 2, 0, 5, 5, 2]])


def toy_hessian():
    h = torch.eye(8)
    h[3, 7] = h[7, 3] = 1.0  # the 4th and 8th inputs are perfectly correlated (1-based)
    return h


PAPER_FAITHFUL = {"lambda0": 0.01, "beta": 1.01, "lambda_adapt": False, "solver": "gd",
                  "accelerate": False, "finish": 0.0}


@pytest.mark.parametrize("options", [{}, PAPER_FAITHFUL], ids=["defaults", "paper"])
@pytest.mark.parametrize("refine", ["gd", "exact"])
def test_toy_prox_merges_the_correlated_weights(options, refine):
    res = prune_layer(W_TOY, toy_hessian(), method="prox", refine=refine, **options)
    assert torch.allclose(res.weight, torch.tensor([[0.0, 5, 0, 4, 0, 5, 5, 0]]), atol=1e-3)
    assert res.loss_refined == pytest.approx(9.0, rel=1e-4)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("refine", ["gd", "exact"])
def test_toy_wanda_and_sparsegpt_keep_the_suboptimal_mask(method, refine):
    res = prune_layer(W_TOY, toy_hessian(), method=method, refine=refine)
    assert res.mask.tolist() == [[False, True, True, False, False, True, True, False]]
    assert torch.allclose(res.weight, torch.tensor([[0.0, 5, 3, 0, 0, 5, 5, 0]]), atol=1e-3)
    assert res.loss_refined == pytest.approx(16.0, rel=1e-4)


def test_toy_sparsegpt_defers_the_loss():
    # first cell: the 2 is absorbed into the correlated 8th weight (2 -> 4); second cell: the 4 goes
    res = prune_layer(W_TOY, toy_hessian(), method="sparsegpt", percdamp=1e-6)  # H is singular
    assert res.loss_method == pytest.approx(16.0, rel=1e-4)


def synthetic(d, alpha, seed):
    """The paper's generator: alpha diag(U[0,1]) + (1 - alpha) Z Z^T, Z ~ N(0, 1/d)."""
    g = torch.Generator().manual_seed(seed)
    diag = torch.diag(torch.rand(d, generator=g, dtype=torch.float64))
    z = torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5
    h = alpha * diag + (1 - alpha) * (z @ z.T)
    return torch.randn(1, d, generator=g, dtype=torch.float64), h


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synthetic_correlated_prox_has_lowest_loss(seed):
    w, h = synthetic(128, alpha=0.3, seed=seed)
    losses = {m: prune_layer(w, h, method=m, refine="exact").loss_refined
              for m in ("prox", "wanda", "sparsegpt")}
    assert losses["prox"] <= min(losses["wanda"], losses["sparsegpt"]) * (1 + 1e-6), losses


@pytest.mark.parametrize("seed", [0, 1])
def test_synthetic_uncorrelated_all_methods_agree(seed):
    w, h = synthetic(64, alpha=1.0, seed=seed)
    ref = prune_layer(w, h, method="wanda", refine="exact").loss_refined
    for method, opts in [("prox", {}), ("sparsegpt", {"percdamp": 0.0}), ("dsnot", {})]:
        loss = prune_layer(w, h, method=method, refine="exact", **opts).loss_refined
        assert loss == pytest.approx(ref, rel=1e-6), method
    # with SparseGPT's default 1% dampening its score is w^2 (H_jj + damp): nearly Wanda's
    loss = prune_layer(w, h, method="sparsegpt", refine="exact").loss_refined
    assert loss == pytest.approx(ref, rel=2e-2)
