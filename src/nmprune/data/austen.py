"""Jane Austen's six novels from Debian's ``r-cran-janeaustenr``: out-of-distribution text.

The R package stores each novel as a character vector of hard-wrapped lines (blank lines
between paragraphs) in its lazy-load data base ``data/Rdata.rdb``, read here with the small
R deserializer of :mod:`nmprune.data.rdata` (no R needed). Paragraphs are re-flowed into one
line each and separated by blank lines. The evaluation split is ``Persuasion``; the
calibration split is the other five novels.
"""

from __future__ import annotations

import os
from pathlib import Path

from .rdata import read_lazyload_db
from .corpus import Corpus

AUSTEN_APT = "apt-get install -y r-cran-janeaustenr"

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


def austen_data_prefix() -> Path:
    """``.../janeaustenr/data/Rdata`` of the installed R package (R_LIBS and Debian's R libraries)."""
    roots = [p for p in os.environ.get("R_LIBS", "").split(os.pathsep) if p] + list(R_LIBRARIES)
    for root in roots:
        prefix = Path(root) / "janeaustenr" / "data" / "Rdata"
        if prefix.with_suffix(".rdx").is_file() and prefix.with_suffix(".rdb").is_file():
            return prefix
    raise ValueError(
        "the 'austen' text source needs the Jane Austen novels of Debian's R package "
        f"janeaustenr; install it with: {AUSTEN_APT} (searched {', '.join(roots)})"
    )


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
    """R object name -> the novel's lines, as the R package stores them."""
    objects = read_lazyload_db(austen_data_prefix())
    missing = [name for name, _ in AUSTEN_BOOKS if name not in objects]
    if missing:
        raise ValueError(f"janeaustenr data lacks {missing}; reinstall it with: {AUSTEN_APT}")
    return {name: objects[name].value for name, _ in AUSTEN_BOOKS}


def austen_corpus(split: str) -> Corpus:
    novels = austen_novels()
    names = [n for n, _ in AUSTEN_BOOKS if (n in AUSTEN_EVAL_BOOKS) == (split == "eval")]
    return Corpus([reflow(novels[n]) for n in names], "\n\n")
