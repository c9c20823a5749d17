"""Method-level oracles: brute force, float64 direct solves, an independent SparseGPT."""

import itertools

import pytest
import torch

from nmprune.loss import local_loss
from nmprune.pattern import NMPattern, is_nm_sparse
from nmprune.solve import prune_layer
from nmprune.registry import get_method, get_refiner
from refine_oracle import masked_optimum


def brute_force_best_loss(w_star, h, pattern):
    """Minimum local loss over every N:M mask (rows independently), weights re-optimised."""
    d = w_star.shape[1]
    cell_choices = [c for c in itertools.product([0, 1], repeat=pattern.m) if sum(c) == pattern.n]
    total = 0.0
    for r in range(w_star.shape[0]):
        best = float("inf")
        for cells in itertools.product(cell_choices, repeat=d // pattern.m):
            mask = torch.tensor([x for c in cells for x in c], dtype=torch.bool).unsqueeze(0)
            w = masked_optimum(w_star[r:r + 1], h, mask)
            best = min(best, local_loss(w, w_star[r:r + 1].double(), h.double()))
        total += best
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wanda_is_optimal_for_diagonal_hessians_and_prox_matches(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 8, generator=g, dtype=torch.float64)
    h = torch.diag(torch.rand(8, generator=g, dtype=torch.float64) * 3)
    best = brute_force_best_loss(w, h, NMPattern(2, 4))
    wanda = prune_layer(w, h, method="wanda")
    assert wanda.loss_method == pytest.approx(best, rel=1e-9)  # Theorem thm:wanda_opt
    prox = prune_layer(w, h, method="prox", refine="exact")
    assert prox.loss_refined == pytest.approx(best, rel=1e-6)


def correlated(d_out, d_in, seed, n=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    n = n or 3 * d_in
    x = torch.randn(d_in, 8, generator=g, dtype=torch.float64) @ torch.randn(8, n, generator=g, dtype=torch.float64)
    x = (x + torch.randn(d_in, n, generator=g, dtype=torch.float64)) * torch.exp(torch.randn(d_in, 1, generator=g, dtype=torch.float64))
    return torch.randn(d_out, d_in, generator=g, dtype=torch.float64).to(dtype), (x @ x.T / n).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("singular", [False, True])
def test_exact_refinement_matches_float64_direct_solve(dtype, singular):
    w, h = correlated(12, 64, seed=3, n=40 if singular else None, dtype=dtype)
    if singular:
        h[7, :] = 0
        h[:, 7] = 0
    res = prune_layer(w, h, method="wanda", refine="exact", refine_tol=1e-10, refine_max_iter=500)
    ref = masked_optimum(w, h, res.mask)
    ref_loss = local_loss(ref, w.double(), h.double())
    assert res.loss_refined == pytest.approx(ref_loss, rel=1e-6 if dtype == torch.float64 else 1e-4)
    # ref minimises the loss, so the H-norm of the difference is the loss gap
    diff = res.weight.double() - ref
    assert float(((diff @ h.double()) * diff).sum()) <= (1e-6 if dtype == torch.float64 else 1e-4) * ref_loss
    gd = prune_layer(w, h, method="wanda", refine="gd", refine_steps=200)
    assert res.loss_refined <= gd.loss_refined * (1 + 1e-6)


def sparsegpt_straightforward(w, h, pattern, percdamp=0.01):
    """Independent SparseGPT: every column re-derives its OBS update from the explicit inverse of
    the Hessian of the columns not yet processed (no Cholesky trick, no blocks, no lazy batches).

    The row of the upper Cholesky factor of H^-1 at column j equals (H_FF)^-1[0, :] / sqrt(.[0, 0])
    with F the columns j..d-1, which is what the reference's score and update use."""
    w, h = w.double().clone(), h.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += percdamp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    w[:, dead] = 0
    d = h.shape[0]
    d_col = torch.stack([torch.linalg.inv(h[j:, j:])[0, 0] for j in range(d)]).sqrt()
    pruned = torch.zeros_like(w, dtype=torch.bool)
    for j in range(d):
        if j % pattern.m == 0:
            score = w[:, j:j + pattern.m] ** 2 / d_col[j:j + pattern.m] ** 2
            order = torch.argsort(score, dim=1)[:, : pattern.m - pattern.n]
            pruned[:, j:j + pattern.m].scatter_(1, order, True)
        hinv_row = torch.linalg.inv(h[j:, j:])[0]
        q = torch.where(pruned[:, j], 0.0, w[:, j])
        err = (w[:, j] - q) / hinv_row[0]
        w[:, j:] -= torch.outer(err, hinv_row)
        w[:, j] = q
    return w


@pytest.mark.parametrize("pattern", [NMPattern(2, 4), NMPattern(1, 4), NMPattern(4, 8)])
@pytest.mark.parametrize("blocksize", [8, 128])
def test_sparsegpt_matches_straightforward_reimplementation(pattern, blocksize):
    w, h = correlated(10, 48, seed=5)
    h[9, :] = 0
    h[:, 9] = 0  # a dead input
    ours = get_method("sparsegpt").fn(w, h, pattern, blocksize=blocksize)
    ref = sparsegpt_straightforward(w, h, pattern)
    assert torch.equal(ours != 0, ref != 0)
    assert torch.allclose(ours, ref, atol=1e-9 * float(ref.abs().max()))
    assert is_nm_sparse(ours, pattern)


def test_dsnot_reduces_mean_output_shift_and_falls_back_to_wanda():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2000, generator=g) + torch.rand(64, 1, generator=g)
    h, mean = x @ x.T / 2000, x.mean(1)
    w = torch.randn(16, 64, generator=g)
    wanda = prune_layer(w, h, method="wanda").weight
    assert torch.equal(prune_layer(w, h, method="dsnot").weight, wanda)  # no input_mean: Wanda
    ds = prune_layer(w, h, method="dsnot", input_mean=mean).weight
    assert is_nm_sparse(ds, "2:4") and not torch.equal(ds, wanda)
    shift_w, shift_d = ((w - wanda) @ mean).abs(), ((w - ds) @ mean).abs()
    assert float(shift_d.sum()) < 0.7 * float(shift_w.sum())  # its aim: a smaller mean output shift
    with pytest.raises(ValueError, match="input_mean must be a tensor of shape"):
        prune_layer(w, h, method="dsnot", input_mean=mean[:-1])


@pytest.mark.parametrize("d_in", [16, 64, 128])
def test_dsnot_stays_n_m_when_its_candidates_run_out(d_in):
    """Few pruned weights per row against max_cycle_time (50): the candidate lists reach
    kept weights and cells run out of prune candidates; the result is still 2:4, and a row
    changes only by swaps inside cells (as many kept weights per cell as Wanda's)."""
    g = torch.Generator().manual_seed(d_in)
    x = (torch.randn(d_in, 4 * d_in, generator=g) + 2 * torch.rand(d_in, 1, generator=g)) \
        * torch.exp(torch.randn(d_in, 1, generator=g))
    h, mean = x @ x.T / x.shape[1], x.mean(1)
    w = torch.randn(32, d_in, generator=g)
    ds = prune_layer(w, h, method="dsnot", input_mean=mean, update_threshold=0.0).weight
    assert is_nm_sparse(ds, "2:4")
    assert int((ds != 0).sum()) == w.numel() // 2


def test_exact_refiner_rejects_bad_options():
    w, h = correlated(4, 16, seed=0)
    with pytest.raises(ValueError, match="option 'refine_tol' of refiner 'exact' must be float >= 0"):
        prune_layer(w, h, method="wanda", refine="exact", refine_tol=-1.0)
    with pytest.raises(ValueError, match="blocksize must be a positive multiple of M=4"):
        prune_layer(w, h, method="sparsegpt", blocksize=6)
    with pytest.raises(ValueError, match="option 'beta' of method 'prox' must be float > 1"):
        prune_layer(w, h, method="prox", beta=1.0)
    assert get_refiner("exact").fn(w * 0, w, h, torch.zeros_like(w, dtype=torch.bool)).abs().sum() == 0


def test_bfloat16_gradient_gives_the_full_precision_loss():
    """gradient_precision="bfloat16" rounds only the gradient product: after exact refinement the
    loss matches the full-precision loop's (the SmolLM2 layers moved by at most 0.003%)."""
    w, h = correlated(64, 128, 7, dtype=torch.float32)
    full = prune_layer(w, h, method="prox", refine="exact", gradient_precision="full")
    low = prune_layer(w, h, method="prox", refine="exact", gradient_precision="bfloat16")
    assert is_nm_sparse(low.weight, NMPattern(2, 4)) and low.weight.dtype == torch.float32
    assert low.loss_refined == pytest.approx(full.loss_refined, rel=1e-2)
    # the low-precision product really is used: the unrefined results differ
    assert not torch.equal(low.weight, full.weight)


def test_gradient_precision_auto_follows_the_hardware(monkeypatch):
    from nmprune.algorithms import prox as prox_module

    rows = prox_module.BF16_MIN_ROWS
    w32, w64 = torch.zeros(rows, 4), torch.zeros(rows, 4, dtype=torch.float64)
    for bf16, amx, expected in ((False, False, None), (True, False, torch.bfloat16), (False, True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert prox_module.gradient_dtype("auto", w32) is expected
        assert prox_module.gradient_dtype("auto", w64) is None  # float64 work keeps its precision
        assert prox_module.gradient_dtype("full", w32) is None
        assert prox_module.gradient_dtype("bfloat16", w64) is torch.bfloat16
        assert prox_module.gradient_dtype("auto", w32[: rows - 1]) is None  # too few rows to pay
    with pytest.raises(ValueError, match="gradient_precision"):
        prune_layer(w32, torch.eye(4), method="prox", gradient_precision="half")


def fista_reference(w_star, h, lambda0, beta, lambda_adapt=True):
    """Classical FISTA proximal gradient (Beck & Teboulle) on eq. ``squared_loss`` + lambda_k
    r_2:4, Wanda-scaled, run until every cell is 2:4; written out plainly for the test."""
    from nmprune.linalg import gd_step_size
    from nmprune.prox import prox_2of4

    s = torch.diagonal(h).sqrt()
    ws, hs = w_star * s, h / s[:, None] / s[None, :]
    eta = gd_step_size(hs)
    lam = lambda0 / float(ws.abs().mean()) if lambda_adapt else lambda0
    w, w_prev, t = ws.clone(), ws.clone(), 1.0
    while bool((torch.count_nonzero(w.reshape(-1, 4), dim=1) > 2).any()):
        t_next = 0.5 * (1.0 + (1.0 + 4.0 * t * t) ** 0.5)
        y = w + (t - 1.0) / t_next * (w - w_prev)
        t = t_next
        z = y - 2.0 * eta * ((y - ws) @ hs)
        w_prev, w = w, prox_2of4(z.reshape(-1, 4), lam).reshape(w.shape)
        lam *= beta
    return w / s


def test_shrink_momentum_one_is_classical_fista_and_other_values_differ():
    """``shrink_momentum`` weights the prox's shrinkage in the extrapolation: 1 is FISTA itself."""
    w, h = correlated(6, 32, 3)
    opts = dict(lambda0=1e-3, beta=1.05, finish=0.0, gradient_precision="full")
    fista = prune_layer(w, h, method="prox", shrink_momentum=1.0, **opts).weight
    torch.testing.assert_close(fista, fista_reference(w, h, 1e-3, 1.05), rtol=1e-9, atol=1e-12)
    damped = prune_layer(w, h, method="prox", shrink_momentum=0.2, **opts).weight
    assert is_nm_sparse(damped, NMPattern(2, 4)) and not torch.equal(damped, fista)
    for bad in (-0.1, 1.5, "fast"):
        with pytest.raises(ValueError, match="shrink_momentum"):
            prune_layer(w, h, method="prox", shrink_momentum=bad)


def test_auto_shrink_momentum_follows_the_spectrum():
    """"auto": rho = min(1, 4 mean eigenvalue / gamma_max) of the scaled H. A well-conditioned H
    keeps classical FISTA (the same result as rho = 1); a spiked one damps the shrinkage."""
    from nmprune.linalg import column_scale, gd_step_size, rescale
    from nmprune.algorithms.prox import auto_shrink_momentum

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g, dtype=torch.float64)
    u = torch.randn(64, 1, generator=g, dtype=torch.float64)
    spiked = torch.eye(64, dtype=torch.float64) + u @ u.T
    rhos = []
    for h in (torch.eye(64, dtype=torch.float64), torch.eye(64, dtype=torch.float64) + 0.1, spiked):
        hs = rescale(w, h, column_scale(h))[1]
        expected = min(1.0, 4.0 * float(hs.diagonal().mean()) / float(torch.linalg.eigvalsh(hs)[-1]))
        rhos.append(auto_shrink_momentum(hs, gd_step_size(hs)))
        assert rhos[-1] == pytest.approx(expected, rel=1e-3)
    assert rhos[0] == 1.0 and 0.0 < rhos[2] < rhos[1] < 1.0
    rho = rhos[2]
    opts = dict(finish=0.0, gradient_precision="full")
    identity = torch.eye(64, dtype=torch.float64) * 2.0
    assert torch.equal(prune_layer(w, identity, method="prox", **opts).weight,
                       prune_layer(w, identity, method="prox", shrink_momentum=1.0, **opts).weight)
    assert torch.equal(prune_layer(w, spiked, method="prox", **opts).weight,
                       prune_layer(w, spiked, method="prox", shrink_momentum=rho, **opts).weight)
