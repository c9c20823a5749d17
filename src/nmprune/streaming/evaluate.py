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

from typing import Any

import torch
from torch import Tensor, nn

from ..evaluate import batch_perplexity, eval_windows
from ..stages.block_runner import BlockInputs, Recorder, output_like, run_block
from ..memory import release_memory
from .source import StreamingModel


def _progress(iterable, progress: bool, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not progress, **kwargs)


def block_outputs(source: StreamingModel, batches: list[Tensor], device: torch.device,
                  progress: bool = False) -> BlockInputs:
    """The last block's outputs for each token batch (``hidden``), with the per-block call
    arguments and the output template of the capture."""
    inputs = source.capture(batches, device)
    for i in _progress(range(len(source)), progress, desc="perplexity blocks"):
        with source.block(i, device) as block:
            inputs.hidden = [run_block(block, h, inputs.call(i, h)) for h in inputs.hidden]
        release_memory(collect=False)  # else the heap fragments: about +5 MiB a block on SmolLM2
    return inputs


def head_logits(source: StreamingModel, inputs: BlockInputs, batches: list[Tensor],
                device: torch.device):
    """Yield each batch's ids (on ``device``) and logits, from its last-block output
    (``inputs.hidden``). One tuple per batch and no local holds the logits, so a consumer
    that drops them frees them before the next batch's are made (a ``zip`` would keep
    its last tuple, and so one more batch of logits, alive)."""
    parent_name, _, attr = source.blocks_name.rpartition(".")
    parent = source.model.get_submodule(parent_name) if parent_name else source.model
    current: dict[str, Tensor] = {}

    def replay(index: int, args: tuple, kwargs: dict) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return output_like(inputs.output_template, current["final"] if index == 0 else hidden)

    stand_ins = nn.ModuleList([Recorder(i, b, replay) for i, b in enumerate(source.blocks)])
    with source.outside(device):
        setattr(parent, attr, stand_ins)
        try:
            for ids, final in zip(batches, inputs.hidden):
                current["final"] = final
                ids = ids.to(device)
                yield ids, source.model(input_ids=ids, use_cache=False).logits
        finally:
            setattr(parent, attr, source.blocks)


@torch.no_grad()
def streaming_perplexity(source: StreamingModel, input_ids: Tensor, seqlen: int = 2048,
                         batch_size: int = 1, device: str | torch.device | None = None,
                         progress: bool = True) -> float:
    """Perplexity of ``source``'s model on a ``(1, N)`` token stream, block by block
    (module docstring); arguments as :func:`nmprune.evaluate.perplexity` (``device``
    defaults to the CPU)."""
    device = torch.device(device or "cpu")
    batches = list(eval_windows(input_ids, seqlen, batch_size).split(batch_size))
    inputs = block_outputs(source, batches, device, progress)
    return batch_perplexity(head_logits(source, inputs, batches, device))
