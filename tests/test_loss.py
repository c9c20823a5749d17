import torch

from nmprune.loss import local_loss, local_loss_grad


def test_local_loss_matches_definition_and_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 50, generator=g, dtype=torch.float64)
    h = x @ x.T / 50
    w_star = torch.randn(3, 8, generator=g, dtype=torch.float64)
    w = torch.randn(3, 8, generator=g, dtype=torch.float64)
    direct = float(((w @ x - w_star @ x) ** 2).sum() / 50)
    assert abs(local_loss(w, w_star, h) - direct) < 1e-10 * direct
    wr = w.clone().requires_grad_(True)
    torch.trace((wr - w_star) @ h @ (wr - w_star).T).backward()
    assert torch.allclose(local_loss_grad(w, w_star @ h, h), wr.grad)
