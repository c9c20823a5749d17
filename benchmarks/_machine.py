"""The CPU a benchmark ran on, for its results.

The CPU behind the benchmark machine changes between runs, and numba's kernels and torch's
matmul do not change speed together from one CPU to another (docs/benchmarks.md). Timings are
only comparable between runs on the same CPU, so the benchmarks record it with
:func:`cpu_description`.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def cpu_description() -> dict[str, str]:
    """``model`` (``/proc/cpuinfo``'s model name, else :func:`platform.processor`) and
    ``llvm_target`` (the CPU LLVM compiles numba kernels for, ``"unknown"`` without llvmlite)."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    try:
        import llvmlite.binding as llvm

        target = llvm.get_host_cpu_name()
    except ImportError:
        target = "unknown"
    return {"model": model, "llvm_target": target}


def code_commit() -> str:
    """The short hash of the checkout the benchmark ran (``""`` outside a git work tree)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                          capture_output=True, text=True).stdout.strip()
