"""Writing a pruned model shard by shard, without the whole model in memory.

:class:`ShardedWriter` plans the output layout up front from the input checkpoint (the
same tensors, in the model's dtype): one safetensors shard per decoder block, written by
:meth:`ShardedWriter.write` as soon as the block is final (its pruned layer weights as
given, its other tensors such as norms and biases copied from the input checkpoint; a
block sink for :func:`nmprune.pipeline.prune_model`), and the tensors outside
the blocks (embeddings, norms, LM head) copied from the input checkpoint tensor by tensor
into shards of at most one block's size (a larger tensor gets a shard of its own). Shards
are named ``model-NNNNN-of-NNNNN.safetensors`` and listed by a standard
``model.safetensors.index.json``, so the directory loads with ``from_pretrained``.
Everything goes into ``OUT.partial/unfinished`` (:meth:`ShardedWriter.close` completes it as a model
directory that can be read back, e.g. to evaluate it) and appears under ``OUT`` by one
rename at :meth:`ShardedWriter.publish`, as :func:`nmprune.output.save_pretrained_atomic`
does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..output import UNFINISHED, partial_save_dir, publish_atomic, remove_partial_save, staging_dir, writing
from ..stages.sink import DiscardingSink
from .files import INDEX
from .source import StreamingModel


def _pack(keys: list[str], size: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive groups of ``keys`` of at most ``limit`` bytes (a larger key alone)."""
    groups: list[list[str]] = []
    total = limit + 1
    for key in keys:
        if total + size[key] > limit:
            groups.append([])
            total = 0
        groups[-1].append(key)
        total += size[key]
    return groups


class ShardedWriter:
    """The output directory of a streamed run (module docstring)."""

    def __init__(self, source: StreamingModel, out: str | os.PathLike, staged: bool = True):
        self.source = source
        self.out = Path(out)
        itemsize = {k: source.output_dtype(k).itemsize for k in
                    source.outside_keys() + [k for i in range(len(source)) for k in source.block_keys(i)]}
        size = {k: itemsize[k] * _numel(source.files.shape(k)) for k in itemsize}
        self.block_groups = [source.block_keys(i) for i in range(len(source))]
        limit = max((sum(size[k] for k in g) for g in self.block_groups), default=1)
        self.outside_groups = _pack(source.outside_keys(), size, limit)
        groups = self.block_groups + self.outside_groups
        n = len(groups)
        self.shard_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.weight_map = {k: name for name, g in zip(self.shard_names, groups) for k in g}
        self.total_size = sum(size.values())
        self.written: set[str] = set()
        # not ``staged``: the directory another process stages (:class:`RankZeroShards`)
        self.tmp = staging_dir(self.out) if staged else partial_save_dir(self.out) / UNFINISHED

    def _save(self, shard: str, tensors: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        with writing(self.tmp / shard):
            save_file({k: v.detach().to("cpu", self.source.output_dtype(k)).contiguous()
                       for k, v in tensors.items()}, str(self.tmp / shard), metadata={"format": "pt"})
        self.written.add(shard)

    def write(self, index: int, weights: Mapping[str, Tensor]) -> None:
        """Write block ``index`` into its shard: ``weights`` maps every prunable layer's
        full module name to its weight as the layer stores it; the block's other tensors
        come from the input checkpoint."""
        layers = self.source.layers(index)
        missing = [name for name in layers if name not in weights]
        if missing:
            raise ValueError(f"block {index} is missing the weights of {', '.join(missing[:3])}")
        given = {self.source.weight_key(name): weights[name] for name in layers}
        tensors = self.source.files.read([k for k in self.block_groups[index] if k not in given])
        self._save(self.shard_names[index], {**tensors, **given})

    def read(self, index: int) -> dict[str, Tensor]:
        """Block ``index``'s prunable layers' weights as :meth:`write` wrote them (from its shard)."""
        from safetensors import safe_open

        with safe_open(str(self.tmp / self.shard_names[index]), framework="pt") as shard:
            return {name: shard.get_tensor(self.source.weight_key(name)) for name in self.source.layers(index)}

    def _copy_outside(self) -> None:
        """Copy the tensors outside the blocks from the input checkpoint."""
        for j, keys in enumerate(self.outside_groups):
            self._save(self.shard_names[len(self.block_groups) + j],
                       self.source.files.read(keys))

    def close(self, tokenizer: Any = None) -> Path:
        """Copy the tensors outside the blocks and write the index, configuration,
        generation configuration and tokenizer: ``OUT.partial/unfinished`` is a complete model
        directory. Every block must have been written."""
        self._copy_outside()
        missing = [s for s in self.shard_names if s not in self.written]
        if missing:
            raise RuntimeError(f"shard {missing[0]} was never written")
        index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
        model = self.source.model
        model.config.architectures = [type(model).__name__]
        model.config.dtype = self.source.dtype
        with writing(self.tmp):
            (self.tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            model.config.save_pretrained(self.tmp)
            if model.can_generate():
                model.generation_config.save_pretrained(self.tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(self.tmp)
        return self.tmp

    def finish(self, tokenizer: Any) -> StreamingModel:
        """Complete the directory (:meth:`close`) and open it as the pruned model, streamed."""
        return StreamingModel(self.close(tokenizer), dtype=self.source.dtype)

    def publish(self, extra_files: Mapping[str, str] | None = None) -> Path:
        """Add ``extra_files`` (name -> text) and rename the directory to ``out``; a failed
        write (a full disk, say) abandons the output."""
        try:
            with writing(self.tmp):
                for name, text in (extra_files or {}).items():
                    (self.tmp / name).write_text(text)
        except BaseException:
            self.abandon()
            raise
        return publish_atomic(self.tmp, self.out)

    def abandon(self) -> None:
        """Delete the unfinished output."""
        remove_partial_save(self.out)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class RankZeroShards(DiscardingSink):
    """The sink of a rank other than 0 in a streamed run under torchrun: it writes nothing
    (rank 0's :class:`ShardedWriter` writes every block) but reads a block's pruned weights
    back from the shard rank 0 wrote (:meth:`ShardedWriter.read`), for the global
    distillation sharded over the ranks (:mod:`nmprune.stages.sharded_pass`)."""

    def __init__(self, source: StreamingModel, out: str | os.PathLike):
        self.shards = ShardedWriter(source, out, staged=False)

    def read(self, index: int) -> dict[str, Tensor]:
        return self.shards.read(index)
