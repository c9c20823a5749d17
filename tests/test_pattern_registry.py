import pytest
import torch

from nmprune.pattern import NMPattern, count_dense_cells, from_cells, is_nm_sparse, parse_pattern, to_cells, topn_mask


@pytest.mark.parametrize("text,n,m", [("2:4", 2, 4), (" 4:8 ", 4, 8), ("1:4", 1, 4)])
def test_parse_pattern(text, n, m):
    assert parse_pattern(text) == NMPattern(n, m)


@pytest.mark.parametrize("bad", ["4:4", "0:4", "5:4", "2-4", "a:b", "2:4:8", ""])
def test_parse_pattern_rejects(bad):
    with pytest.raises(ValueError, match="N:M|0 < N < M"):
        parse_pattern(bad)


def test_topn_mask_keeps_largest_and_breaks_ties_by_index():
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.0, 5.0, 5.0, 5.0, 5.0]])
    mask = topn_mask(scores, NMPattern(2, 4))
    assert mask.tolist() == [[False, True, True, False, True, True, False, False]]
    assert is_nm_sparse(scores * mask, "2:4")
    assert not is_nm_sparse(scores, "2:4")


def test_topn_mask_rejects_indivisible_dim():
    with pytest.raises(ValueError, match="not divisible by M=4"):
        topn_mask(torch.ones(2, 6), NMPattern(2, 4))


def test_methods_function_survives_importing_the_algorithms_package():
    import nmprune
    import nmprune.algorithms.prox  # noqa: F401

    assert callable(nmprune.methods)
    assert {"magnitude", "wanda", "sparsegpt", "dsnot", "prox", "prox-l0"} <= set(nmprune.methods())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("pattern", ["2:4", "1:4", "3:8", "5:16"])
def test_topn_mask_matches_a_stable_sort_on_ties_signs_and_infinities(dtype, pattern):
    p = parse_pattern(pattern)
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(64, 32, generator=gen) * torch.randint(0, 3, (64, 32), generator=gen)
    s[:, 3] = s[:, 2]
    s[:, 8:12] = 0.0
    s[:, 16:20] = -0.0
    s[:, 17] = 0.0
    s[5], s[6] = float("inf"), -float("inf")
    s[7, :4] = torch.tensor([-1e-30, -0.0, 1e-30, -3e38])
    s = s.to(dtype)
    cells = to_cells(s.double(), p.m)  # the oracle: a stable descending sort in float64
    order = torch.sort(cells, dim=-1, descending=True, stable=True).indices[..., : p.n]
    expected = from_cells(torch.zeros_like(cells, dtype=torch.bool).scatter_(-1, order, True))
    assert torch.equal(topn_mask(s, p), expected)


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 4), (3, 4), (4, 8), (7, 8), (2, 3), (3, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_count_dense_cells_matches_a_per_cell_count(n, m, dtype):
    """The packed-flags count (M in 1, 2, 4, 8) and the fallback (other M) against counting the
    non-zeros of every cell, on random sparsity, -0.0, NaN-free signs and a transposed view."""
    g = torch.Generator().manual_seed(n * 10 + m)
    w = torch.randn(37, 6 * m, generator=g) * (torch.rand(37, 6 * m, generator=g) > 0.4)
    w[0, :m] = -0.0
    w = w.to(dtype)
    expected = sum(int((row != 0).sum()) > n for row in w.reshape(-1, m))
    assert count_dense_cells(w, NMPattern(n, m)) == expected
    assert count_dense_cells(w.t().contiguous().t(), NMPattern(n, m)) == expected
    assert is_nm_sparse(w, NMPattern(n, m)) == (expected == 0)
