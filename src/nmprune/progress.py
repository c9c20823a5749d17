"""Progress output of long work, on stderr: tqdm bars, and one line per stage of a run.

On a terminal every bar shows; in a log file (stderr not a terminal) the bars nested inside
another (a block's layers, a block's reconstruction steps) are left out, because tqdm moves
the cursor up to redraw them, which leaves escape characters in the file, and the others
redraw at most every :data:`LOG_INTERVAL_S` seconds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

#: Seconds between two redraws of a bar written to a file rather than a terminal.
LOG_INTERVAL_S = 30.0


def bar(iterable: Iterable | None = None, *, enabled: bool, nested: bool = False, **kwargs: Any):
    """A tqdm bar over ``iterable`` (or a manual one), shown when ``enabled``; ``nested``:
    it runs inside another bar, is removed when done and shows only on a terminal."""
    from tqdm.auto import tqdm

    terminal = sys.stderr.isatty()
    if not terminal:
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    return tqdm(iterable, disable=not enabled or (nested and not terminal),
                **({"leave": False} if nested else {}), **kwargs)


def stage(text: str, enabled: bool = True) -> None:
    """Say on stderr which stage of the run starts (``nmprune: TEXT``)."""
    if enabled:
        print(f"nmprune: {text}", file=sys.stderr, flush=True)
