"""The block sink stage: where a finished block's pruned weights go.

A sink (the :class:`BlockSink` interface) receives, block by block, the weights of every
prunable layer as the layer stores them (``module.weight``), keyed by full module name.
:class:`ModelSink` writes them into a model held in memory (a no-op for a block pruned in
place; a resumed block's weights come from the checkpoint); a streaming sink writes
safetensors shards instead; :class:`DiscardingSink` keeps nothing (the ranks other than 0 of a
streamed run under torchrun, where rank 0 writes the shards).

A job's sink is an :class:`OutputSink` (from its source's ``output``): once every block is
written, ``finish`` completes the output and gives the pruned model to evaluate, ``publish``
makes it appear under ``--out`` at once, and ``abandon`` removes what a failed run wrote.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from .source import BlockSource, ModelBlocks


class BlockSink(Protocol):
    """What :func:`nmprune.pipeline.prune_model` asks of a sink."""

    def write(self, index: int, weights: Mapping[str, Tensor]) -> None:
        """Keep block ``index``'s final weights (every prunable layer's, by full name)."""

    def read(self, index: int) -> dict[str, Tensor]:
        """Block ``index``'s weights as last written (every prunable layer's, by full name)."""


class OutputSink(BlockSink, Protocol):
    """What a prune job (:func:`nmprune.job.run`) asks of its sink beyond the blocks."""

    def finish(self, tokenizer: Any) -> BlockSource:
        """Every block is written: complete the output (``tokenizer`` beside it) and return
        the pruned model, to evaluate."""

    def publish(self, extra_files: Mapping[str, str]) -> None:
        """Write the output, with ``extra_files`` (name -> text), so that it appears under
        ``out`` at once."""

    def abandon(self) -> None:
        """Remove what a failed run left of the output."""


class ModelSink:
    """Writes finished blocks into the model behind ``source``; saved whole to ``out``."""

    def __init__(self, source: ModelBlocks, out: str | os.PathLike | None = None):
        self.source = source
        self.out = None if out is None else Path(out)
        self.tokenizer: Any = None

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

    def read(self, index: int) -> dict[str, Tensor]:
        """The model's own weights of block ``index``'s prunable layers."""
        return {name: module.weight for name, module in self.source.layers(index).items()}

    def finish(self, tokenizer: Any) -> ModelBlocks:
        """The model is pruned in place: it is its own output (saved with ``tokenizer``)."""
        self.tokenizer = tokenizer
        return self.source

    def publish(self, extra_files: Mapping[str, str]) -> None:
        """Save model, tokenizer and ``extra_files`` to ``out`` by one rename
        (:func:`nmprune.output.save_pretrained_atomic`)."""
        from ..output import save_pretrained_atomic

        save_pretrained_atomic(self.source.model, self.tokenizer, self.out, dict(extra_files))

    def abandon(self) -> None:
        """Nothing is written before :meth:`publish`, which cleans up after itself."""


class DiscardingSink:
    """Keeps nothing: a rank other than 0 in a streamed run under torchrun (rank 0's
    sink writes every block; this rank's copy of a block is released after it)."""

    def write(self, index: int, weights: Mapping[str, Tensor]) -> None:
        """Nothing to keep."""

    def read(self, index: int) -> dict[str, Tensor]:
        raise RuntimeError("this rank writes no output: rank 0 holds the pruned weights")

    def finish(self, tokenizer: Any) -> BlockSource:
        raise RuntimeError("this rank writes no output: rank 0 holds the pruned model")

    def publish(self, extra_files: Mapping[str, str]) -> None:
        raise RuntimeError("this rank writes no output: rank 0 publishes it")

    def abandon(self) -> None:
        """Nothing was written."""
