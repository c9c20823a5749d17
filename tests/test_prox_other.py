"""Regularizer values, the closed-form proxes (L0/L1/L2, 1:M) and the general N:M prox against
brute force (tests/prox_bruteforce.py), and their input checks."""

from __future__ import annotations

import itertools

import pytest
import torch

from nmprune.prox import prox_1ofm, prox_2of4, prox_l0, prox_l1, prox_l2, prox_nm, r_2of4, r_nm
from prox_bruteforce import objective, reference_min


def _subset_sum(w: torch.Tensor, n: int) -> torch.Tensor:
    a = w.abs().tolist()
    return torch.tensor(
        [sum(torch.tensor([row[j] for j in s], dtype=torch.float64).prod().item()
             for s in itertools.combinations(range(len(row)), n + 1)) for row in a],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("n, m", [(1, 4), (2, 4), (3, 6), (4, 8), (2, 8)])
def test_r_nm_matches_subset_enumeration(n, m):
    w = torch.randn(40, m, dtype=torch.float64)
    w[::3, : m - n] = 0.0  # at most n non-zeros: in the null space (Fact fact:nullspace)
    torch.testing.assert_close(r_nm(w, n), _subset_sum(w, n), rtol=1e-12, atol=1e-14)
    assert bool((r_nm(w[::3], n) == 0).all())
    assert bool((r_nm(w[1::3], n) > 0).all())
    if (n, m) == (2, 4):
        torch.testing.assert_close(r_2of4(w), _subset_sum(w, 2), rtol=1e-12, atol=1e-14)


def _penalised_bruteforce(z: torch.Tensor, lam: float, n: int, rho) -> torch.Tensor:
    """min over w of 0.5||w - z||^2 + lam * (sum of rho over the M - n smallest |w_i|): enumerate
    the penalised set P, minimise each coordinate on a fine grid of [0, |z_i|]."""
    m = z.shape[-1]
    t = torch.linspace(0, 1, 4001, dtype=torch.float64)
    grid = z.abs()[..., None] * t  # (B, M, G)
    free = 0.5 * (grid - z.abs()[..., None]).square()
    pen = (free + lam * rho(grid)).amin(-1)  # (B, M)
    best = torch.full(z.shape[:-1], torch.inf, dtype=torch.float64)
    for p in itertools.combinations(range(m), m - n):
        mask = torch.zeros(m, dtype=torch.bool)
        mask[list(p)] = True
        best = torch.minimum(best, torch.where(mask, pen, free.amin(-1)).sum(-1))
    return best


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 6)])
def test_simple_proxes_match_bruteforce(n, m):
    z = torch.randn(150, m, dtype=torch.float64)
    for lam in (0.05, 0.3, 1.0):
        cases = [
            (prox_l1, lambda g: g.abs(), lambda w: w.abs()),
            (prox_l2, lambda g: 0.5 * g.square(), lambda w: 0.5 * w.square()),
            (prox_l0, lambda g: (g != 0).to(g.dtype), lambda w: (w != 0).to(w.dtype)),
        ]
        for prox, rho_grid, rho in cases:
            w = prox(z, lam, n)
            small = w.abs().sort(-1).values[:, : m - n]
            val = 0.5 * (w - z).square().sum(-1) + lam * rho(small).sum(-1)
            ref = _penalised_bruteforce(z, lam, n, rho_grid)
            assert bool((val <= ref + 1e-7 * (1 + ref)).all()), prox.__name__
            assert bool((w.abs() <= z.abs()).all()) and bool((w * z >= 0).all())
            top = z.abs().topk(n, -1).indices
            torch.testing.assert_close(w.gather(-1, top), z.gather(-1, top))


def test_appendix_formulas_on_sorted_cell():
    z = torch.tensor([[1.6, 1.1, 0.8, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(prox_l0(z, 0.1), z)
    torch.testing.assert_close(prox_l0(z, 0.125), z)  # lam = 0.5^2/2 is not above: kept
    torch.testing.assert_close(prox_l0(z, 0.3), torch.tensor([[1.6, 1.1, 0.8, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(prox_l1(z, 0.3), torch.tensor([[1.6, 1.1, 0.5, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(prox_l2(z, 1.0), torch.tensor([[1.6, 1.1, 0.4, 0.25]], dtype=torch.float64))


@pytest.mark.parametrize("m", [3, 4, 6])
def test_prox_1ofm_matches_bruteforce(m):
    g = torch.Generator().manual_seed(m)
    z = torch.randn(400, m, dtype=torch.float64, generator=g)
    z[:50] = 1.0 + 1e-6 * z[:50]  # near-ties
    z[50:100, 1:] = 0.0  # zeros
    lam = 10 ** torch.empty(400, dtype=torch.float64).uniform_(-2, 0.7, generator=g)
    lam[100:120] = 1.0  # the boundary of convexity
    ref = reference_min(z, lam, 1, starts=3, iters=800)
    w = prox_1ofm(z, lam)
    f = objective(w, z, lam, 1)
    assert bool((f <= ref + 1e-9 * (ref.abs() + 1e-12)).all()), float(((f - ref) / ref).max())
    assert bool((w.abs() <= z.abs() + 1e-12).all())
    assert torch.equal(prox_1ofm(z, 0.0), z)


def test_prox_nm_dispatch_and_accuracy():
    z4 = torch.randn(50, 4, dtype=torch.float64)
    assert torch.equal(prox_nm(z4, 0.3, 2), prox_2of4(z4, 0.3))
    assert torch.equal(prox_nm(z4, 0.3, 1), prox_1ofm(z4, 0.3))
    g = torch.Generator().manual_seed(5)
    for n, m in ((2, 5), (3, 5)):
        z = torch.randn(150, m, dtype=torch.float64, generator=g)
        lam = 10 ** torch.empty(150, dtype=torch.float64).uniform_(-1.5, 0.5, generator=g)
        ref = reference_min(z, lam, n, starts=3, iters=800)
        w = prox_nm(z, lam, n)
        f = objective(w, z, lam, n)
        gap = (f - ref) / ref.abs().clamp_min(1e-12)
        assert gap.max() <= 1e-6, f"{n}:{m} worst relative gap {gap.max():.3e}"
        assert bool((w.abs() <= z.abs()).all())
        assert bool(((prox_nm(z, 1e8, n) != 0).sum(-1) <= n).all())
    assert torch.equal(prox_nm(z, 0.0, 3), z)


@pytest.mark.parametrize("fn", [prox_l0, prox_l1, prox_l2, prox_1ofm, prox_nm])
def test_bad_input(fn):
    kw = {"n": 2} if fn is prox_nm else {}
    with pytest.raises(ValueError, match="NaN or Inf"):
        fn(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), 0.1, **kw)
    with pytest.raises(ValueError, match="non-negative"):
        fn(torch.randn(2, 4), -1.0, **kw)
    with pytest.raises(ValueError, match="floating-point"):
        fn(torch.ones(2, 4, dtype=torch.int32), 0.1, **kw)
    if fn is not prox_1ofm:
        with pytest.raises(ValueError, match="n must be"):
            fn(torch.randn(2, 4), 0.1, n=4)


def test_r_bad_input():
    with pytest.raises(ValueError, match="4 weights"):
        r_2of4(torch.randn(2, 5))
    with pytest.raises(ValueError, match="n must be"):
        r_nm(torch.randn(2, 5), 5)
    with pytest.raises(ValueError, match="floating-point"):
        r_nm(torch.ones(2, 5, dtype=torch.int64), 2)
