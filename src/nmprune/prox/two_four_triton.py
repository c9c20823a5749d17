"""The exact 2:4 prox (``solver="reduced"``) as a Triton kernel: the path of
:func:`nmprune.prox.prox_2of4` for float32, bfloat16 and float16 CUDA tensors.

One program takes ``BLOCK`` cells (one per thread) and runs, in float32, the case analysis of
the CPU kernel (:mod:`nmprune.prox.reduced_simd`; Algorithm
``alg:prox_enumerate``, derivations in ``docs/prox.md``): ``|z|`` of each cell sorted by a
sorting network (Lemma ``lemma:sorted_prox``) and scaled by a power of two (exact) to
``1 <= z_1 < 2``; the 2-sparse point ``[z_1, z_2, 0, 0]``; the PSD stationary point of ``g``
(eq. ``prox_sorted3``) by monotone Newton on ``Phi(u) = 0`` (``u = lam w_3``, eq.
``stationarity_3sparse``); and, unless ``K >= 1``, the necessary conditions or the KKT
certificate of the best sparse point (eq. ``hessian_4sparse``) rule it out, the dense case:
damped Newton on the convex reduced problem ``min_R G`` (Lemma ``lem:hessian``), whose
interior stationary point is the PSD stationary point of ``f`` (eq. ``prox_sorted``,
Corollary ``corollary:no_spurious``), with the case and ``(x, y)`` boxes and the convexity
lower bound that prove for most cells that no dense point beats the best sparse one. The best
candidate is polished by one fixed-point step where that contracts, and mapped back to the
positions and signs of ``z``. Each loop runs while any cell of the program still needs it
(at most its cap: ``ITER_3SPARSE``, ...): a program skips the dense stage when none of its cells
is open to it, and stops it when every open cell is settled. A settled cell keeps its point, so
its answer does not depend on the cells beside it. On real layers this takes a tenth of the
instructions of running every loop to its cap (``benchmarks/results/prox_kernel_cost.md``).

Cells the kernel cannot settle in float32 are flagged undecided, and :func:`prox_2of4_triton`
re-solves them with the float64 torch solver :func:`nmprune.prox.reduced.solve_sorted_reduced`:
3-sparse Newton not converged; dense case neither solved nor ruled out (the CPU kernel's
per-cell fallbacks are not here); two candidates whose objectives float32 cannot separate
(the difference, summed as terms proportional to the difference of the points, within
``MARGIN`` times its rounding-error bound); NaN or Inf (the wrapper raises); a largest ``|z|``
outside ``[2^-126, 2^127)``.

Imported only when a CUDA tensor arrives, or by tests that set ``TRITON_INTERPRET=1`` before
triton is imported, to run the kernel on CPU tensors in Triton's interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..checks import non_finite_error
from .cells import sort_abs, unsort
from .reduced import solve_sorted_reduced

BLOCK = 128  # cells per program, one per thread of 4 warps (sm_90: 96 registers, no spills; not timed)
ITER_3SPARSE = tl.constexpr(12)  # Newton steps on Phi(u) = 0
ITER_CONVEX = tl.constexpr(16)  # damped Newton steps on min_R G
CONVEX_PULLS = tl.constexpr(12)  # halvings of the start towards the origin, into R
CONVEX_HALVINGS = tl.constexpr(8)  # backtracking steps of the line search and of the slide
LP_TOL = tl.constexpr(1e-5)  # relative feasibility tolerance of the LP's vertices
STEP_TOL = tl.constexpr(1e-5)  # converged: a relative Newton step below this, ...
RES_TOL = tl.constexpr(1e-6)  # ... or (3-sparse, roots u ~ 0) a residual at float32 rounding
UMAX_SLACK = tl.constexpr(1e-5)  # see _three_sparse
# comparisons of objectives closer than MARGIN x their rounding-error bound (~80 ulps) are not
# trusted: near-ties (undecided), the convexity bound (no proof), the line search (accepted)
MARGIN = tl.constexpr(1e-5)
BOX_ROUNDS = tl.constexpr(4)  # rounds of the case box (reduced_kernel.case_box)
XY_ROUNDS = tl.constexpr(3)  # rounds of the (x, y) box (reduced_kernel.xy_box)
BOX_SLACK = tl.constexpr(1e-5)  # the boxes widened by this much of the cell's scale


@triton.jit
def _any(flags):
    """Is any of the program's ``flags`` set? (The loops below run while one of their cells
    still needs them: a cell's answer never depends on the other cells of its program.)"""
    return tl.max(flags.to(tl.int32), axis=0) > 0


@triton.jit
def _pd4(lam, w1, w2, w3, w4):
    """Is the Hessian of ``f`` (eq. ``hessian_4sparse``: unit diagonal, ``h_ij = lam (w_k + w_l)``)
    positive definite? Sylvester's criterion, as :func:`nmprune.prox.reduced_kernel.pd4`."""
    a = lam * (w3 + w4)
    b = lam * (w2 + w4)
    c = lam * (w2 + w3)
    d = lam * (w1 + w4)
    e = lam * (w1 + w3)
    f = lam * (w1 + w2)
    m2 = 1.0 - a * a
    m3 = m2 - b * b - d * d + 2.0 * a * b * d
    m4 = (m3 - c * c * (1.0 - d * d) - e * e * (1.0 - b * b) - f * f * m2
          + 2.0 * (c * e * (a - b * d) + c * f * (b - a * d) + e * f * (d - a * b)))
    return (m2 > 0.0) & (m3 > 0.0) & (m4 > 0.0)


@triton.jit
def _phi(u, big_a, big_b, c):
    """``(Phi(u), Phi'(u), the magnitude of its terms)`` of
    ``Phi(u) = u + (A^2/(1+u)^2 - B^2/(1-u)^2)/4 - c`` (``A = lam S``, ``B = lam D``, ``c = lam z_3``)."""
    ip = 1.0 / (1.0 + u)
    im = 1.0 / (1.0 - u)
    aa = big_a * ip
    aa = aa * aa
    bb = big_b * im
    bb = bb * bb
    return u + (aa - bb) * 0.25 - c, 1.0 - (aa * ip + bb * im) * 0.5, tl.abs(u) + (aa + bb) * 0.25 + c


@triton.jit
def _three_sparse(a1, a2, a3, lam, run):
    """``(u, found, none, K, steps)`` of :func:`nmprune.prox.reduced.three_sparse_root`: monotone Newton
    on ``Phi(u) = 0`` (``u = lam w_3``, eq. ``stationarity_3sparse``) from the inflection point
    ``u*``, or from ``c = lam z_3`` where the root lies left of ``u*`` (``Phi`` convex) and
    ``c < u*``: every valid root is below ``c``, and a root near 0 is then not lost to the
    rounding of ``u* - step``. ``none`` where it is proven that no valid PSD root exists
    (``K >= 1``, or an iterate leaves the region that holds it). Only the ``run`` cells iterate,
    each until one step after it converged (then it stays where it is) or until it is ruled
    out, at most ``ITER_3SPARSE`` steps; ``steps``: how many the program took."""
    s = a1 + a2
    d = a1 - a2
    root = tl.sqrt(d * s)
    u = (s - root) / (s + root)
    k = lam * (a1 + root) * 0.5
    big_a = lam * s
    big_b = lam * d
    c = lam * a3
    # valid roots: u < z_2/z_1 (w_2 > 0), and so u < c (w_3 < z_3); float32 rounding can put
    # a root at c itself (lam^2 w_1 w_2 below c's ulp), hence the slack
    c_up = c * (1.0 + UMAX_SLACK)
    umax = tl.minimum(a2 / a1, c_up)
    phi = u + k * (big_a - big_b) * 0.25 - c  # at u*
    left = phi > 0.0  # the root lies left of u*, else right of it (Phi concave there)
    from_c = left & (c_up < u)
    phi_c, dphi_c, mag = _phi(c_up, big_a, big_b, c)
    u = tl.where(from_c, c_up, u)
    phi = tl.where(from_c, phi_c, phi)
    dphi = tl.where(from_c, dphi_c, 1.0 - k * k)
    # from c: Phi < 0 puts the root beyond c, Phi' <= 0 every point left of c outside the PSD region
    none = (k >= 1.0) | (from_c & ((phi < 0.0) | (dphi <= 0.0))) | (~left & (u >= umax))
    step = tl.zeros_like(u)
    converged = tl.zeros_like(u) > 0.0
    active = run & ~none
    steps = 0
    go = _any(active)
    while go:
        step = tl.where(active, phi / dphi, step)
        u = tl.where(active, u - step, u)
        phi_u, dphi_u, mag_u = _phi(u, big_a, big_b, c)
        phi = tl.where(active, phi_u, phi)
        dphi = tl.where(active, dphi_u, dphi)
        mag = tl.where(active, mag_u, mag)
        # left of u* the iterates stay above the root, right of it below (tangent lines)
        none = none | (active & (tl.where(left, u <= 0.0, u >= umax) | (dphi <= 0.0)))
        polished = active & converged  # one step past convergence: float32's accuracy
        converged = ~none & ((tl.abs(step) <= STEP_TOL * u) | (tl.abs(phi) <= RES_TOL * mag))
        active = active & ~none & ~polished
        steps += 1
        go = _any(active) & (steps < ITER_3SPARSE)
    invalid = converged & ((u <= 0.0) | (u >= umax))
    return u, converged & ~invalid, none | invalid, k, steps


@triton.jit
def _g_derivs(x, y, s1, s2, d1, d2):
    """Half the gradient and half the Hessian of ``G`` (:mod:`nmprune.prox.reduced`):
    ``(g1, g2, h11, h12, h22)``."""
    r = 1.0 / ((1.0 - x) * (1.0 - y))
    ix = (1.0 - y) * r
    iy = (1.0 - x) * r
    e2 = d2 * ix
    e1 = d1 * iy
    g1 = x - s1 + x * y + 0.5 * (y * y - e2 * e2)
    g2 = y - s2 + x * y + 0.5 * (x * x - e1 * e1)
    return g1, g2, 1.0 + y - e2 * e2 * ix, x + y, 1.0 + x - e1 * e1 * iy


@triton.jit
def _g_value(x, y, s1, s2, d1, d2):
    """``(G(x, y), the sum of the magnitudes of its terms)``: the dense objective minimised over
    the differences ``w_1 - w_2``, ``w_3 - w_4`` is ``G / (4 lam^2)``."""
    p = (x - s1) * (x - s1) + (y - s2) * (y - s2) + x * y * (x + y)
    q = d1 * d1 * y / (1.0 - y) + d2 * d2 * x / (1.0 - x)
    return p - q, tl.abs(p) + tl.abs(q)


@triton.jit
def _in_r(x, y, s1, s2, d1, d2):
    """Is ``(x, y)`` in ``R = {x, y < 1, grad^2 G > 0}`` (convex; the image of the region where
    the Hessian of ``f`` is positive definite, Lemma ``lem:hessian``; ``G`` is convex on it)?"""
    _, _, h11, h12, h22 = _g_derivs(x, y, s1, s2, d1, d2)
    return (x < 1.0) & (y < 1.0) & (h11 > 0.0) & (h11 * h22 - h12 * h12 > 0.0)


@triton.jit
def _phi_grad(x, y, h11, h12, h22, d1, d2):
    """``(dphi/dx, dphi/dy, phi)`` of the concave ``phi = sqrt(h11 h22) - (x + y)``, positive on ``R``."""
    root = tl.sqrt(h11 * h22)
    ix = 1.0 / (1.0 - x)
    iy = 1.0 / (1.0 - y)
    ax = (h22 * (-3.0 * d2 * d2 * ix * ix * ix * ix) + h11) / (2.0 * root) - 1.0
    ay = (h22 + h11 * (-3.0 * d1 * d1 * iy * iy * iy * iy)) / (2.0 * root) - 1.0
    return ax, ay, root - h12


@triton.jit
def _meets(a, b, c, x, y):
    """``a x + b y >= c``, up to a relative ``LP_TOL`` (a looser LP only weakens the bound)."""
    return a * x + b * y >= c - LP_TOL * (tl.abs(a * x) + tl.abs(b * y) + tl.abs(c))


@triton.jit
def _within(v, lo, hi):
    """``lo <= v <= hi`` with :func:`_meets`'s tolerance; False for an infinite or NaN ``v``."""
    return ((v >= lo - LP_TOL * (tl.abs(v) + tl.abs(lo))) & (v <= hi + LP_TOL * (tl.abs(v) + tl.abs(hi)))
            & (tl.abs(v) < float("inf")))


@triton.jit
def _edge_vertex(fixed, rb, a, c, lo, hi, e1, e2, e3, f1, f2, f3, g_fixed, g_free, SWAP: tl.constexpr):
    """``g.(x, y)`` where the line ``a fixed + b free = c`` (``rb = 1/b``) meets the box edge
    at ``fixed`` if ``free`` is in ``[lo, hi]`` and the point meets the cuts ``e``, ``f``;
    else inf (``SWAP``: ``fixed`` is ``y``)."""
    free = (c - a * fixed) * rb
    if SWAP:
        ok = _meets(e1, e2, e3, free, fixed) & _meets(f1, f2, f3, free, fixed)
    else:
        ok = _meets(e1, e2, e3, fixed, free) & _meets(f1, f2, f3, fixed, free)
    return tl.where(ok & _within(free, lo, hi), g_fixed * fixed + g_free * free, float("inf"))


@triton.jit
def _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, a, b, c, e1, e2, e3, f1, f2, f3):
    """The smallest ``g.(x, y)`` over the feasible points where the line of the cut ``(a, b, c)``
    meets the box edges or the line of the cut ``e`` (inf where none is)."""
    rb = 1.0 / b
    ra = 1.0 / a
    low = tl.minimum(_edge_vertex(xlo, rb, a, c, ylo, yhi, e1, e2, e3, f1, f2, f3, g1, g2, False),
                     _edge_vertex(xhi, rb, a, c, ylo, yhi, e1, e2, e3, f1, f2, f3, g1, g2, False))
    low = tl.minimum(low, _edge_vertex(ylo, ra, b, c, xlo, xhi, e1, e2, e3, f1, f2, f3, g2, g1, True))
    low = tl.minimum(low, _edge_vertex(yhi, ra, b, c, xlo, xhi, e1, e2, e3, f1, f2, f3, g2, g1, True))
    det = a * e2 - e1 * b
    x = (c * e2 - e3 * b) / det
    y = (a * e3 - e1 * c) / det
    ok = (det != 0.0) & _within(x, xlo, xhi) & _within(y, ylo, yhi) & _meets(f1, f2, f3, x, y)
    return tl.minimum(low, tl.where(ok, g1 * x + g2 * y, float("inf")))


@triton.jit
def _corner(x, y, g1, g2, a1, a2, a3, b1, b2, b3, c1, c2, c3):
    """``g1 x + g2 y`` at the box corner ``(x, y)`` if it meets the three cuts, else inf."""
    ok = _meets(a1, a2, a3, x, y) & _meets(b1, b2, b3, x, y) & _meets(c1, c2, c3, x, y)
    return tl.where(ok, g1 * x + g2 * y, float("inf"))


@triton.jit
def _lp_min_box(g1, g2, xlo, xhi, ylo, yhi, a1, a2, a3, b1, b2, b3, c1, c2, c3):
    """Minimum of ``g1 x + g2 y`` over the box cut by the half-planes ``a1 x + a2 y >= a3``,
    ``b..``, ``c..`` (inf when empty), at the 19 crossings of its lines that can be vertices
    (:func:`nmprune.prox.reduced_kernel.lp_min_box`)."""
    low = tl.minimum(tl.minimum(_corner(xlo, ylo, g1, g2, a1, a2, a3, b1, b2, b3, c1, c2, c3),
                                _corner(xlo, yhi, g1, g2, a1, a2, a3, b1, b2, b3, c1, c2, c3)),
                     tl.minimum(_corner(xhi, ylo, g1, g2, a1, a2, a3, b1, b2, b3, c1, c2, c3),
                                _corner(xhi, yhi, g1, g2, a1, a2, a3, b1, b2, b3, c1, c2, c3)))
    low = tl.minimum(low, _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, a1, a2, a3, b1, b2, b3, c1, c2, c3))
    low = tl.minimum(low, _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, b1, b2, b3, c1, c2, c3, a1, a2, a3))
    low = tl.minimum(low, _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, c1, c2, c3, a1, a2, a3, b1, b2, b3))
    return tl.where((xlo <= xhi) & (ylo <= yhi), low, float("inf"))


@triton.jit
def _dense(a1, a2, a3, a4, lam, target, xlo, xhi, ylo, yhi, open4):
    """The dense case on ``G(x, y)`` (``x = lam (w_1 + w_2)``, ``y = lam (w_3 + w_4)``): damped
    Newton on the convex problem ``min_R G`` from ``(S_1, S_2)/2`` pulled into ``R``, with the
    line search and the slide along the boundary of ``R`` of the CPU kernel's convex stage
    (:mod:`nmprune.prox.reduced_simd`), and at every iterate its lower bound
    ``G(p) + grad G(p).(q - p)`` over the box ``xlo..yhi`` (which holds every dense PSD
    stationary point with ``w_2, w_4 > 0``) cut by tangents of ``phi >= 0``, ``w_4 >= 0``,
    ``w_2 >= 0``. Returns ``(w_1..w_4, state)``: state 1 an interior stationary point (the
    unique PSD stationary point of ``f``, Corollary ``corollary:no_spurious``; ``w`` after one
    more Newton step), 3 proven that no dense point beats ``target`` (``4 lam^2`` times the
    best sparse objective), 0 or 2 undecided, 4 not run (``open4`` False); then the program's
    counts of pulls, Newton steps, line-search trials and slide trials. Every loop stops once
    none of its cells needs it: the ``open4`` cells are the only ones that hold it."""
    s1 = lam * (a1 + a2)
    s2 = lam * (a3 + a4)
    d1 = lam * (a1 - a2)
    d2 = lam * (a3 - a4)
    x = 0.5 * s1
    y = 0.5 * s2
    inside = _in_r(x, y, s1, s2, d1, d2)
    pulls = 0
    go = _any(open4 & ~inside)
    while go:  # R is convex and holds the origin (d1, d2 < 1)
        x = tl.where(inside, x, 0.5 * x)
        y = tl.where(inside, y, 0.5 * y)
        inside = _in_r(x, y, s1, s2, d1, d2)
        pulls += 1
        go = _any(open4 & ~inside) & (pulls < CONVEX_PULLS)
    state = tl.where(open4, 0.0, 4.0)
    steps = 0
    trials = 0
    slides = 0
    go = _any(state == 0.0)
    while go:
        g1, g2, h11, h12, h22 = _g_derivs(x, y, s1, s2, d1, d2)
        det = h11 * h22 - h12 * h12
        dx = (h12 * g2 - h22 * g1) / det
        dy = (h12 * g1 - h11 * g2) / det
        gv, gabs = _g_value(x, y, s1, s2, d1, d2)
        inside = (x < 1.0) & (y < 1.0) & (h11 > 0.0) & (det > 0.0)
        ax, ay, phi = _phi_grad(x, y, h11, h12, h22, d1, d2)
        ix = 1.0 / (1.0 - x)
        iy = 1.0 / (1.0 - y)
        low = _lp_min_box(g1, g2, xlo, xhi, ylo, yhi, ax, ay, ax * x + ay * y - phi,  # phi >= 0
                          -d2 * ix * ix, 1.0, d2 * ix - d2 * ix * ix * x,  # y >= d2 / (1 - x)
                          1.0, -d1 * iy * iy, d1 * iy - d1 * iy * iy * y)  # x >= d1 / (1 - y)
        bound = gv - 2.0 * (g1 * x + g2 * y) + 2.0 * low
        margin = MARGIN * (gabs + target + 4.0 * (tl.abs(g1) + tl.abs(g2)))
        done = inside & (tl.abs(dx) + tl.abs(dy) <= STEP_TOL * (x + y))
        new = tl.where(done, 1.0, tl.where(bound > target + margin, 3.0, tl.where(inside, 0.0, 2.0)))
        state = tl.where(state == 0.0, new, state)
        # backtracking from the Newton step (Armijo, up to G's rounding), then the slide
        dec = -(g1 * dx + g2 * dy)
        xn = x
        yn = y
        moved = state != 0.0
        t = 1.0
        halvings = 0
        more = _any(~moved)
        while more:
            cx = x + t * dx
            cy = y + t * dy
            gn = _g_value(cx, cy, s1, s2, d1, d2)[0]
            ok = ~moved & _in_r(cx, cy, s1, s2, d1, d2) & (gn <= gv - 2e-4 * t * dec + MARGIN * gabs)
            xn = tl.where(ok, cx, xn)
            yn = tl.where(ok, cy, yn)
            moved = moved | ok
            t = t * 0.5
            halvings += 1
            more = _any(~moved) & (halvings < CONVEX_HALVINGS)
        trials += halvings
        # near the boundary of R, where grad^2 G turns singular, Newton steps are cut short:
        # minus the gradient projected onto the tangent of phi = 0 slides along it
        proj = (g1 * ax + g2 * ay) / (ax * ax + ay * ay)
        tx = proj * ax - g1
        ty = proj * ay - g2
        norm = tl.sqrt(tx * tx + ty * ty)
        ts = tl.where(norm > 0.0, 0.1 / norm, 0.0)
        halvings = 0
        more = _any(~moved)
        while more:
            cx = x + ts * tx
            cy = y + ts * ty
            gn = _g_value(cx, cy, s1, s2, d1, d2)[0]
            ok = ~moved & _in_r(cx, cy, s1, s2, d1, d2) & (gn < gv)
            xn = tl.where(ok, cx, xn)
            yn = tl.where(ok, cy, yn)
            moved = moved | ok
            ts = ts * 0.5
            halvings += 1
            more = _any(~moved) & (halvings < CONVEX_HALVINGS)
        slides += halvings
        state = tl.where((state == 0.0) & ~moved, 2.0, state)  # stalled
        x = tl.where(state == 0.0, xn, x)
        y = tl.where(state == 0.0, yn, y)
        steps += 1
        go = _any(state == 0.0) & (steps < ITER_CONVEX)
    g1, g2, h11, h12, h22 = _g_derivs(x, y, s1, s2, d1, d2)
    det = h11 * h22 - h12 * h12
    x = x + (h12 * g2 - h22 * g1) / det
    y = y + (h12 * g1 - h11 * g2) / det
    p = x / lam
    q = y / lam
    da = (a1 - a2) / (1.0 - y)
    db = (a3 - a4) / (1.0 - x)
    return (p + da) * 0.5, (p - da) * 0.5, (q + db) * 0.5, (q - db) * 0.5, state, pulls, steps, trials, slides


@triton.jit
def _case_box(a1, a2, a3, a4, lam):
    """Bounds ``lo <= w <= hi`` on every interior minimiser of the dense case, propagated
    through the stationarity equations from the PSD bounds ``w_1 >= z_1/3, w_2 >= z_2/3``
    (:func:`nmprune.prox.reduced_kernel.case_box`), widened by ``BOX_SLACK``; ``ok`` False
    proves that there is none. Returns ``(ok, lo_1 + lo_2, hi_1 + hi_2, lo_3 + lo_4, hi_3 + hi_4)``."""
    l1 = a1 / 3.0
    l2 = a2 / 3.0
    l3 = tl.zeros_like(a1)
    l4 = tl.zeros_like(a1)
    h1 = a1
    h2 = a2
    h3 = a3
    h4 = a4
    for _ in range(BOX_ROUNDS):
        h1 = tl.minimum(h1, a1 - lam * (l2 * l3 + l2 * l4 + l3 * l4))
        h2 = tl.minimum(h2, a2 - lam * (l1 * l3 + l1 * l4 + l3 * l4))
        h3 = tl.minimum(h3, a3 - lam * (l1 * l2 + l1 * l4 + l2 * l4))
        h4 = tl.minimum(h4, a4 - lam * (l1 * l2 + l1 * l3 + l2 * l3))
        l1 = tl.maximum(l1, a1 - lam * (h2 * h3 + h2 * h4 + h3 * h4))
        l2 = tl.maximum(l2, a2 - lam * (h1 * h3 + h1 * h4 + h3 * h4))
        l3 = tl.maximum(l3, a3 - lam * (h1 * h2 + h1 * h4 + h2 * h4))
        l4 = tl.maximum(l4, a4 - lam * (h1 * h2 + h1 * h3 + h2 * h3))
    t = BOX_SLACK * a1
    l1 = tl.maximum(l1 - t, 0.0)
    l2 = tl.maximum(l2 - t, 0.0)
    l3 = tl.maximum(l3 - t, 0.0)
    l4 = tl.maximum(l4 - t, 0.0)
    h1 = h1 + t
    h2 = h2 + t
    h3 = h3 + t
    h4 = h4 + t
    ok = (h4 > 0.0) & (l1 <= h1) & (l2 <= h2) & (l3 <= h3) & (l4 <= h4)
    return ok, l1 + l2, h1 + h2, l3 + l4, h3 + h4


@triton.jit
def _cbrt_below(q):
    """A lower bound on ``q^(1/3)`` (:func:`nmprune.prox.reduced_kernel._cbrt_below`)."""
    t = (q + 2.0) * (1.0 / 3.0)
    t = (2.0 * t + q / (t * t)) * (1.0 / 3.0)
    t = (2.0 * t + q / (t * t)) * (1.0 / 3.0)
    return q / (t * t)


@triton.jit
def _xy_box(s1, s2, d1, d2, xlo, xhi, ylo, yhi):
    """The box on ``(x, y)`` of a dense PSD stationary point with ``w_2, w_4 > 0``, tightened
    by its necessary conditions (:func:`nmprune.prox.reduced_kernel.xy_box`) and widened by
    ``BOX_SLACK``; empty where there is no such point."""
    xhi = tl.minimum(xhi, 1.0)
    yhi = tl.minimum(yhi, 1.0)
    for _ in range(XY_ROUNDS):
        xhi = tl.minimum(tl.minimum(xhi, s1 / (1.0 + ylo)), 1.0 - _cbrt_below(d2 * d2 / (1.0 + yhi)))
        yhi = tl.minimum(tl.minimum(yhi, s2 / (1.0 + xlo)), 1.0 - _cbrt_below(d1 * d1 / (1.0 + xhi)))
        xlo = tl.maximum(tl.maximum(xlo, d1 / (1.0 - ylo)), (s1 - 0.5 * yhi * yhi) / (1.0 + yhi))
        ylo = tl.maximum(tl.maximum(ylo, d2 / (1.0 - xlo)), (s2 - 0.5 * xhi * xhi) / (1.0 + xhi))
    t = BOX_SLACK * (s1 + s2)
    return xlo - t, xhi + t, ylo - t, yhi + t


@triton.jit
def _gap(p1, p2, p3, p4, q1, q2, q3, q4, a1, a2, a3, a4, lam):
    """``(f(p) - f(q), err)`` (eq. ``def_f_w``): the difference as ``sum_i (p_i - q_i) t_i``,
    ``t_i = (p_i + q_i)/2 - a_i + lam e_2(...)`` (``r_{2:4}`` is affine in each coordinate:
    changed one coordinate at a time), so that its rounding error is a few float32 ulps of
    ``err = sum_i |p_i - q_i| (|(p_i + q_i)/2 - a_i| + a_i + lam e_2)``, and vanishes with
    ``p - q`` (where a 3-sparse or dense point is born from a sparser one).
    A point computed with a small error changes ``f`` only to second order (every candidate is
    stationary on its support, and its zeros are exact)."""
    d1 = p1 - q1
    d2 = p2 - q2
    d3 = p3 - q3
    d4 = p4 - q4
    m1 = 0.5 * (p1 + q1) - a1
    m2 = 0.5 * (p2 + q2) - a2
    m3 = 0.5 * (p3 + q3) - a3
    m4 = 0.5 * (p4 + q4) - a4
    r1 = lam * (q2 * q3 + q2 * q4 + q3 * q4)
    r2 = lam * (p1 * q3 + p1 * q4 + q3 * q4)
    r3 = lam * (p1 * p2 + p1 * q4 + p2 * q4)
    r4 = lam * (p1 * p2 + p1 * p3 + p2 * p3)
    gap = d1 * (m1 + r1) + d2 * (m2 + r2) + d3 * (m3 + r3) + d4 * (m4 + r4)
    err = (tl.abs(d1) * (tl.abs(m1) + a1 + r1) + tl.abs(d2) * (tl.abs(m2) + a2 + r2)
           + tl.abs(d3) * (tl.abs(m3) + a3 + r3) + tl.abs(d4) * (tl.abs(m4) + a4 + r4))
    return gap, err


@triton.jit
def _pick(rank, w1, w2, w3, w4):
    """The sorted solution's entry of descending rank ``rank``."""
    return tl.where(rank == 0, w1, tl.where(rank == 1, w2, tl.where(rank == 2, w3, w4)))


@triton.jit
def _store(out_ptr, i, mask, z, rank, w1, w2, w3, w4, scale):
    """Entry ``i`` of the answer: its rank's sorted entry, scaled back, with the sign of ``z``."""
    w = _pick(rank, w1, w2, w3, w4) * scale
    tl.store(out_ptr + i, tl.where(z < 0.0, -w, w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def prox_kernel(z_ptr, lam_ptr, out_ptr, undecided_ptr, loops_ptr, n, BLOCK: tl.constexpr,
                 LOOPS: tl.constexpr):
    """The 2:4 prox of cells ``z[4 i : 4 i + 4]`` with ``lam[i]`` into ``out`` (same layout);
    ``undecided[i]`` 1 where the cell must be re-solved (its ``out`` is then not valid). With
    ``LOOPS``, program ``p`` writes how many times each of its loops ran to ``loops[p, :]``
    (:data:`LOOP_NAMES`; for ``benchmarks/prox_kernel_cost.py``)."""
    cell = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cell < n
    z0 = tl.load(z_ptr + 4 * cell, mask=mask, other=0.0).to(tl.float32)
    z1 = tl.load(z_ptr + 4 * cell + 1, mask=mask, other=0.0).to(tl.float32)
    z2 = tl.load(z_ptr + 4 * cell + 2, mask=mask, other=0.0).to(tl.float32)
    z3 = tl.load(z_ptr + 4 * cell + 3, mask=mask, other=0.0).to(tl.float32)
    lam = tl.load(lam_ptr + cell, mask=mask, other=0.0).to(tl.float32)
    b0 = tl.abs(z0)
    b1 = tl.abs(z1)
    b2 = tl.abs(z2)
    b3 = tl.abs(z3)
    finite = (b0 < float("inf")) & (b1 < float("inf")) & (b2 < float("inf")) & (b3 < float("inf"))
    # descending rank of each position, ties broken by position (as torch.sort(stable=True))
    c01 = (b1 > b0).to(tl.int32)
    c02 = (b2 > b0).to(tl.int32)
    c03 = (b3 > b0).to(tl.int32)
    c12 = (b2 > b1).to(tl.int32)
    c13 = (b3 > b1).to(tl.int32)
    c23 = (b3 > b2).to(tl.int32)
    r0 = c01 + c02 + c03
    r1 = 1 - c01 + c12 + c13
    r2 = 2 - c02 - c12 + c23
    r3 = 3 - c03 - c13 - c23
    # the sorted values by a sorting network (five compare-exchanges)
    p0 = tl.maximum(b0, b1)
    q0 = tl.minimum(b0, b1)
    p1 = tl.maximum(b2, b3)
    q1 = tl.minimum(b2, b3)
    a1 = tl.maximum(p0, p1)
    m0 = tl.minimum(p0, p1)
    m1 = tl.maximum(q0, q1)
    a4 = tl.minimum(q0, q1)
    a2 = tl.maximum(m0, m1)
    a3 = tl.minimum(m0, m1)
    # scale by the power of two 2^e <= a1 (exact): c w solves (c z, lam / c), Lemma lemma:sorted_prox
    expo = a1.to(tl.int32, bitcast=True) & 0x7F800000
    scale = expo.to(tl.float32, bitcast=True)
    inv = ((254 << 23) - expo).to(tl.float32, bitcast=True)
    scalable = (expo > 0) & (expo < (254 << 23))
    a1 = a1 * inv
    a2 = a2 * inv
    a3 = a3 * inv
    a4 = a4 * inv
    # K >= 1 (the 2-sparse answer) for every lam >= 4 now: the cap only avoids overflow
    lam = tl.minimum(lam * scale, 4.0)

    run3 = lam * a3 > 0.0
    u, found, none, k, newton3 = _three_sparse(a1, a2, a3, lam, run3)
    den = 1.0 - u * u
    v1 = (a1 - u * a2) / den
    v2 = (a2 - u * a1) / den
    v3 = u / lam
    ok3 = run3 & found & (v2 > 0.0) & (v3 > 0.0)
    gap, err = _gap(v1, v2, v3, 0.0, a1, a2, 0.0, 0.0, a1, a2, a3, a4, lam)
    take = ok3 & (gap < 0.0)
    undecided = (run3 & ~found & ~none) | (ok3 & (tl.abs(gap) <= MARGIN * err))
    s1 = tl.where(take, v1, a1)
    s2 = tl.where(take, v2, a2)
    s3 = tl.where(take, v3, 0.0)

    # the dense case: K < 1, z_4 > 0, the PSD bound lam z1 z2 < 9 z4, lam (z_1 - z_2) < 1,
    # lam (z_3 - z_4) < 1, and no KKT certificate of the best sparse point
    nu3 = tl.where(s3 > 0.0, 0.0, lam * s1 * s2 - a3)
    nu4 = lam * (s1 * s2 + s3 * (s1 + s2)) - a4
    certified = (nu3 >= 0.0) & (nu4 >= 0.0) & _pd4(lam, s1, s2, s3, 0.0)
    open4 = ((k < 1.0) & (lam * a4 > 0.0) & (lam * a1 * a2 < 9.0 * a4) & (lam * (a1 - a2) < 1.0)
             & (lam * (a3 - a4) < 1.0) & ~certified)
    box, xlo, xhi, ylo, yhi = _case_box(a1, a2, a3, a4, lam)
    xlo, xhi, ylo, yhi = _xy_box(lam * (a1 + a2), lam * (a3 + a4), lam * (a1 - a2), lam * (a3 - a4),
                                 lam * xlo, lam * xhi, lam * ylo, lam * yhi)
    xlo = tl.where(box, xlo, 2.0)  # an empty case box: an empty (x, y) box (x < 1)
    f_sparse = 0.5 * ((s1 - a1) * (s1 - a1) + (s2 - a2) * (s2 - a2) + (s3 - a3) * (s3 - a3) + a4 * a4)
    f_sparse = f_sparse + lam * s1 * s2 * s3
    x1, x2, x3, x4, state, pulls, steps, trials, slides = _dense(
        a1, a2, a3, a4, lam, 4.0 * lam * lam * f_sparse, xlo, xhi, ylo, yhi, open4)
    converged = state == 1.0
    open4 = open4 & (state < 3.0)
    ok4 = open4 & converged & (x2 > 0.0) & (x4 > 0.0)
    gap, err = _gap(x1, x2, x3, x4, s1, s2, s3, 0.0, a1, a2, a3, a4, lam)
    take = ok4 & (gap < 0.0)
    undecided = undecided | (open4 & ~converged) | (ok4 & (tl.abs(gap) <= MARGIN * err))

    zero = lam == 0.0  # lam = 0 (or below float32 at this scale): z itself
    w1 = tl.where(zero, a1, tl.where(take, x1, s1))
    w2 = tl.where(zero, a2, tl.where(take, x2, s2))
    w3 = tl.where(zero, a3, tl.where(take, x3, s3))
    w4 = tl.where(zero, a4, tl.where(take, x4, 0.0))
    # a fixed-point step w_i = z_i - lam e_2(w_-i) on the support (stationarity, Lemma
    # lem:three_cases): a contraction by 2 lam sum(w) < 1/2, near-correct rounding for small lam
    polish = lam * (w1 + w2 + w3 + w4) < 0.25
    n1 = a1 - lam * (w2 * w3 + w2 * w4 + w3 * w4)
    n2 = a2 - lam * (w1 * w3 + w1 * w4 + w3 * w4)
    n3 = a3 - lam * (w1 * w2 + w1 * w4 + w2 * w4)
    n4 = a4 - lam * (w1 * w2 + w1 * w3 + w2 * w3)
    w1 = tl.where(polish & (w1 > 0.0), n1, w1)
    w2 = tl.where(polish & (w2 > 0.0), n2, w2)
    w3 = tl.where(polish & (w3 > 0.0), n3, w3)
    w4 = tl.where(polish & (w4 > 0.0), n4, w4)
    # 0 <= w <= |z| holds exactly; float32 rounding can break it by an ulp
    w1 = tl.minimum(tl.maximum(w1, 0.0), a1)
    w2 = tl.minimum(tl.maximum(w2, 0.0), a2)
    w3 = tl.minimum(tl.maximum(w3, 0.0), a3)
    w4 = tl.minimum(tl.maximum(w4, 0.0), a4)
    undecided = (undecided & ~zero) | ~finite | ((a1 > 0.0) & ~scalable)
    tl.store(undecided_ptr + cell, undecided.to(tl.int8), mask=mask)
    _store(out_ptr, 4 * cell, mask, z0, r0, w1, w2, w3, w4, scale)
    _store(out_ptr, 4 * cell + 1, mask, z1, r1, w1, w2, w3, w4, scale)
    _store(out_ptr, 4 * cell + 2, mask, z2, r2, w1, w2, w3, w4, scale)
    _store(out_ptr, 4 * cell + 3, mask, z3, r3, w1, w2, w3, w4, scale)
    if LOOPS:
        row = loops_ptr + tl.program_id(0).to(tl.int64) * 5
        tl.store(row, newton3)
        tl.store(row + 1, pulls)
        tl.store(row + 2, steps)
        tl.store(row + 3, trials)
        tl.store(row + 4, slides)


def triton_cells(zc: Tensor, lam_c: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """The kernel on cells ``zc`` (n, 4; float64, float32, bfloat16 or float16) with ``lam_c``
    (n,), ``block`` cells per program (a power of two): ``(w, undecided)``, ``w`` in the dtype of
    ``zc`` and valid where ``undecided`` (bool, n) is False. CUDA tensors, or CPU tensors when
    ``TRITON_INTERPRET=1`` was set before triton was first imported (Triton's interpreter, for
    tests: its cost is per operation, so large blocks run faster there)."""
    out, undecided, _ = _launch(zc, lam_c, block, loops=False)
    return out, undecided


#: the kernel's loops, in the order :func:`loop_counts` reports them: the 3-sparse Newton
#: steps, the pulls of the dense start into R, the dense Newton steps, and the trials of its
#: line search and of its slide (summed over the Newton steps)
LOOP_NAMES = ("newton3", "pulls", "convex_steps", "line_search", "slide")


def loop_counts(zc: Tensor, lam_c: Tensor, block: int = BLOCK) -> Tensor:
    """How many times each loop of :data:`LOOP_NAMES` ran in each program of ``block`` cells
    on these cells (int32, ``(programs, 5)``); what the kernel's time depends on beside the
    number of cells (``benchmarks/prox_kernel_cost.py``)."""
    return _launch(zc, lam_c, block, loops=True)[2]


def _launch(zc: Tensor, lam_c: Tensor, block: int, loops: bool) -> tuple[Tensor, Tensor, Tensor]:
    if zc.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton 2:4 prox needs CUDA tensors (or TRITON_INTERPRET=1), got {zc.device}")
    zk, lk = zc.contiguous(), lam_c.contiguous()
    out = torch.empty_like(zk)
    undecided = torch.zeros(zk.shape[0], dtype=torch.int8, device=zk.device)
    programs = triton.cdiv(zk.shape[0], block)
    counts = torch.zeros((programs if loops else 0, len(LOOP_NAMES)), dtype=torch.int32, device=zk.device)
    if zk.shape[0]:
        prox_kernel[(programs,)](zk, lk, out, undecided, counts, zk.shape[0], BLOCK=block, LOOPS=loops)
    return out, undecided.bool(), counts


def compile_kernel(arch: int = 90, cells: str = "fp32", loops: bool = False):
    """:func:`prox_kernel` compiled by Triton, with no GPU needed, for CUDA compute capability
    ``arch`` (90: an H200), cells of Triton type ``cells`` and ``LOOPS`` as ``loops``: the
    arguments :func:`triton_cells` launches it with (lam in float32, as
    :func:`nmprune.prox.prox_2of4` passes it on CUDA). Not under ``TRITON_INTERPRET=1``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"z_ptr": f"*{cells}", "lam_ptr": "*fp32", "out_ptr": f"*{cells}", "undecided_ptr": "*i8",
                 "loops_ptr": "*i32", "n": "i32", "BLOCK": "constexpr", "LOOPS": "constexpr"}
    source = ASTSource(fn=prox_kernel, signature=signature, constexprs={"BLOCK": BLOCK, "LOOPS": loops})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def prox_2of4_triton(zc: Tensor, lam_c: Tensor, block: int = BLOCK) -> Tensor:
    """``solver="reduced"`` on CUDA: :func:`triton_cells`, with the cells it leaves undecided
    re-solved by the float64 torch solver (as the CPU path does); ``ValueError`` for NaN or Inf
    in ``zc``. Returns the dtype of ``zc``."""
    out, undecided = triton_cells(zc, lam_c, block)
    rows = undecided.nonzero().squeeze(-1)
    if rows.numel():
        zr = zc[rows]
        if not bool(torch.isfinite(zr).all()):
            raise non_finite_error("z")
        a, order = sort_abs(zr)
        w = solve_sorted_reduced(a.to(torch.float64), lam_c[rows].to(torch.float64))
        out[rows] = unsort(w.to(out.dtype), order, zr)
    return out
