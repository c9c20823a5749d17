"""Resumable progress of a pruning run, saved after every decoder block.

A checkpoint directory holds

* ``block_NNNN.safetensors``: the pruned weights of each finished block;
* ``hidden_NNNN.safetensors``: the hidden states entering the next block (dense or
  pruned activations, whichever the run propagates), one tensor per calibration batch;
* ``teachers.safetensors``: the dense model's next-token distribution on the global
  distillation's own calibration windows, computed before the first block is pruned;
* ``.nmprune``: the marker that it is an nmprune checkpoint (:mod:`nmprune.output`);
  nothing else is ever deleted or replaced;
* ``manifest.json``: the run's identity hash, the number of finished blocks, the
  per-layer records so far, the size and SHA-256 of every file above, free-form extras
  (e.g. dense perplexities) and the SHA-256 of the manifest's own content.

Every file is written to a temporary name and renamed into place; the manifest is
replaced last, so a run killed at any moment leaves the previous consistent state.
Opening a checkpoint verifies the manifest's own hash and every file's size and hash, and
a block file must hold exactly the layers the model has: damage of any kind (bytes flipped,
a tensor renamed or missing, an edited manifest) is a :class:`CheckpointError`, never a
silently different model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from .output import check_owned, mark, marker, remove_owned, writing

FORMAT = 3  # 3: the hidden states as streams (stream{k}_batch_{j}), not side by side
MANIFEST = "manifest.json"
#: The only file names a manifest may list (nothing outside the directory is ever touched).
_FILE_NAME = re.compile(r"((block|hidden)_\d{4}|teachers|distillation_[01](_rank\d{3,})?)\.safetensors")
#: the global distillation's progress files: one process's (:data:`PASS`), or a pass sharded
#: over ranks, one file a rank (:func:`pass_part_name`)
_PASS_FILE = re.compile(r"distillation_[01](_rank\d{3,})?\.safetensors")
TEACHERS = "teachers.safetensors"
#: the global distillation's progress (:meth:`Checkpoint.save_pass`), in two files by turns
PASS = ("distillation_0.safetensors", "distillation_1.safetensors")


def pass_part_name(turn: int, rank: int) -> str:
    """The file of rank ``rank``'s part of a sharded pass's progress, of turn 0 or 1
    (:meth:`Checkpoint.save_pass_parts`)."""
    return f"distillation_{turn}_rank{rank:03d}.safetensors"


def write_tensors(path: Path, tensors: dict[str, Tensor]) -> dict[str, Any]:
    """Write one safetensors file atomically; its manifest entry (size and SHA-256): what a
    rank other than 0 writes into rank 0's checkpoint (:meth:`Checkpoint.save_pass_parts`)."""
    _save_tensors(path, tensors)
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}
#: What a checkpoint directory may hold besides its marker (temporary names included).
_OWN_ENTRY = re.compile(rf"({_FILE_NAME.pattern}|{re.escape(MANIFEST)})(\.tmp)?")
KIND = "checkpoint"
FLAG = "--checkpoint-dir"
_RESTART = "delete the directory or pass --restart to start over"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, or made by a different run)."""


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def content_sha256(manifest: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the manifest's content without its own ``sha256`` field."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _atomic_write_bytes(path: Path, write) -> None:
    """``write`` a temporary file and rename it to ``path``; a failed write (a full disk,
    say) removes the temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(path):
            write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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
        self.created = False  # True when Checkpoint.open made the directory

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str | os.PathLike, identity: str, *, restart: bool = False) -> "Checkpoint":
        """Open (or create) the checkpoint in ``directory`` for a run with ``identity``.

        A directory that is neither empty nor marked as an nmprune checkpoint is refused
        (:func:`nmprune.output.check_owned`), ``restart`` included. ``restart`` discards what
        a checkpoint holds, and so does a checkpoint killed before its first manifest was
        written. A checkpoint of another run, or a damaged one (manifest or any file not as
        written), raises :class:`CheckpointError` saying how to proceed. ``created`` tells
        whether this call started the checkpoint afresh.
        """
        d = Path(directory)
        if marker(d) is None and (d / MANIFEST).is_file():
            cls._adopt_unmarked(d)
        exists = check_owned(d, KIND, FLAG)
        if exists and (d / MANIFEST).exists() and not restart:
            manifest = cls._read_manifest(d)
            if manifest["identity"] != identity:
                raise CheckpointError(f"the checkpoint in {d} belongs to a run with other settings "
                                      f"(identity {manifest['identity']}, this run {identity}); rerun "
                                      "with the original settings to resume it, or pass --restart "
                                      "(or delete the directory) to start over")
            ck = cls(d, manifest)
            ck._check_files()
            return ck
        made = not exists or bool((marker(d) or {}).get("made_directory"))
        if exists:
            remove_owned(d, KIND, FLAG, names=_own_entries(d))
        d.mkdir(parents=True, exist_ok=True)
        mark(d, KIND, made)
        ck = cls(d, {"format": FORMAT, "identity": identity, "done_blocks": 0, "records": [],
                     "files": {}, "extra": {}})
        ck._write_manifest()
        ck.created = True
        return ck

    @classmethod
    def _adopt_unmarked(cls, d: Path) -> None:
        """Mark a checkpoint written before checkpoints carried a marker: one whose manifest
        nmprune wrote (its own SHA-256 holds), so that its run can resume."""
        try:
            cls._read_manifest(d)
        except CheckpointError:
            return
        mark(d, KIND, made=True)

    @classmethod
    def discard_completed(cls, directory: str | os.PathLike, out: str | os.PathLike) -> bool:
        """Delete the checkpoint in ``directory`` when its run has published ``out`` (a run
        killed between its output's rename and the checkpoint's removal leaves one);
        whether it did."""
        d, out = Path(directory), Path(out)
        if not out.is_dir() or (marker(d) or {}).get("kind") != KIND or not (d / MANIFEST).is_file():
            return False
        try:
            manifest = cls._read_manifest(d)
        except CheckpointError:
            return False
        if manifest["extra"].get("published_to") != str(out.resolve()):
            return False
        cls(d, manifest).remove()
        return True

    @staticmethod
    def _read_manifest(d: Path) -> dict[str, Any]:
        """The manifest, after checking its format, keys and its own SHA-256."""
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            manifest = None
        if not isinstance(manifest, dict):
            raise CheckpointError(f"the checkpoint in {d} is corrupt (unreadable {MANIFEST}); {_RESTART}")
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"the checkpoint in {d} has format {manifest.get('format')!r}, "
                                  f"this nmprune reads format {FORMAT}; {_RESTART}")
        keys = {"identity", "done_blocks", "records", "files", "extra", "sha256"}
        if not keys <= set(manifest) or manifest["sha256"] != content_sha256(manifest):
            raise CheckpointError(f"the checkpoint in {d} is corrupt ({d / MANIFEST} was changed "
                                  f"after nmprune wrote it); {_RESTART}")
        return manifest

    def _corrupt(self, name: str, why: str) -> CheckpointError:
        return CheckpointError(f"the checkpoint in {self.directory} is corrupt "
                               f"({self.directory / name} {why}); {_RESTART}")

    def _check_files(self) -> None:
        """Every listed file exists with the size and SHA-256 it was written with."""
        for name, entry in self.manifest["files"].items():
            p = self.directory / name
            if not _FILE_NAME.fullmatch(name):
                raise self._corrupt(MANIFEST, f"lists a file named {name!r}")
            if not p.is_file() or p.stat().st_size != entry["size"]:
                raise self._corrupt(name, "is missing or truncated")
            if file_sha256(p) != entry["sha256"]:
                raise self._corrupt(name, "does not hold the bytes that were written (SHA-256 differs)")

    def _write_manifest(self) -> None:
        self.manifest["sha256"] = content_sha256(self.manifest)
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

    def save_blocks(self, first: int, weights: list[dict[str, Tensor]], hidden: list[list[Tensor]] | None,
                    records: list[dict[str, Any]], blocks: Sequence[dict[str, Any]] = ()) -> None:
        """Durably record blocks ``first, first + 1, ...`` (one weight dict each; ``first``
        must be the next block) as finished at once; ``hidden`` (streams of per-batch tensors,
        the statistics stage's) enters the block after them.
        ``records`` (one per layer) and ``blocks`` (one per block, the reconstruction's;
        the extra ``"blocks"``) join those of the earlier blocks in the same manifest write."""
        if first != self.done_blocks:
            raise ValueError(f"block {first} saved out of order (expected {self.done_blocks})")
        files = dict(self.manifest["files"])
        for index, tensors in enumerate(weights, start=first):
            name = f"block_{index:04d}.safetensors"
            files[name] = self._save(name, tensors)
        old_hidden = [f for f in files if f.startswith("hidden_")]
        last = first + len(weights) - 1
        if hidden is not None:
            hname = f"hidden_{last:04d}.safetensors"
            files[hname] = self._save(hname, {f"stream{k}_batch_{j:06d}": h for k, stream in enumerate(hidden)
                                              for j, h in enumerate(stream)})
        for f in old_hidden:
            del files[f]
        if blocks:
            self.manifest["extra"]["blocks"] = self.get("blocks", []) + list(blocks)
        self.manifest.update(done_blocks=last + 1, files=files,
                             records=self.manifest["records"] + records)
        self._write_manifest()
        for f in old_hidden:
            (self.directory / f).unlink(missing_ok=True)

    def _save(self, name: str, tensors: dict[str, Tensor]) -> dict[str, Any]:
        """Write one safetensors file; returns its manifest entry (size and SHA-256)."""
        return write_tensors(self.directory / name, tensors)

    def _load(self, name: str) -> dict[str, Tensor]:
        from safetensors.torch import load_file

        try:
            return load_file(str(self.directory / name))
        except Exception as e:  # safetensors raises its own error types on damaged files
            raise self._corrupt(name, f"cannot be read: {e}") from e

    def block_weights(self, index: int, expected: Mapping[str, Sequence[int]]) -> dict[str, Tensor]:
        """The saved weights of finished block ``index``, which must be exactly the layers
        ``expected`` names (sub-layer name -> weight shape): a tensor missing, extra or of
        another shape is corruption."""
        if index >= self.done_blocks:
            raise ValueError(f"block {index} is not finished in this checkpoint")
        name = f"block_{index:04d}.safetensors"
        saved = self._load(name)
        missing = sorted(set(expected) - set(saved))
        extra = sorted(set(saved) - set(expected))
        if missing or extra:
            raise self._corrupt(name, f"lacks {', '.join(missing) or '-'} and has unexpected "
                                      f"{', '.join(extra) or '-'}")
        for sub, shape in expected.items():
            if tuple(saved[sub].shape) != tuple(shape):
                raise self._corrupt(name, f"holds {sub} of shape {tuple(saved[sub].shape)}, "
                                          f"the model's is {tuple(shape)}")
        return saved

    def hidden(self) -> list[list[Tensor]]:
        """The saved hidden states entering block ``done_blocks``, stream by stream."""
        names = [f for f in self.manifest["files"] if f.startswith("hidden_")]
        if len(names) != 1:
            raise CheckpointError(f"the checkpoint in {self.directory} holds no block inputs; {_RESTART}")
        tensors = self._load(names[0])
        streams: dict[int, list[Tensor]] = {}
        for key in sorted(tensors):
            streams.setdefault(int(key[len("stream"):key.index("_")]), []).append(tensors[key])
        return [streams[k] for k in sorted(streams)]

    def save_teachers(self, tensors: dict[str, Tensor], made_of: str) -> None:
        """Durably record the distillation's dense distribution on its own windows (computed
        before the first block is pruned), and what it was ``made_of`` (under ``"teachers of"``:
        a resumed run takes it up only for the same windows)."""
        files = dict(self.manifest["files"])
        files[TEACHERS] = self._save(TEACHERS, tensors)
        self.manifest["files"] = files
        self.manifest["extra"]["teachers of"] = made_of
        self._write_manifest()

    def teachers(self) -> dict[str, Tensor] | None:
        """What :meth:`save_teachers` recorded, None where nothing was."""
        return self._load(TEACHERS) if TEACHERS in self.manifest["files"] else None

    def save_pass(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        """Durably record the global distillation's progress: its ``tensors`` and ``state``
        (JSON). The two files of :data:`PASS` take turns, so that the one the manifest names
        is never overwritten: a kill at any point leaves the last progress, or this one."""
        name = PASS[1] if PASS[0] in self.manifest["files"] else PASS[0]
        self._record_pass({name: self._save(name, tensors)}, state)

    def next_pass_turn(self) -> int:
        """The turn (0 or 1) the next save of the pass's progress writes: not the last one's."""
        return 1 if any(_PASS_FILE.fullmatch(f) and f.startswith("distillation_0") for f in self.manifest["files"]) \
            else 0

    def save_pass_parts(self, parts: Mapping[str, dict[str, Any]], state: dict[str, Any]) -> None:
        """Durably record the progress of a pass sharded over ranks: every rank has written its
        part into this directory (``parts``: file name -> manifest entry, every rank's, of turn
        :meth:`next_pass_turn`, :func:`pass_part_name`); one manifest write makes them the
        progress, and the files of the turn before are deleted."""
        self._record_pass(dict(parts), state)

    def _record_pass(self, new: dict[str, dict[str, Any]], state: dict[str, Any]) -> None:
        old = [f for f in self.manifest["files"] if _PASS_FILE.fullmatch(f) and f not in new]
        self.manifest["files"] = {**{k: v for k, v in self.manifest["files"].items() if k not in old}, **new}
        self.manifest["extra"]["distillation"] = state
        self._write_manifest()
        for f in old:
            (self.directory / f).unlink(missing_ok=True)

    def saved_pass(self) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
        """What :meth:`save_pass` recorded last, None where nothing was."""
        name = next((name for name in PASS if name in self.manifest["files"]), None)
        return None if name is None else (self._load(name), self.get("distillation"))

    def remove(self) -> None:
        """Delete the files this checkpoint wrote, and its directory if nmprune made it
        (after the run's output is complete)."""
        remove_owned(self.directory, KIND, FLAG, names=_own_entries(self.directory))


def _own_entries(directory: Path) -> list[str]:
    """The entries of ``directory`` a checkpoint writes (finished or temporary files)."""
    return [p.name for p in directory.iterdir() if _OWN_ENTRY.fullmatch(p.name)]
