"""The 'austen' source: Jane Austen's novels read from Debian's r-cran-janeaustenr.

Needs the R package's files and the ``rdata`` Python package, both installed by
``scripts/install.sh`` (the files unpacked into ~/.cache/nmprune/R, found without R_LIBS):
these tests FAIL, never skip, when either is missing.
"""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from nmprune.data import load_corpus, load_text
from nmprune.data.austen import (
    AUSTEN_BOOKS,
    austen_cache_library,
    austen_data_prefix,
    austen_novels,
    read_lazyload_db,
    reflow,
)
from nmprune.data.sources import check_readable

INSTALL_AUSTEN = Path(__file__).resolve().parents[1] / "scripts" / "install_austen.sh"


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
    assert all(type(line) is str for lines in novels.values() for line in lines)


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
    monkeypatch.setenv("NMPRUNE_R_LIBS", str(tmp_path / "cache"))
    monkeypatch.setattr(austen, "R_LIBRARIES", ())
    with pytest.raises(ValueError, match="apt-get install -y r-cran-janeaustenr") as info:
        austen_data_prefix()
    assert "scripts/install_austen.sh" in str(info.value) and str(tmp_path / "cache") in str(info.value)


def test_install_austen_prints_a_library_that_is_searched(monkeypatch, tmp_path):
    """What scripts/install_austen.sh unpacks (HOME's default cache here, already filled, so
    nothing is downloaded) is found with no R_LIBS set."""
    import nmprune.data.austen as austen

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NMPRUNE_R_LIBS", raising=False)
    monkeypatch.delenv("R_LIBS", raising=False)
    assert austen_cache_library() == tmp_path / ".cache/nmprune/R/usr/lib/R/site-library"
    data = austen_cache_library() / "janeaustenr" / "data"
    data.mkdir(parents=True)
    for suffix in (".rdx", ".rdb"):
        (data / f"Rdata{suffix}").write_bytes(b"")
    done = subprocess.run(["bash", str(INSTALL_AUSTEN)], capture_output=True, text=True, check=True)
    library = done.stdout.strip()
    assert library in austen.austen_library_roots()
    if library == str(austen_cache_library()):  # not Debian's installed r-cran-janeaustenr
        monkeypatch.setattr(austen, "R_LIBRARIES", ())
        assert austen_data_prefix() == data / "Rdata"


def test_reflow_joins_wrapped_lines_into_paragraphs():
    assert reflow(["", "a b", "c", "", "", "d", None, "e "]) == "a b c\n\nd\n\ne"


# --- the lazy-load data base around the objects rdata deserializes -----------------------------

def _xdr(value: object) -> bytes:
    """R's XDR serialization (version 2, no header) of a character vector (list of str/None),
    an integer vector (tuple of int), a double (float) or a named list (dict), by hand."""
    if isinstance(value, list):
        out = struct.pack(">ii", 16, len(value))
        for v in value:
            if v is None:
                out += struct.pack(">ii", 9, -1)
            else:
                b = v.encode()
                out += struct.pack(">ii", 9 | (0x40000 if v.isascii() else 0x8000), len(b)) + b
        return out
    if isinstance(value, tuple):
        return struct.pack(f">ii{len(value)}i", 13, len(value), *value)
    if isinstance(value, float):
        return struct.pack(">iid", 14, 1, value)
    assert isinstance(value, dict)
    if not value:
        return struct.pack(">ii", 19, 0)
    items = b"".join(_xdr(v) for v in value.values())
    names = struct.pack(">ii", 0x402, 1) + struct.pack(">ii", 0x40009, 5) + b"names" + _xdr(list(value))
    return struct.pack(">ii", 19 | 0x200, len(value)) + items + names + struct.pack(">i", 254)


def _serialize(value: object) -> bytes:
    return b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300) + _xdr(value)


def _write_db(prefix: Path, records: dict[str, bytes], compressed: float) -> None:
    """``prefix.rdx`` / ``prefix.rdb`` holding ``records`` (already framed) as R writes them."""
    blob, variables = b"", {}
    for name, record in records.items():
        variables[name] = (len(blob), len(record))
        blob += record
    prefix.with_name(prefix.name + ".rdb").write_bytes(blob)
    index = {"variables": variables, "references": {}, "compressed": compressed}
    prefix.with_name(prefix.name + ".rdx").write_bytes(gzip.compress(_serialize(index)))  # saveRDS


def test_lazyload_db_zlib_and_typed_records(tmp_path):
    text = ["a", None, "Émile"]
    ser = _serialize(text)
    length = struct.pack(">i", len(ser))
    _write_db(tmp_path / "one", {"x": length + zlib.compress(ser)}, compressed=1.0)
    assert read_lazyload_db(tmp_path / "one")["x"].tolist() == text
    typed = {"z": length + b"Z" + zlib.compress(ser), "raw": length + b"0" + ser}
    _write_db(tmp_path / "three", typed, compressed=3.0)
    assert {k: v.tolist() for k, v in read_lazyload_db(tmp_path / "three").items()} == {"z": text, "raw": text}
    _write_db(tmp_path / "xz", {"x": length + b"X" + ser}, compressed=3.0)
    with pytest.raises(ValueError, match="unsupported R lazy-load data base compression"):
        read_lazyload_db(tmp_path / "xz")


def test_missing_rdata_is_a_one_line_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "rdata", None)  # what `import rdata` sees when it is absent
    for read in (austen_novels, lambda: check_readable("austen", "eval")):
        with pytest.raises(ValueError, match=r"pip install rdata") as info:
            read()
        assert "\n" not in str(info.value)


def test_other_sources_need_no_rdata():
    code = ("import sys; sys.modules['rdata'] = None\n"
            "from nmprune.data import eval_tokens, load_text\n"
            "import nmprune.cli\n"
            "assert load_text('wiki', 'eval')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
