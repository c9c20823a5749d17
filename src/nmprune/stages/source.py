"""The block source stage: where a decoder block's modules and weights come from.

A block source (the :class:`BlockSource` interface) lists the prunable layers of every block
(``layer_shapes``, for planning before any weights move), captures the hidden states
entering the first block (``capture``) and hands the pipeline one block at a time on the
compute device (``load``, ``offload``, ``release``), and turns the last block's outputs into
logits through the model's own head (``head_logits``). :class:`ModelBlocks` serves a model held
in CPU memory; :class:`nmprune.streaming.StreamingModel` reads each block from the
checkpoint instead. Both find blocks and layers by :class:`DecoderBlocks`.

A source is also what a prune or eval job (:mod:`nmprune.job`) holds of its model, so that
the job never asks which kind it has: it checks the weights (``check_finite``), measures
perplexity (``perplexity``), hands lm-eval the whole model (``whole_model``, refused when
streamed) and opens where the pruned blocks go (``output``, a
:class:`~nmprune.stages.sink.OutputSink`). For the global distillation it gives the dense
model's distribution on the pass's own windows before pruning (``dense_teachers``) and the
whole pruned model to train (``whole_pruned``): a streamed source loads every block for it,
with the pruned weights its sink wrote, and writes the trained ones back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from ..distill import TeacherTopK
from .block_runner import BlockInputs, capture_block_inputs, head_logits
from .distillation import dense_teachers
from ..models import find_blocks, find_linears, outside_parameters, weight_matrix

if TYPE_CHECKING:
    from .sink import BlockSink, OutputSink

#: Why lm-eval cannot run on a streamed model (``{flag}``: the option that asked for it).
STREAMED_TASKS = (
    "{flag} cannot run on a streamed model (--offload, a model larger than memory, or "
    "several ranks on a safetensors model): lm-eval calls the whole model at once, so it "
    "needs every weight in memory. Prune without --eval-tasks, then run "
    "'nmprune eval OUT --tasks ...' on the saved model on a machine where it fits (the "
    "perplexity evaluation streams, lm-eval does not)")


class BlockSource(Protocol):
    """What :func:`nmprune.pipeline.prune_model` and the jobs ask of a block source."""

    model: nn.Module
    streamed: bool  # the weights stay in the checkpoint (read block by block)

    def __len__(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def layers(self, index: int) -> dict[str, nn.Module]: ...

    def layer_shapes(self) -> dict[str, tuple[int, int]]: ...

    def capture(self, batches: Sequence[Tensor], device: torch.device, keep_hidden: bool = True
                ) -> BlockInputs: ...

    def load(self, index: int, device: torch.device) -> nn.Module: ...

    def head_logits(self, template: Any, batches: Sequence[Tensor], finals: Sequence[Tensor],
                    device: torch.device) -> Iterator[tuple[Tensor, Tensor]]: ...

    def offload(self, index: int) -> None: ...

    def release(self, index: int) -> None: ...

    def check_finite(self) -> None: ...

    def perplexity(self, input_ids: Tensor, seqlen: int, device: Any, progress: bool,
                   prefix: Sequence[int], desc: str) -> float: ...

    def whole_model(self, flag: str) -> nn.Module: ...

    def dense_teachers(self, batches: Sequence[Tensor], k: int, device: torch.device,
                       dtype: torch.dtype | None) -> list[TeacherTopK]: ...

    def whole_pruned(self, sink: BlockSink) -> AbstractContextManager[nn.Module]: ...

    def block(self, index: int, device: torch.device | str = "cpu") -> AbstractContextManager[nn.Module]: ...

    def outside(self, device: torch.device | str = "cpu") -> AbstractContextManager[nn.Module]: ...

    def output(self, out: str | os.PathLike, writes: bool) -> OutputSink: ...


class DecoderBlocks:
    """The decoder blocks of ``model`` and their prunable layers, the part every block
    source shares: a block's prunable layers are its ``nn.Linear`` / ``Conv1D`` modules,
    keyed by full module name (``model.layers.3.mlp.down_proj``), minus any whose weight is
    tied to a module outside the blocks (:func:`nmprune.models.outside_parameters`, the one
    rule for tied weights). ``model`` may live on the meta device."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.blocks_name, self.blocks = find_blocks(model)
        tied = outside_parameters(model, self.blocks)
        self._layers = [{f"{self.blocks_name}.{i}.{sub}": m for sub, m in find_linears(b, tied).items()}
                        for i, b in enumerate(self.blocks)]

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: token ids must lie below this."""
        return self.model.get_input_embeddings().weight.shape[0]

    def layers(self, index: int) -> dict[str, nn.Module]:
        """The prunable layers of block ``index`` by full name."""
        return self._layers[index]

    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """``(d_out, d_in)`` of every prunable layer of every block, by full name."""
        return {name: tuple(weight_matrix(m).shape) for layers in self._layers
                for name, m in layers.items()}

    @contextmanager
    def block(self, index: int, device: torch.device | str = "cpu") -> Iterator[nn.Module]:
        """Block ``index`` loaded (:meth:`load`) for the ``with`` body, released afterwards."""
        try:
            yield self.load(index, device)
        finally:
            self.release(index)


class ModelBlocks(DecoderBlocks):
    """The block source of a model in CPU memory: its blocks visit the compute device one
    at a time. ``origin`` names the model in messages (where it was loaded from)."""

    streamed = False

    def __init__(self, model: nn.Module, origin: object = "the model"):
        super().__init__(model)
        self.origin = origin

    def check_finite(self) -> None:
        """Refuse NaN or Inf in any parameter or buffer, naming each
        (:func:`nmprune.validate.check_finite`)."""
        from ..validate import check_finite

        check_finite(self.model, self.origin)

    def perplexity(self, input_ids: Tensor, seqlen: int, device: Any, progress: bool,
                   prefix: Sequence[int], desc: str) -> float:
        """The model's perplexity on a ``(1, N)`` token stream
        (:func:`nmprune.evaluate.perplexity`)."""
        from ..evaluate import perplexity

        return perplexity(self.model, input_ids, seqlen=seqlen, device=device, progress=progress,
                          prefix=prefix, desc=desc)

    def whole_model(self, flag: str) -> nn.Module:
        """The model itself, for lm-eval."""
        return self.model

    @contextmanager
    def outside(self, device: torch.device | str = "cpu") -> Iterator[nn.Module]:
        """The model, whose modules outside the blocks are always loaded."""
        yield self.model

    def dense_teachers(self, batches: Sequence[Tensor], k: int, device: torch.device,
                       dtype: torch.dtype | None) -> list[TeacherTopK]:
        """The model's (still dense) ``k`` most likely tokens on ``batches``, for the global
        distillation (:func:`~nmprune.stages.distillation.dense_teachers`)."""
        return dense_teachers(self.model, batches, k, device, dtype)

    @contextmanager
    def whole_pruned(self, sink: BlockSink) -> Iterator[nn.Module]:
        """The model itself, pruned in place by ``sink`` (a :class:`~nmprune.stages.sink.ModelSink`):
        what the global distillation trains is already the output."""
        yield self.model

    def output(self, out: str | os.PathLike, writes: bool) -> OutputSink:
        """A :class:`~nmprune.stages.sink.ModelSink` into this model, saved to ``out`` whole
        (every rank keeps its copy up to date: ``writes`` only says who saves)."""
        from .sink import ModelSink

        return ModelSink(self, out)

    def capture(self, batches: Sequence[Tensor], device: torch.device, keep_hidden: bool = True
                ) -> BlockInputs:
        """Run the model on ``batches`` up to block 0 (:func:`capture_block_inputs`)."""
        return capture_block_inputs(self.model, self.blocks_name, self.blocks, list(batches), device,
                                    keep_hidden=keep_hidden)

    def head_logits(self, template: Any, batches: Sequence[Tensor], finals: Sequence[Tensor],
                    device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
        """Each batch's ids and logits from its last-block output (:func:`head_logits`); the
        modules outside the blocks visit ``device`` meanwhile."""
        yield from head_logits(self.model, self.blocks_name, self.blocks, template, batches, finals, device)

    def load(self, index: int, device: torch.device) -> nn.Module:
        """Block ``index`` on ``device``."""
        return self.blocks[index].to(device)

    def offload(self, index: int) -> None:
        """Block ``index`` back to the CPU, its weights kept."""
        self.blocks[index].to("cpu")

    def release(self, index: int) -> None:
        """Block ``index`` is saved: back to the CPU (the model keeps its weights)."""
        self.offload(index)
