"""The 'austen' source: Jane Austen's novels read from Debian's r-cran-janeaustenr.

Needs the Debian package (``apt-get install -y --no-install-recommends r-cran-janeaustenr``,
which the CI setup installs): these tests FAIL, never skip, when it is missing.
"""

from __future__ import annotations

import gzip
import struct

import pytest

from nmprune.data import load_corpus, load_text
from nmprune.data.austen import AUSTEN_BOOKS, austen_data_prefix, austen_novels, reflow
from nmprune.data.rdata import unserialize


def test_austen_reads_the_six_novels():
    novels = austen_novels()
    assert list(novels) == [name for name, _ in AUSTEN_BOOKS] and len(novels) == 6
    pp = novels["prideprejudice"]
    assert pp[0] == "PRIDE AND PREJUDICE"
    first = next(i for i, line in enumerate(pp) if line.startswith("It is a truth"))
    assert pp[first] == "It is a truth universally acknowledged, that a single man in possession"
    assert pp[first + 1] == "of a good fortune, must be in want of a wife."
    assert novels["emma"][0] == "EMMA" and novels["persuasion"][0] == "Persuasion"
    assert all(len(lines) > 7000 for lines in novels.values())


def test_austen_splits_persuasion_is_held_out():
    calib, held = load_corpus("austen", "calib"), load_corpus("austen", "eval")
    assert len(calib.documents) == 5 and len(held.documents) == 1
    assert held.documents[0].startswith("Persuasion\n\nby\n\nJane Austen")
    assert "Sir Walter Elliot, of Kellynch Hall, in Somersetshire" in held.documents[0]
    text = load_text("austen", "calib")
    assert ("It is a truth universally acknowledged, that a single man in possession of a good "
            "fortune, must be in want of a wife.") in text
    assert "Kellynch" not in text


def test_austen_missing_package_says_what_to_install(monkeypatch, tmp_path):
    import nmprune.data.austen as austen

    monkeypatch.setenv("R_LIBS", str(tmp_path))
    monkeypatch.setattr(austen, "R_LIBRARIES", ())
    with pytest.raises(ValueError, match="apt-get install -y r-cran-janeaustenr"):
        austen_data_prefix()


def test_reflow_joins_wrapped_lines_into_paragraphs():
    assert reflow(["", "a b", "c", "", "", "d", None, "e "]) == "a b c\n\nd\n\ne"


def _xdr_strsxp(values: list[str | None]) -> bytes:
    """R's serialize(x, NULL, xdr=TRUE, version=2) of a character vector, written by hand."""
    out = b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300) + struct.pack(">ii", 16, len(values))
    for v in values:
        if v is None:
            out += struct.pack(">ii", 9, -1)
        else:
            b = v.encode()
            out += struct.pack(">ii", 0x40009, len(b)) + b
    return out


def test_unserialize_character_vector_with_na_and_gzip():
    data = _xdr_strsxp(["a", None, "Émile"])
    assert unserialize(data).value == ["a", None, "Émile"]
    assert unserialize(gzip.compress(data)).value == ["a", None, "Émile"]
    with pytest.raises(ValueError, match="only XDR"):
        unserialize(b"A\n" + data[2:])
