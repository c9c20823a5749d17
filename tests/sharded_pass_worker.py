"""Run under ``torchrun`` by test_distributed.py: the global distillation pass on a tiny
Llama sharded over the ranks (:func:`nmprune.stages.sharded_pass.sharded_whole`), gloo.

    python -m torch.distributed.run --nproc-per-node 2 tests/sharded_pass_worker.py OUT

Each rank holds calibration batch ``rank`` of :func:`pruned_model_and_windows`; the pass
runs twice, its state in the device's memory and offloaded to CPU memory (FSDP2's
``CPUOffloadPolicy``, on the CPU a copy in the same memory); rank 0 saves both runs' trained
weights, the pass's record and each rank's share of the trained weights' rows under OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_models_tiny import tiny_model, token_batch  # noqa: E402

from nmprune.distill import DISTILL_TOPK  # noqa: E402
from nmprune.reconstruct import FitOptions, local_part  # noqa: E402
from nmprune.stages.distillation import PassRuntime, PassWindows, dense_teachers, distill  # noqa: E402
from nmprune.stages.sharded_pass import sharded_whole  # noqa: E402
from nmprune.stages.sink import ModelSink  # noqa: E402
from nmprune.stages.source import ModelBlocks  # noqa: E402

#: how the pass trains: each epoch is one step of every rank's batch (float32 products)
OPTIONS = FitOptions(epochs=3, lr=2e-2, batches_per_step=1, precision="full")


def pruned_model_and_windows() -> tuple[torch.nn.Module, torch.Tensor, list]:
    """A tiny Llama whose block layers are 2:4 by magnitude, two windows and the dense
    model's distribution on them."""
    model = tiny_model("llama", layers=2)
    batches = token_batch(2, 16, seed=3)
    teachers = dense_teachers(model, [b[None] for b in batches], DISTILL_TOPK, torch.device("cpu"))
    source = ModelBlocks(model)
    with torch.no_grad():
        for i in range(len(source)):
            for m in source.layers(i).values():
                w = m.weight
                cells = w.reshape(-1, 4)
                keep = cells.abs().topk(2, dim=-1).indices
                m.weight.copy_(torch.zeros_like(cells).scatter(-1, keep, cells.gather(-1, keep)).reshape(w.shape))
    return model, batches, teachers


def trained_names(source: ModelBlocks) -> list[str]:
    return [name for i in range(len(source)) for name in source.layers(i)]


def all_reduce(tensors):
    for t in tensors:
        dist.all_reduce(t)


def train(offloaded: bool) -> tuple[dict, dict, dict]:
    """One pass on this rank's window: the trained weights, the record, this rank's rows."""
    rank = dist.get_rank()
    model, batches, teachers = pruned_model_and_windows()
    source = ModelBlocks(model)
    names = trained_names(source)
    with sharded_whole(source, ModelSink(source), torch.device("cpu"), None, offloaded) as sharded:
        weights = [sharded.get_submodule(n).weight for n in names]
        rows = {n: list(local_part(w).shape) for n, w in zip(names, weights)}
        record = distill(sharded, weights, PassWindows([batches[rank][None]], [teachers[rank]], [rank], 2),
                         OPTIONS, PassRuntime(all_reduce, torch.device("cpu")))
    return {n: source.model.get_submodule(n).weight.detach() for n in names}, record, rows


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    weights, record, rows = train(False)
    offloaded, _, _ = train(True)
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, rows)
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "offloaded": offloaded}, out / "weights.pt")
        (out / "record.json").write_text(json.dumps({"record": record, "rows": shares}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
