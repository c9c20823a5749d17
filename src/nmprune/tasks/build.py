"""Build the offline lm-eval task data from the held-out (evaluation) splits of our texts.

Run ``python -m nmprune.tasks.build`` (the ``austen`` text needs Debian's
``r-cran-janeaustenr``, see docs/data.md) to rewrite the JSON-lines files next to this
module; the output is the same on every run (fixed seed, documents in the order the data
module gives them). Only :func:`nmprune.data.load_corpus` ``(source, "eval")`` is read, so no
item shares text with the calibration split.

Two task kinds per text (docs/downstream.md):

* ``cloze`` (LAMBADA style): the first sentences of a document with the last word of the last
  sentence removed; the model must predict that word (``target``).
* ``next`` (HellaSwag style): the first sentences of a document and four candidate next
  sentences: the true one and three drawn from other documents of the same split, of
  comparable length (``endings``, ``label`` = index of the true one).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
SEED = 1234
ITEMS = 300
#: At most this many characters of context before the target word or the endings.
MAX_CONTEXT_CHARS = 600
MAX_SENTENCE_CHARS = 300
MIN_SENTENCE_WORDS = 6
CHOICES = 4
#: Austen distractors come from paragraphs at least this far from the item's paragraph.
MIN_PARAGRAPH_DISTANCE = 10

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"“‘(]?[A-Z])")
_WORD = re.compile(r"[A-Za-z]{3,}")


def sentences(text: str) -> list[str]:
    """The sentences of ``text`` (whitespace collapsed; split after . ! ? before a capital)."""
    text = " ".join(text.split())
    return [s for s in _SENTENCE_END.split(text) if s]


def _usable(sentence: str) -> bool:
    return len(sentence) <= MAX_SENTENCE_CHARS and len(sentence.split()) >= MIN_SENTENCE_WORDS


def cloze_item(sents: list[str], rng: random.Random) -> dict[str, str] | None:
    """One last-word item from a document's sentences, or None when none fits.

    The passage is the document's first ``j + 1`` sentences (``j`` drawn among those that fit
    in :data:`MAX_CONTEXT_CHARS`); its last sentence must end in ``.`` after a word of three
    or more letters, which becomes the target (the ``.`` is dropped, as in LAMBADA).
    """
    candidates = []
    for j, s in enumerate(sents):
        passage = " ".join(sents[: j + 1])
        if len(passage) > MAX_CONTEXT_CHARS:
            break
        last = s[:-1].rsplit(" ", 1)[-1] if s.endswith(".") else ""
        if _usable(s) and _WORD.fullmatch(last):
            candidates.append((passage[: -len(last) - 1].rstrip(), last))
    if not candidates:
        return None
    context, target = rng.choice(candidates)
    return {"context": context, "target": target}


def next_items(documents: list[list[str]], n: int, rng: random.Random,
               far_apart: int = 1) -> list[dict]:
    """``n`` four-way next-sentence items (see the module docstring) from sentence lists.

    ``far_apart``: distractors come from documents whose index differs by at least this.
    """
    pool = [(i, s) for i, sents in enumerate(documents) for s in sents[1:] if _usable(s)]
    order = list(range(len(documents)))
    rng.shuffle(order)
    items = []
    for i in order:
        sents = documents[i]
        ks = [k for k in range(1, len(sents))
              if _usable(sents[k]) and len(" ".join(sents[:k])) <= MAX_CONTEXT_CHARS]
        if not ks:
            continue
        k = rng.choice(ks)
        true = sents[k]
        similar = [s for j, s in pool if abs(j - i) >= far_apart and s != true
                   and 0.5 * len(true) <= len(s) <= 2 * len(true)]
        if len(similar) < CHOICES - 1:
            continue
        endings = rng.sample(similar, CHOICES - 1)
        label = rng.randrange(CHOICES)
        endings.insert(label, true)
        items.append({"context": " ".join(sents[:k]), "endings": endings, "label": label})
        if len(items) == n:
            break
    return items


def cloze_items(documents: list[list[str]], n: int, rng: random.Random) -> list[dict]:
    order = list(range(len(documents)))
    rng.shuffle(order)
    items = []
    for i in order:
        item = cloze_item(documents[i], rng)
        if item is not None:
            items.append(item)
            if len(items) == n:
                break
    return items


def source_documents(source: str) -> list[list[str]]:
    """Sentence lists of the evaluation split: wiki articles, or Austen paragraphs."""
    from nmprune.data import load_corpus

    corpus = load_corpus(source, "eval")
    texts = corpus.documents if len(corpus.documents) > 1 else corpus.text().split("\n\n")
    return [sentences(t) for t in texts if t.strip()]


#: source -> how far apart (in documents) an item and its distractors must be.
SOURCES = {"wiki": 1, "austen": MIN_PARAGRAPH_DISTANCE}


def build(source: str, items: int = ITEMS, seed: int = SEED) -> dict[str, list[dict]]:
    """The two task files of ``source``: ``{"<source>_cloze": [...], "<source>_next": [...]}``
    (drawn with the seeds ``seed`` and ``seed + 1``)."""
    documents = source_documents(source)
    out = {f"{source}_cloze": cloze_items(documents, items, random.Random(seed)),
           f"{source}_next": next_items(documents, items, random.Random(seed + 1), SOURCES[source])}
    for name, records in out.items():
        if len(records) < items:
            raise ValueError(f"{source} gives only {len(records)} {name} items, {items} wanted")
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({"id": i, **r}, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    parser.add_argument("--out", type=Path, default=TASKS_DIR, help="folder for the .jsonl files")
    args = parser.parse_args(argv)
    for source in args.sources:
        for name, records in build(source).items():
            write_jsonl(args.out / f"{name}.jsonl", records)
            print(f"{args.out / f'{name}.jsonl'}: {len(records)} items")


if __name__ == "__main__":
    main()
