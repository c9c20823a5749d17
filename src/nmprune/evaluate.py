"""Perplexity evaluation (the SparseGPT/Wanda protocol) and a Markdown table of results.

Protocol of :func:`perplexity`: the token stream is cut into ``N // seqlen`` non-overlapping
windows of ``seqlen`` tokens (the last ``N % seqlen`` tokens are dropped, as the reference
code does); inside each window every token but the first is predicted from the ones before it;
the perplexity is ``exp`` of the mean negative log-likelihood over all predicted tokens,
i.e. over ``windows * (seqlen - 1)`` tokens. Since all windows have the same length this is
the same number as the reference ``exp(sum_w seqlen * mean_nll_w / (windows * seqlen))``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "MultipleChoice",
    "downstream_accuracy",
    "load_multiple_choice",
    "eval_windows",
    "perplexity",
    "perplexity_table",
    "window_nll",
]


def window_nll(logits: Tensor, input_ids: Tensor) -> tuple[Tensor, int]:
    """Summed next-token negative log-likelihood (float64) of a batch of windows, and the count.

    ``logits`` (batch, seqlen, vocab) are the model outputs on ``input_ids`` (batch, seqlen);
    position ``t`` predicts token ``t + 1``. The cross-entropy is taken in fp32 at least.
    """
    if logits.ndim != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    pred = logits[:, :-1, :]
    if pred.dtype not in (torch.float32, torch.float64):
        pred = pred.float()
    target = input_ids[:, 1:].to(pred.device)
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="sum")
    return nll.double(), target.numel()


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


# ------------------------------------------------------------- zero-shot multiple choice


@dataclass(frozen=True)
class MultipleChoice:
    """One zero-shot multiple-choice question: the answer is ``choices[label]``."""

    context: str
    choices: tuple[str, ...]
    label: int

    def __post_init__(self):
        if not self.context:
            raise ValueError("a multiple-choice context must not be empty")
        if len(self.choices) < 2 or not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError("a multiple-choice question needs at least two non-empty choices")
        if not isinstance(self.label, int) or not 0 <= self.label < len(self.choices):
            raise ValueError(f"label {self.label!r} is not an index into {len(self.choices)} choices")


def load_multiple_choice(path: str | Path) -> list[MultipleChoice]:
    """Questions of a JSON-lines task file: ``{"context": str, "choices": [str, ...], "label": int}``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"task file {str(path)!r} does not exist")
    out = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out.append(MultipleChoice(rec["context"], tuple(rec["choices"]), rec["label"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{p}:{lineno}: not a task record with context, choices, label ({e})") from None
    if not out:
        raise ValueError(f"task file {p} holds no questions")
    return out


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context ids and continuation ids, as lm-eval-harness does: the continuation is what
    tokenizing ``context + continuation`` adds after the context's ids (trailing spaces of the
    context move to the continuation); the tokenizer's special prefix (BOS) leads the context."""
    stripped = context.rstrip(" ")
    continuation = context[len(stripped) :] + continuation
    prefix = tokenizer("a", add_special_tokens=True, verbose=False)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False, verbose=False)["input_ids"]
    bos = prefix[: len(prefix) - len(plain)] if prefix[len(prefix) - len(plain) :] == plain else []
    ctx = tokenizer(stripped, add_special_tokens=False, verbose=False)["input_ids"]
    whole = tokenizer(stripped + continuation, add_special_tokens=False, verbose=False)["input_ids"]
    n = len(ctx)
    while n > 0 and whole[:n] != ctx[:n]:  # a merge across the boundary: keep the common prefix
        n -= 1
    return list(bos) + list(whole[:n]), list(whole[n:])


@torch.no_grad()
def downstream_accuracy(
    model,
    tokenizer,
    questions: Sequence[MultipleChoice] | str | Path,
    device=None,
    progress: bool = True,
) -> dict[str, float]:
    """Zero-shot multiple-choice accuracy by log-likelihood (the lm-eval-harness ``acc``/``acc_norm``).

    Each choice is scored by the summed log-probability of its tokens after the context;
    ``acc`` picks the highest sum, ``acc_norm`` the highest sum per character of the choice.
    ``questions``: a list of :class:`MultipleChoice` or the path of a JSON-lines task file
    (:func:`load_multiple_choice`). Returns ``{"acc", "acc_norm", "n"}``. Runs like
    :func:`perplexity` (no grad, eval mode, the model's input device unless ``device``).
    """
    if isinstance(questions, (str, Path)):
        questions = load_multiple_choice(questions)
    if not questions:
        raise ValueError("no questions to evaluate")
    run_on = torch.device(device) if device is not None else _input_device(model)
    was_training = model.training
    model.eval()
    correct = correct_norm = 0
    try:
        from tqdm.auto import tqdm

        for q in tqdm(questions, desc="multiple choice", unit="question", disable=not progress):
            pairs = [_encode_pair(tokenizer, q.context, c) for c in q.choices]
            seqs = [ctx + cont for ctx, cont in pairs]
            if any(not cont for _, cont in pairs) or any(len(s) < 2 for s in seqs):
                raise ValueError(f"a choice of {q.context[:40]!r} tokenizes to nothing after its context")
            width = max(map(len, seqs))
            batch = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):  # right padding: causal attention never sees it
                batch[i, : len(s)] = torch.tensor(s)
            logits = model(input_ids=batch.to(run_on), use_cache=False).logits
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            scores = []
            for i, (ctx, cont) in enumerate(pairs):
                pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
                scores.append(float(logp[i, pos, torch.tensor(cont)].double().sum()))
            best = max(range(len(scores)), key=lambda i: scores[i])
            best_norm = max(range(len(scores)), key=lambda i: scores[i] / len(q.choices[i]))
            correct += best == q.label
            correct_norm += best_norm == q.label
    finally:
        model.train(was_training)
    return {"acc": correct / len(questions), "acc_norm": correct_norm / len(questions), "n": float(len(questions))}
