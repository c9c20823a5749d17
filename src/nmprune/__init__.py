"""nmprune: one-shot N:M (2:4) sparsity for pretrained language models.

Implements "A Proximal Operator for Inducing 2:4-Sparsity" (Kübler et al.): the exact
2:4 proximal operator, the proximal-gradient layer pruner, masked-gradient refinement,
the Wanda / SparseGPT / DSnoT / magnitude baselines, and a whole-model pipeline.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first use, so `import nmprune` stays light)
_EXPORTS = {
    "NMPattern": "pattern",
    "parse_pattern": "pattern",
    "is_nm_sparse": "pattern",
    "methods": "registry",
    "refiners": "registry",
    "register_method": "registry",
    "register_refiner": "registry",
    "prune_matrix": "solve",
    "prune_layer": "solve",
    "LayerResult": "solve",
    "local_loss": "loss",
    "prune_model": "pipeline",
    "RunConfig": "config",
    "build_config": "config",
    "run": "job",
    "result_table": "job",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'nmprune' has no attribute {name!r}")
