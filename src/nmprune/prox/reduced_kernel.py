"""Scalar numba code of the compiled reduced 2:4 solver (:mod:`nmprune.prox.reduced_simd`).

Two kinds of functions: branch-free helpers that the vectorised loops of ``reduced_simd``
inline (the positive-definiteness test, the KKT certificate, the Newton step on ``G``, the
case and ``(x, y)`` boxes, the convexity lower bound with its unrolled 2-D linear programme),
and :func:`dense_case`, the exact dense-case fallbacks run one cell at a time for the few
cells the vectorised stages leave open (damped Newton on the convex reduced problem with the
convexity lower bound, then damped Newton on ``f``), where branchy per-cell code with early
exits is cheaper than more vectorised stages. All functions use numpy's error model (a
division by zero gives inf or nan, which the comparisons then reject, instead of raising); all
arithmetic is float64. The derivations are in ``docs/prox.md``.
"""

from __future__ import annotations

import numpy as np

from numba import njit

STEP_TOL = 1e-12
BOX_ROUNDS = 4
MAX_FALLBACK = 30
MAX_HALVINGS = 20
XY_ROUNDS = 3
BOX_SLACK = 1e-9  # the boxes are widened by this much of the cell's scale (see case_box)
NEWTON4_ITER = 30
DEC_TOL = 1e-24


@njit(cache=True, error_model="numpy", inline="always")
def objective4(w1, w2, w3, w4, z1, z2, z3, z4, lam):
    q = 0.5 * ((w1 - z1) ** 2 + (w2 - z2) ** 2 + (w3 - z3) ** 2 + (w4 - z4) ** 2)
    return q + lam * (w1 * w2 * (w3 + w4) + w3 * w4 * (w1 + w2))


@njit(cache=True, error_model="numpy", inline="always")
def pd4(lam, w1, w2, w3, w4):
    """Is the 4x4 Hessian (eq. ``hessian_4sparse``, unit diagonal, off-diagonal
    ``h_ij = lam (w_k + w_l)``) at ``w`` positive definite? Sylvester's criterion on its
    leading principal minors, expanded: no square root or division, and no branch (so loops
    over cells that call it vectorise)."""
    a = lam * (w3 + w4)  # h12
    b = lam * (w2 + w4)  # h13
    c = lam * (w2 + w3)  # h14
    d = lam * (w1 + w4)  # h23
    e = lam * (w1 + w3)  # h24
    f = lam * (w1 + w2)  # h34
    m2 = 1.0 - a * a
    m3 = m2 - b * b - d * d + 2.0 * a * b * d
    m4 = (m3 - c * c * (1.0 - d * d) - e * e * (1.0 - b * b) - f * f * m2
          + 2.0 * (c * e * (a - b * d) + c * f * (b - a * d) + e * f * (d - a * b)))
    return (m2 > 0.0) & (m3 > 0.0) & (m4 > 0.0)


@njit(cache=True, error_model="numpy", inline="always")
def sparse_point_rules_out_dense(w1, w2, w3, z3, z4, lam):
    """KKT certificate of :func:`nmprune.prox.reduced.sparse_point_rules_out_dense` for ``[w1, w2, w3, 0]``."""
    nu3 = 0.0 if w3 > 0.0 else lam * w1 * w2 - z3
    nu4 = lam * (w1 * w2 + w3 * (w1 + w2)) - z4
    return (nu3 >= 0.0) & (nu4 >= 0.0) & pd4(lam, w1, w2, w3, 0.0)


@njit(cache=True, error_model="numpy", inline="always")
def dense_weights(x, y, z1, z2, z3, z4, lam):
    """The dense point of ``(x, y)``: sums ``x/lam``, ``y/lam`` and the optimal differences
    ``(z1 - z2)/(1 - y)``, ``(z3 - z4)/(1 - x)``."""
    p = x / lam
    q = y / lam
    a = (z1 - z2) / (1.0 - y)
    b = (z3 - z4) / (1.0 - x)
    return (p + a) / 2.0, (p - a) / 2.0, (q + b) / 2.0, (q - b) / 2.0


@njit(cache=True, error_model="numpy", inline="always")
def case_box(z1, z2, z3, z4, lam):
    """Bounds ``lo <= w <= hi`` on every interior minimiser of the dense case
    (:func:`nmprune.prox.newton._case_bounds`, k = 4). Returns ``(ok, lo1..lo4, hi1..hi4)``;
    ``ok`` is False when the bounds prove there is none.

    For small ``lam`` the rounds converge onto the minimiser itself, so the box collapses
    to a point, and rounding can leave ``lo`` an ulp above ``hi``: the bounds are widened by
    ``BOX_SLACK * z1`` before the test (a looser necessary condition only costs work).
    A strict test would declare the dense case empty for most cells with ``lam z1 < 1e-3``
    and return a 3-sparse point."""
    l1, l2, l3, l4 = z1 / 3.0, z2 / 3.0, 0.0, 0.0
    h1, h2, h3, h4 = z1, z2, z3, z4
    for _ in range(BOX_ROUNDS):
        h1 = min(h1, z1 - lam * (l2 * l3 + l2 * l4 + l3 * l4))
        h2 = min(h2, z2 - lam * (l1 * l3 + l1 * l4 + l3 * l4))
        h3 = min(h3, z3 - lam * (l1 * l2 + l1 * l4 + l2 * l4))
        h4 = min(h4, z4 - lam * (l1 * l2 + l1 * l3 + l2 * l3))
        l1 = max(l1, z1 - lam * (h2 * h3 + h2 * h4 + h3 * h4))
        l2 = max(l2, z2 - lam * (h1 * h3 + h1 * h4 + h3 * h4))
        l3 = max(l3, z3 - lam * (h1 * h2 + h1 * h4 + h2 * h4))
        l4 = max(l4, z4 - lam * (h1 * h2 + h1 * h3 + h2 * h3))
    t = BOX_SLACK * z1
    l1, l2, l3, l4 = max(l1 - t, 0.0), max(l2 - t, 0.0), max(l3 - t, 0.0), max(l4 - t, 0.0)
    h1, h2, h3, h4 = h1 + t, h2 + t, h3 + t, h4 + t
    ok = (h4 > 0.0) & (l1 <= h1) & (l2 <= h2) & (l3 <= h3) & (l4 <= h4)
    return ok, l1, l2, l3, l4, h1, h2, h3, h4


@njit(cache=True, error_model="numpy", inline="always")
def xy_box(s1, s2, d1, d2, xlo, xhi, ylo, yhi):
    """Tighten the box on ``(x, y)`` of a dense PSD stationary point with ``w_2, w_4 > 0``.
    Necessary conditions, from ``grad G = 0`` and ``w_4 > 0`` (``d2/(1-x) < y``):
    ``(S1 - y^2/2)/(1+y) <= x < S1/(1+y)``, and symmetrically for ``y``; from ``w_2, w_4 > 0``:
    ``x > d1/(1-y)``, ``y > d2/(1-x)``; from the diagonal of ``grad^2 G > 0``:
    ``(1-x)^3 > d2^2/(1+y)``, ``(1-y)^3 > d1^2/(1+x)``. Returns ``(ok, xlo, xhi, ylo, yhi)``.
    Branch-free: the bounds only tighten, so a box found empty stays empty. Like
    :func:`case_box` the result is widened by ``BOX_SLACK`` of the scale ``s1 + s2``
    before the emptiness test (the box collapses onto the point for small ``lam``)."""
    xhi = min(xhi, 1.0)
    yhi = min(yhi, 1.0)
    for _ in range(XY_ROUNDS):
        xhi = min(xhi, s1 / (1.0 + ylo), 1.0 - _cbrt_below(d2 * d2 / (1.0 + yhi)))
        yhi = min(yhi, s2 / (1.0 + xlo), 1.0 - _cbrt_below(d1 * d1 / (1.0 + xhi)))
        xlo = max(xlo, d1 / (1.0 - ylo), (s1 - 0.5 * yhi * yhi) / (1.0 + yhi))
        ylo = max(ylo, d2 / (1.0 - xlo), (s2 - 0.5 * xhi * xhi) / (1.0 + xhi))
    t = BOX_SLACK * (s1 + s2)
    xlo, xhi, ylo, yhi = xlo - t, xhi + t, ylo - t, yhi + t
    return (xlo < xhi) & (ylo < yhi), xlo, xhi, ylo, yhi


@njit(cache=True, error_model="numpy", inline="always")
def _cbrt_below(q):
    """A lower bound on the cube root ``r`` of ``q >= 0`` without a libm call (so it
    vectorises): the tangent of ``q^(1/3)`` at 1, ``(q + 2)/3``, lies above ``r`` (concave
    root), so do the Newton steps on ``t^3 = q`` from it, and then ``r = q / r^2 >= q / t^2``.
    Used only to loosen bounds, never to solve: two steps make it tight where it matters
    (``q`` near 1; for small ``q`` the bound ``1 - r`` is near 1 anyway)."""
    t = (q + 2.0) * (1.0 / 3.0)
    for _ in range(2):
        t = (2.0 * t + q / (t * t)) * (1.0 / 3.0)
    return q / (t * t)


@njit(cache=True, error_model="numpy", inline="always")
def g_value(x, y, s1, s2, d1, d2):
    """``G(x, y)`` of :mod:`nmprune.prox.reduced`; the dense objective minimised over the
    differences ``w1 - w2``, ``w3 - w4`` is ``G / (4 lam^2)``."""
    return ((x - s1) ** 2 + (y - s2) ** 2 + x * y * (x + y)
            - d1 * d1 * y / (1.0 - y) - d2 * d2 * x / (1.0 - x))


@njit(cache=True, error_model="numpy", inline="always")
def _g_derivs(x, y, s1, s2, d1, d2):
    """Half the gradient and half the Hessian of ``G``: ``(g1, g2, h11, h12, h22)``
    (``1/(1-x)`` and ``1/(1-y)`` from one division: divisions bound the vectorised loops)."""
    r = 1.0 / ((1.0 - x) * (1.0 - y))
    ix = (1.0 - y) * r
    iy = (1.0 - x) * r
    e2 = d2 * ix
    e1 = d1 * iy
    g1 = x - s1 + x * y + 0.5 * (y * y - e2 * e2)
    g2 = y - s2 + x * y + 0.5 * (x * x - e1 * e1)
    return g1, g2, 1.0 + y - e2 * e2 * ix, x + y, 1.0 + x - e1 * e1 * iy


@njit(cache=True, error_model="numpy", inline="always")
def in_r(x, y, s1, s2, d1, d2):
    """Is ``(x, y)`` inside ``R = {x, y < 1, grad^2 G > 0}``, the image of the region where
    the Hessian of ``f`` is positive definite (convex; ``G`` is convex on it)?"""
    _, _, h11, h12, h22 = _g_derivs(x, y, s1, s2, d1, d2)
    return (x < 1.0) & (y < 1.0) & (h11 > 0.0) & (h11 * h22 - h12 * h12 > 0.0)


@njit(cache=True, error_model="numpy", inline="always")
def _meets(a, b, c, x, y):
    """``a x + b y >= c`` up to a relative tolerance of 1e-9."""
    return a * x + b * y >= c - 1e-9 * (abs(a * x) + abs(b * y) + abs(c))


@njit(cache=True, error_model="numpy", inline="always")
def _within(v, lo, hi):
    """``lo <= v <= hi`` with :func:`_meets`'s tolerance; False for an infinite or NaN ``v``."""
    return ((v >= lo - 1e-9 * (abs(v) + abs(lo))) & (v <= hi + 1e-9 * (abs(v) + abs(hi)))
            & (abs(v) < np.inf))


@njit(cache=True, error_model="numpy", inline="always")
def _edge_vertex(fixed, rb, a, c, lo, hi, cut1, cut2, g_fixed, g_free, swap):
    """``g.(x, y)`` where the line ``a fixed + b free = c`` (``rb = 1/b``) meets the box
    edge at ``fixed``, if ``free`` is in ``[lo, hi]`` and the point meets the two other
    cuts (``(a, b, c)`` triples, in ``(x, y)`` order; ``swap``: ``fixed`` is ``y``), else inf."""
    free = (c - a * fixed) * rb
    x = free if swap else fixed
    y = fixed if swap else free
    ok = (_within(free, lo, hi) & _meets(cut1[0], cut1[1], cut1[2], x, y)
          & _meets(cut2[0], cut2[1], cut2[2], x, y))
    return g_fixed * fixed + g_free * free if ok else np.inf


@njit(cache=True, error_model="numpy", inline="always")
def _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, cut, other1, other2):
    """The smallest ``g.(x, y)`` over the feasible points where the line of ``cut`` meets the
    four box edges or the line of ``other1`` (inf where none is feasible)."""
    a, b, c = cut
    rb, ra = 1.0 / b, 1.0 / a
    low = min(_edge_vertex(xlo, rb, a, c, ylo, yhi, other1, other2, g1, g2, False),
              _edge_vertex(xhi, rb, a, c, ylo, yhi, other1, other2, g1, g2, False))
    low = min(low, min(_edge_vertex(ylo, ra, b, c, xlo, xhi, other1, other2, g2, g1, True),
                       _edge_vertex(yhi, ra, b, c, xlo, xhi, other1, other2, g2, g1, True)))
    a2, b2, c2 = other1
    det = a * b2 - a2 * b
    inv = 1.0 / det
    x = (c * b2 - c2 * b) * inv
    y = (a * c2 - a2 * c) * inv
    ok = ((det != 0.0) & _within(x, xlo, xhi) & _within(y, ylo, yhi)
          & _meets(other2[0], other2[1], other2[2], x, y))
    return min(low, g1 * x + g2 * y if ok else np.inf)


@njit(cache=True, error_model="numpy", inline="always")
def _corner(x, y, g1, g2, cut1, cut2, cut3):
    """``g1 x + g2 y`` at the box corner ``(x, y)`` if it meets the three cuts, else inf."""
    ok = (_meets(cut1[0], cut1[1], cut1[2], x, y) & _meets(cut2[0], cut2[1], cut2[2], x, y)
          & _meets(cut3[0], cut3[1], cut3[2], x, y))
    return g1 * x + g2 * y if ok else np.inf


@njit(cache=True, error_model="numpy", inline="always")
def lp_min_box(g1, g2, xlo, xhi, ylo, yhi, cut1, cut2, cut3):
    """Minimum of ``g1 x + g2 y`` over the box ``[xlo, xhi] x [ylo, yhi]`` cut by the three
    half-planes ``a x + b y >= c`` (``cut_k = (a, b, c)``); ``inf`` when that polygon is
    empty. The optimum of a bounded 2-D polygon is one of its vertices, so the 19 crossings
    of its lines that can be vertices are checked: the 4 corners (against the cuts), each
    cut's line with the 4 box edges (the crossing against its edge's range and the other
    cuts) and the 3 crossings of the cuts' lines (against the box and the third cut). A
    point is only checked against the constraints it does not lie on (75 tests and 9
    divisions, not 147 and 21 for all 7 constraints at all 21 pairs). Straight-line code, so loops over cells that call it vectorise."""
    low = min(min(_corner(xlo, ylo, g1, g2, cut1, cut2, cut3), _corner(xlo, yhi, g1, g2, cut1, cut2, cut3)),
              min(_corner(xhi, ylo, g1, g2, cut1, cut2, cut3), _corner(xhi, yhi, g1, g2, cut1, cut2, cut3)))
    low = min(low, _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, cut1, cut2, cut3))
    low = min(low, _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, cut2, cut3, cut1))
    low = min(low, _cut_vertices(g1, g2, xlo, xhi, ylo, yhi, cut3, cut1, cut2))
    return low if (xlo <= xhi) & (ylo <= yhi) else np.inf


@njit(cache=True, error_model="numpy", inline="always")
def phi_grad(x, y, h11, h12, h22, d1, d2):
    """``(dphi/dx, dphi/dy, phi)`` for ``phi = sqrt(h11 h22) - (x + y)`` (concave; ``R`` is
    where it is positive, with ``x, y < 1``)."""
    root = np.sqrt(h11 * h22)
    ix = 1.0 / (1.0 - x)
    iy = 1.0 / (1.0 - y)
    ax = (h22 * (-3.0 * d2 * d2 * ix ** 4) + h11) / (2.0 * root) - 1.0
    ay = (h22 + h11 * (-3.0 * d1 * d1 * iy ** 4)) / (2.0 * root) - 1.0
    return ax, ay, root - h12


@njit(cache=True, error_model="numpy", inline="always")
def convex_lower_bound(x, y, gv, g1, g2, h11, h12, h22, d1, d2, xlo, xhi, ylo, yhi):
    """Lower bound on ``G`` over the dense PSD points with non-negative entries in the box,
    from the point ``p = (x, y)`` of ``R``: ``G(q) >= G(p) + grad G(p).(q - p)`` (``G`` is
    convex on ``R``) minimised over the box cut by tangents of the convex constraints:
    ``phi = sqrt(h11 h22) - (x + y) >= 0`` (``phi`` concave; it holds ``R``), ``w_4 >= 0``
    i.e. ``y >= d2/(1 - x)`` and ``w_2 >= 0`` i.e. ``x >= d1/(1 - y)`` (convex curves)."""
    ax, ay, phi = phi_grad(x, y, h11, h12, h22, d1, d2)
    ix = 1.0 / (1.0 - x)
    iy = 1.0 / (1.0 - y)
    # y >= d2 ix + d2 ix^2 (x' - x), i.e. -d2 ix^2 x' + y' >= d2 ix - d2 ix^2 x; same for x
    low = lp_min_box(g1, g2, xlo, xhi, ylo, yhi, (ax, ay, ax * x + ay * y - phi),
                      (-d2 * ix * ix, 1.0, d2 * ix - d2 * ix * ix * x),
                      (1.0, -d1 * iy * iy, d1 * iy - d1 * iy * iy * y))
    return gv - 2.0 * (g1 * x + g2 * y) + 2.0 * low


@njit(cache=True, error_model="numpy", inline="always")
def g_newton(x, y, s1, s2, d1, d2):
    """Half the gradient and Hessian of ``G`` at ``(x, y)`` (:func:`_g_derivs`), the Hessian's
    determinant and the Newton step ``(dx, dy) = -(grad^2 G)^{-1} grad G``."""
    g1, g2, h11, h12, h22 = _g_derivs(x, y, s1, s2, d1, d2)
    det = h11 * h22 - h12 * h12
    inv = 1.0 / det
    return g1, g2, h11, h12, h22, det, (h12 * g2 - h22 * g1) * inv, (h12 * g1 - h11 * g2) * inv


@njit(cache=True, error_model="numpy")
def _dense_convex(z1, z2, z3, z4, lam, xlo, xhi, ylo, yhi, best, x, y):
    """Minimise ``G`` over ``R`` (a convex problem in two variables) by damped Newton from
    ``(x, y)`` pulled into ``R``, for cells where plain Newton did not converge. Returns
    ``(status, w1..w4)``: 1 an interior stationary point (the PSD stationary point of
    ``f``), 0 proven that the dense case cannot beat ``best`` (the convexity bound
    ``G(p) + grad G(p).(q - p)`` over the box ``xlo..xhi, ylo..yhi`` that holds every
    dense PSD point, divided by ``4 lam^2``, exceeds it), -1 undecided."""
    s1 = lam * (z1 + z2)
    s2 = lam * (z3 + z4)
    d1 = lam * (z1 - z2)
    d2 = lam * (z3 - z4)
    scale = 4.0 * lam * lam
    # R is convex and holds the origin (d1, d2 < 1): pull the start towards it until inside
    for _ in range(60):
        if in_r(x, y, s1, s2, d1, d2):
            break
        x *= 0.5
        y *= 0.5
    gv = g_value(x, y, s1, s2, d1, d2)
    for _ in range(MAX_FALLBACK):
        g1, g2, h11, h12, h22, _, dx, dy = g_newton(x, y, s1, s2, d1, d2)
        lower = convex_lower_bound(x, y, gv, g1, g2, h11, h12, h22, d1, d2, xlo, xhi, ylo, yhi)
        if lower > best * scale:
            return 0, 0.0, 0.0, 0.0, 0.0
        dec = -(g1 * dx + g2 * dy)
        if dec <= DEC_TOL * (s1 * s1 + s2 * s2) and abs(dx) + abs(dy) <= STEP_TOL * (x + y):
            w1, w2, w3, w4 = dense_weights(x, y, z1, z2, z3, z4, lam)
            return 1, w1, w2, w3, w4
        t = 1.0
        xb, yb, gb = x, y, gv
        for _ in range(MAX_HALVINGS):
            xn, yn = x + t * dx, y + t * dy
            if in_r(xn, yn, s1, s2, d1, d2):
                gn = g_value(xn, yn, s1, s2, d1, d2)
                if gn <= gv - 2e-4 * t * dec:
                    xb, yb, gb = xn, yn, gn
                    break
            t *= 0.5
        if t < 0.25:
            # near the boundary of R, where grad^2 G turns singular, Newton steps get cut
            # short: also try the gradient projected onto the tangent of phi = 0, which
            # slides along the boundary towards its minimiser
            nx, ny, _ = phi_grad(x, y, h11, h12, h22, d1, d2)
            proj = (g1 * nx + g2 * ny) / (nx * nx + ny * ny)
            tx, ty = -(g1 - proj * nx), -(g2 - proj * ny)
            norm = np.sqrt(tx * tx + ty * ty)
            if norm > 0.0:
                t = 0.1 / norm
                for _ in range(MAX_HALVINGS):
                    xn, yn = x + t * tx, y + t * ty
                    if in_r(xn, yn, s1, s2, d1, d2):
                        gn = g_value(xn, yn, s1, s2, d1, d2)
                        if gn < gb:
                            xb, yb, gb = xn, yn, gn
                            break
                    t *= 0.5
        if gb >= gv:
            break
        x, y, gv = xb, yb, gb
    return -1, 0.0, 0.0, 0.0, 0.0


@njit(cache=True, error_model="numpy")
def _grad_hess4(w, z, lam, g, h):
    """Gradient and Hessian (eq. ``hessian_4sparse``) of ``f`` at ``w`` into ``g``, ``h``."""
    g[0] = w[0] - z[0] + lam * (w[1] * w[2] + w[1] * w[3] + w[2] * w[3])
    g[1] = w[1] - z[1] + lam * (w[0] * w[2] + w[0] * w[3] + w[2] * w[3])
    g[2] = w[2] - z[2] + lam * (w[0] * w[1] + w[0] * w[3] + w[1] * w[3])
    g[3] = w[3] - z[3] + lam * (w[0] * w[1] + w[0] * w[2] + w[1] * w[2])
    total = w[0] + w[1] + w[2] + w[3]
    for i in range(4):
        h[i, i] = 1.0
        for j in range(i + 1, 4):
            h[i, j] = h[j, i] = lam * (total - w[i] - w[j])


@njit(cache=True, error_model="numpy")
def _newton_direction(h, g, d):
    """``d = -h^{-1} g`` by Cholesky; False when ``h`` is not positive definite."""
    low = np.zeros((4, 4))
    for j in range(4):
        v = h[j, j]
        for t in range(j):
            v -= low[j, t] * low[j, t]
        if v <= 0.0:
            return False
        low[j, j] = np.sqrt(v)
        for i in range(j + 1, 4):
            v = h[i, j]
            for t in range(j):
                v -= low[i, t] * low[j, t]
            low[i, j] = v / low[j, j]
    for i in range(4):
        v = -g[i]
        for t in range(i):
            v -= low[i, t] * d[t]
        d[i] = v / low[i, i]
    for i in range(3, -1, -1):
        v = d[i]
        for t in range(i + 1, 4):
            v -= low[t, i] * d[t]
        d[i] = v / low[i, i]
    return True


@njit(cache=True, error_model="numpy")
def _dense_newton4(z, lam, lo, hi, beat):
    """Last resort for the dense case, the damped Newton method of
    :func:`nmprune.prox.newton.damped_newton` on ``f`` over ``w > 0`` with a positive definite
    Hessian, from the middle of the case box ``lo <= w <= hi`` (or a scaled ``z`` well inside
    the PSD region); stops early when the convexity bound over the box exceeds ``beat``.
    Returns ``(objective, w)`` of its last iterate."""
    g = np.empty(4)
    d = np.empty(4)
    h = np.empty((4, 4))
    cand = np.empty(4)
    w = 0.5 * (lo + hi)
    _grad_hess4(w, z, lam, g, h)
    if not (_newton_direction(h, g, d) and w.min() > 0.0):
        w = z * min(0.25 / max(lam * z.sum(), 1e-300), 1.0)
    f = objective4(w[0], w[1], w[2], w[3], z[0], z[1], z[2], z[3], lam)
    zmax2 = z[0] * z[0]
    for _ in range(NEWTON4_ITER):
        _grad_hess4(w, z, lam, g, h)
        _newton_direction(h, g, d)
        dec = 0.0
        lower = f
        gg = 0.0
        for i in range(4):
            dec -= g[i] * d[i]
            lower += min(g[i] * (lo[i] - w[i]), g[i] * (hi[i] - w[i]))
            gg += g[i] * g[i]
        if lower > beat or dec <= 1e-22 * zmax2 or w.min() <= 1e-12 * z[0]:
            break
        alpha_n = 1.0
        alpha_g = 0.25
        for i in range(4):
            if d[i] < 0.0:
                alpha_n = min(alpha_n, -0.99 * w[i] / d[i])
            if g[i] > 0.0:
                alpha_g = min(alpha_g, 0.99 * w[i] / g[i])
        accepted = False
        for trial in range(6):  # two Newton steps shrunk by 4, then gradient steps halved
            if trial < 2:
                step = alpha_n * 0.25 ** trial
                for i in range(4):
                    cand[i] = w[i] + step * d[i]
                need = f - 1e-4 * step * dec
            else:
                step = alpha_g * 0.5 ** (trial - 2)
                for i in range(4):
                    cand[i] = w[i] - step * g[i]
                need = f - 1e-4 * step * gg
            fc = objective4(cand[0], cand[1], cand[2], cand[3], z[0], z[1], z[2], z[3], lam)
            if fc <= need and pd4(lam, cand[0], cand[1], cand[2], cand[3]):
                w[:] = cand
                f = fc
                accepted = True
                break
        if not accepted:
            break
    return f, w


@njit(cache=True, error_model="numpy")
def dense_case(z1, z2, z3, z4, lam, w1, w2, w3, best, x0, y0):
    """The answer ``w1..w4`` given the best sparse point ``[w1, w2, w3, 0]`` (objective
    ``best``) of a cell whose dense case plain Newton left open: the necessary conditions,
    then the convex fallback going on from ``(x0, y0)`` (where the caller's own convex
    iterations stopped), then damped Newton on ``f``."""
    w4 = 0.0
    ok, l1, l2, l3, l4, h1, h2, h3, h4 = case_box(z1, z2, z3, z4, lam)
    if not ok:
        return w1, w2, w3, w4
    s1, s2 = lam * (z1 + z2), lam * (z3 + z4)
    d1, d2 = lam * (z1 - z2), lam * (z3 - z4)
    if d1 >= 1.0 or d2 >= 1.0:
        return w1, w2, w3, w4  # lam (w1 - w2) <= lam (w1 + w3) <= 1 at a PSD point
    ok, xlo, xhi, ylo, yhi = xy_box(s1, s2, d1, d2, lam * (l1 + l2), lam * (h1 + h2),
                                     lam * (l3 + l4), lam * (h3 + h4))
    if not ok:
        return w1, w2, w3, w4
    st, v1, v2, v3, v4 = _dense_convex(z1, z2, z3, z4, lam, xlo, xhi, ylo, yhi, best, x0, y0)
    if st < 0:
        f4, v = _dense_newton4(np.array((z1, z2, z3, z4)), lam, np.array((l1, l2, l3, l4)),
                               np.array((h1, h2, h3, h4)), best)
        if f4 < best:
            return v[0], v[1], v[2], v[3]
        return w1, w2, w3, w4
    if st == 0:
        return w1, w2, w3, w4
    if v2 > 0.0 and v4 > 0.0:
        f4 = objective4(v1, v2, v3, v4, z1, z2, z3, z4, lam)
        if f4 < best:
            return v1, v2, v3, v4
    return w1, w2, w3, w4