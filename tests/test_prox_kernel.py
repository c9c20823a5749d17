"""The compiled 2:4 prox (nmprune.prox.reduced_simd, used by prox_2of4 on CPU) against
the vectorised exact solvers and the float64 brute force: same objective on every cell, a rare
fallback, and the undecided cells handed back for the exact torch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nmprune.prox import prox_2of4, reduced_simd
from nmprune.prox.cells import sort_abs, unsort
from nmprune.prox.newton import solve_sorted_newton
from prox_bruteforce import objective, reference_min


def _matrix_cells(n: int, seed: int, decades: tuple[float, float] = (-1, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian weight cells with lam spread over ``decades`` around the median 2:4 threshold
    ``z3/(z1 z2)`` (by default two decades, where all three cases and the hard dense boundary
    occur)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 4, dtype=torch.float64, generator=g) * 0.02
    a = z.abs().sort(-1, descending=True).values
    lam = (a[:, 2] / (a[:, 0] * a[:, 1])).median() * 10 ** torch.empty(n, dtype=torch.float64).uniform_(*decades, generator=g)
    return z, lam


def _kernel(z: torch.Tensor, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(z)
    undecided = torch.zeros(z.shape[0], dtype=torch.bool)
    reduced_simd.run(z.contiguous().numpy(), lam.contiguous().numpy(), out.numpy(), undecided.numpy())
    return out, undecided


def _newton(z: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    a, order = sort_abs(z)
    return unsort(solve_sorted_newton(a, lam), order, z)


def test_kernel_matches_exact_newton_on_matrix_cells():
    z, lam = _matrix_cells(40_000, 0)
    w, undecided = _kernel(z, lam)
    decided = ~undecided
    assert int(undecided.sum()) < 1e-3 * len(z)  # the torch fallback stays rare
    f_kernel = objective(w, z, lam, 2)
    f_newton = objective(_newton(z, lam), z, lam, 2)
    gap = (f_kernel - f_newton) / f_newton.abs().clamp_min(1e-300)
    assert float(gap[decided].max()) <= 1e-10
    # every case occurs: 2-sparse, 3-sparse and dense answers
    nnz = (w[decided] != 0).sum(-1)
    assert {2, 3, 4} <= set(nnz.unique().tolist())


def test_kernel_keeps_the_dense_answer_for_small_lam():
    """The first proximal-gradient iterations: lam far below the 2:4 threshold, where the
    answer is dense and close to ``z``. The dense case's boxes collapse onto the answer there;
    a strict emptiness test once returned a 3-sparse point for most of these cells."""
    z, lam = _matrix_cells(20_000, 5, decades=(-8, -1))
    w, undecided = _kernel(z, lam)
    assert not bool(undecided.any())
    f_kernel = objective(w, z, lam, 2)
    f_newton = objective(_newton(z, lam), z, lam, 2)
    assert float(((f_kernel - f_newton) / f_newton.abs().clamp_min(1e-300)).max()) <= 1e-10
    assert float(((w != 0).sum(-1) == 4).double().mean()) > 0.9


def test_prox_2of4_cpu_path_resolves_undecided_cells_exactly(monkeypatch):
    """Cells the kernel flags as undecided (rare: near-fold 3-sparse roots) are re-solved by the
    vectorised exact path; force a random tenth of them to be flagged, with garbage output."""
    z, lam = _matrix_cells(4000, 1)
    real_run = reduced_simd.run
    flagged = torch.rand(len(z), generator=torch.Generator().manual_seed(0)) < 0.1

    def flaky_run(zz, ll, out, undecided):
        real_run(zz, ll, out, undecided)
        out[flagged.numpy()] = 123.0
        undecided[flagged.numpy()] = True

    monkeypatch.setattr(reduced_simd, "run", flaky_run)
    w = prox_2of4(z, lam)
    assert not bool((w == 123.0).any())
    sub = flagged.nonzero().squeeze(-1)[:200]
    ref = reference_min(z[sub], lam[sub], 2, iters=1500)
    f = objective(w[sub], z[sub], lam[sub], 2)
    assert float(((f - ref) / ref.abs().clamp_min(1e-300)).max()) <= 1e-9


def test_kernel_leaves_torch_thread_count_alone():
    z, lam = _matrix_cells(1000, 4)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            prox_2of4(z, lam)
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_kernel_forces_loop_interleaving_only_while_it_compiles(monkeypatch):
    import llvmlite.binding as llvm

    calls = []
    monkeypatch.setattr(llvm, "set_option", lambda name, option: calls.append(option))
    monkeypatch.setattr(reduced_simd, "COMPILED_DTYPES", set())  # as if this process had not run it yet
    z, lam = _matrix_cells(1000, 5)
    first = prox_2of4(z, lam)
    assert calls == ["-force-vector-interleave=2", "-force-vector-interleave=0"]  # set, then restored
    assert torch.equal(prox_2of4(z, lam), first)
    assert len(calls) == 2  # later calls of the same dtypes leave LLVM's options alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kernel_keeps_dtype_signs_and_positions(dtype):
    z, lam = _matrix_cells(3000, 2)
    z = z.to(dtype)
    w = prox_2of4(z, lam.to(torch.float64 if dtype == torch.float64 else torch.float32))
    assert w.dtype == dtype and w.shape == z.shape
    assert bool(((w == 0) | (torch.sign(w) == torch.sign(z))).all())
    assert bool((w.abs() <= z.abs()).all())
    # ties and zeros: the permutation reduction must be consistent
    tied = torch.tensor([[1.0, -1.0, 1.0, -1.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.0, -2.0, 0.0]], dtype=dtype)
    wt = prox_2of4(tied, 10.0)
    assert bool(((wt != 0).sum(-1) <= 2).all())
    assert torch.equal(prox_2of4(tied, 0.0), tied)


def test_kernel_threads_give_identical_results():
    z, lam = _matrix_cells(20_000, 3)
    z32 = z.to(torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prox_2of4(z32, lam)
        torch.set_num_threads(2)
        two = prox_2of4(z32, lam)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert np.isfinite(one.numpy()).all()


def test_chunk_size_bounds_and_results_independent_of_it():
    assert reduced_simd.chunk_size(1536 * 576 // 4, 1) == reduced_simd.MAX_CHUNK
    assert reduced_simd.chunk_size(1536 * 576 // 4, 2) == 7900  # 28 chunks, not 27 (the last 2192)
    assert reduced_simd.chunk_size(100, 2) == reduced_simd.MIN_CHUNK
    for cells in (3000, 40_000, 221_184, 1_000_003):
        for threads in (1, 2, 3, 16):
            chunk = reduced_simd.chunk_size(cells, threads)
            count = -(-cells // chunk)
            assert reduced_simd.MIN_CHUNK <= chunk <= max(reduced_simd.MAX_CHUNK, reduced_simd.MIN_CHUNK)
            if cells >= threads * reduced_simd.MIN_CHUNK:  # every thread gets the same number
                assert count % threads == 0 and count * chunk - cells < count
    z, lam = _matrix_cells(20_000, 4)
    outs = []
    for chunk in (reduced_simd.MIN_CHUNK, 3000, reduced_simd.MAX_CHUNK):
        out, undecided = torch.empty_like(z), torch.zeros(z.shape[0], dtype=torch.bool)
        reduced_simd.run(z.numpy(), lam.numpy(), out.numpy(), undecided.numpy(), chunk)
        outs.append((out, undecided))
    for out, undecided in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(undecided, outs[0][1])
    with pytest.raises(ValueError, match="chunk"):  # the work arrays hold MAX_CHUNK cells
        reduced_simd.run(z.numpy(), lam.numpy(), out.numpy(), undecided.numpy(), reduced_simd.MAX_CHUNK + 1)


def test_vectorised_stages_give_the_exact_answers_where_every_stage_occurs():
    """The staged, vectorised pass (reduced_simd) against the exact damped-Newton solver on
    cells where every stage and the per-cell dense fallbacks occur: the same objective to
    1e-12 and the same support."""
    z, lam = _matrix_cells(30_000, 5)
    w, undecided = _kernel(z, lam)
    ref = _newton(z, lam)
    f, f_ref = objective(w, z, lam, 2), objective(ref, z, lam, 2)
    ok = ~undecided
    assert float(((f - f_ref) / f_ref.abs().clamp_min(1e-300))[ok].abs().max()) <= 1e-12
    assert torch.equal(w[ok] != 0, ref[ok] != 0)  # the same support


def _lp_min_reference(cons: np.ndarray, g: np.ndarray) -> float:
    """Minimum of ``g . (x, y)`` over ``{cons[k, 0] x + cons[k, 1] y >= cons[k, 2]}``, by the
    plain loop over every pair of constraint lines (a bounded polygon's optimum is a vertex),
    with the kernel's 1e-9 relative feasibility tolerance; ``inf`` when empty."""
    best = np.inf
    m = len(cons)
    for i in range(m):
        for j in range(i + 1, m):
            (a1, b1, c1), (a2, b2, c2) = cons[i], cons[j]
            det = a1 * b2 - a2 * b1
            if det == 0.0:
                continue
            x, y = (c1 * b2 - c2 * b1) / det, (a1 * c2 - a2 * c1) / det
            if all(a * x + b * y >= c - 1e-9 * (abs(a * x) + abs(b * y) + abs(c)) for a, b, c in cons):
                best = min(best, g[0] * x + g[1] * y)
    return best


def test_unrolled_linear_programme_matches_the_plain_loop():
    """The kernels' LP (reduced_kernel.lp_min_box: the 19 possible vertices of a box cut by
    three half-planes, unrolled) against a plain Python loop over every crossing of the 7 lines
    checked against all 7 constraints, on random polygons, with cuts parallel to the box and
    to each other among them."""
    from numba import njit

    from nmprune.prox.reduced_kernel import lp_min_box

    @njit(error_model="numpy")  # as the kernels: parallel lines divide by zero
    def unrolled(cons, g):
        out = np.empty(cons.shape[0])
        for i in range(cons.shape[0]):
            c = cons[i]
            out[i] = lp_min_box(g[i, 0], g[i, 1], c[0, 2], -c[1, 2], c[2, 2], -c[3, 2],
                                 (c[4, 0], c[4, 1], c[4, 2]), (c[5, 0], c[5, 1], c[5, 2]),
                                 (c[6, 0], c[6, 1], c[6, 2]))
        return out

    rng = np.random.default_rng(0)
    n = 4000
    cons = np.zeros((n, 7, 3))
    lo, hi = rng.uniform(-1, 0, (n, 2)), rng.uniform(0.2, 1, (n, 2))
    cons[:, 0] = np.stack([np.ones(n), np.zeros(n), lo[:, 0]], 1)
    cons[:, 1] = np.stack([-np.ones(n), np.zeros(n), -hi[:, 0]], 1)
    cons[:, 2] = np.stack([np.zeros(n), np.ones(n), lo[:, 1]], 1)
    cons[:, 3] = np.stack([np.zeros(n), -np.ones(n), -hi[:, 1]], 1)
    cons[:, 4:, :2] = rng.normal(size=(n, 3, 2))
    cons[:, 4:, 2] = rng.normal(scale=0.5, size=(n, 3))
    degenerate = np.arange(n) % 8
    cons[degenerate == 1, 4, 0] = 0.0  # a horizontal cut
    cons[degenerate == 2, 5, 1] = 0.0  # a vertical cut
    cons[degenerate == 3, 6, :2] = 2.0 * cons[degenerate == 3, 4, :2]  # two parallel cuts
    g = rng.normal(size=(n, 2))
    ref = np.array([_lp_min_reference(cons[i], g[i]) for i in range(n)])
    out = unrolled(cons, g)
    finite = np.isfinite(ref)
    assert 0.2 * n < finite.sum() < n  # feasible and empty polygons both occur
    for kind in (1, 2, 3):
        assert finite[degenerate == kind].any() and not finite[degenerate == kind].all()
    assert np.array_equal(finite, np.isfinite(out))
    assert np.allclose(ref[finite], out[finite], rtol=1e-12, atol=1e-12)


def test_proven_dense_cells_have_dense_answers_and_the_bound_is_sharper_than_z4_squared():
    """Stage 1 marks a cell dense when ``lam r(z)`` is below a lower bound on every point with a
    zero entry; the float64 brute force must find a dense minimiser for every such cell, and
    the bound must prove more cells than the plain ``z_4^2 / 2``."""
    z, lam = _matrix_cells(3000, 11, decades=(-2.5, 0))
    a = z.abs().sort(-1, descending=True).values
    n = len(z)
    rows = [np.empty(n) for _ in range(10)]
    reduced_simd.load_cells(z.numpy().reshape(-1), lam.numpy(), 0, *rows[:5], np.empty(n, np.int32), *rows[5:])
    dense = torch.from_numpy(rows[9] == 4.0)
    z1, z2, z3, z4 = a.unbind(-1)
    reg = z1 * z2 * (z3 + z4) + z3 * z4 * (z1 + z2)
    old = lam * reg < 0.5 * z4 * z4
    assert bool((old <= dense).all()) and int(dense.sum()) > 1.2 * int(old.sum()) > 0
    # the exact solver's minimisers of the flagged cells are dense and as good as brute force
    f_ref = reference_min(a[dense], lam[dense], 2)
    w = _newton(a[dense], lam[dense])
    assert bool((w != 0).all())
    assert float(((objective(w, a[dense], lam[dense], 2) - f_ref) / f_ref).max()) <= 1e-9


def test_numba_is_loaded_only_when_the_compiled_prox_runs():
    """Every method registers without numba; the first CPU prox loads it (a wanda or sparsegpt
    run never pays for its compiler's memory)."""
    import subprocess
    import sys

    code = ("import sys, torch, nmprune.registry as r; r.methods(); print('numba' in sys.modules); "
            "from nmprune.prox import prox_2of4; prox_2of4(torch.randn(8, 4), 0.1); "
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
