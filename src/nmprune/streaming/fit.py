"""Whether a model fits in memory: its weights' size against the memory available.

The weights' size is counted from the model's configuration without loading anything: the
model is built on the meta device and its distinct parameters' elements are multiplied by
the run dtype's size (for a GGUF file: the dense float dtype it is unpacked to). The memory
available is the kernel's ``MemAvailable`` (``/proc/meminfo``), lowered to what the
process's memory cgroup still allows when it has a limit. An in-memory run holds about
:data:`IN_MEMORY_FACTOR` times the weights at its peak (the model, the copy
``save_pretrained`` makes while writing, the solvers' and evaluation's working memory; the
packaged model's main job peaks at 2.6 times its float32 weights), so streaming is picked
when that exceeds the memory available.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from ..models import ModelSource, parse_dtype, read_config
from .files import INDEX, SINGLE

IN_MEMORY_FACTOR = 2.5
GIB = float(1 << 30)


def streamable(source: ModelSource) -> bool:
    """A local directory holding safetensors weights (a GGUF file or hub id loads whole)."""
    p = Path(source.path)
    return source.gguf_file is None and p.is_dir() and ((p / SINGLE).is_file() or (p / INDEX).is_file())


def ranks_offload(offload: bool | None, processes: int, source: ModelSource) -> bool | None:
    """The ``offload`` a run of ``processes`` ranks uses: several ranks never hold a private
    copy each of a model that can stream (:func:`streamable`), so ``None`` (decide by memory)
    becomes ``True`` for them; otherwise ``offload`` as given."""
    return True if offload is None and processes > 1 and streamable(source) else offload


def weight_bytes(source: ModelSource, dtype: str | torch.dtype | None = "auto", config=None) -> int:
    """Bytes of the model's distinct parameters in the run dtype (module docstring);
    ``config`` is the model's configuration when the caller has read it already."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = config if config is not None else read_config(source)
    parsed = parse_dtype(dtype)
    if parsed == "auto":
        parsed = parse_dtype(getattr(config, "dtype", None) or "float32")
    with init_empty_weights():  # on a copy: building a model may edit its configuration
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), trust_remote_code=False)
    model.tie_weights()  # the meta context unties shared parameters
    return sum(p.numel() for p in model.parameters()) * parsed.itemsize


def _cgroup_headroom() -> int | None:
    """What this process's memory cgroup (v1 or v2) still allows, if it has a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit_file, usage_file = base / "memory.max", base / "memory.current"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit_file, usage_file = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        try:
            limit, usage = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < (1 << 60):
            return int(limit) - usage
    return None


def available_memory() -> int:
    """Bytes this process can still take (module docstring)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom()
    return min(avail, headroom) if headroom is not None else avail


def choose_streaming(source: ModelSource, dtype: str | torch.dtype | None, offload: bool | None,
                     config=None, processes: int = 1) -> bool:
    """Stream (True) or load whole (False): ``offload`` decides when given; otherwise
    streaming is picked when ``processes`` in-memory runs (the ranks on this machine, each
    with its own copy) would not fit (module docstring). A model that must stream but is no
    local safetensors checkpoint is a ValueError. ``config`` as in :func:`weight_bytes`."""
    if offload is False:
        return False
    if offload:
        if not streamable(source):
            raise ValueError(f"offload streams local safetensors checkpoints; {source} is a "
                             f"{'GGUF file' if source.gguf_file else 'hub id or has no safetensors weights'}, "
                             "which loads whole (download or save it as a safetensors directory "
                             "with save_pretrained to stream it)")
        return True
    need = processes * IN_MEMORY_FACTOR * weight_bytes(source, dtype, config)
    avail = available_memory()
    if need <= avail:
        return False
    if streamable(source):
        return True
    copies = f"{processes} processes x " if processes > 1 else ""
    raise ValueError(f"{source} does not fit in memory: loading it whole takes about {need / GIB:.1f} GiB "
                     f"({copies}{IN_MEMORY_FACTOR} x its weights) and {avail / GIB:.1f} GiB is available; "
                     f"{'GGUF files' if source.gguf_file else 'hub ids'} load whole, only local "
                     "safetensors checkpoints stream: save it with save_pretrained (or download "
                     "it) to a directory and prune that")
