"""A minimal reader of R's serialization format and of R lazy-load databases (.rdx/.rdb).

Just enough of R's ``serialize()`` (XDR binary, format ``"X\\n"``, versions 2 and 3) to read the
data sets R packages ship: atomic vectors, lists, pairlists, symbols, attributes and
environments' contents. Reading code (closures, byte code) is not supported.

An R lazy-load database is a pair of files ``NAME.rdx`` / ``NAME.rdb``. The ``.rdx`` is a
gzip-compressed serialized list whose ``variables`` entry maps each object name to an
``(offset, length)`` pair inside the ``.rdb``; there each object is a 4-byte big-endian
uncompressed length followed by the zlib-compressed serialization of the object.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# SEXP types
_NILSXP, _SYMSXP, _LISTSXP, _CLOSXP, _ENVSXP, _PROMSXP, _LANGSXP = 0, 1, 2, 3, 4, 5, 6
_CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _CPLXSXP, _STRSXP, _DOTSXP = 9, 10, 13, 14, 15, 16, 17
_VECSXP, _EXPRSXP, _RAWSXP, _S4SXP = 19, 20, 24, 25
# serialization pseudo-types
_REFSXP, _NILVALUE, _GLOBALENV, _UNBOUNDVALUE, _MISSINGARG, _BASENAMESPACE = 255, 254, 253, 252, 251, 250
_NAMESPACESXP, _PACKAGESXP, _PERSISTSXP, _EMPTYENV, _BASEENV = 249, 248, 247, 242, 241
_ATTRLANGSXP, _ATTRLISTSXP, _ALTREP = 240, 239, 238

_NA_INT = -(2**31)


@dataclass
class RObject:
    """An R value with attributes: ``value`` is a Python list (vectors), dict (pairlists,
    environments) or str (symbols); ``attributes`` maps attribute names to values."""

    rtype: int
    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str] | None:
        names = self.attributes.get("names")
        return names.value if isinstance(names, RObject) else None


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated R serialization")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def header(self) -> None:
        fmt = self.take(2)
        if fmt != b"X\n":
            raise ValueError(f"only XDR R serializations ('X\\n') are supported, got {fmt!r}")
        version = self.int()
        self.int(), self.int()  # writer version, minimal reader version
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def attributes(self, has_attr: bool) -> dict[str, Any]:
        if not has_attr:
            return {}
        attr = self.item()
        return attr.value if isinstance(attr, RObject) and isinstance(attr.value, dict) else {}

    def item(self) -> Any:
        flags = self.int()
        sxp = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sxp in (_NILVALUE, _NILSXP):
            return None
        if sxp in (_GLOBALENV, _EMPTYENV, _BASEENV, _BASENAMESPACE, _UNBOUNDVALUE, _MISSINGARG):
            return RObject(sxp, None)
        if sxp == _REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if sxp in (_NAMESPACESXP, _PACKAGESXP, _PERSISTSXP):
            self.int()  # always 0
            obj = RObject(sxp, self.strings(self.length()))
            self.refs.append(obj)
            return obj
        if sxp == _SYMSXP:
            name = self.item()
            obj = RObject(_SYMSXP, name)
            self.refs.append(obj)
            return obj
        if sxp == _ENVSXP:
            obj = RObject(_ENVSXP, {})
            self.refs.append(obj)
            self.int()  # locked
            self.item()  # enclosing environment
            frame, hashtab = self.item(), self.item()
            obj.attributes = self.attributes(True)
            for part in (frame, hashtab):
                _collect_bindings(part, obj.value)
            return obj
        if sxp in (_LISTSXP, _LANGSXP, _CLOSXP, _PROMSXP, _DOTSXP, _ATTRLANGSXP, _ATTRLISTSXP):
            return self.pairlist(sxp, flags, has_attr, has_tag)
        if sxp == _CHARSXP:
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8", errors="replace")
        if sxp in (_LGLSXP, _INTSXP):
            n = self.length()
            ints = struct.unpack(f">{n}i", self.take(4 * n))
            value = [None if v == _NA_INT else (bool(v) if sxp == _LGLSXP else v) for v in ints]
        elif sxp == _REALSXP:
            n = self.length()
            value = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif sxp == _CPLXSXP:
            n = self.length()
            parts = struct.unpack(f">{2 * n}d", self.take(16 * n))
            value = [complex(parts[2 * i], parts[2 * i + 1]) for i in range(n)]
        elif sxp == _STRSXP:
            value = self.strings(self.length())
        elif sxp in (_VECSXP, _EXPRSXP):
            value = [self.item() for _ in range(self.length())]
        elif sxp == _RAWSXP:
            value = self.take(self.length())
        elif sxp == _S4SXP:
            value = None
        elif sxp == _ALTREP:
            return self.altrep()
        else:
            raise ValueError(f"unsupported R object type {sxp} in serialization")
        return RObject(sxp, value, self.attributes(has_attr))

    def strings(self, n: int) -> list[str | None]:
        return [self.item() for _ in range(n)]

    def pairlist(self, sxp: int, flags: int, has_attr: bool, has_tag: bool) -> RObject:
        """A pairlist as an ordered dict tag -> value (untagged cells get keys '', '1', ...)."""
        out: dict[str, Any] = {}
        attrs: dict[str, Any] = {}
        while True:
            if has_attr:
                attrs = self.attributes(True) or attrs
            tag = self.item() if has_tag else None
            key = tag.value if isinstance(tag, RObject) and isinstance(tag.value, str) else str(len(out))
            out[key] = self.item()
            flags = self.int()
            nxt = flags & 0xFF
            if nxt in (_NILVALUE, _NILSXP):
                return RObject(sxp, out, attrs)
            if nxt not in (_LISTSXP, _LANGSXP, _DOTSXP, _ATTRLISTSXP, _ATTRLANGSXP):
                self.pos -= 4  # a non-pairlist tail (dotted pair): read it as the last value
                out["."] = self.item()
                return RObject(sxp, out, attrs)
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

    def altrep(self) -> Any:
        """ALTREP objects R writes for compact sequences and wrappers, expanded to plain vectors."""
        info, state, attr = self.item(), self.item(), self.item()
        kind = info.value.get("0") if isinstance(info, RObject) and isinstance(info.value, dict) else None
        kind = kind.value if isinstance(kind, RObject) else kind
        attributes = attr.value if isinstance(attr, RObject) and isinstance(attr.value, dict) else {}
        if kind == "compact_intseq":
            n, start, step = (int(v) for v in state.value)
            return RObject(_INTSXP, [start + i * step for i in range(n)], attributes)
        if kind == "compact_realseq":
            n, start, step = state.value
            return RObject(_REALSXP, [start + i * step for i in range(int(n))], attributes)
        if kind in ("wrap_integer", "wrap_real", "wrap_string", "wrap_logical", "wrap_list"):
            inner = state.value[0]
            return RObject(inner.rtype, inner.value, attributes or inner.attributes)
        if kind == "deferred_string":
            arg = state.value.get("0") if isinstance(state.value, dict) else state
            return RObject(_STRSXP, [None if v is None else str(v) for v in arg.value], attributes)
        raise ValueError(f"unsupported ALTREP class {kind!r} in R serialization")


def _collect_bindings(part: Any, into: dict[str, Any]) -> None:
    if isinstance(part, RObject) and isinstance(part.value, dict):
        into.update(part.value)
    elif isinstance(part, RObject) and isinstance(part.value, list):  # hashed frame: list of pairlists
        for bucket in part.value:
            _collect_bindings(bucket, into)


def unserialize(data: bytes) -> Any:
    """The R object serialized (XDR) in ``data``; gzip-compressed input is accepted."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    reader = _Reader(data)
    reader.header()
    return reader.item()


def read_lazyload_db(prefix: str | Path) -> dict[str, Any]:
    """All objects of the lazy-load database ``prefix.rdx`` / ``prefix.rdb``, by name."""
    prefix = Path(prefix)
    rdx, rdb = prefix.with_name(prefix.name + ".rdx"), prefix.with_name(prefix.name + ".rdb")
    index = unserialize(rdx.read_bytes())
    entries = dict(zip(index.names or [], index.value))
    variables = entries.get("variables")
    if not isinstance(variables, RObject):
        raise ValueError(f"{rdx} is not an R lazy-load index")
    blob = rdb.read_bytes()
    out: dict[str, Any] = {}
    for name, pos in zip(variables.names or [], variables.value):
        offset, length = (int(v) for v in pos.value)
        raw = blob[offset : offset + length]
        payload = raw[4:]
        if payload[:1] in (b"Z", b"2", b"X", b"0"):  # typed compression header (R >= 2.10)
            kind, payload = payload[:1], payload[1:]
            if kind != b"Z" and kind != b"0":
                raise ValueError(f"{rdb}: object {name!r} uses an unsupported compression ({kind!r})")
            payload = zlib.decompress(payload) if kind == b"Z" else payload
        else:
            payload = zlib.decompress(payload)
        out[name] = unserialize(payload)
    return out
