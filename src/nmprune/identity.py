"""The identity of a model's files: a digest that changes when the model does.

A checkpoint resumes only on the model it was started on, and ranks under ``torchrun``
must prune the same model; both compare :func:`model_digest`, never the user's
``--model`` string (the same string can name other files from another working directory,
and other strings can name the same files).

The digest covers, for a local model, the configuration and tokenizer files byte for
byte and every weight file the loader may read:

* a safetensors file: its size, its header (every tensor's name, dtype, shape and
  offsets) and, of every tensor, the bytes at the start, middle and end of its data, so a
  model with the same layout but other weights (a fine-tune) has another digest;
* any other weight file (GGUF, pickles): its size and its bytes, all of them up to
  :data:`FULL_HASH_BYTES`, beyond that :data:`SAMPLES` evenly spaced pieces.

A hub id is named by its id and the commit transformers resolved it to.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from .models import ModelSource, read_config

#: Files hashed whole up to this size; larger ones are sampled.
FULL_HASH_BYTES = 1 << 30
#: Pieces read from a large non-safetensors file, and bytes per piece.
SAMPLES = 4096
PIECE = 4096
#: Small files beside the weights that decide the model or its tokenisation.
_METADATA_PREFIXES = ("config.json", "generation_config.json", "tokenizer", "special_tokens_map",
                      "added_tokens", "vocab", "merges", "chat_template", "preprocessor_config")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def _update_sampled(digest, f, size: int, spans: list[tuple[int, int]]) -> None:
    """Feed ``digest`` the bytes of each ``(start, length)`` span of the open file ``f``."""
    for start, length in spans:
        f.seek(start)
        digest.update(f.read(min(length, max(size - start, 0))))


def _spread(begin: int, end: int, count: int, piece: int) -> list[tuple[int, int]]:
    """``count`` spans of ``piece`` bytes evenly spread over ``[begin, end)`` (the whole
    range when it is no longer than the spans together)."""
    length = end - begin
    if length <= count * piece:
        return [(begin, length)]
    step = (length - piece) / (count - 1)
    return [(begin + int(i * step), piece) for i in range(count)]


def _safetensors_header(f, path: Path, size: int) -> tuple[int, dict]:
    """``(data offset, header)`` of a safetensors file, or a ValueError naming it."""
    raw = f.read(8)
    if len(raw) < 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
    (length,) = struct.unpack("<Q", raw)
    if length > size - 8:
        raise ValueError(f"{path} is not a complete safetensors file (its header claims "
                         f"{length} bytes, the file has {size})")
    try:
        header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file (unreadable header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a mapping)")
    return 8 + length, header


def file_digest(path: str | os.PathLike) -> str:
    """Hex SHA-256 identifying one weight file (module docstring)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            offset, header = _safetensors_header(f, path, size)
            digest.update(json.dumps(header, sort_keys=True).encode())
            spans = []
            for name in sorted(k for k in header if k != "__metadata__"):
                begin, end = (offset + o for o in header[name].get("data_offsets", (0, 0)))
                spans += _spread(begin, end, 3, PIECE)
            _update_sampled(digest, f, size, spans)
        elif size <= FULL_HASH_BYTES:
            for piece in iter(lambda: f.read(1 << 20), b""):
                digest.update(piece)
        else:
            _update_sampled(digest, f, size, _spread(0, size, SAMPLES, PIECE))
    return digest.hexdigest()


def _is_metadata(name: str) -> bool:
    return name.startswith(_METADATA_PREFIXES) and not name.endswith(_WEIGHT_SUFFIXES)


def model_digest(source: ModelSource, config=None) -> str:
    """A 16-hex-digit digest of the model ``source`` names (module docstring); ``config``
    is its transformers configuration, read here for a hub id (its resolved commit) when
    not given."""
    parts: list[str] = []
    root = Path(source.path)
    if source.gguf_file:
        parts.append(f"gguf {file_digest(root / source.gguf_file)}")
    elif root.is_dir():
        for entry in sorted(root.iterdir(), key=lambda p: p.name):
            if not entry.is_file():
                continue
            if entry.name.endswith(_WEIGHT_SUFFIXES):
                parts.append(f"weights {entry.name} {file_digest(entry)}")
            elif entry.name.endswith(".index.json") or _is_metadata(entry.name):
                parts.append(f"file {entry.name} {hashlib.sha256(entry.read_bytes()).hexdigest()}")
    else:  # a hub id: transformers records the commit it resolved
        config = config if config is not None else read_config(source)
        parts.append(f"hub {source.path} {getattr(config, '_commit_hash', None)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
