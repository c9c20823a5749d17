"""Give freed memory back to the operating system during a long run.

glibc keeps freed heap memory for reuse, and its mmap threshold grows each time a large block
is freed, so later large tensors come from the heap and fragment it: on the packaged model the
resident set grows by about 100 MB per decoder block. :func:`prefer_mmap` (called by the CLI)
pins the threshold at 32 MiB, so the large activation tensors are always mapped and unmapped
directly while the many small temporaries of the layer solvers keep reusing the heap; a
streamed run (a model larger than memory) lowers it to 4 MiB, so that every tensor of a
weight's size is mapped too: at 32 MiB the 16 MiB solver temporaries of a hidden-1024 model
fragmented the heap (a streamed SparseGPT run peaked about 160 MiB higher;
docs/pipeline.md#large-models), while the main job's layer solvers ran a few percent slower
at 4 MiB. Pinning the mmap threshold also pins glibc's trim threshold, at 128 KiB: every
free that left more than that at the top of the heap gave it back to the system, and the next
allocation faulted it in again, page by page. Reconstruction frees and reallocates its
activations every step, so a run spent about a tenth of its CPU time in the kernel: on the
scaling benchmark's Llama (2 streamed ranks, AMD EPYC znver5) 7.7 million page faults and
18 s of system time in an 80 s run. :func:`prefer_mmap` therefore also sets the trim threshold
to twice the mmap threshold, as glibc's own dynamic rule does: 2.5 million faults at 8 MiB
(a streamed run's), 1.9 million at 16 MiB and 1.2 million at 64 MiB (72 s instead of 80 s). A
larger one would keep more free memory resident between trims, which streamed runs, sized to
fit, cannot spare. :func:`release_memory` (after loading, evaluating and every block, and, without
the garbage collection, after every layer, every evaluation batch and every block of a
streamed evaluation) still returns all free heap pages.
:func:`frozen_heap` keeps the objects that live for the whole run (a loaded model, its
tokenizer and the imported libraries: about 400,000 objects on the packaged model) out of
the garbage collector's view while the blocks are pruned, so that each full collection
walks only what the run created since, instead of 0.2 s of walking everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Iterator


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both exist on glibc only
        return libc
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return None


LIBC = _glibc()
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def prefer_mmap(threshold: int = 32 << 20) -> None:
    """Serve allocations of ``threshold`` bytes or more by mmap, and keep up to twice that in
    free bytes at the top of the heap between :func:`release_memory` calls (glibc;
    process-wide, so only the command-line entry points call it)."""
    if LIBC is not None:
        LIBC.mallopt(_M_MMAP_THRESHOLD, threshold)
        LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * threshold)


def release_memory(collect: bool = True) -> None:
    """Collect garbage (unless ``collect=False``) and, on glibc, return free heap pages to the
    system."""
    if collect:
        gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect garbage, then exclude every object alive now from later collections
    (:func:`gc.freeze`) until the block exits. Inside another ``gc.freeze`` it does
    nothing."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
