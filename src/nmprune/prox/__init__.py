"""Proximal operators of the N:M regularizers (paper Section 3 and Appendix "Other Regularizers").

Public API:

* :func:`prox_2of4` -- exact 2:4 prox (default ``solver="reduced"``, exact ``solver="newton"``; ``solver="gd"`` is the paper's)
* :func:`prox_nm` -- general N:M prox by case enumeration (dispatches 2:4 and 1:M)
* :func:`prox_1ofm` -- exact closed-form 1:M prox
* :func:`prox_l0`, :func:`prox_l1`, :func:`prox_l2` -- proxes of the simpler regularizers
  (eqs. ``L0``, ``L1``, ``L2``)
* :func:`r_2of4`, :func:`r_nm` -- the regularizer values (eq. ``regularizer_nm``)
"""

from .general import prox_nm
from .regularizers import prox_objective, r_2of4, r_nm
from .simple import prox_1ofm, prox_l0, prox_l1, prox_l2
from .two_four import prox_2of4

__all__ = [
    "prox_1ofm",
    "prox_2of4",
    "prox_l0",
    "prox_l1",
    "prox_l2",
    "prox_nm",
    "prox_objective",
    "r_2of4",
    "r_nm",
]
