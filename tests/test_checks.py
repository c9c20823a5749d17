"""Input checks of the solvers (:mod:`nmprune.checks`)."""

import pytest
import torch

from nmprune.checks import check_symmetric


@pytest.mark.parametrize("where", [(0, 1), (2400, 10), (10, 2499), (1800, 1799)])
def test_check_symmetric_finds_an_asymmetry_in_any_block_of_rows(where):
    """2500 inputs are checked in two blocks of rows: a flaw in either is found, and a
    symmetric matrix (its largest entry negative) passes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2500, 64, generator=gen)
    h = x @ x.T
    h[5, 5] = -2 * float(h.abs().max())
    check_symmetric("H", h)
    i, j = where
    h[i, j] += 1e-3 * float(h.abs().max())
    with pytest.raises(ValueError, match="H is not symmetric"):
        check_symmetric("H", h)
