"""The pieces of the reduced 2:4 solver (nmprune.prox.reduced): the 3-sparse scalar equation with
its certificates, the dense 2x2 Newton and the K < 1 condition, against float64 brute force
(tests/prox_bruteforce.py) and the stationarity/Hessian conditions of the paper."""

from __future__ import annotations

import pytest
import torch

from nmprune.prox.problem import grad_hess_2of4, objective_2of4, positive_definite
from nmprune.prox.reduced import dense_point, solve_sorted_reduced, three_sparse_root
from prox_bruteforce import objective, reference_min


def _sorted_cells(n: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted positive cells (generic, near-ties, exact ties) with lam around the thresholds."""
    g = torch.Generator().manual_seed(seed)
    q = n // 3
    base = torch.rand(q, 1, dtype=torch.float64, generator=g) + 0.5
    z = torch.cat([
        torch.rand(n - 2 * q, m, dtype=torch.float64, generator=g) + 1e-3,
        base + 1e-4 * torch.rand(q, m, dtype=torch.float64, generator=g),
        torch.randint(1, 4, (q, m), generator=g).to(torch.float64),
    ])
    z = z.sort(-1, descending=True).values
    lam = 10 ** torch.empty(n, dtype=torch.float64).uniform_(-1.5, 0.7, generator=g) / z[:, 0]
    return z, lam


def test_three_sparse_root_certificates_match_bruteforce():
    z, lam = _sorted_cells(900, 3, 0)
    u, found, none = three_sparse_root(z[:, 0], z[:, 1], z[:, 2], lam)
    assert bool((found & none).sum() == 0)
    assert int((~found & ~none).sum()) <= 2  # undecided cells go to the fallback
    assert found.sum() > 100 and none.sum() > 100
    # the prox of r_{2:3} is the 3-variable problem g (eq. prox_sorted3): its global minimum
    ref = reference_min(z, lam, 2, iters=1500)
    boundary = 0.5 * z[:, 2].square()  # best point with a zero entry: [z1, z2, 0]
    tol = 1e-9 * z.square().sum(-1)
    # none: no interior PSD stationary point, so the global minimum lies on the boundary
    assert bool((ref[none] >= boundary[none] - tol[none]).all())
    # found: a stationary point (eq. stationarity_3sparse) with positive entries and PSD Hessian
    zf, lf, uf = z[found], lam[found], u[found]
    den = 1 - uf * uf
    w = torch.stack(((zf[:, 0] - uf * zf[:, 1]) / den, (zf[:, 1] - uf * zf[:, 0]) / den, uf / lf), -1)
    assert bool((w > 0).all())
    grad, hess = grad_hess_2of4(w, zf, lf)
    assert float((grad.abs().amax(-1) / zf[:, 0]).max()) <= 1e-12
    hess_m = torch.stack([torch.stack([torch.as_tensor(h, dtype=torch.float64).expand(len(w)) for h in row], -1)
                          for row in hess], -2)
    assert float(torch.linalg.eigvalsh(hess_m)[:, 0].min()) >= -1e-12
    # and min(candidate, boundary) is the global minimum of g
    best = torch.minimum(objective_2of4(w, zf, lf), boundary[found])
    assert bool(((best - ref[found]) <= 1e-9 * ref[found].abs() + tol[found]).all())


def test_k_condition_rules_out_3sparse_and_dense():
    """K = lam (z1 + sqrt(z1^2 - z2^2)) / 2 >= 1 leaves only [z1, z2, 0, 0] (brute force)."""
    z, lam = _sorted_cells(600, 4, 1)
    k = lam * (z[:, 0] + (z[:, 0].square() - z[:, 1].square()).sqrt()) / 2
    lam = torch.where(k >= 1, lam, lam * 2.0 / k.clamp_min(1e-12))  # push every cell to K >= 1
    w = solve_sorted_reduced(z, lam)
    assert torch.equal(w[:, 2:], torch.zeros_like(w[:, 2:]))
    ref = reference_min(z, lam, 2, iters=1000)
    f2 = 0.5 * z[:, 2:].square().sum(-1)
    assert bool((ref >= f2 - 1e-9 * z.square().sum(-1)).all())


def test_dense_point_is_the_psd_stationary_point():
    z, lam = _sorted_cells(900, 4, 2)
    lam = lam * 0.3  # mostly dense optima
    w, pd = dense_point(*z.unbind(-1), lam)
    assert pd.sum() > 300
    wp, zp, lp = w[pd], z[pd], lam[pd]
    grad, hess = grad_hess_2of4(wp, zp, lp)
    assert float((grad.abs().amax(-1) / zp[:, 0]).max()) <= 1e-10
    assert bool(positive_definite(hess).all())
    # no dense point beats the global minimum; where the minimum is below every sparse
    # candidate (so it is dense), the dense point is positive and attains it
    ref = reference_min(z, lam, 2, iters=1500)
    f = objective(w, z, lam, 2)
    pos = pd & (w > 0).all(-1)
    scale = ref.abs() + 1e-12 * z.square().sum(-1)
    assert float(((ref - f) / scale)[pos].max()) <= 1e-6
    u, found, _ = three_sparse_root(z[:, 0], z[:, 1], z[:, 2], lam)
    den = 1 - u * u
    w3 = torch.stack(((z[:, 0] - u * z[:, 1]) / den, (z[:, 1] - u * z[:, 0]) / den, u / lam,
                      torch.zeros_like(u)), -1)
    sparse = torch.minimum(0.5 * z[:, 2:].square().sum(-1),
                           torch.where(found, objective_2of4(w3, z, lam), torch.inf))
    dense_opt = ref < sparse - 1e-6 * scale
    assert dense_opt.sum() > 100
    # the plain Newton steps may miss a few (near the PSD boundary): the fallback solves those
    hit = dense_opt & pos
    assert int(hit.sum()) >= 0.95 * int(dense_opt.sum()), (int(hit.sum()), int(dense_opt.sum()))
    assert float(((f - ref) / scale)[hit].max()) <= 1e-6
    # the whole solver is exact on every cell, the missed ones included
    full = objective(solve_sorted_reduced(z, lam), z, lam, 2)
    assert float(((full - ref) / scale).max()) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reduced_equals_newton_on_many_cells(dtype):
    """The two exact solvers agree (same objective) on 20000 mixed cells of both dtypes."""
    from nmprune.prox import prox_2of4

    g = torch.Generator().manual_seed(4)
    z = torch.randn(20000, 4, generator=g, dtype=torch.float64)
    lam = 10 ** torch.empty(20000, dtype=torch.float64).uniform_(-1.5, 1.0, generator=g) / z.abs().amax(-1)
    z, lam = z.to(dtype), lam.to(dtype)
    wr = prox_2of4(z, lam, solver="reduced")
    wn = prox_2of4(z, lam, solver="newton")
    z64, l64 = z.double(), lam.double()
    fr, fn = objective(wr.double(), z64, l64, 2), objective(wn.double(), z64, l64, 2)
    gap = (fr - fn) / (fn.abs() + 1e-12 * z64.square().sum(-1))
    assert float(gap.abs().max()) <= (1e-9 if dtype == torch.float64 else 1e-5)
