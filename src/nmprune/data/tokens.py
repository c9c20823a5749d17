"""Tokenizing long texts fast and drawing calibration windows from token streams.

Pure functions: text -> token ids, token ids -> windows. No file or source knowledge.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

#: Characters per chunk when tokenizing a long text (~10-15k tokens for English BPE).
CHUNK_CHARS = 50_000

# A space between two letters: every regex pre-tokenizer of byte-level BPE tokenizers
# (GPT-2, Llama-3, SmolLM, Qwen, ...) starts a new pre-token there (" word"), so cutting the
# text right before such a space gives exactly the ids of tokenizing the whole text at once.
_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")


def chunk_text(text: str, chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut ``text`` into pieces of about ``chunk_chars`` characters at letter-space-letter spots.

    The pieces concatenate back to ``text``; a piece is longer when no cut spot is near.
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    pieces, start = [], 0
    while len(text) - start > chunk_chars:
        m = _CUT.search(text, start + chunk_chars)
        if m is None:
            break
        pieces.append(text[start : m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def _special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer puts before and after a text with ``add_special_tokens=True`` (e.g. BOS)."""
    plain = tokenizer("a", add_special_tokens=False, verbose=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True, verbose=False)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return list(full[:i]), list(full[i + len(plain) :])
    return [], []


def window_prefix(tokenizer) -> list[int]:
    """The ids every window starts with: those the tokenizer puts before a text by default
    (Gemma's BOS; none for SmolLM2, whose tokenizer adds nothing). A model trained with a BOS
    reads a window without one badly (dense Gemma-3-270M: wiki perplexity 24.3 without)."""
    return _special_affixes(tokenizer)[0]


def prefixed_windows(windows: Tensor, prefix: Sequence[int]) -> Tensor:
    """``windows`` (n, L) with ``prefix`` put in front of each: (n, len(prefix) + L)."""
    if not prefix:
        return windows
    head = torch.tensor(list(prefix), dtype=windows.dtype).expand(windows.shape[0], len(prefix))
    return torch.cat([head, windows], 1)


def strip_prefix(tokens: Tensor, prefix: Sequence[int]) -> Tensor:
    """A 1-D token stream without ``prefix`` at its start (where :func:`tokenize_text` put it)."""
    k = len(prefix)
    if k and tokens.numel() >= k and tokens[:k].tolist() == list(prefix):
        return tokens[k:]
    return tokens


def window_body(seqlen: int, prefix: Sequence[int], what: str = "seqlen") -> int:
    """The text tokens in a window of ``seqlen`` that starts with ``prefix``."""
    body = seqlen - len(prefix)
    if body < 1:
        raise ValueError(f"{what} {seqlen} leaves no room for text after the tokenizer's "
                         f"{len(prefix)} start token(s); use a longer {what}")
    return body


def tokenize_text(tokenizer, text: str, chunk_chars: int = CHUNK_CHARS) -> Tensor:
    """Token ids of ``text`` as one 1-D LongTensor, like ``tokenizer(text).input_ids[0]``.

    The text is tokenized in chunks in one batched call (a fast tokenizer runs them in
    parallel), the special tokens the tokenizer adds to a text (a BOS) are put once around the
    whole stream, and no "sequence longer than model_max_length" warning is raised: the stream
    is meant to be cut into windows, never fed whole to a model.
    """
    if not text:
        raise ValueError("cannot tokenize an empty text")
    pieces = chunk_text(text, chunk_chars)
    ids = tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]
    prefix, suffix = _special_affixes(tokenizer)
    flat = [prefix] + list(ids) + [suffix]
    return torch.tensor([t for part in flat for t in part], dtype=torch.long)


def too_short_message(what: str, ntokens: int, nsamples: int, seqlen: int) -> str:
    return (
        f"{what} has {ntokens} tokens, too few for {nsamples} windows of {seqlen} tokens "
        f"(needs {nsamples * seqlen}); lower nsamples or seqlen, or use a longer text"
    )


def disjoint_windows(tokens: Tensor, nsamples: int, seqlen: int, seed: int) -> Tensor:
    """``nsamples`` non-overlapping random windows of ``seqlen`` tokens, shape (nsamples, seqlen).

    The SparseGPT/Wanda protocol (random contiguous windows of the calibration stream from a
    seeded generator), with the guarantee that no token is used twice: the free space
    ``N - nsamples*seqlen`` is spread at random in front of the sorted windows, which are
    then returned in a random order.
    """
    _check_window_args(tokens, nsamples, seqlen)
    n = tokens.numel()
    slack = n - nsamples * seqlen
    if slack < 0:
        raise ValueError(too_short_message("the calibration text", n, nsamples, seqlen))
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.randint(0, slack + 1, (nsamples,), generator=gen).sort().values
    starts = gaps + torch.arange(nsamples) * seqlen
    starts = starts[torch.randperm(nsamples, generator=gen)]
    return tokens[starts[:, None] + torch.arange(seqlen)]


def reference_windows(tokens: Tensor, nsamples: int, seqlen: int, seed: int) -> Tensor:
    """The windows of SparseGPT/Wanda's WikiText-2 loader: Python ``random`` seeded with ``seed``,
    start ``randint(0, N - seqlen - 1)`` per sample; windows may overlap.
    """
    _check_window_args(tokens, nsamples, seqlen)
    n = tokens.numel()
    if n <= seqlen:
        raise ValueError(too_short_message("the calibration text", n, 1, seqlen + 1))
    rng = random.Random(seed)
    starts = torch.tensor([rng.randint(0, n - seqlen - 1) for _ in range(nsamples)])
    return tokens[starts[:, None] + torch.arange(seqlen)]


def packed_windows(token_lists, separator: list[int], nsamples: int, seqlen: int) -> Tensor:
    """Documents packed end to end, each followed by ``separator`` (an EOS), cut into
    ``nsamples`` consecutive windows of ``seqlen`` tokens: the paper's calibration protocol
    (Sec. ``sec:llm_experiments``: C4 "packed with end-of-sequence tokens and chunked into
    1024 sequences of length 2048"). ``token_lists`` is consumed only as far as needed.
    """
    if nsamples < 1 or seqlen < 1:
        raise ValueError(f"nsamples and seqlen must be positive, got {nsamples} and {seqlen}")
    need, stream = nsamples * seqlen, []
    for ids in token_lists:
        stream.extend(ids)
        stream.extend(separator)
        if len(stream) >= need:
            return torch.tensor(stream[:need], dtype=torch.long).reshape(nsamples, seqlen)
    raise ValueError(too_short_message("the packed calibration text", len(stream), nsamples, seqlen))


#: Draws before giving up when no document is longer than seqlen.
MAX_DOCUMENT_DRAWS = 100_000


def reference_document_windows(
    documents: Sequence[str], encode: Callable[[str], list[int]], nsamples: int, seqlen: int, seed: int
) -> Tensor:
    """The windows of SparseGPT/Wanda's C4 loader.

    With Python ``random`` seeded with ``seed``, per sample: draw documents uniformly until
    one tokenizes to more than ``seqlen`` tokens (Wanda's strict ``>``), then take the window
    starting at ``randint(0, len - seqlen - 1)`` of it. ``encode`` tokenizes one document as
    the reference does (special tokens included).
    """
    if nsamples < 1 or seqlen < 1:
        raise ValueError(f"nsamples and seqlen must be positive, got {nsamples} and {seqlen}")
    if not documents:
        raise ValueError("no calibration documents")
    rng = random.Random(seed)
    windows = []
    for _ in range(nsamples):
        for _draw in range(MAX_DOCUMENT_DRAWS):
            ids = encode(documents[rng.randint(0, len(documents) - 1)])
            if len(ids) > seqlen:
                break
        else:
            raise ValueError(
                f"no calibration document longer than {seqlen} tokens in {MAX_DOCUMENT_DRAWS} "
                "draws; lower seqlen or use longer documents"
            )
        i = rng.randint(0, len(ids) - seqlen - 1)
        windows.append(torch.tensor(ids[i : i + seqlen], dtype=torch.long))
    return torch.stack(windows)


def _check_window_args(tokens: Tensor, nsamples: int, seqlen: int) -> None:
    if not isinstance(tokens, Tensor) or tokens.ndim != 1 or tokens.dtype != torch.long:
        raise ValueError("tokens must be a 1-D LongTensor")
    if nsamples < 1 or seqlen < 1:
        raise ValueError(f"nsamples and seqlen must be positive, got {nsamples} and {seqlen}")
