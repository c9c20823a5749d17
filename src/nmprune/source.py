"""The block source stage: where a decoder block's modules and weights come from.

A block source lists the prunable layers of every block (:meth:`ModelBlocks.layer_shapes`,
for planning before any weights move), captures the hidden states entering the first block
(:meth:`~ModelBlocks.capture`) and hands the pipeline one block at a time on the compute
device (:meth:`~ModelBlocks.load`, :meth:`~ModelBlocks.release`). :class:`ModelBlocks` serves
a model held in CPU memory; a streaming source reads each block from the checkpoint instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .block_runner import BlockInputs, capture_block_inputs
from .models import find_blocks, find_linears, shared_weight_ptrs, weight_matrix


class ModelBlocks:
    """The blocks of ``model`` (in CPU memory), visiting the compute device one at a time.

    A block's prunable layers are its ``nn.Linear`` / ``Conv1D`` modules, keyed by full module
    name (``model.layers.3.mlp.down_proj``), minus any whose weight is tied to a module
    outside the blocks (:func:`nmprune.models.find_linears`).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.blocks_name, self.blocks = find_blocks(model)
        tied = shared_weight_ptrs(model, self.blocks)
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

    def capture(self, batches: Sequence[Tensor], device: torch.device, keep_hidden: bool = True
                ) -> BlockInputs:
        """Run the model on ``batches`` up to block 0 (:func:`capture_block_inputs`)."""
        return capture_block_inputs(self.model, self.blocks_name, self.blocks, list(batches), device,
                                    keep_hidden=keep_hidden)

    def load(self, index: int, device: torch.device) -> nn.Module:
        """Block ``index`` on ``device``."""
        return self.blocks[index].to(device)

    def offload(self, index: int) -> None:
        """Block ``index`` back to the CPU, its weights kept."""
        self.blocks[index].to("cpu")

    def release(self, index: int) -> None:
        """Block ``index`` is saved: back to the CPU (the model keeps its weights)."""
        self.offload(index)
