"""Perplexity evaluation (the SparseGPT/Wanda protocol) and a Markdown table of results.

Protocol of :func:`perplexity`: the token stream is cut into ``N // seqlen`` non-overlapping
windows of ``seqlen`` tokens (the last ``N % seqlen`` tokens are dropped, as the reference
code does); inside each window every token but the first is predicted from the ones before it;
the perplexity is ``exp`` of the mean negative log-likelihood over all predicted tokens,
i.e. over ``windows * (seqlen - 1)`` tokens. Since all windows have the same length this is
the same number as the reference ``exp(sum_w seqlen * mean_nll_w / (windows * seqlen))``.

Downstream accuracy (lm-evaluation-harness tasks) is :mod:`nmprune.downstream`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .memory import release_memory

__all__ = [
    "eval_windows",
    "perplexity",
    "perplexity_table",
    "window_nll",
]


def window_nll(logits: Tensor, input_ids: Tensor, chunk_bytes: int = 16 << 20) -> tuple[Tensor, int]:
    """Summed next-token negative log-likelihood (float64) of a batch of windows, and the count.

    ``logits`` (batch, seqlen, vocab) are the model outputs on ``input_ids`` (batch, seqlen);
    position ``t`` predicts token ``t + 1``. The cross-entropy is taken in fp32 at least, over
    runs of positions of about ``chunk_bytes`` each, whose sums add up in float64: the
    log-softmax (and a bfloat16 model's fp32 copy) never exists for a whole batch at once.
    """
    if logits.ndim != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = max(1, chunk_bytes // (logits.shape[-1] * dtype.itemsize))
    target = input_ids[:, 1:].to(logits.device)
    nll = torch.zeros((), dtype=torch.float64, device=logits.device)
    for pred, tgt in zip(logits[:, :-1], target):
        for start in range(0, tgt.shape[0], rows):
            chunk = pred[start:start + rows].to(dtype)
            nll += F.cross_entropy(chunk, tgt[start:start + rows], reduction="sum").double()
    return nll, target.numel()


def _input_device(model) -> torch.device:
    """Where the model takes its inputs: the device of its input embeddings."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.device
    return next(model.parameters()).device


def eval_windows(input_ids: Tensor, seqlen: int, batch_size: int = 1) -> Tensor:
    """The ``(windows, seqlen)`` non-overlapping windows of a ``(1, N)`` token stream
    (module docstring), after checking the arguments of :func:`perplexity`."""
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be a tensor of shape (1, N), got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a LongTensor, got {input_ids.dtype}")
    if not isinstance(seqlen, int) or seqlen < 2:
        raise ValueError(f"seqlen must be an integer >= 2, got {seqlen!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    nwindows = input_ids.shape[1] // seqlen
    if nwindows == 0:
        raise ValueError(
            f"{input_ids.shape[1]} tokens make no window of seqlen={seqlen}; lower seqlen or evaluate more text"
        )
    return input_ids[0, : nwindows * seqlen].reshape(nwindows, seqlen)


@torch.no_grad()
def perplexity(
    model,
    input_ids: Tensor,
    seqlen: int = 2048,
    batch_size: int = 1,
    device=None,
    progress: bool = True,
) -> float:
    """Perplexity of a causal LM on a token stream, by non-overlapping windows (module docstring).

    ``model``: a Hugging Face causal LM (or any module whose ``model(input_ids).logits`` are
    next-token logits). ``input_ids``: LongTensor of shape (1, N). ``device``: where to run;
    by default the device of the model's input embeddings. A model living elsewhere (and not
    dispatched over several devices by accelerate) is moved to ``device`` for the evaluation
    and moved back afterwards. The model is put in eval mode during the call and its
    training flag restored. Raises ValueError when ``N < seqlen`` (no window).
    """
    windows = eval_windows(input_ids, seqlen, batch_size)
    nwindows = windows.shape[0]

    home = _input_device(model)
    run_on = torch.device(device) if device is not None else home
    move = run_on != home and not getattr(model, "hf_device_map", None)
    was_training = model.training
    if move:
        model.to(run_on)
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        from tqdm.auto import tqdm

        with tqdm(total=nwindows, desc="perplexity", unit="window", disable=not progress) as bar:
            for start in range(0, nwindows, batch_size):
                batch = windows[start : start + batch_size].to(run_on)
                logits = model(input_ids=batch, use_cache=False).logits
                nll, n = window_nll(logits, batch)
                del logits  # before the next batch's: one batch of logits at a time
                release_memory(collect=False)  # the batch's activations: heap pages back
                total += nll.cpu()
                count += n
                bar.update(batch.shape[0])
    finally:
        if move:
            model.to(home)
        model.train(was_training)
    return math.exp(float(total) / count)


def _fmt(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else str(value)


def perplexity_table(rows: Mapping[str, Mapping[str, float]]) -> str:
    """A Markdown table: one row per model, one column per dataset (in order of first appearance).

    >>> print(perplexity_table({"dense": {"wiki": 12.3456}, "2:4 prox": {"wiki": 20.0, "austen": 30.0}}))
    | model | wiki | austen |
    | --- | ---: | ---: |
    | dense | 12.35 | — |
    | 2:4 prox | 20.00 | 30.00 |
    """
    if not rows:
        raise ValueError("perplexity_table needs at least one row")
    columns: list[str] = []
    for values in rows.values():
        columns.extend(c for c in values if c not in columns)
    lines = [
        "| model | " + " | ".join(columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for name, values in rows.items():
        cells = [_fmt(float(values[c])) if c in values else "—" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
