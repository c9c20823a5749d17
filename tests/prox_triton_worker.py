"""Runs the Triton 2:4 prox (nmprune.prox.two_four_triton) on CPU tensors in Triton's
interpreter, for tests/test_prox_triton.py: ``python prox_triton_worker.py JOBS RESULTS``.

TRITON_INTERPRET=1 is set here, before triton is first imported, so only this process
interprets. ``JOBS`` (``torch.save``) maps a name to ``(what, z, lam, block)``: ``what`` "cells"
runs :func:`triton_cells` (result ``{"w", "undecided"}``), "prox" :func:`prox_2of4_triton`
(``{"w"}``), "loops" :func:`loop_counts` (``{"loops"}``), with ``block`` cells per program (None: the default, slow here); a ``ValueError``
becomes ``{"error": message}``. Writes the results to ``RESULTS``.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from nmprune.prox.two_four_triton import loop_counts, prox_2of4_triton, triton_cells  # noqa: E402

def main(jobs_path: str, results_path: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, (what, z, lam, block) in torch.load(jobs_path).items():
        size = {} if block is None else {"block": block}
        try:
            if what == "cells":
                w, undecided = triton_cells(z, lam, **size)
                results[name] = {"w": w, "undecided": undecided}
            elif what == "loops":
                results[name] = {"loops": loop_counts(z, lam, **size)}
            else:
                results[name] = {"w": prox_2of4_triton(z, lam, **size)}
        except ValueError as err:
            results[name] = {"error": str(err)}
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
