"""The 2:4 prox (nmprune.prox.prox_2of4) against the brute-force float64 reference in
tests/prox_bruteforce.py, plus its structural properties and input checks."""

from __future__ import annotations

import pytest
import torch

from nmprune.prox import prox_2of4, r_2of4
from prox_bruteforce import objective, reference_min

FIG1 = [[1.6, 1.1, 0.8, 0.5], [1.6, 1.11, 1.1, 1.09], [1.6, 1.59, 1.58, 1.09], [1.6, 1.59, 1.58, 1.57]]


def _cells(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard and easy cells of many kinds with lam spread around the critical thresholds."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64, generator=g)
    parts = []
    # the paper's Figure 1 inputs over a dense lam grid (set below), with random signs/orders
    fig = torch.tensor(FIG1, dtype=torch.float64).repeat(60, 1)
    parts.append(fig)
    parts.append(torch.randn(400, 4, **f64))  # generic, mixed signs
    base = torch.rand(300, 1, **f64) + 0.5
    parts.append(base + 1e-6 * torch.randn(300, 4, **f64))  # near-ties
    parts.append(base + 1e-2 * torch.randn(300, 4, **f64))  # near-ties, looser
    ties = torch.randint(1, 4, (200, 4), generator=g).to(torch.float64)  # exact ties
    parts.append(ties * torch.where(torch.rand(200, 4, **f64) < 0.5, -1.0, 1.0))
    zeros = torch.randn(200, 4, **f64)
    zeros[torch.rand(200, 4, **f64) < 0.35] = 0.0  # zeros
    parts.append(zeros)
    top = torch.rand(200, 1, **f64) + 1
    parts.append(torch.cat([top, top * (1 - 1e-7 * torch.rand(200, 3, **f64))], 1))  # all tied
    z = torch.cat(parts)
    z = z * 10 ** torch.empty(len(z), 1, dtype=torch.float64).uniform_(-3, 3, generator=g)  # scales
    z = z[:, torch.randperm(4, generator=g)]
    zmax = z.abs().amax(-1).clamp_min(1e-30)
    # lam in units of 1/max|z| (the prox is scale-covariant: lam ~ z_3/(z_1 z_2))
    lam = 10 ** torch.empty(len(z), dtype=torch.float64).uniform_(-2, 1.3, generator=g) / zmax
    n_fig = fig.shape[0]
    lam[:n_fig] = torch.linspace(0.0, 3.0, n_fig, dtype=torch.float64) / zmax[:n_fig]
    # every third other cell again with a small lam (lam max|z| down to 1e-8): a dense answer
    # close to z, as in the first iterations of the proximal-gradient loop
    small = z[n_fig::3]
    small_lam = 10 ** torch.empty(len(small), dtype=torch.float64).uniform_(-8, -2, generator=g) / zmax[n_fig::3]
    return torch.cat([z, small]), torch.cat([lam, small_lam])


@pytest.fixture(scope="module")
def cells():
    z, lam = _cells(0)
    return z, lam, reference_min(z, lam, 2, iters=1000)


def _rel_gap(w, z, lam, ref):
    f = objective(w.to(torch.float64), z, lam, 2)
    return (f - ref) / (ref.abs() + 1e-12 * z.square().sum(-1) + 1e-300)


@pytest.mark.parametrize("solver", ["reduced", "newton"])
def test_exact_solver_matches_bruteforce_float64(cells, solver):
    z, lam, ref = cells
    gap = _rel_gap(prox_2of4(z, lam, solver=solver), z, lam, ref)
    assert gap.max() <= 1e-6, f"worst relative objective gap {gap.max():.3e}"


@pytest.fixture(scope="module")
def cells32(cells):
    z, lam, _ = cells
    z64 = z.to(torch.float32).to(torch.float64)
    return z64, lam, reference_min(z64, lam, 2, iters=600, seed=1)


@pytest.mark.parametrize("solver", ["reduced", "newton"])
def test_exact_solver_matches_bruteforce_float32(cells32, solver):
    z64, lam, ref = cells32
    z32 = z64.to(torch.float32)
    w = prox_2of4(z32, lam.to(torch.float32), solver=solver)
    assert w.dtype == torch.float32
    # lam rounded to float32 as the solver sees it
    gap = _rel_gap(w, z64, lam.to(torch.float32).to(torch.float64), ref)
    assert gap.max() <= 1e-5, f"worst relative objective gap {gap.max():.3e}"


def test_gd_solver_matches_bruteforce(cells):
    z, lam, ref = cells
    w = prox_2of4(z[:600], lam[:600], solver="gd", gd_max_iter=20000, gd_tol=1e-12)
    gap = _rel_gap(w, z[:600], lam[:600], ref[:600])
    assert gap.max() <= 1e-5, f"worst relative objective gap {gap.max():.3e}"


def test_figure1_paths_and_thresholds():
    z = torch.tensor(FIG1, dtype=torch.float64)
    lam2 = z[:, 2] / (z[:, 0] * z[:, 1])  # Lemma lem:opt_cond_ext: 2-sparse needs lam >= lam2
    below = prox_2of4(z, lam2 * 0.999)
    assert bool((below[:, 2] > 0).all())
    huge = prox_2of4(z, 1e6)
    assert torch.equal(huge[:, 2:], torch.zeros(4, 2, dtype=torch.float64))
    assert torch.equal(huge[:, :2], z[:, :2])


def test_properties_sign_permutation_scaling():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2000, 4, dtype=torch.float64, generator=g)
    lam = 10 ** torch.empty(2000, dtype=torch.float64).uniform_(-1.5, 1, generator=g)
    w = prox_2of4(z, lam)
    # |w_i| <= |z_i| and w_i has the sign of z_i (or is zero)
    assert bool((w.abs() <= z.abs()).all())
    assert bool((w * z >= 0).all())
    # sign and permutation equivariance
    perm = torch.randperm(4, generator=g)
    signs = torch.where(torch.rand(2000, 4, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    torch.testing.assert_close(prox_2of4(signs * z[:, perm], lam), signs * w[:, perm], rtol=1e-9, atol=1e-12)
    # scaling: c w solves (c z, lam / c)
    for c in (1e-3, 7.0, 1e3):
        torch.testing.assert_close(prox_2of4(c * z, lam / c), c * w, rtol=1e-6, atol=1e-9 * c)
    # lam = 0 returns z exactly
    assert torch.equal(prox_2of4(z, 0.0), z)
    # exactly 2-sparse once lam is large (here beyond 9 z3 / (z1 z2))
    a = z.abs().sort(-1, descending=True).values
    big = 9.01 * a[:, 2] / (a[:, 0] * a[:, 1])
    wb = prox_2of4(z, big)
    assert bool(((wb != 0).sum(-1) <= 2).all())
    assert float(r_2of4(wb).abs().max()) == 0.0


def test_shapes_broadcast_dtype_and_no_loop_over_batch_dims():
    z = torch.randn(3, 5, 4, dtype=torch.float32)
    lam = torch.rand(3, 1, dtype=torch.float32)
    w = prox_2of4(z, lam)
    assert w.shape == z.shape and w.dtype == torch.float32
    torch.testing.assert_close(w[1], prox_2of4(z[1], lam[1].expand(5)))


@pytest.mark.parametrize(
    "z, lam, match",
    [
        (torch.randn(3, 5), 0.1, "4 weights"),
        (torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), 0.1, "NaN or Inf"),
        (torch.tensor([[1.0, float("inf"), 0.0, 0.0]]), 0.1, "NaN or Inf"),
        (torch.randn(3, 4), -0.1, "non-negative"),
        (torch.randn(3, 4), float("nan"), "finite"),
        (torch.randn(3, 4), torch.tensor([0.1, -1.0, 0.2]), "non-negative"),
        (torch.randn(3, 4), torch.tensor([1, 2, 3]), "floating-point"),
        (torch.randn(3, 4), torch.rand(2), "broadcast"),
        (torch.ones(3, 4, dtype=torch.int64), 0.1, "floating-point"),
    ],
)
def test_bad_input(z, lam, match):
    with pytest.raises(ValueError, match=match):
        prox_2of4(z, lam)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("solver", ["reduced", "newton"])
def test_non_finite_entries_anywhere_in_a_large_input_are_rejected(dtype, bad, solver):
    """The compiled kernel finds NaN and Inf itself (no separate pass over ``z``): one bad
    entry in a multi-chunk input, in the first or a later chunk, first or last in its cell and
    beside a larger finite entry, still raises."""
    z = torch.randn(3 * 8192 + 5, 4, dtype=torch.float64)
    for row, col in ((20000, 0), (9, 3)):
        bad_z = z.clone()
        bad_z[row, col] = bad
        bad_z[row, (col + 1) % 4] = 5.0  # a NaN is not found by being the largest entry
        with pytest.raises(ValueError, match="z contains NaN or Inf"):
            prox_2of4(bad_z.to(dtype), torch.full((z.shape[0],), 0.3), solver=solver)
    assert torch.isfinite(prox_2of4(z.to(dtype), 0.3, solver=solver)).all()


def test_bad_solver_options():
    with pytest.raises(ValueError, match="solver"):
        prox_2of4(torch.randn(2, 4), 0.1, solver="bfgs")
    with pytest.raises(ValueError, match="gd_max_iter"):
        prox_2of4(torch.randn(2, 4), 0.1, solver="gd", gd_max_iter=0)
