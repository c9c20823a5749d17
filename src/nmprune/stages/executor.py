"""The solver stage: how a block's layer problems are spread and solved.

An executor (the :class:`Executor` interface) decides which calibration batches this process
runs (:meth:`shard`), combines the layer statistics of all processes before any layer is
solved (:meth:`reduce`) and any other per-process sums (:meth:`all_reduce`: a reconstruction
step's gradients) and solves a block's :class:`LayerJob` s (:meth:`solve`), calling
``done`` with every job's pruned weights in job order. It also carries what the pipeline
exchanges between processes (rank 0's checkpoint state, the hidden states a checkpoint
saves, every rank's busy time) and runs each phase of local work so that an error in one
process reaches all of them (:meth:`phase`). :class:`LocalExecutor` does all of it in this
process; :class:`nmprune.distributed.DistributedExecutor` spreads the same calls over ranks.
:func:`solve_needs` states what the solves need (:mod:`.needs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from ..checks import NonFiniteModel, all_finite
from ..loss import local_loss
from .needs import RunShape, StageNeeds
from .plan import LayerPlan, wanda_reference
from .sink import BlockSink
from .source import BlockSource
from ..registry import RowShards
from ..solve import check_problem, dampened, solve
from .statistics import InputStats, statistic_values
from .token_shares import TokenSharing

T = TypeVar("T")


@dataclass
class LayerJob:
    """One layer's problem: its dense weights ``(d_out, d_in)``, input statistics and plan."""

    name: str
    block: int
    weight: Tensor
    stats: InputStats | None  # None once the job is done (the statistics can be freed)
    plan: LayerPlan


def wanda_loss(w: Tensor, h: Tensor, plan: LayerPlan, loss_method: float | None = None) -> float:
    """The local loss (paper eq. ``squared_loss``, on the undamped ``h``) of Wanda's mask with
    ``plan``'s pattern, Wanda seeing ``plan``'s dampening: the loss of
    :func:`nmprune.stages.plan.wanda_reference` as :func:`nmprune.solve.solve` computes it.

    When ``plan``'s method stage is that reference (Wanda, refined or not), this is its loss
    ``loss_method`` (if given) and costs nothing; otherwise one ``rows x d_in^2`` product
    (``solve`` would make two, and check ``w`` and ``h`` again, which the plan's own solve
    has done)."""
    reference = wanda_reference(plan.pattern, plan.damp)
    if loss_method is not None and replace(plan, refiner=None, refiner_options={}) == reference:
        return loss_method
    with dampened(h, reference.damp) as h_solve:
        pruned = reference.method.fn(w, h_solve, reference.pattern, **reference.method_options)
    return local_loss(pruned, w, h)


def run_job(job: LayerJob, device: torch.device, rows: range | None = None,
            shards: RowShards | None = None) -> tuple[Tensor, dict[str, Any]]:
    """Solve ``job`` on ``device``: the pruned matrix (float, on ``device``) and its record
    (docs/methods.md, "The per-layer record"): the plan (``method``, ``refine``, ``pattern``,
    ``damp``); the local losses (paper eq. ``squared_loss``, on the undamped ``H``) after the
    method and after refinement (``loss_method``, ``loss_refined``: None without a refiner)
    and the seconds each took (``seconds_method``, ``seconds_refine``); the loss of Wanda with
    the same pattern and dampening (``loss_wanda``, :func:`wanda_loss`), the final loss
    relative to it (``loss_vs_wanda``: None when ``loss_wanda`` is 0) and the seconds that
    took (``seconds_wanda_reference``); the whole job's wall and CPU seconds (``seconds``,
    ``cpu_seconds``: this process's, all its threads).

    ``rows`` and ``shards``: solve only these output rows, while other processes solve the
    others (:func:`nmprune.solve.solve`); the whole layer's inputs are checked first, so
    every process fails alike on bad ones. The matrix is then these rows, and the losses
    their part of the layer's."""
    started, cpu_started = time.perf_counter(), time.process_time()
    h = job.stats.hessian().to(device)
    if h.numel() and not all_finite(h):
        raise NonFiniteModel(f"layer {job.name}: its input statistics on the calibration text hold NaN or "
                         "Inf: the model's activations overflow before this layer (a weight too large "
                         "for its dtype?); check the model's weights, or use --dtype float32")
    w = job.weight.detach().to(device=device, dtype=h.dtype)  # the solvers leave it as it is
    try:
        if rows is not None:
            check_problem(w, h, job.plan.pattern)
            w = w[rows.start:rows.stop]
        result = solve(w, h, job.plan, statistic_values(job.plan.statistics, job.stats, device), shards)
    except ValueError as e:  # bad tensors (NaN/Inf weights or statistics): say which layer
        raise (NonFiniteModel if isinstance(e, NonFiniteModel) else ValueError)(f"layer {job.name}: {e}") from e
    record = {**job.plan.describe(), "loss_method": result.loss_method,
              "loss_refined": result.loss_refined, "seconds_method": result.seconds_method,
              "seconds_refine": result.seconds_refine}
    weight = result.weight
    del result  # its mask is freed before the reference's temporaries are made
    start = time.perf_counter()
    loss_wanda = wanda_loss(w, h, job.plan, record["loss_method"])
    final = record["loss_refined"] if record["loss_refined"] is not None else record["loss_method"]
    record.update(loss_wanda=loss_wanda, loss_vs_wanda=final / loss_wanda if loss_wanda > 0 else None,
                  seconds_wanda_reference=time.perf_counter() - start,
                  seconds=time.perf_counter() - started, cpu_seconds=time.process_time() - cpu_started)
    return weight, record


Done = Callable[[LayerJob, Tensor, dict[str, Any]], None]


class Executor(Protocol):
    """What :func:`nmprune.pipeline.prune_model` asks of the solver stage (module docstring):
    :class:`LocalExecutor` in one process, :class:`nmprune.distributed.DistributedExecutor`
    on each rank of a process group."""

    rank: int
    world: int
    is_main: bool
    device: torch.device

    def phase(self, name: str) -> AbstractContextManager: ...

    def broadcast_object(self, value: T) -> T: ...

    def broadcast_tensors(self, tensors: Sequence[Tensor]) -> None: ...

    def gather_batches(self, local: list[Tensor], sizes: Sequence[int]) -> list[Tensor] | None: ...

    def scatter_batches(self, batches: list[Tensor] | None, local_like: list[Tensor]) -> list[Tensor]: ...

    def per_rank(self, value: T) -> list[T]: ...

    def shard(self, items: Sequence[T]) -> list[T]: ...

    def reduce(self, stats: list[InputStats]) -> None: ...

    def all_reduce(self, tensors: Sequence[Tensor]) -> None: ...

    def solve(self, jobs: Sequence[LayerJob], done: Done, progress: Callable = iter) -> None: ...

    def token_sharing(self, total: int) -> TokenSharing | None: ...

    def training_model(self, source: BlockSource, sink: BlockSink, dtype: torch.dtype | None,
                       offloaded: bool = False) -> AbstractContextManager[nn.Module]: ...


class LocalExecutor:
    """Every batch and every layer in this process, on ``device``."""

    rank, world, is_main = 0, 1, True

    def __init__(self, device: torch.device):
        self.device = device

    def phase(self, name: str) -> AbstractContextManager:
        """Local work named ``name``: errors simply propagate."""
        return nullcontext()

    def broadcast_object(self, value: T) -> T:
        """Rank 0's ``value``: this one."""
        return value

    def broadcast_tensors(self, tensors: Sequence[Tensor]) -> None:
        """Rank 0's values of ``tensors``: already here."""

    def gather_batches(self, local: list[Tensor], sizes: Sequence[int]) -> list[Tensor]:
        """All calibration batches' tensors (for rank 0's checkpoint): this process's."""
        return local

    def scatter_batches(self, batches: list[Tensor], local_like: list[Tensor]) -> list[Tensor]:
        """This process's share of rank 0's per-batch tensors: all of them."""
        return batches

    def per_rank(self, value: T) -> list[T]:
        """Every process's ``value``, by rank."""
        return [value]

    def shard(self, items: Sequence[T]) -> list[T]:
        """The calibration batches this process runs: all of them."""
        return list(items)

    def reduce(self, stats: list[InputStats]) -> None:
        """Statistics of one process are already complete."""

    def all_reduce(self, tensors: Sequence[Tensor]) -> None:
        """Sums over processes (a reconstruction step's gradients): already complete."""

    def token_sharing(self, total: int) -> None:
        """One process computes every token of a reconstruction step itself."""
        return None

    @contextmanager
    def training_model(self, source: BlockSource, sink: BlockSink, dtype: torch.dtype | None,
                       offloaded: bool = False) -> Iterator[nn.Module]:
        """The whole pruned model for the global distillation, on ``device`` for the ``with``
        body (:meth:`~nmprune.stages.source.BlockSource.whole_pruned`; ``dtype``, the training
        dtype, is the products' under autocast here). One process offloads nothing: the plan
        offloads only a pass sharded over ranks."""
        if offloaded:
            raise ValueError("one process cannot offload the global distillation's state (the pass is not sharded)")
        with source.whole_pruned(sink) as model:
            model.to(self.device)
            try:
                yield model
            finally:
                model.to("cpu")

    def solve(self, jobs: Sequence[LayerJob], done: Done, progress: Callable = iter) -> None:
        """Solve the jobs in order, each handed to ``done`` as soon as it is finished."""
        for job in progress(jobs):
            weight, record = run_job(job, self.device)
            done(job, weight, {**record, "rank": 0})
            del weight  # else the last result lives through the next solve (940 MiB at 70B)


def solve_needs(run: RunShape) -> StageNeeds:
    """What the layer solves need on one rank: the largest layer's solver memory (its float32
    working weight and result, two ``d_in x d_in`` factorisations), and the seconds of the cost
    model (:func:`~nmprune.distributed.plan_cost`, at the rank's :attr:`~.needs.RunShape.solve_speed`)
    spread as the run spreads them: when blocks are solved one at a time (with reconstruction or
    pruned inputs) the busiest rank's share of each block, under the executor's own choice
    between shares of rows and whole layers (:func:`~nmprune.distributed.busiest_rank_cost`);
    otherwise the mean, since a window of blocks keeps the ranks near balance
    (:func:`~nmprune.distributed.balance_window`)."""
    from ..distributed import busiest_rank_cost, plan_cost, splittable

    solver = max(4 * (2 * r * d + 2 * d * d) for r, d in run.shapes.values())
    active = [run.pruned(block) for block in run.per_block]
    costs = [[plan_cost(block[n], run.plans[n], run.device) for n in names]
             for block, names in zip(run.per_block, active)]
    if not run.settings.blocks_in_windows():  # one block at a time: the busiest rank's share of each
        seconds = sum(busiest_rank_cost(c, [block[n][0] for n in names], splittable([run.plans[n] for n in names]),
                                        run.ranks, run.device)
                      for c, block, names in zip(costs, run.per_block, active))
    else:
        seconds = sum(map(sum, costs)) / run.ranks
    return StageNeeds(block_bytes=solver, seconds={"layer_solves": seconds / run.solve_speed})
