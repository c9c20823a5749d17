"""Perplexity of a :class:`~nmprune.streaming.source.StreamingModel`, block by block.

The evaluation windows (:func:`nmprune.evaluate.eval_windows`) go through the model the
way pruning sees it: the embeddings turn them into the hidden states entering block 0
(:func:`nmprune.stages.block_runner.capture_block_inputs`), each block in turn is loaded, applied to
the hidden states of every window batch and released, and finally the model's own forward
pass runs once more per batch with the blocks replaced by stand-ins that hand back the
last block's output, so the model's final norm, LM head and any logit post-processing
produce the logits. Only one block (or the modules outside the blocks) is in memory at
a time, plus the hidden states of the evaluation windows; the same operations on the same
batches as :func:`nmprune.evaluate.perplexity` give the same number.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..evaluate import batch_perplexity, eval_windows
from .source import StreamingModel


@torch.no_grad()
def streaming_perplexity(source: StreamingModel, input_ids: Tensor, seqlen: int = 2048,
                         batch_size: int = 1, device: str | torch.device | None = None,
                         progress: bool = True, prefix: Sequence[int] = (), desc: str = "perplexity") -> float:
    """Perplexity of ``source``'s model on a ``(1, N)`` token stream, block by block
    (module docstring); arguments as :func:`nmprune.evaluate.perplexity` (``device``
    defaults to the CPU)."""
    device = torch.device(device or "cpu")
    batches = list(eval_windows(input_ids, seqlen, batch_size, prefix).split(batch_size))
    inputs = source.block_outputs(batches, device, progress, desc)
    return batch_perplexity(source.head_logits(inputs.output_template, batches, inputs.hidden, device))
