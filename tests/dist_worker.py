"""Run under ``torchrun`` by test_distributed.py: one rank of ``prune_model`` called from
Python inside a process group this script initialises (gloo).

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_worker.py FAMILY MODE OUT [RECONSTRUCT]

MODE ``run`` prunes a tiny model of FAMILY and rank 0 saves the state dict and the report
under OUT; ``fail`` also keeps a checkpoint in OUT/ckpt and raises on rank 1 after block 1;
``resume`` continues from the checkpoint in OUT/ckpt (made by any number of ranks).
RECONSTRUCT (``submodule`` or ``block``) adds local reconstruction with :data:`RECONSTRUCT`
(``block:2``: in two lanes instead of the default one; ``block:1:distill`` adds the global
distillation pass with :data:`DISTILL`);
``prox`` instead prunes with :data:`PROX`, whole layers to each rank (the tiny layers are too
small to split), and ``rows`` does the same but makes the ranks split layers of any size
(:data:`nmprune.distributed.MIN_SHARE_ROWS` lowered to 1, no :data:`~nmprune.distributed.SPLIT_OVERHEAD`
but a split's saving), so they solve shares of every layer's rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_models_tiny import tiny_model, token_batch  # noqa: E402

from nmprune import distributed  # noqa: E402
from nmprune.checkpoint import Checkpoint  # noqa: E402
from nmprune.pipeline import prune_model  # noqa: E402

#: the pass is asked for explicitly (DISTILL): the sharded pass takes other steps than one process's
SETTINGS = dict(method="sparsegpt", refine="exact", pattern="2:4", batch_size=2, reconstruct="none", distill_epochs=0)
RECONSTRUCT = dict(reconstruct_batch_size=2, reconstruct_epochs=5, reconstruct_lr=1.8e-2)
DISTILL = dict(distill_epochs=2, distill_lr=1e-2)
PROX = dict(SETTINGS, method="prox", hessian_inputs="pruned")  # its rows read totals over the layer


def settings(family: str, extra: str) -> dict:
    """The prune_model settings of a worker started with ``extra`` (module docstring)."""
    if extra in ("prox", "rows"):
        return PROX
    granularity, _, rest = extra.partition(":")
    lanes, _, distill = rest.partition(":")
    return dict(SETTINGS, hessian_inputs="pruned" if family == "opt" else "dense",
                **(dict(reconstruct=granularity, **RECONSTRUCT) if extra != "none" else {}),
                **(dict(reconstruct_lanes=int(lanes)) if lanes else {}),
                **(DISTILL if distill else {}))


#: an MLP width at which a tiny Llama's down projection outweighs a rank's fair share of its
#: block, so that two ranks solve two blocks at a time (nmprune.distributed.balance_window):
#: the ``fail`` mode's model, which fails while the group is saved
WIDE_MLP = 512


def build(family: str, intermediate: int = 128):
    """The tiny model of the tests (3 blocks, MLP width ``intermediate``)."""
    return tiny_model(family, layers=3, intermediate=intermediate)


def main(family: str, mode: str, out: Path, extra: str = "none") -> None:
    torch.set_num_threads(1)
    if extra == "rows":
        distributed.MIN_SHARE_ROWS = 1
        distributed.SPLIT_OVERHEAD = {"cpu": -1.0, "cuda": -1.0}  # a split then costs nothing
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(family, WIDE_MLP if mode == "fail" else 128)
    checkpoint = Checkpoint.open(out / "ckpt", "test") if mode in ("fail", "resume") and rank == 0 else None

    def fail(i: int) -> None:
        if mode == "fail" and rank == 1 and i == 1:
            raise ValueError("injected failure on rank 1 after block 1")

    report = prune_model(model, calibration=token_batch(8, 16), device="cpu", progress=False,
                         checkpoint=checkpoint, on_block_done=fail, **settings(family, extra))
    if rank == 0:
        torch.save(model.state_dict(), out / "state.pt")
        (out / "report.json").write_text(json.dumps(report.to_dict(), default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), *sys.argv[4:])
