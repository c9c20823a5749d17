"""DSnoT (Zhang et al., 2024), N:M variant with a Wanda start, following the reference
``prune_DSnoT`` of zyxxmu/DSnoT (cited in paper Section 2).

Training-free prune-and-grow: start from the Wanda mask, then per row repeatedly regrow
one pruned weight and prune one kept weight *of the same cell*, steering the expected
output change ``e_r = sum_{j pruned} W_rj E[x_j]`` of the row towards zero:

* regrow: if ``e_r > 0`` the pruned weight with the largest ``W_rj E[x_j] / Var[x_j]``,
  otherwise the one with the smallest (each candidate list is walked once, in order);
* prune: the kept weight of that cell with the smallest Wanda score that has not been a
  prune candidate before;
* a swap is applied only while ``|e_r|`` exceeds ``update_threshold`` and the swap keeps
  the sign of ``e_r``; a row that fails once stops; at most ``max_cycle_time`` cycles.

``E[x_j]`` is ``input_mean`` and ``Var[x_j] = H_jj - E[x_j]^2`` (``H = X X^T / n`` carries
``E[x_j^2]`` on its diagonal). Without ``input_mean`` every ``e_r`` is 0 and DSnoT returns
the Wanda mask unchanged. Deviations from the reference, which can break N:M: it writes to the
mask of a row also after the row has stopped, and it swaps when a row's candidate list has
run into kept weights (few pruned weights per row against ``max_cycle_time``, e.g.
``d_in`` = 128) or a cell has no kept weight left to prune. Here stopped rows are left
untouched and such a row stops, so the result is always N:M.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linalg import wanda_score
from ..pattern import NMPattern, topn_mask
from ..registry import NonNegativeFloat, NonNegativeInt, register_method


@register_method("dsnot", description="DSnoT: Wanda start + prune-and-grow swaps within cells",
                 statistics=("input_mean",), entry_cost=4.3e-8, rows="independent")
def dsnot(w: Tensor, h: Tensor, pattern: NMPattern, *, input_mean: Tensor | None = None,
          max_cycle_time: NonNegativeInt = 50, update_threshold: NonNegativeFloat = 0.1,
          pow_of_var_regrowing: float = 1.0) -> Tensor:
    """DSnoT N:M pruning; defaults are the reference's recommended settings
    (``max_cycle_time=50, update_threshold=0.1, pow_of_var_regrowing=1``)."""
    d_out, d_in = w.shape
    if input_mean is None:
        mean = torch.zeros(d_in, dtype=w.dtype, device=w.device)
    else:
        if not isinstance(input_mean, Tensor) or input_mean.shape != (d_in,):
            raise ValueError(f"input_mean must be a tensor of shape ({d_in},)")
        if not bool(torch.isfinite(input_mean).all()):
            raise ValueError("input_mean contains NaN or Inf")
        mean = input_mean.to(w.dtype).to(w.device)
    score = wanda_score(w, h)
    keep = topn_mask(score, pattern)
    if d_out == 0 or d_in == 0 or max_cycle_time == 0:
        return w * keep

    contrib = w * mean  # W_rj E[x_j]: what weight j adds to the mean output of row r
    error = (contrib * ~keep).sum(1)  # e_r, pruned contributions
    sign0 = torch.sign(error)
    regrow_metric = contrib * ~keep
    if pow_of_var_regrowing:
        var = (torch.diagonal(h) - mean ** 2).clamp_min(0.0)
        floor = float(var.max()) * 1e-12 if bool((var > 0).any()) else 1.0
        regrow_metric = regrow_metric / var.clamp_min(floor) ** pow_of_var_regrowing
    regrow_order = torch.sort(regrow_metric, dim=1, stable=True).indices
    rows = torch.arange(d_out, device=w.device)
    lo = torch.zeros(d_out, dtype=torch.long, device=w.device)       # next most negative
    hi = torch.full((d_out,), d_in - 1, dtype=torch.long, device=w.device)  # next most positive
    prune_score = torch.where(keep, score, torch.inf)  # only kept weights can be pruned
    active = torch.ones(d_out, dtype=torch.bool, device=w.device)
    m = pattern.m
    offsets = torch.arange(m, device=w.device)
    for _ in range(max_cycle_time):
        if not bool(active.any()):
            break
        positive = error > 0
        pointer = torch.where(positive, hi, lo)
        active = active & (pointer >= 0) & (pointer < d_in)  # a row whose candidates ran out stops
        regrow = regrow_order[rows, pointer.clamp(0, d_in - 1)]
        hi = hi - positive.long()
        lo = lo + (~positive).long()
        cell_start = regrow - regrow % m
        cell_cols = cell_start[:, None] + offsets
        cell_scores = prune_score.gather(1, cell_cols)
        prune = cell_start + cell_scores.argmin(1)
        # a row stops when its candidates on this side run into kept weights, or the cell has
        # no kept weight left that was not a prune candidate: either swap would break N:M
        active = active & ~keep[rows, regrow] & torch.isfinite(cell_scores.min(1).values)
        gain = contrib[rows, prune] - contrib[rows, regrow]
        after = error + gain
        active = active & (error.abs() > update_threshold) & (torch.sign(after) == sign0)
        prune_score[rows, prune] = torch.where(active, torch.inf, prune_score[rows, prune])
        # apply swaps of active rows only (prune first: prune == regrow leaves the weight kept)
        keep[rows[active], prune[active]] = False
        keep[rows[active], regrow[active]] = True
        error = torch.where(active, after, error)
    return w * keep
