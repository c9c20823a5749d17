"""The Triton 2:4 prox (nmprune.prox.two_four_triton, ``solver="reduced"`` on CUDA), run on CPU
tensors in Triton's interpreter, against the float64 torch solver (solve_sorted_reduced) on the
cells of the other prox tests: Gaussian weight cells around the 2:4 threshold and far below it,
the paper's Figure 1 inputs, near and exact ties, zeros, all-tied cells, scales 1e-3..1e3,
lam 0 and huge lam. Every kernel run happens in one subprocess (tests/prox_triton_worker.py),
which sets TRITON_INTERPRET=1 before it imports triton; nothing here runs the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmprune.prox import prox_2of4
from nmprune.prox.cells import sort_abs, unsort
from nmprune.prox.reduced import solve_sorted_reduced
from prox_bruteforce import objective

pytest.importorskip("triton", reason="triton is not installed (pip install 'nmprune[cuda]')")

WORKER = Path(__file__).resolve().parent / "prox_triton_worker.py"
FIG1 = [[1.6, 1.1, 0.8, 0.5], [1.6, 1.11, 1.1, 1.09], [1.6, 1.59, 1.58, 1.09], [1.6, 1.59, 1.58, 1.57]]
BLOCK = 4096  # cells per program in the interpreter, whose cost is per operation (GPU: 128)
TOL = 1e-5  # relative objective gap allowed for float32 cells (as for the CPU path's float32 test)
W_TOL = 1e-5  # and |w - w_exact| / max|z| (float32 cannot place the birth of a tiny w_3 or w_4)


def _gauss_cells(n: int, seed: int, decades: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian weight cells, lam spread over ``decades`` around the median 2:4 threshold."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 4, dtype=torch.float64, generator=g) * 0.02
    a = z.abs().sort(-1, descending=True).values
    med = (a[:, 2] / (a[:, 0] * a[:, 1])).median()
    return z, med * 10 ** torch.empty(n, dtype=torch.float64).uniform_(*decades, generator=g)


def _hard_cells(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell kinds of test_prox_2of4 and test_prox_reduced, at random scales and signs."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64, generator=g)
    fig = torch.tensor(FIG1, dtype=torch.float64).repeat(100, 1)
    base = torch.rand(400, 1, **f64) + 0.5
    zeros = torch.randn(300, 4, **f64)
    zeros[torch.rand(300, 4, **f64) < 0.35] = 0.0
    top = torch.rand(300, 1, **f64) + 1
    parts = [
        fig,
        torch.randn(500, 4, **f64),
        base + 1e-6 * torch.randn(400, 4, **f64),  # near-ties
        base + 1e-2 * torch.randn(400, 4, **f64),
        base + 1e-4 * torch.rand(400, 4, **f64),
        torch.randint(1, 4, (400, 4), generator=g).to(torch.float64),  # exact ties
        zeros,
        torch.cat([top, top * (1 - 1e-7 * torch.rand(300, 3, **f64))], 1),  # all tied
    ]
    z = torch.cat(parts)
    z = z * torch.where(torch.rand(z.shape, **f64) < 0.5, -1.0, 1.0)
    z = z * 10 ** torch.empty(len(z), 1, dtype=torch.float64).uniform_(-3, 3, generator=g)
    z = z[:, torch.randperm(4, generator=g)]
    zmax = z.abs().amax(-1).clamp_min(1e-30)
    lam = 10 ** torch.empty(len(z), dtype=torch.float64).uniform_(-2, 1.3, generator=g) / zmax
    lam[: len(fig)] = torch.linspace(0.0, 3.0, len(fig), dtype=torch.float64) / zmax[: len(fig)]
    small = 10 ** torch.empty(len(z) // 4, dtype=torch.float64).uniform_(-8, -2, generator=g) / zmax[::4]
    return torch.cat([z, z[::4]]), torch.cat([lam, small])


def _exact(z: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The float64 torch solver (the oracle) on the same (rounded) cells and lam."""
    z64 = z.double()
    a, order = sort_abs(z64)
    return unsort(solve_sorted_reduced(a, lam.double()), order, z64)


def _gap(w: torch.Tensor, z: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Relative objective gap of ``w`` to the exact minimiser (the prox tests' measure)."""
    z64, lam64 = z.double(), lam.double()
    ref = objective(_exact(z, lam), z64, lam64, 2)
    return (objective(w.double(), z64, lam64, 2) - ref) / (ref.abs() + 1e-12 * z64.square().sum(-1) + 1e-300)


def _w_err(w: torch.Tensor, z: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``max |w - w_exact| / max |z|`` per cell."""
    z64 = z.double()
    return (w.double() - _exact(z, lam)).abs().amax(-1) / z64.abs().amax(-1).clamp_min(1e-300)


def _f32(cells: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return cells[0].float(), cells[1].float()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job of the module, run by the interpreter in one subprocess: {name: (inputs, result)}."""
    hard = _f32(_hard_cells(0))
    median = _f32(_gauss_cells(6000, 3, (0.0, 0.0)))
    gauss = torch.randn(600, 4, generator=torch.Generator().manual_seed(7)) * 0.02
    nan = gauss[:8].clone()
    nan[5, 2] = float("nan")
    inf = gauss[:8].clone()
    inf[3, 0] = -float("inf")
    jobs = {
        "hard": ("cells", *hard, BLOCK),
        "matrix": ("cells", *_f32(_gauss_cells(8000, 1, (-1.0, 1.0))), BLOCK),
        "small_lam": ("cells", *_f32(_gauss_cells(3000, 2, (-8.0, -1.0))), BLOCK),
        "median_lam": ("cells", *median, BLOCK),
        "hard_prox": ("prox", *hard, BLOCK),
        "default_block": ("prox", median[0][:300], median[1][:300], None),
        "small_blocks": ("cells", hard[0][::12], hard[1][::12], 8),  # every kind of hard cell
        "loops_small_lam": ("loops", *_f32(_gauss_cells(512, 2, (-8.0, -1.0))), 128),
        "loops_matrix": ("loops", *_f32(_gauss_cells(1024, 1, (-1.0, 1.0))), 128),
        "loops_lam_huge": ("loops", gauss, torch.full((600,), 1e30), 128),
        "nan": ("prox", nan, torch.full((8,), 0.3), BLOCK),
        "inf": ("prox", inf, torch.full((8,), 0.3), BLOCK),
        "empty": ("prox", torch.zeros(0, 4), torch.zeros(0), BLOCK),
        "lam0": ("prox", gauss, torch.zeros(600), BLOCK),
        "lam_huge": ("prox", gauss, torch.full((600,), 1e30), BLOCK),
    }
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        jobs[f"dtype_{dtype}"] = ("prox", gauss.to(dtype), torch.full((600,), 20.0, dtype=torch.float64), BLOCK)
    tmp = tmp_path_factory.mktemp("triton")
    torch.save(jobs, tmp / "jobs.pt")
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp / "jobs.pt"), str(tmp / "results.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(tmp / "results.pt")
    return {name: (job[1:3], results[name]) for name, job in jobs.items()}


@pytest.mark.parametrize("name", ["hard", "matrix", "small_lam", "median_lam"])
def test_decided_cells_match_the_float64_solver(runs, name):
    """Where the kernel decides, its answer is the exact minimiser up to float32 rounding: the
    same objective and point (to TOL, W_TOL), with the signs of z and |w| <= |z|."""
    (z, lam), res = runs[name]
    w, undecided = res["w"], res["undecided"]
    ok = ~undecided
    assert float(_gap(w, z, lam)[ok].abs().max()) <= TOL
    assert float(_w_err(w, z, lam)[ok].max()) <= W_TOL
    assert bool(((w == 0) | (torch.sign(w) == torch.sign(z))).all() and (w.abs() <= z.abs()).all())


def test_every_case_occurs_and_few_cells_are_left_undecided(runs):
    (z, lam), res = runs["matrix"]
    nnz = (res["w"][~res["undecided"]] != 0).sum(-1)
    assert {2, 3, 4} <= set(nnz.unique().tolist())
    for name in ("matrix", "median_lam", "small_lam"):
        assert float(runs[name][1]["undecided"].double().mean()) < 2e-3, name
    assert not bool(runs["small_lam"][1]["undecided"].any())  # dense answers, close to z


def test_undecided_cells_are_resolved_by_the_float64_solver(runs):
    """The adversarial cells leave some cells undecided (near-ties, open dense cases);
    prox_2of4_triton re-solves them, and every cell then has the exact answer."""
    (z, lam), res = runs["hard"]
    undecided = res["undecided"]
    assert 0 < int(undecided.sum()) < 0.05 * len(z)
    w = runs["hard_prox"][1]["w"]
    assert float(_gap(w, z, lam).abs().max()) <= TOL and float(_w_err(w, z, lam).max()) <= W_TOL
    assert torch.equal(w[~undecided], res["w"][~undecided])
    assert torch.equal(w[undecided], _exact(z, lam)[undecided].float())


def test_the_default_block_gives_the_same_answers(runs):
    """The GPU's 128 cells per program (3 programs, the last one part empty) against 4096."""
    (z, lam), res = runs["default_block"]
    ref = runs["median_lam"][1]
    w, undecided = ref["w"][:300], ref["undecided"][:300]
    assert torch.equal(res["w"], torch.where(undecided[:, None], _exact(z, lam).float(), w))


def test_a_cell_answer_does_not_depend_on_the_cells_beside_it(runs):
    """The loops run while any cell of the program needs them: programs of 8 adjacent hard
    cells (most of which skip the dense stage or stop early) give every cell the bits that
    programs of 4096 give it."""
    _, res = runs["small_blocks"]
    ref = runs["hard"][1]
    assert torch.equal(res["undecided"], ref["undecided"][::12])
    assert torch.equal(res["w"][~res["undecided"]], ref["w"][::12][~res["undecided"]])


def test_loop_counts_stay_within_the_caps_and_skip_what_no_cell_needs(runs):
    """``loop_counts``: one row per program of 128 cells, each loop within its cap; the dense
    stage runs where cells are dense (small lam) and nothing iterates where every cell is
    2-sparse (huge lam)."""
    from nmprune.prox.two_four_triton import LOOP_NAMES

    caps = torch.tensor([12, 12, 16, 16 * 8, 16 * 8], dtype=torch.int32)
    for name, programs in (("loops_small_lam", 4), ("loops_matrix", 8), ("loops_lam_huge", 5)):
        loops = runs[name][1]["loops"]
        assert loops.shape == (programs, len(LOOP_NAMES)) and bool((loops >= 0).all() and (loops <= caps).all())
    dense = runs["loops_small_lam"][1]["loops"]
    assert bool((dense[:, 2] >= 1).all() and (dense[:, 3] >= dense[:, 2] - 1).all())
    mixed = runs["loops_matrix"][1]["loops"]
    assert bool((mixed[:, 0] >= 1).all() and (mixed[:, 2] < 16).any())  # 3-sparse roots; dense steps stop early
    assert not bool(runs["loops_lam_huge"][1]["loops"].any())


@pytest.mark.parametrize("name", ["nan", "inf"])
def test_non_finite_input_raises_the_cpu_paths_error(runs, name):
    (z, lam), res = runs[name]
    assert res == {"error": "z contains NaN or Inf"}
    with pytest.raises(ValueError, match="^z contains NaN or Inf$"):
        prox_2of4(z, lam)


def test_dtypes_shapes_and_empty_input(runs):
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        (z, lam), res = runs[f"dtype_{dtype}"]
        w = res["w"]
        assert w.dtype == dtype and w.shape == z.shape
        assert float(_w_err(w, z, lam).max()) <= max(torch.finfo(dtype).eps, W_TOL), dtype
    (z, _), res = runs["empty"]
    assert res["w"].shape == (0, 4) and res["w"].dtype == z.dtype


def test_lam_zero_returns_z_and_huge_lam_the_two_largest(runs):
    (z, _), res = runs["lam0"]
    assert torch.equal(res["w"], z)
    (z, _), res = runs["lam_huge"]
    keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, sort_abs(z)[1][:, :2], True)
    assert torch.equal(res["w"], torch.where(keep, z, 0.0))


def test_the_kernel_compiles_for_an_h200_without_one():
    """Triton's interpreter accepts code its compiler rejects (types carried through the
    loops, for one); the kernel is compiled here for sm_90 in each form the CUDA path and the
    cost benchmark launch (float32 and 16-bit cells; loop counts off and on), without a GPU."""
    code = ("from nmprune.prox.two_four_triton import compile_kernel\n"
            "for cells, loops in (('fp32', False), ('bf16', False), ('fp32', True)):\n"
            "    print(len(compile_kernel(90, cells, loops).asm['cubin']))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    sizes = [int(x) for x in out.stdout.split()]
    assert len(sizes) == 3 and min(sizes) > 10_000


def test_triton_is_imported_only_for_cuda_tensors():
    """A CPU prox never imports triton (the CUDA path imports it on its first call)."""
    code = ("import sys, torch; from nmprune.prox import prox_2of4; "
            "prox_2of4(torch.randn(64, 4), 0.1); prox_2of4(torch.randn(64, 4), 0.1, solver='newton'); "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_prox_uses_the_kernel_and_matches_the_float64_solver():
    z, lam = _f32(_gauss_cells(200_000, 4, (-1.5, 1.5)))
    w = prox_2of4(z.cuda(), lam.cuda()).cpu()
    assert w.dtype == torch.float32 and "nmprune.prox.two_four_triton" in sys.modules
    assert float(_gap(w, z, lam).abs().max()) <= TOL and float(_w_err(w, z, lam).max()) <= W_TOL
