"""Perplexity evaluation (the SparseGPT/Wanda protocol) and a Markdown table of results.

Protocol of :func:`perplexity`: the token stream is cut into ``N // seqlen`` non-overlapping
windows of ``seqlen`` tokens (the last ``N % seqlen`` tokens are dropped, as the reference
code does); inside each window every token but the first is predicted from the ones before it;
the perplexity is ``exp`` of the mean negative log-likelihood over all predicted tokens,
i.e. over ``windows * (seqlen - 1)`` tokens. Since all windows have the same length this is
the same number as the reference ``exp(sum_w seqlen * mean_nll_w / (windows * seqlen))``.
With a ``prefix`` (the ids the tokenizer puts before a text, e.g. Gemma's BOS:
:func:`nmprune.data.window_prefix`), each window is the prefix followed by ``seqlen`` minus that
many tokens of the stream (whose own leading prefix is dropped), so every token of a window's
text is predicted, the first one from the prefix, as lm-eval scores such models.

Downstream accuracy (lm-evaluation-harness tasks) is :mod:`nmprune.downstream`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .memory import release_memory
from .models import evaluating

__all__ = [
    "eval_windows",
    "perplexity",
    "perplexity_table",
    "window_kl",
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


def window_kl(reference: Tensor, logits: Tensor, chunk_bytes: int = 16 << 20) -> tuple[Tensor, int]:
    """Summed ``KL(softmax(reference) || softmax(logits))`` (float64) over every position of a
    batch of windows, and the count: how far a model's next-token distributions are from a
    reference model's on the same windows, in fp32 at least and in runs of positions of about
    ``chunk_bytes`` (as :func:`window_nll`)."""
    if reference.shape != logits.shape or logits.ndim != 3:
        raise ValueError(f"logits {tuple(logits.shape)} do not match the reference {tuple(reference.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = max(1, chunk_bytes // (logits.shape[-1] * dtype.itemsize))
    flat_ref, flat = reference.reshape(-1, logits.shape[-1]), logits.reshape(-1, logits.shape[-1])
    kl = torch.zeros((), dtype=torch.float64, device=logits.device)
    for start in range(0, flat.shape[0], rows):
        ref = F.log_softmax(flat_ref[start:start + rows].to(dtype), -1)
        kl += F.kl_div(F.log_softmax(flat[start:start + rows].to(dtype), -1), ref, log_target=True,
                       reduction="sum").double()
    return kl, flat.shape[0]


def eval_windows(input_ids: Tensor, seqlen: int, batch_size: int = 1, prefix: Sequence[int] = ()) -> Tensor:
    """The ``(windows, seqlen)`` non-overlapping windows of a ``(1, N)`` token stream, each
    starting with ``prefix`` (module docstring), after checking the arguments of
    :func:`perplexity`."""
    from .data.tokens import prefixed_windows, strip_prefix, window_body

    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be a tensor of shape (1, N), got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a LongTensor, got {input_ids.dtype}")
    if not isinstance(seqlen, int) or seqlen < 2:
        raise ValueError(f"seqlen must be an integer >= 2, got {seqlen!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    body = window_body(seqlen, prefix)
    stream = strip_prefix(input_ids[0], prefix)
    nwindows = stream.shape[0] // body
    if nwindows == 0:
        raise ValueError(
            f"{input_ids.shape[1]} tokens make no window of seqlen={seqlen}; lower seqlen or evaluate more text"
        )
    return prefixed_windows(stream[: nwindows * body].reshape(nwindows, body), prefix)


def perplexity(
    model,
    input_ids: Tensor,
    seqlen: int = 2048,
    batch_size: int = 1,
    device=None,
    progress: bool = True,
    prefix: Sequence[int] = (),
    desc: str = "perplexity",
) -> float:
    """Perplexity of a causal LM on a token stream, by non-overlapping windows (module docstring).

    ``model``: a Hugging Face causal LM (or any module whose ``model(input_ids).logits`` are
    next-token logits). ``input_ids``: LongTensor of shape (1, N). ``device``: where to run;
    by default the device of the model's input embeddings. A model living elsewhere (and not
    dispatched over several devices by accelerate) is moved to ``device`` for the evaluation
    and moved back afterwards. The model is put in eval mode during the call and its
    training flag restored. ``prefix``: ids every window starts with (module docstring).
    ``desc``: the progress bar's label.
    Raises ValueError when ``N < seqlen`` (no window).
    """
    from .progress import bar as progress_bar

    windows = eval_windows(input_ids, seqlen, batch_size, prefix)
    with evaluating(model, device) as run_on, \
            progress_bar(total=windows.shape[0], desc=desc, unit="window", enabled=progress) as bar:
        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for ids in windows.split(batch_size):
                ids = ids.to(run_on)
                yield ids, model(input_ids=ids, use_cache=False).logits  # no local keeps them
                bar.update(ids.shape[0])

        return batch_perplexity(batches())


def perplexity_from_nll(mean_nll: float) -> float:
    """``exp`` of a mean negative log-likelihood per token, infinite where it overflows
    (a model whose head overflows; ``math.exp`` would raise)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


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
    return perplexity_from_nll(float(total) / count)


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
