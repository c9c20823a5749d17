"""What a run writes outside its output model, and the rule for deleting it.

nmprune deletes only what it created. Every directory it makes for its own use (the
staged save ``OUT.partial``, the checkpoint ``OUT.checkpoint``) receives a marker file
(:data:`MARKER`) naming its kind before anything else goes in, and :func:`remove_owned`
refuses a directory without one, whatever its name. A directory killed between its
creation and its marker is empty, and an empty directory is taken as it is (removing it
loses nothing).

A save is staged in ``OUT.partial/unfinished/`` and renamed to ``OUT`` at once
(:func:`publish_atomic`): ``OUT.partial`` itself holds no ``config.json``, so no loader
takes it for a model, and ``OUT`` appears only complete. Two runs writing the same ``OUT``
(or the same checkpoint) at once are kept apart by :class:`RunLock`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError
from torch import nn

MARKER = ".nmprune"
PARTIAL_SUFFIX = ".partial"
UNFINISHED = "unfinished"
LOCK_SUFFIX = ".lock"


class NotOwnedError(ValueError):
    """A directory nmprune would replace or delete, but did not create."""


def mark(directory: Path, kind: str, made: bool) -> None:
    """Write the marker of a ``kind`` directory (``made``: nmprune created the directory
    itself, so it may remove the directory too, not only its own files)."""
    (directory / MARKER).write_text(json.dumps({"kind": kind, "made_directory": made}) + "\n")


def marker(directory: Path) -> dict | None:
    """The marker of ``directory``, or None when it has none (or an unreadable one)."""
    try:
        value = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def check_owned(directory: Path, kind: str, flag: str) -> bool:
    """Whether ``directory`` exists, after checking that nmprune may replace it: it is a
    ``kind`` directory with its marker, or empty. Anything else is a
    :class:`NotOwnedError` naming ``flag``."""
    if not directory.exists():
        return False
    if directory.is_dir():
        found = marker(directory)
        if (found or {}).get("kind") == kind or not any(directory.iterdir()):
            return True
    raise NotOwnedError(f"{directory} exists and was not made by nmprune as a {kind} directory "
                        f"(no {MARKER} marker); nmprune deletes only what it created: move it "
                        f"away or choose another {flag}")


def remove_owned(directory: Path, kind: str, flag: str, names: list[str] | None = None) -> None:
    """Delete the ``kind`` directory nmprune made (:func:`check_owned` first). With
    ``names``, only those entries and the marker go, and the directory itself only when it
    is then empty and nmprune had created it."""
    if not check_owned(directory, kind, flag):
        return
    made = (marker(directory) or {}).get("made_directory", True)
    if names is None:
        shutil.rmtree(directory)
        return
    for name in [*names, MARKER]:
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    if made and not any(directory.iterdir()):
        directory.rmdir()


# ----------------------------------------------------------------------------- failed writes

#: Errors of the machine rather than of the input (a full disk, a failing device): exit code 1.
IO_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})


def os_error(error: Exception) -> OSError | None:
    """safetensors' error for a failed read or write of the machine's (a full disk: "...
    (os error 28)") as the OSError it stands for; None for any other."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Inside, a write that fails for the machine (:data:`IO_FAILURES`: a full disk, say;
    also as safetensors reports it) is raised again as an OSError naming ``path``, the
    file or folder being written, which the bare error does not."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        failure = e if isinstance(e, OSError) else os_error(e)
        if failure is None or failure.errno not in IO_FAILURES or getattr(e, "filename", None):
            raise
        raise OSError(failure.errno, os.strerror(failure.errno), str(path)) from e


# ----------------------------------------------------------------------------- staged save

def partial_save_dir(out: str | os.PathLike) -> Path:
    """Where a save of ``out`` is staged (``OUT.partial``)."""
    out = Path(out)
    return out.with_name(out.name + PARTIAL_SUFFIX)


def remove_partial_save(out: str | os.PathLike) -> None:
    """Delete what a killed or failed save of ``out`` left behind (``OUT.partial``), if
    anything; an ``OUT.partial`` nmprune did not make is a :class:`NotOwnedError`."""
    remove_owned(partial_save_dir(out), "partial", "--out")


def staging_dir(out: str | os.PathLike) -> Path:
    """The empty directory ``OUT.partial/unfinished`` a save writes into before
    :func:`publish_atomic` renames it to ``out`` (which must not exist yet); a leftover
    ``OUT.partial`` of a killed save is replaced."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"output directory {out} already exists; choose another --out or remove it")
    remove_partial_save(out)
    partial = partial_save_dir(out)
    partial.mkdir(parents=True)
    mark(partial, "partial", made=True)
    tmp = partial / UNFINISHED
    tmp.mkdir()
    return tmp


def publish_atomic(tmp: Path, out: str | os.PathLike) -> Path:
    """Give every file in ``tmp`` the permissions the user's umask gives a new file
    (transformers writes the weights through a private temporary file, mode 600), rename
    ``tmp`` to ``out`` and remove the then empty ``OUT.partial``."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)
    os.replace(tmp, out)
    remove_partial_save(out)
    return Path(out)


def save_pretrained_atomic(model: nn.Module, tokenizer, out: str | os.PathLike,
                           extra_files: dict[str, str] | None = None) -> Path:
    """Save the model (safetensors, zeros stored densely), tokenizer and ``extra_files``
    (name -> text) into ``OUT.partial/unfinished/``, then rename that directory to ``out``.

    ``out`` must not exist yet; a leftover ``OUT.partial`` of a killed save is replaced,
    and a failed save (a full disk, say) removes what it wrote. GGUF-loaded models save as
    ordinary transformers checkpoints that load without ``gguf_file``.
    """
    tmp = staging_dir(out)
    try:
        with writing(tmp):
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
    except BaseException:
        remove_partial_save(out)
        raise
    return publish_atomic(tmp, out)


# ----------------------------------------------------------------------------- locking

class RunLock:
    """An exclusive lock on ``PATH.lock`` for each path, held from :meth:`acquire` to
    :meth:`release` (or the process's end: the kernel drops an ``flock`` with its owner).

    A second run on a locked path is refused at once, naming the holder's process id. The
    lock files are removed by their holder; a file found replaced after locking (its
    holder removed it meanwhile) is locked afresh.
    """

    def __init__(self, paths: list[Path]):
        self.paths = [p.with_name(p.name + LOCK_SUFFIX) for p in dict.fromkeys(Path(q) for q in paths)]
        self._held: list[tuple[Path, int]] = []

    def acquire(self) -> "RunLock":
        try:
            for path in self.paths:
                self._held.append((path, self._lock(path)))
        except BaseException:
            self.release()
            raise
        return self

    @staticmethod
    def _lock(path: Path) -> int:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
                os.close(fd)
                target = path.with_name(path.name.removesuffix(LOCK_SUFFIX))
                raise ValueError(f"another nmprune run (process {holder}) is writing {target} "
                                 f"(lock {path}); wait for it to finish or choose another "
                                 "--out / --checkpoint-dir") from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return fd
            os.close(fd)

    def release(self) -> None:
        """Remove the lock files and drop the locks."""
        while self._held:
            path, fd = self._held.pop()
            path.unlink(missing_ok=True)
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
