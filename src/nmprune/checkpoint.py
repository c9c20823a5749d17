"""Resumable progress of a pruning run, saved after every decoder block.

A checkpoint directory holds

* ``block_NNNN.safetensors``: the pruned weights of each finished block;
* ``hidden_NNNN.safetensors``: the hidden states entering the next block (dense or
  pruned activations, whichever the run propagates), one tensor per calibration batch;
* ``manifest.json``: the run's identity hash, the number of finished blocks, the
  per-layer records so far, file sizes and free-form extras (e.g. dense perplexities).

Every file is written to a temporary name and renamed into place; the manifest is
replaced last, so a run killed at any moment leaves the previous consistent state.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

FORMAT = 1
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, or made by a different run)."""


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _save_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    _atomic_write_bytes(path, lambda p: save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(p)))


class Checkpoint:
    """A run's checkpoint directory. Open with :meth:`open`."""

    def __init__(self, directory: Path, manifest: dict[str, Any]):
        self.directory = directory
        self.manifest = manifest

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str | os.PathLike, identity: str, *, restart: bool = False) -> "Checkpoint":
        """Open (or create) the checkpoint in ``directory`` for a run with ``identity``.

        ``restart`` discards what is there. A checkpoint of another run, or an unreadable
        one, raises :class:`CheckpointError` saying how to proceed.
        """
        d = Path(directory)
        if restart and d.exists():
            shutil.rmtree(d)
        path = d / MANIFEST
        if not path.exists():
            if d.exists() and any(d.iterdir()):
                raise CheckpointError(f"{d} exists but holds no {MANIFEST}; it is not an nmprune "
                                      "checkpoint (or is corrupt): delete it or pass --restart")
            d.mkdir(parents=True, exist_ok=True)
            ck = cls(d, {"format": FORMAT, "identity": identity, "done_blocks": 0, "records": [],
                         "files": {}, "extra": {}})
            ck._write_manifest()
            return ck
        try:
            manifest = json.loads(path.read_text())
            ok = isinstance(manifest, dict) and manifest.get("format") == FORMAT and \
                {"identity", "done_blocks", "records", "files", "extra"} <= set(manifest)
        except (OSError, json.JSONDecodeError):
            ok = False
        if not ok:
            raise CheckpointError(f"the checkpoint in {d} is corrupt (unreadable {MANIFEST}); "
                                  "delete the directory or pass --restart to start over")
        if manifest["identity"] != identity:
            raise CheckpointError(f"the checkpoint in {d} belongs to a run with other settings "
                                  f"(identity {manifest['identity']}, this run {identity}); rerun "
                                  "with the original settings to resume it, or pass --restart "
                                  "(or delete the directory) to start over")
        ck = cls(d, manifest)
        ck._check_files()
        return ck

    def _check_files(self) -> None:
        for name, size in self.manifest["files"].items():
            p = self.directory / name
            if not p.is_file() or p.stat().st_size != size:
                raise CheckpointError(f"the checkpoint in {self.directory} is corrupt ({name} is "
                                      "missing or truncated); delete the directory or pass "
                                      "--restart to start over")

    def _write_manifest(self) -> None:
        text = json.dumps(self.manifest, indent=1, default=str)
        _atomic_write_bytes(self.directory / MANIFEST, lambda p: p.write_text(text))

    # -- state ---------------------------------------------------------------------------

    @property
    def done_blocks(self) -> int:
        """How many decoder blocks are finished."""
        return int(self.manifest["done_blocks"])

    @property
    def records(self) -> list[dict[str, Any]]:
        """Per-layer records of the finished blocks."""
        return list(self.manifest["records"])

    def get(self, key: str, default: Any = None) -> Any:
        """A stored extra (JSON value)."""
        return self.manifest["extra"].get(key, default)

    def put(self, key: str, value: Any) -> None:
        """Store an extra (JSON value) durably."""
        self.manifest["extra"][key] = value
        self._write_manifest()

    def bind(self, key: str, value: str) -> None:
        """Record ``value`` under ``key`` on first use; later runs must bring the same one."""
        old = self.get(key)
        if old is None:
            self.put(key, value)
        elif old != value:
            raise CheckpointError(f"the checkpoint in {self.directory} was made with another {key} "
                                  f"({old} vs {value}); rerun with the original inputs, or pass "
                                  "--restart (or delete the directory) to start over")

    # -- blocks --------------------------------------------------------------------------

    def save_block(self, index: int, weights: dict[str, Tensor], hidden: list[Tensor] | None,
                   records: list[dict[str, Any]]) -> None:
        """Durably record block ``index`` as finished (it must be the next one)."""
        self.save_blocks(index, [weights], hidden, records)

    def save_blocks(self, first: int, weights: list[dict[str, Tensor]], hidden: list[Tensor] | None,
                    records: list[dict[str, Any]]) -> None:
        """Durably record blocks ``first, first + 1, ...`` (one weight dict each; ``first``
        must be the next block) as finished at once; ``hidden`` enters the block after them."""
        if first != self.done_blocks:
            raise ValueError(f"block {first} saved out of order (expected {self.done_blocks})")
        files = dict(self.manifest["files"])
        for index, tensors in enumerate(weights, start=first):
            name = f"block_{index:04d}.safetensors"
            _save_tensors(self.directory / name, tensors)
            files[name] = (self.directory / name).stat().st_size
        old_hidden = [f for f in files if f.startswith("hidden_")]
        last = first + len(weights) - 1
        if hidden is not None:
            hname = f"hidden_{last:04d}.safetensors"
            _save_tensors(self.directory / hname, {f"batch_{j:06d}": h for j, h in enumerate(hidden)})
            files[hname] = (self.directory / hname).stat().st_size
        for f in old_hidden:
            del files[f]
        self.manifest.update(done_blocks=last + 1, files=files,
                             records=self.manifest["records"] + records)
        self._write_manifest()
        for f in old_hidden:
            (self.directory / f).unlink(missing_ok=True)

    def _load(self, name: str) -> dict[str, Tensor]:
        from safetensors.torch import load_file

        try:
            return load_file(str(self.directory / name))
        except Exception as e:  # safetensors raises its own error types on damaged files
            raise CheckpointError(f"the checkpoint in {self.directory} is corrupt ({name}: {e}); "
                                  "delete the directory or pass --restart to start over") from e

    def block_weights(self, index: int) -> dict[str, Tensor]:
        """The saved weights of finished block ``index``."""
        if index >= self.done_blocks:
            raise ValueError(f"block {index} is not finished in this checkpoint")
        return self._load(f"block_{index:04d}.safetensors")

    def hidden(self) -> list[Tensor]:
        """The saved hidden states entering block ``done_blocks``."""
        names = [f for f in self.manifest["files"] if f.startswith("hidden_")]
        if len(names) != 1:
            raise CheckpointError(f"the checkpoint in {self.directory} holds no block inputs; "
                                  "delete the directory or pass --restart to start over")
        tensors = self._load(names[0])
        return [tensors[k] for k in sorted(tensors)]

    def remove(self) -> None:
        """Delete the checkpoint directory (after the run's output is complete)."""
        shutil.rmtree(self.directory, ignore_errors=True)
