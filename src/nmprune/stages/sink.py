"""The block sink stage: where a finished block's pruned weights go.

A sink (the :class:`BlockSink` interface) receives, block by block, the weights of every
prunable layer as the layer stores them (``module.weight``), keyed by full module name.
:class:`ModelSink` writes them into a model held in memory (a no-op for a block pruned in
place; a resumed block's weights come from the checkpoint); a streaming sink writes
safetensors shards instead; :class:`DiscardingSink` keeps nothing (the ranks other than 0 of a
streamed run under torchrun, where rank 0 writes the shards).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor

from .source import ModelBlocks


class BlockSink(Protocol):
    """What :func:`nmprune.pipeline.prune_model` asks of a sink."""

    def write(self, index: int, weights: Mapping[str, Tensor]) -> None:
        """Keep block ``index``'s final weights (every prunable layer's, by full name)."""


class ModelSink:
    """Writes finished blocks into the model behind ``source``."""

    def __init__(self, source: ModelBlocks):
        self.source = source

    def write(self, index: int, weights: Mapping[str, Tensor]) -> None:
        """Give every prunable layer of block ``index`` its weight from ``weights``."""
        layers = self.source.layers(index)
        missing = [name for name in layers if name not in weights]
        if missing:
            raise ValueError(f"block {index} is missing the weights of {', '.join(missing[:3])}")
        with torch.no_grad():
            for name, module in layers.items():
                if weights[name].data_ptr() != module.weight.data_ptr():
                    module.weight.copy_(weights[name])


class DiscardingSink:
    """Keeps nothing: a rank other than 0 in a streamed run under torchrun (rank 0's
    sink writes every block; this rank's copy of a block is released after it)."""

    def write(self, index: int, weights: Mapping[str, Tensor]) -> None:
        """Nothing to keep."""
