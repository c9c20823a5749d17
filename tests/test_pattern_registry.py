import pytest
import torch

from nmprune.pattern import NMPattern, is_nm_sparse, parse_pattern, topn_mask
from nmprune.registry import Registered, split_options


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


def test_split_options_routes_and_rejects():
    def method(w, h, p, *, alpha=1.0):
        return w

    def refiner(w, ws, h, mask, *, steps=10):
        return w

    m, r = Registered("m", method, ""), Registered("r", refiner, "")
    assert split_options({"alpha": 2, "refine_steps": 3}, m, r) == ({"alpha": 2}, {"steps": 3})
    with pytest.raises(ValueError, match="unknown option 'beta'"):
        split_options({"beta": 2}, m, r)
    with pytest.raises(ValueError, match="unknown option 'refine_steps'"):
        split_options({"refine_steps": 2}, m, None)


def test_methods_function_survives_importing_the_algorithms_package():
    import nmprune
    import nmprune.algorithms.prox  # noqa: F401

    assert callable(nmprune.methods)
    assert {"magnitude", "wanda", "sparsegpt", "dsnot", "prox", "prox-l0"} <= set(nmprune.methods())
