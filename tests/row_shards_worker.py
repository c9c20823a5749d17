"""Run under ``torchrun`` by test_row_shards.py: every rank solves its share of each test
layer's rows (:func:`nmprune.distributed.row_share`) with the ranks' totals
(:class:`nmprune.distributed.RankTotals` through the executor's ``run_job``), and rank 0
also solves each layer whole and writes both under OUT.

    python -m torch.distributed.run --nproc-per-node N tests/row_shards_worker.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nmprune.distributed import RankTotals, current, row_share
from nmprune.stages.executor import LayerJob, run_job
from nmprune.stages.plan import resolve_plan
from nmprune.stages.statistics import accumulate, new_stats

#: (method, refiner) pairs: every built-in method, each refiner, and both kinds of rows
SOLVERS = [("prox", "exact"), ("prox", None), ("prox-l1", "gd"), ("prox-l0", None), ("prox-l2", None),
           ("sparsegpt", "exact"), ("wanda", "gd"), ("magnitude", "exact"), ("dsnot", None)]


def problems() -> dict[str, tuple[torch.Tensor, object]]:
    """A layer with a few dominant inputs (real layers' outliers) and one with fewer
    calibration tokens than inputs (a singular H), 203 rows: shares of unequal size."""
    torch.manual_seed(0)
    out = {}
    for name, tokens in (("outliers", 1024), ("singular", 96)):
        x = torch.randn(tokens, 128)
        x[:, :4] *= 20.0
        stats = accumulate(new_stats(128), x)
        out[name] = (torch.randn(203, 128), stats)
    return out


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks = current("cpu")
    results = {}
    for pname, (w, stats) in problems().items():
        for method, refine in SOLVERS:
            plan = resolve_plan(method, refine, "2:4", {}, 0.01)
            job = LayerJob(f"{pname}/{method}+{refine}", 0, w, stats, plan)
            mine = row_share(ranks.rank, ranks.world, w.shape[0])
            part, record = run_job(job, ranks.device, rows=mine, shards=RankTotals(ranks, w))
            gathered = [None] * ranks.world  # shares of unequal sizes: gloo's all_gather wants equal ones
            dist.all_gather_object(gathered, (part, record["loss_refined"] if refine else record["loss_method"]))
            parts, losses = zip(*gathered)
            if ranks.is_main:
                whole, whole_record = run_job(job, ranks.device)
                results[job.name] = {"rows": torch.cat(parts), "whole": whole, "loss_rows": sum(losses),
                                     "loss_whole": whole_record["loss_refined"] if refine else whole_record["loss_method"],
                                     "rows_kind": [s.rows for s in (plan.method, plan.refiner) if s is not None]}
    if ranks.is_main:
        torch.save(results, out / f"rows-{ranks.world}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
