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


def test_frozen_heap_hides_the_objects_alive_at_entry_and_collects_new_cycles():
    import gc
    import weakref

    class Node:
        pass

    old = Node()
    old.self = old  # a cycle alive at entry: frozen, so never collected inside the block
    ref_old = weakref.ref(old)
    with memory.frozen_heap():
        assert gc.get_freeze_count() > 0
        del old
        new = Node()
        new.self = new
        ref_new = weakref.ref(new)
        del new
        gc.collect()
        assert ref_new() is None  # garbage made inside the block is still collected
        assert ref_old() is not None
        with memory.frozen_heap():  # nested: leaves the outer freeze alone
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref_old() is None
