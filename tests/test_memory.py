"""nmprune.memory: freed heap pages go back to the system (glibc)."""

from __future__ import annotations

import pytest

from nmprune import memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(memory.LIBC is None, reason="glibc only (malloc_trim/mallopt)")
def test_release_memory_returns_freed_heap_pages():
    # 200 MB in 256 KiB chunks (below glibc's mmap threshold: they come from the heap);
    # keep one small object allocated after them so the heap top cannot simply shrink
    chunks = [bytearray(256 * 1024) for _ in range(800)]
    for c in chunks:
        c[::4096] = b"x" * len(c[::4096])  # touch every page
    pin = bytearray(1024)
    before = _rss_mb()
    del chunks
    memory.release_memory()
    after = _rss_mb()
    assert before - after > 150, (before, after)
    del pin


@pytest.mark.skipif(memory.LIBC is None, reason="glibc only (malloc_trim/mallopt)")
def test_prefer_mmap_maps_large_blocks():
    memory.prefer_mmap()
    before = _rss_mb()
    block = bytearray(64 << 20)
    block[::4096] = b"x" * len(block[::4096])
    assert _rss_mb() - before > 50
    del block
    # a mapped block is unmapped on free: the memory is back without any trim
    assert _rss_mb() - before < 20
