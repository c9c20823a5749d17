"""nmprune.memory: freed heap pages go back to the system (glibc).

The resident-set measurements run in a fresh Python process each: what glibc does with a
block depends on the allocator's history (a heap with enough free space serves even a block
above the mmap threshold, and that block then stays resident after the free), so in the test
process they would depend on the tests that ran before.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap

import pytest

from nmprune import memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _in_fresh_process(body: str) -> list[float]:
    """Run ``body`` (which has ``memory``, ``json`` and ``_rss_mb`` at hand and prints a JSON
    list of resident-set sizes) in a new interpreter; the list it printed."""
    code = "import json\nfrom nmprune import memory\n" + inspect.getsource(_rss_mb) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(memory.LIBC is None, reason="glibc only (malloc_trim/mallopt)")
def test_release_memory_returns_freed_heap_pages():
    # prefer_mmap (as the CLI does) puts 256 KiB below the mmap threshold: 200 MB in 256 KiB
    # chunks come from the heap; one small object allocated after them keeps the heap top
    # from simply shrinking, so the freed pages stay resident until release_memory
    before, freed, after = _in_fresh_process("""
        memory.prefer_mmap()
        chunks = [bytearray(256 * 1024) for _ in range(800)]
        for c in chunks:
            c[::4096] = b"x" * len(c[::4096])  # touch every page
        pin = bytearray(1024)
        before = _rss_mb()
        del chunks
        freed = _rss_mb()
        memory.release_memory()
        print(json.dumps([before, freed, _rss_mb()]))
    """)
    assert before - freed < 20, (before, freed)
    assert before - after > 150, (before, after)


@pytest.mark.skipif(memory.LIBC is None, reason="glibc only (malloc_trim/mallopt)")
@pytest.mark.parametrize("keep", [True, False])
def test_prefer_mmap_keeps_a_freed_heap_top_until_release_memory(keep: bool):
    # 40 MB in 256 KiB blocks from the heap (malloc and free straight from libc, and the
    # resident set read without a Python file buffer, so that nothing else lands on the heap),
    # freed from the top down: prefer_mmap keeps the free top resident (below its trim
    # threshold, twice the 32 MiB mmap threshold) for the next allocations, until
    # release_memory. The mmap threshold pinned alone (as before) left glibc's 128 KiB trim
    # threshold, which gives the pages back at once: the case that shows the probe tells the
    # two apart
    setup = "memory.prefer_mmap()" if keep else "memory.LIBC.mallopt(-3, 32 << 20)"
    before, freed, after = _in_fresh_process(f"""
        import ctypes, os
        libc = memory.LIBC
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        def resident():
            os.lseek(fd, 0, 0)
            return int(os.read(fd, 100).split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
        {setup}
        before = resident()
        blocks = [libc.malloc(256 * 1024) for _ in range(160)]
        for b in blocks:
            libc.memset(b, 1, 256 * 1024)
        for b in reversed(blocks):
            libc.free(b)
        freed = resident()
        memory.release_memory()
        print(json.dumps([before, freed, resident()]))
    """)
    assert (freed - before > 30) == keep, (before, freed)
    assert after - before < 10, (before, after)


@pytest.mark.skipif(memory.LIBC is None, reason="glibc only (malloc_trim/mallopt)")
@pytest.mark.parametrize("threshold_mib, block_mib, mapped", [(32, 64, True), (4, 16, True), (None, 16, False)])
def test_prefer_mmap_maps_large_blocks(threshold_mib: int | None, block_mib: int, mapped: bool):
    # a freed mapped 24 MiB block first raises glibc's dynamic mmap threshold, as a long run
    # does: without prefer_mmap a 16 MiB block then comes from the heap and stays resident
    # (the last case, which shows that the probe tells a mapped block from a heap one)
    prefer = "" if threshold_mib is None else f"memory.prefer_mmap({threshold_mib} << 20)"
    before, grown, after = _in_fresh_process(f"""
        warm = bytearray(24 << 20)
        del warm
        {prefer}
        before = _rss_mb()
        block = bytearray({block_mib} << 20)
        block[::4096] = b"x" * len(block[::4096])
        grown = _rss_mb()
        del block
        print(json.dumps([before, grown, _rss_mb()]))
    """)
    assert grown - before > 0.75 * block_mib, (before, grown)
    # a mapped block is unmapped on free: the memory is back without any trim
    assert (after - before < 0.25 * block_mib) == mapped, (before, grown, after)


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
