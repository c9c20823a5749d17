"""The ``custom_dataset`` of nmprune's offline lm-eval tasks: JSON-lines files beside the YAML.

lm-eval hands a task's ``dataset_kwargs`` to this function; relative ``data_files`` are read
from this folder, so the task YAML files work from any working directory, in nmprune and with
lm-eval's own ``--include_path``. lm-eval loads this file by path, so it imports nothing
from nmprune.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REBUILD = "python -m nmprune.tasks.build"


def load(data_files: dict[str, str], **_: Any):
    """A ``datasets.DatasetDict`` with one split per entry of ``data_files`` (split -> file).

    A missing file is a ValueError naming it and the command that rebuilds it. Other keyword
    arguments (lm-eval passes the task's metadata) are ignored.
    """
    import datasets

    files = {split: HERE / name for split, name in data_files.items()}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ValueError(f"nmprune task data {', '.join(missing)} is missing; rebuild it with: {REBUILD}")
    return datasets.load_dataset("json", data_files={s: str(p) for s, p in files.items()})
