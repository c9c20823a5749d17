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
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .memory import release_memory
from .models import evaluating

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
    from tqdm.auto import tqdm

    with evaluating(model, device) as run_on, \
            tqdm(total=windows.shape[0], desc="perplexity", unit="window", disable=not progress) as bar:
        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for ids in windows.split(batch_size):
                ids = ids.to(run_on)
                yield ids, model(input_ids=ids, use_cache=False).logits  # no local keeps them
                bar.update(ids.shape[0])

        return batch_perplexity(batches())


def batch_perplexity(batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """``exp`` of the mean next-token negative log-likelihood (:func:`window_nll`) over
    ``(ids, logits)`` batches, summed in float64. Each batch's logits are dropped and the
    heap's free pages returned before the next batch is drawn, so one batch of logits (and
    of activations) is alive at a time, provided ``batches`` keeps no reference to the
    tuples it yields (a generator yielding fresh tuples; not a ``zip``)."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for ids, logits in batches:
        nll, n = window_nll(logits, ids)
        del logits
        release_memory(collect=False)
        total += nll.cpu()
        count += n
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
