"""General N:M prox ``prox_{lam r_{N:M}}`` by case enumeration (Section "Generalization to N:M").

On sorted non-negative cells the optimum is supported on a top-``k`` set (the argument of Lemma
``lemma:sorted_prox`` holds for any N:M). For ``k = N`` the candidate keeps the N largest entries;
for every ``k > N`` the restricted problem ``0.5||w - z_{1:k}||^2 + lam e_{N+1}(w)`` is solved by
the damped Newton method of :mod:`nmprune.prox.newton` (iterates kept positive and inside the
PSD-Hessian region), and the best objective is returned. The paper proves this exact only for
2:4 (the convexity of the PSD region, Lemma ``lem:hessian``, is not known for N > 2); its
accuracy against brute force is measured in ``benchmarks/prox_speed.py``. 2:4 is dispatched to
:func:`prox_2of4` and 1:M to the closed-form :func:`prox_1ofm`.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from .cells import check_cells, check_n, lam_tensor, sort_abs, unsort
from .newton import damped_newton
from .problem import grad_hess_nm
from .regularizers import elementary_symmetric, prox_objective
from .simple import prox_1ofm
from .two_four import prox_2of4


def prox_nm(z: Tensor, lam: float | Tensor, n: int) -> Tensor:
    """Prox of ``lam r_{N:M}`` (eq. ``regularizer_nm``) for every cell ``z[..., :M]``, ``N = n``.

    Exact for 2:4 and 1:M (dispatched); for other patterns a case enumeration whose accuracy is
    measured, not proven. Computes in float64, returns the dtype and device of ``z``.
    """
    check_cells(z)
    m = z.shape[-1]
    check_n(n, m)
    if n == 1:
        return prox_1ofm(z, lam)
    if (n, m) == (2, 4):
        return prox_2of4(z, lam)
    lam_c = lam_tensor(lam, z, torch.float64).reshape(-1)
    zc = z.reshape(-1, m)
    a, order = sort_abs(zc)
    a = a.to(torch.float64)
    w = a.clone()
    w[:, n:] = 0.0
    best = 0.5 * a[:, n:].square().sum(-1)
    obj = partial(prox_objective, n=n)
    gh = partial(grad_hess_nm, n=n)
    for k in range(n + 1, m + 1):
        rows = (a[:, k - 1] > 0).nonzero().squeeze(-1)  # a zero entry never helps
        if rows.numel() == 0:
            continue
        zk, lk = a[rows, :k], lam_c[rows]
        # start inside the PD region: Gershgorin row sums lam (k-1) e_{n-1}(w) <= 1/2
        bound = lk * (k - 1) * elementary_symmetric(zk, n - 1)[:, n - 1]
        c = torch.clamp((0.5 / bound.clamp_min(1e-300)) ** (1.0 / (n - 1)), max=1.0)
        wk = damped_newton(zk, lk, zk * c[:, None], obj, gh)
        fk = obj(wk, zk, lk) + 0.5 * a[rows, k:].square().sum(-1)
        better = fk < best[rows]
        r = rows[better]
        best[r] = fk[better]
        w[r] = 0.0
        w[r, :k] = wk[better]
    return unsort(w.to(z.dtype), order, zc).reshape(z.shape)
