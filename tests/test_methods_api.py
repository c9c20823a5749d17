"""prune_layer / prune_matrix: validation, dtypes, N:M output, edge cases, for every method."""

import pytest
import torch

import nmprune
from nmprune.loss import local_loss
from nmprune.pattern import is_nm_sparse, parse_pattern
from nmprune.solve import LayerResult, prune_layer, prune_matrix
from nmprune.registry import get_method


def correlated_problem(d_out=8, d_in=32, n=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d_in, n, generator=g, dtype=torch.float64)
    x = x + 0.8 * torch.randn(1, n, generator=g, dtype=torch.float64)  # shared factor: correlated inputs
    h = (x @ x.T / n)
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    return w.to(dtype), h.to(dtype)


# a short lambda schedule keeps the proximal methods fast here (their defaults are benchmarked)
FAST = {"lambda_adapt": True, "lambda0": 0.01, "beta": 1.3}


def fast(method):
    return dict(FAST) if method.startswith("prox") else {}


def supported(method, pattern):
    return get_method(method).supports(parse_pattern(pattern))


@pytest.mark.parametrize("method", nmprune.methods())
@pytest.mark.parametrize("pattern", ["2:4", "1:4", "4:8"])
def test_every_method_returns_exact_nm(method, pattern):
    if not supported(method, pattern):
        pytest.skip(f"{method} declares no support for {pattern}")  # declared, not silent
    w, h = correlated_problem()
    res = prune_layer(w, h, method=method, pattern=pattern, refine="gd", refine_steps=20, **fast(method))
    assert isinstance(res, LayerResult)
    assert res.weight.shape == w.shape and res.weight.dtype == w.dtype
    assert is_nm_sparse(res.weight, pattern)
    p = parse_pattern(pattern)
    assert (res.mask.reshape(w.shape[0], -1, p.m).sum(-1) == p.n).all()
    assert not bool(res.weight[~res.mask].any())
    assert res.loss_refined <= res.loss_method * (1 + 1e-5) + 1e-6
    assert res.loss_method == pytest.approx(local_loss(prune_matrix(w, h, method=method, pattern=pattern, **fast(method)), w, h),
                                            rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("method", nmprune.methods())
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_round_trip(method, dtype):
    w, h = correlated_problem(dtype=dtype)
    out = prune_matrix(w, h, method=method, **fast(method))
    assert out.dtype == dtype and out.shape == w.shape and is_nm_sparse(out, "2:4")


@pytest.mark.parametrize("method", nmprune.methods())
def test_singular_hessian_dead_inputs_and_zero_rows(method):
    w, h = correlated_problem(d_in=32, n=8)  # rank 8 < 32: singular
    h[5, :] = 0
    h[:, 5] = 0  # dead input
    h[6:8, :] = 0
    h[:, 6:8] = 0
    w[2] = 0  # all-zero row
    for refine in (None, "gd", *(["exact"] if "exact" in nmprune.refiners() else [])):
        res = prune_layer(w, h, method=method, refine=refine, **fast(method))
        assert is_nm_sparse(res.weight, "2:4") and bool(torch.isfinite(res.weight).all())
        assert not bool(res.weight[2].any())
    zero_h = torch.zeros_like(h)
    assert is_nm_sparse(prune_matrix(w, zero_h, method=method, refine="gd", **fast(method)), "2:4")


def test_bad_inputs_raise_value_errors_naming_the_problem():
    w, h = correlated_problem()
    with pytest.raises(ValueError, match="shapes do not match"):
        prune_matrix(w, h[:-4, :-4])
    with pytest.raises(ValueError, match="not divisible by M=8"):
        prune_matrix(w[:, :28], h[:28, :28], method="wanda", pattern="2:8")
    with pytest.raises(ValueError, match="N:M"):
        prune_matrix(w, h, method="wanda", pattern="4:2")
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="W contains NaN or Inf"):
        prune_matrix(bad, h, method="wanda")
    bad_h = h.clone()
    bad_h[1, 1] = float("inf")
    with pytest.raises(ValueError, match="H contains NaN or Inf"):
        prune_matrix(w, bad_h, method="wanda")
    asym = h.clone()
    asym[0, 1] += 1.0
    with pytest.raises(ValueError, match="H is not symmetric"):
        prune_matrix(w, asym, method="wanda")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        prune_matrix(w, h, method="nope")
    with pytest.raises(ValueError, match="unknown refiner 'nope'"):
        prune_matrix(w, h, method="wanda", refine="nope")
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        prune_matrix(w, h, method="wanda", bogus=1)
    with pytest.raises(ValueError, match="unknown option 'refine_steps'"):
        prune_matrix(w, h, method="wanda", refine_steps=3)
    with pytest.raises(ValueError, match="W must be a matrix"):
        prune_matrix(w[0], h, method="wanda")
    with pytest.raises(ValueError, match="floating-point"):
        prune_matrix(w.to(torch.int64), h, method="wanda")
    with pytest.raises(ValueError, match="option 'refine_steps' of refiner 'gd' must be int >= 0"):
        prune_matrix(w, h, method="wanda", refine="gd", refine_steps=-1)


def test_gd_refinement_decreases_loss_monotonically_and_keeps_mask():
    w, h = correlated_problem(d_out=6, d_in=48, dtype=torch.float64)
    res = prune_layer(w, h, method="wanda")
    cur, prev = res.weight, local_loss(res.weight, w, h)
    refine = nmprune.registry.get_refiner("gd").fn
    for _ in range(30):
        cur = refine(cur, w, h, res.mask, steps=5)
        loss = local_loss(cur, w, h)
        assert loss <= prev * (1 + 1e-12)
        assert not bool(cur[~res.mask].any())
        prev = loss
    assert prev < 0.9 * res.loss_method
