"""Calibration and evaluation text: sources, token streams and calibration batches.

Public API:

- :func:`load_text` ``(source, split) -> str``: the text of a split ("calib" or "eval").
- :func:`calibration_batch` ``(tokenizer, source, nsamples, seqlen, seed) -> (nsamples, seqlen)``
  calibration windows, the inputs whose layer activations ``X`` give the Hessians
  ``H = X X^T / n`` of the local squared loss (eq. ``squared_loss``, problem eq. ``n_m_squard_loss``).
- :func:`eval_tokens` ``(tokenizer, source, max_tokens) -> (1, N)``: the held-out token stream
  for :func:`nmprune.evaluate.perplexity`.

Sources are described in :mod:`nmprune.data.sources` and docs/data.md.
"""

from __future__ import annotations

import random

from torch import Tensor

from .corpus import Corpus
from .sources import (
    C4_EVAL_DOCUMENTS,
    NAMED_SOURCES,
    SPLITS,
    load_corpus,
    parse_source,
    wiki_split_of,
)
from .tokens import (
    disjoint_windows,
    packed_windows,
    prefixed_windows,
    reference_document_windows,
    reference_windows,
    strip_prefix,
    tokenize_text,
    window_body,
    window_prefix,
)

#: The reference C4 evaluation keeps the first C4_EVAL_WINDOWS * seqlen tokens.
C4_EVAL_WINDOWS = 256

__all__ = [
    "C4_EVAL_DOCUMENTS",
    "C4_EVAL_WINDOWS",
    "NAMED_SOURCES",
    "SPLITS",
    "Corpus",
    "c4_eval_max_tokens",
    "calibration_batch",
    "eval_tokens",
    "load_corpus",
    "load_text",
    "packed_calibration_batch",
    "parse_source",
    "tokenize_text",
    "wiki_split_of",
    "window_prefix",
]


def load_text(source: str, split: str) -> str:
    """The text of ``split`` ("calib" or "eval") of ``source``, documents joined as the protocol says.

    ``source``: "wiki" (default packaged text), "c4", "c4:PATH", "wikitext2", "wikitext2:PATH",
    "austen", a .txt/.jsonl path (split 90/10), or "whole:PATH" (the whole file).
    Unknown sources raise ValueError listing the valid ones.
    """
    return load_corpus(source, split).text()


def calibration_batch(tokenizer, source: str = "wiki", nsamples: int = 128, seqlen: int = 512, seed: int = 0) -> Tensor:
    """Calibration inputs: a LongTensor of shape (nsamples, seqlen), reproducible from ``seed``.

    - "c4": the SparseGPT/Wanda sampler, document by document (:func:`reference_document_windows`).
    - "wikitext2": the reference sampler on the tokenized train text (:func:`reference_windows`).
    - every other source: random non-overlapping windows of the tokenized calibration text
      (:func:`disjoint_windows`); a text with fewer than nsamples*seqlen tokens raises ValueError.

    Every window starts with the ids the tokenizer puts before a text (:func:`window_prefix`,
    e.g. Gemma's BOS), followed by ``seqlen`` minus that many text tokens drawn as above.
    """
    if not isinstance(nsamples, int) or not isinstance(seqlen, int) or nsamples < 1 or seqlen < 1:
        raise ValueError(f"nsamples and seqlen must be positive integers, got {nsamples!r} and {seqlen!r}")
    prefix = window_prefix(tokenizer)
    body = window_body(seqlen, prefix)
    corpus = load_corpus(source, "calib")
    name = parse_source(source)[0]
    if name == "c4":
        def encode(doc: str) -> list[int]:  # the reference's ids, less the prefix every window gets
            return list(tokenizer(doc, add_special_tokens=not prefix, verbose=False)["input_ids"])

        return prefixed_windows(reference_document_windows(corpus.documents, encode, nsamples, body, seed), prefix)
    tokens = strip_prefix(tokenize_text(tokenizer, corpus.text()), prefix)
    if name == "wikitext2":
        return prefixed_windows(reference_windows(tokens, nsamples, body, seed), prefix)
    return prefixed_windows(disjoint_windows(tokens, nsamples, body, seed), prefix)


#: Documents tokenized per batched tokenizer call when packing.
PACK_BATCH_DOCUMENTS = 256


def packed_calibration_batch(
    tokenizer, source: str = "c4", nsamples: int = 128, seqlen: int = 512, seed: int = 0
) -> Tensor:
    """The paper's calibration protocol, shape (nsamples, seqlen): the calibration documents in
    an order shuffled by ``seed``, each followed by the tokenizer's EOS, packed end to end and
    cut into consecutive windows (the paper uses C4 with nsamples=1024, seqlen=2048).
    Only as many documents as needed are tokenized.
    """
    if not isinstance(nsamples, int) or not isinstance(seqlen, int) or nsamples < 1 or seqlen < 1:
        raise ValueError(f"nsamples and seqlen must be positive integers, got {nsamples!r} and {seqlen!r}")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("packing needs a tokenizer with an end-of-sequence token (eos_token_id is None)")
    documents = load_corpus(source, "calib").documents
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)

    def token_lists():
        for start in range(0, len(order), PACK_BATCH_DOCUMENTS):
            batch = [documents[i] for i in order[start : start + PACK_BATCH_DOCUMENTS]]
            yield from tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]

    return packed_windows(token_lists(), [eos], nsamples, seqlen)


def c4_eval_max_tokens(seqlen: int) -> int:
    """The reference C4 evaluation cap: the first ``256 * seqlen`` validation tokens."""
    return C4_EVAL_WINDOWS * seqlen


def eval_tokens(tokenizer, source: str = "wiki", max_tokens: int | None = None, *, seqlen: int = 2048) -> Tensor:
    """The held-out token stream of ``source``, shape (1, N).

    ``max_tokens`` keeps the first tokens only. For "c4" it defaults to the reference cap
    :func:`c4_eval_max_tokens` ``(seqlen)`` (256 windows of the evaluation ``seqlen``); other
    sources are whole by default.
    """
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
    if max_tokens is None and parse_source(source)[0] == "c4":
        max_tokens = c4_eval_max_tokens(seqlen)
    tokens = tokenize_text(tokenizer, load_text(source, "eval"))
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    return tokens[None, :]
