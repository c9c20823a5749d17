"""Jane Austen's six novels from Debian's ``r-cran-janeaustenr``: out-of-distribution text.

The R package stores each novel as a character vector of hard-wrapped lines (blank lines
between paragraphs) in its lazy-load data base ``data/Rdata.rdx`` / ``data/Rdata.rdb``. The
objects are deserialized by the ``rdata`` package (the optional extra ``nmprune[austen]``;
no R needed); only the lazy-load container around them is unpacked here. Paragraphs are
re-flowed into one line each and separated by blank lines. The evaluation split is
``Persuasion``; the calibration split is the other five novels.

The R package is looked for in ``$R_LIBS``, in Debian's R libraries and in the folder that
``scripts/install_austen.sh`` (run by ``scripts/install.sh``) unpacks the Debian package into:
``$NMPRUNE_R_LIBS``, by default ``~/.cache/nmprune/R``.
"""

from __future__ import annotations

import importlib.util
import io
import os
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

from .corpus import Corpus

AUSTEN_APT = "apt-get install -y r-cran-janeaustenr"
AUSTEN_INSTALL = f"{AUSTEN_APT} (or, without R: bash scripts/install_austen.sh)"
RDATA_INSTALL = "pip install rdata"

#: The novels in publication order: (R object name, title).
AUSTEN_BOOKS = (
    ("sensesensibility", "Sense & Sensibility"),
    ("prideprejudice", "Pride & Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
)
AUSTEN_EVAL_BOOKS = ("persuasion",)

R_LIBRARIES = ("/usr/lib/R/site-library", "/usr/local/lib/R/site-library", "/usr/lib/R/library")

#: Decoders of the typed records of a lazy-load data base (R's ``compress = 2`` or ``3``) that
#: are read here, by the type byte that follows the record's length: zlib and stored.
_TYPED_RECORDS = {b"Z": zlib.decompress, b"0": bytes}


def austen_cache_library() -> Path:
    """The R library inside the folder ``scripts/install_austen.sh`` unpacks the Debian package
    into (``$NMPRUNE_R_LIBS``, by default ``~/.cache/nmprune/R``)."""
    dest = os.environ.get("NMPRUNE_R_LIBS") or Path.home() / ".cache" / "nmprune" / "R"
    return Path(dest) / "usr" / "lib" / "R" / "site-library"


def austen_library_roots() -> list[str]:
    """The R libraries searched for janeaustenr, in order: ``$R_LIBS``, Debian's R libraries,
    then :func:`austen_cache_library`."""
    r_libs = [p for p in os.environ.get("R_LIBS", "").split(os.pathsep) if p]
    return r_libs + list(R_LIBRARIES) + [str(austen_cache_library())]


def austen_data_prefix() -> Path:
    """``.../janeaustenr/data/Rdata`` of the first R library in :func:`austen_library_roots`
    that holds the package's data base; a ValueError saying how to install it otherwise."""
    roots = austen_library_roots()
    for root in roots:
        prefix = Path(root) / "janeaustenr" / "data" / "Rdata"
        if prefix.with_suffix(".rdx").is_file() and prefix.with_suffix(".rdb").is_file():
            return prefix
    raise ValueError(
        "the 'austen' text source needs the Jane Austen novels of Debian's R package "
        f"janeaustenr; install it with: {AUSTEN_INSTALL} (searched {', '.join(roots)})"
    )


def _rdata() -> ModuleType:
    """The ``rdata`` package; a one-line ValueError saying how to install it when it is missing."""
    if importlib.util.find_spec("rdata") is None:
        raise ValueError(
            "the 'austen' text source reads R data with the Python package rdata (the "
            f"nmprune[austen] extra); install it with: {RDATA_INSTALL}"
        )
    import rdata

    return rdata


def check_austen_readable() -> None:
    """Raise the ValueError :func:`austen_novels` would raise for a missing R package or a
    missing ``rdata`` package, without reading the novels."""
    austen_data_prefix()
    _rdata()


def _record_payload(record: bytes, compressed: int) -> bytes:
    """The serialization stored in one record of a ``.rdb`` file. After a 4-byte big-endian
    length comes zlib data (``compressed`` 1, R's default) or, for ``compressed`` 2 or 3, a type
    byte and the data it describes (see ``_TYPED_RECORDS``; bzip2 and xz records are a
    ValueError)."""
    body = record[4:]
    if compressed == 1:
        return zlib.decompress(body)
    decode = _TYPED_RECORDS.get(body[:1]) if compressed in (2, 3) else None
    if decode is None:
        raise ValueError(f"unsupported R lazy-load data base compression "
                         f"(compressed={compressed}, record type {body[:1]!r})")
    return decode(body[1:])


def read_lazyload_db(prefix: str | Path) -> dict[str, Any]:
    """All objects of the R lazy-load data base ``prefix.rdx`` / ``prefix.rdb``, by name, as
    ``rdata`` converts them (a character vector is a numpy array of str).

    The ``.rdx`` is a serialized list whose ``variables`` maps each object name to its
    ``(offset, length)`` record in the ``.rdb`` and whose ``compressed`` says how the records
    are compressed (see :func:`_record_payload`); each record holds the object's serialization.
    """
    rdata = _rdata()
    prefix = Path(prefix)
    index = rdata.read_rds(prefix.with_name(prefix.name + ".rdx"))
    compressed = int(index["compressed"][0])
    blob = prefix.with_name(prefix.name + ".rdb").read_bytes()
    out: dict[str, Any] = {}
    for name, (offset, length) in index["variables"].items():
        record = blob[int(offset) : int(offset) + int(length)]
        out[str(name)] = rdata.read_rds(io.BytesIO(_record_payload(record, compressed)))
    return out


def reflow(lines: list[str | None]) -> str:
    """Hard-wrapped lines -> one line per paragraph, paragraphs separated by a blank line."""
    paragraphs, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def austen_novels() -> dict[str, list[str | None]]:
    """R object name -> the novel's lines (None for an R ``NA``), as the R package stores them."""
    objects = read_lazyload_db(austen_data_prefix())
    missing = [name for name, _ in AUSTEN_BOOKS if name not in objects]
    if missing:
        raise ValueError(f"janeaustenr data lacks {missing}; reinstall it with: {AUSTEN_INSTALL}")
    return {name: objects[name].tolist() for name, _ in AUSTEN_BOOKS}


def austen_corpus(split: str) -> Corpus:
    """The calibration (five novels) or evaluation (*Persuasion*) split, one document per novel."""
    novels = austen_novels()
    names = [n for n, _ in AUSTEN_BOOKS if (n in AUSTEN_EVAL_BOOKS) == (split == "eval")]
    return Corpus([reflow(novels[n]) for n in names], "\n\n")
