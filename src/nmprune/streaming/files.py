"""A safetensors checkpoint on disk, checked before any work and read tensor by tensor.

A checkpoint is either ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file), the layout
``save_pretrained`` writes. :meth:`SafetensorsFiles.open` checks up front that every
shard exists and is a complete safetensors file (``safe_open`` parses its header and
rejects a file shorter than the header says), that the index names each tensor once and
that each shard holds the tensors the index gives it. :meth:`SafetensorsFiles.check_fits`
compares the stored shapes and dtypes (from the headers, no data read) with a model's
tensors. Reads open the shard with
``safe_open``, whose tensors are views of a private memory map of the file (copy on
write): a tensor costs memory (and address space) only while the caller holds it, and no
shard stays mapped after its tensors are dropped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointFileError(ValueError):
    """A safetensors checkpoint that cannot be read as it stands."""


#: Safetensors dtype names of floating point types (``F16``, ``BF16``, ``F32``, ``F8_E4M3`` ...);
#: the others are integers (``I8``, ``U8`` ...), ``BOOL`` and complex (``C64``).
_FLOATING = ("F", "BF")


def missing_tensors(where: object, names: list[str]) -> str:
    """The start of the error for the tensors ``names`` (in the model's order) that the
    checkpoint in ``where`` lacks."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{where} holds no tensor {names[0]!r}{more} that its configuration asks for"


def check_no_extra_blocks(where: object, keys: list[str], blocks_name: str, n_blocks: int) -> None:
    """Refuse a checkpoint holding tensors of decoder blocks beyond the ``n_blocks`` its
    configuration builds (``blocks_name.N.`` with ``N >= n_blocks``): loading would drop them
    without a word and prune a truncated model."""
    pattern = re.compile(rf"{re.escape(blocks_name)}\.(\d+)\.")
    extra = sorted({int(m.group(1)) for m in map(pattern.match, keys) if m and int(m.group(1)) >= n_blocks})
    if extra:
        raise CheckpointFileError(f"{where} holds decoder block {extra[0]}"
                                  f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''} "
                                  f"beyond the {n_blocks} blocks its configuration builds: the "
                                  "configuration belongs to a smaller model")


def shape_mismatch(where: object, key: str, stored: tuple[int, ...],
                   needed: tuple[int, ...]) -> CheckpointFileError:
    """The error for tensor ``key`` stored in ``where`` with shape ``stored`` where the
    model built from its configuration has shape ``needed``."""
    return CheckpointFileError(f"{where} stores tensor {key!r} with shape {tuple(stored)}, but its "
                               f"configuration makes it {tuple(needed)}: the weights do not belong "
                               "to this configuration")


def _unique_pairs(path: Path):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise CheckpointFileError(f"{path} names tensor {key!r} twice")
            seen.add(key)
        return dict(pairs)
    return hook


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text(), object_pairs_hook=_unique_pairs(path))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointFileError(f"{path} is not a readable JSON index: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFileError(f"{path} has no weight_map of tensor names to shard files")
    return weight_map


class SafetensorsFiles:
    """The tensors of a checkpoint directory: names, shapes, dtypes, sizes, and reads."""

    def __init__(self, directory: Path, weight_map: dict[str, str]):
        self.directory = directory
        self.weight_map = weight_map
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        self._stamps: dict[str, tuple[int, int]] = {}  # shard -> (size, mtime) when opened

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "SafetensorsFiles":
        """Check and open the checkpoint in ``directory`` (module docstring); any problem is
        a :class:`CheckpointFileError` naming the file."""
        d = Path(directory)
        if (d / INDEX).is_file():
            weight_map = _read_index(d / INDEX)
        elif (d / SINGLE).is_file():
            weight_map = None
        else:
            raise CheckpointFileError(f"{d} holds neither {SINGLE} nor {INDEX}; streaming reads "
                                      "safetensors checkpoints only")
        shards = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        files = cls(d, weight_map or {})
        owner: dict[str, str] = {}
        for shard in shards:
            path = d / shard
            if Path(shard).name != shard or not path.is_file():
                raise CheckpointFileError(f"shard {path} named by {d / INDEX} does not exist")
            keys = files._scan(path)
            for key in keys:
                if key in owner:
                    raise CheckpointFileError(f"{path} and {d / owner[key]} both hold tensor {key!r}")
                owner[key] = shard
            if weight_map is None:
                files.weight_map = dict.fromkeys(keys, shard)
                continue
            listed = {k for k, v in weight_map.items() if v == shard}
            missing = sorted(listed - set(keys))
            if missing:
                raise CheckpointFileError(f"{path} lacks tensor {missing[0]!r} that {d / INDEX} "
                                          "places in it")
        return files

    def _scan(self, path: Path) -> list[str]:
        from safetensors import safe_open

        try:
            stat = path.stat()
            self._stamps[path.name] = (stat.st_size, stat.st_mtime_ns)
            with safe_open(str(path), framework="pt") as handle:
                keys = list(handle.keys())
                for key in keys:
                    piece = handle.get_slice(key)
                    self._meta.setdefault(key, (tuple(piece.get_shape()), piece.get_dtype()))
        except Exception as e:  # safetensors raises its own error type on damaged files
            raise CheckpointFileError(f"{path} is not a complete safetensors file "
                                      f"(truncated or damaged): {e}") from e
        return keys

    # -- queries --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Tensor names, in the order of the index (or file)."""
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][0]

    def dtype(self, key: str) -> str:
        """The stored dtype's safetensors name (``F32``, ``BF16``, ``I8``, ``BOOL`` ...)."""
        return self._meta[key][1]

    def check_fits(self, tensors: Mapping[str, Tensor]) -> None:
        """Refuse a stored tensor that does not fit the model's tensor of the same name in
        ``tensors`` (meta tensors will do): another shape (:func:`shape_mismatch`), or
        integers or booleans where the model's tensor is floating point (loading would cast
        them without a word). Names absent from the checkpoint are not looked at."""
        for key, tensor in tensors.items():
            if key not in self:
                continue
            if self.shape(key) != tuple(tensor.shape):
                raise shape_mismatch(self.directory, key, self.shape(key), tuple(tensor.shape))
            if tensor.is_floating_point() and not self.dtype(key).startswith(_FLOATING):
                raise CheckpointFileError(
                    f"{self.directory} stores tensor {key!r} as {self.dtype(key)}, not floating "
                    f"point, where the model's tensor is {str(tensor.dtype).removeprefix('torch.')}; "
                    "nmprune does not cast stored integers to floats (a quantized checkpoint "
                    "needs the quantization_config it was saved with in its config.json)")

    def get(self, key: str) -> Tensor:
        """Tensor ``key`` read from its shard (CPU, the stored dtype)."""
        return self.read([key])[key]

    def read(self, keys: list[str]) -> dict[str, Tensor]:
        """Tensors ``keys`` (CPU, stored dtype), opening each shard once."""
        from safetensors import safe_open

        by_shard: dict[str, list[str]] = {}
        for key in keys:
            if key not in self.weight_map:
                raise KeyError(key)
            by_shard.setdefault(self.weight_map[key], []).append(key)
        out = {}
        for shard, names in by_shard.items():
            path = self.directory / shard
            try:
                stat = path.stat()
                if (stat.st_size, stat.st_mtime_ns) != self._stamps[shard]:
                    raise CheckpointFileError(
                        f"{path} changed while the run was reading the model (size or modification "
                        "time differ from when it was opened): the blocks read so far came from "
                        "the old file. Restore it, or rerun with --restart on the new model")
                with safe_open(str(path), framework="pt") as handle:
                    out.update((k, handle.get_tensor(k)) for k in names)
            except CheckpointFileError:
                raise
            except Exception as e:  # a removed or unreadable shard; safetensors' own error type
                raise CheckpointFileError(f"cannot read {path}: {e}") from e
        return {k: out[k] for k in keys}
