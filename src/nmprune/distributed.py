"""Pruning on several processes: ``torch.distributed``, launched by ``torchrun``.

Every layer's problem (paper eq. ``squared_loss``) is independent once its Hessian is known,
which is why the paper prunes on several GPUs (Appendix ``app:use_unpruned_inputs``). Here
each rank (one process, one device: ``cuda:LOCAL_RANK`` with NCCL, the CPU with gloo)

1. runs its contiguous share of the calibration batches through the current block;
2. all-reduces the input statistics (``sum x x^T``, ``sum x``, token count: sums, so the
   reduction is exact up to float summation order) before any layer is solved;
3. solves its share of the layers. The loss is a sum over a layer's rows, and every built-in
   solver treats the rows independently once ``H`` is known (reading the few totals its loop
   needs over all rows through :class:`~nmprune.registry.RowShards`), so each rank can solve
   a contiguous share of every layer's rows (:func:`split_rows`), which keeps the ranks
   equally busy whatever the block's shapes and the cost model's errors. Where a solver is
   registered ``rows="whole"``, or the layers are too small to split, the cost-based
   assignment (:func:`assign`, longest job first to the least loaded rank) gives each rank
   whole layers instead;
4. receives every other rank's pruned weights (rows) by broadcast, so after each block all
   ranks hold the same pruned block (needed to propagate with ``hessian_inputs="pruned"``,
   and it lets :func:`nmprune.pipeline.prune_model` return the same model on every rank).

Errors never hang a job: each phase ends in :func:`Ranks.check`, an all-gather of every
rank's status; a rank that raised makes all ranks raise :class:`RankError` naming it and its
message, and every collective has the process group's timeout
(``NMPRUNE_DIST_TIMEOUT`` seconds, default 1800) for a rank that died without a word.

Without a process group (no ``torchrun``, or ``WORLD_SIZE`` 1) none of this runs.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .devices import default_device
from .reconstruct import lane_of
from .registry import get_method, get_refiner
from .stages.sharded_pass import sharded_whole
from .stages.token_shares import TokenSharing

T = TypeVar("T")

TIMEOUT_ENV = "NMPRUNE_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0
#: :meth:`Ranks.all_reduce_sum` sums small tensors of one dtype together, in flat buckets of up
#: to this many bytes: one collective per bucket, not per tensor (a reconstruction step's
#: gradients, one per pruned layer, and its error would otherwise be eight collectives, and on
#: gloo their latency took a fifth of a 2-rank reconstruction)
BUCKET_BYTES = 32 << 20


class RankError(RuntimeError):
    """Another rank (or this one) failed; the message names the rank and its error.
    ``user_error``: every failing rank's error was the user's input (a ValueError, which the
    command line ends with exit code 2), not a bug or the environment."""

    def __init__(self, message: str, user_error: bool = False):
        super().__init__(message)
        self.user_error = user_error


class PeerLost(RankError):
    """A collective failed on this rank: another rank stopped without a word (killed, out of
    memory, its machine gone) or passed the collective timeout. Not followed by the farewell
    barrier of :func:`teardown`, which would wait for the lost rank."""


def flat_buckets(tensors: Sequence[Tensor], limit: int) -> list[list[Tensor]]:
    """``tensors`` grouped by dtype and device, in order, each group split into buckets of at
    most ``limit`` bytes (a tensor larger than that, or not contiguous, is a bucket alone)."""
    open_: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    done: list[list[Tensor]] = []
    for t in tensors:
        size = t.numel() * t.element_size()
        if size > limit or not t.is_contiguous():
            done.append([t])
            continue
        key = (t.dtype, t.device)
        bucket = open_.setdefault(key, [])
        if bucket and sum(x.numel() * x.element_size() for x in bucket) + size > limit:
            done.append(bucket)
            bucket = open_[key] = []
        bucket.append(t)
    return done + [b for b in open_.values() if b]


@contextmanager
def _peer_lost(what: str) -> Iterator[None]:
    """Turn the backend's error in a collective (gloo and NCCL raise RuntimeError, NCCL's as
    ``DistBackendError``) into one :class:`PeerLost` line that says what to do."""
    try:
        yield
    except RuntimeError as e:
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". This is typically")[0]
        raise PeerLost(f"lost contact with another rank during {what} ({cause[:160]}): a rank stopped "
                       "without a word (killed, out of memory, or its machine went away) or passed the "
                       f"collective timeout ({TIMEOUT_ENV}); see the other ranks' logs, then rerun the "
                       "same torchrun command: it resumes from the checkpoint") from e


class JobMismatch(ValueError):
    """The ranks were started with other settings or model files (raised on every rank)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the initialised process group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    #: the ranks on this machine (``LOCAL_WORLD_SIZE``), which share its memory
    local_world: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes checkpoints, reports and the pruned model."""
        return self.rank == 0

    # -- errors ----------------------------------------------------------------------------

    def check(self, phase: str, error: BaseException | None = None, payload: Any = None) -> list[Any]:
        """All-gather each rank's ``(error, payload)`` after ``phase``. A rank that brings
        an ``error`` raises it again; when any rank brought one, the others raise
        :class:`RankError` naming it; otherwise the payloads come back by rank."""
        status = None if error is None else f"{type(error).__name__}: {error}"
        user = isinstance(error, ValueError)
        gathered: list[Any] = [None] * self.world
        with _peer_lost(f"the status check after {phase}"):
            dist.all_gather_object(gathered, (status, user, payload))
        if error is not None:
            raise error
        failed = [(r, s, u) for r, (s, u, _) in enumerate(gathered) if s is not None]
        if failed:
            text = "; ".join(f"rank {r} failed during {phase}: {s}" for r, s, _ in failed)
            raise RankError(text, user_error=all(u for _, _, u in failed))
        return [p for _, _, p in gathered]

    def agree(self, digests: dict[str, str]) -> None:
        """Every rank brings the same ``digests`` (name -> digest: the settings, the model
        files, ...), or every rank raises the same :class:`JobMismatch` naming what differs and on
        which ranks: ranks started with other settings or other files never work together."""
        gathered = self.check("comparing the ranks' settings and model files", payload=digests)
        differ = [f"{name} (rank 0: {value}; " + ", ".join(
                      f"rank {r}: {g.get(name)}" for r, g in enumerate(gathered) if g.get(name) != value) + ")"
                  for name, value in gathered[0].items()
                  if any(g.get(name) != value for g in gathered)]
        if differ:
            raise JobMismatch(f"the {self.world} ranks were not started on the same job: their "
                             f"{'; '.join(differ)} differ; start every rank with the same "
                             "command, settings and model files")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run a phase's local work; on leaving, :meth:`check` all ranks' status (an error
        inside is reported to every rank instead of leaving them waiting)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every error is reported to all ranks
            self.check(name, e)  # raises e again
        self.check(name)

    # -- data --------------------------------------------------------------------------------

    def share(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (calibration batches)."""
        if n < self.world:
            raise ValueError(f"{n} calibration batches cannot be shared by {self.world} ranks; "
                             "use more samples (--nsamples) or a smaller --batch-size")
        return range(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def owner_of(self, index: int, n: int) -> int:
        """The rank whose :meth:`share` of ``n`` items holds item ``index`` (the reconstruction's
        lane of that item with one lane per rank)."""
        return lane_of(index, n, self.world)

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """``value`` of rank ``src`` on every rank (small picklable values)."""
        box = [value]
        with _peer_lost("a broadcast"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_reduce_sum(self, tensors: Sequence[Tensor]) -> None:
        """Sum each tensor over all ranks, in place (on this rank's device); the tensors of one
        dtype go in flat buckets of up to :data:`BUCKET_BYTES`, one collective each (a larger
        tensor goes alone, without a copy when it is on this rank's device)."""
        for bucket in flat_buckets(tensors, BUCKET_BYTES):
            alone = len(bucket) == 1 and bucket[0].device == self.device
            buf = bucket[0] if alone else torch.cat([t.detach().reshape(-1).to(self.device) for t in bucket])
            with _peer_lost("a sum over the ranks"):
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            offset = 0
            for t in bucket if not alone else ():
                t.copy_(buf[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()

    def broadcast_into(self, target: Tensor, src: int) -> None:
        """Overwrite ``target`` on every rank with rank ``src``'s ``target``."""
        buf = target.detach()
        if buf.device != self.device or not buf.is_contiguous():
            buf = buf.to(self.device).contiguous()
        with _peer_lost("a broadcast"):
            dist.broadcast(buf, src=src)
        if buf is not target:
            with torch.no_grad():
                target.copy_(buf)

    def gather_batches(self, local: list[Tensor], sizes: Sequence[int]) -> list[Tensor] | None:
        """All batches on rank 0, in order, from each rank's :meth:`share` ``local``; ``None``
        on the other ranks. ``sizes`` holds every batch's first dimension (the calibration
        split, known to all ranks); the other dimensions and the dtype are ``local[0]``'s."""
        mine = self.share(len(sizes))
        if not self.is_main:
            with _peer_lost("gathering the calibration states"):
                for t in local:
                    dist.send(t.detach().to(self.device).contiguous(), dst=0)
            return None
        like = local[0]
        result: list[Tensor] = []
        for j, size in enumerate(sizes):
            if j in mine:
                result.append(local[j - mine.start])
                continue
            buf = torch.empty((size, *like.shape[1:]), dtype=like.dtype, device=self.device)
            with _peer_lost("gathering the calibration states"):
                dist.recv(buf, src=self.owner_of(j, len(sizes)))
            result.append(buf)
        return result

    def scatter_batches(self, batches: list[Tensor] | None, local_like: list[Tensor]) -> list[Tensor]:
        """Rank 0's ``batches`` (all of them, in order) split by :meth:`share`: every rank
        gets its own, received into tensors shaped like its ``local_like``."""
        if not self.is_main:
            result = [torch.empty_like(t, device=self.device) for t in local_like]
            with _peer_lost("sharing out the calibration states"):
                for buf in result:
                    dist.recv(buf, src=0)
            return result
        assert batches is not None
        mine = self.share(len(batches))
        with _peer_lost("sharing out the calibration states"):
            for j, t in enumerate(batches):
                if j not in mine:
                    dist.send(t.to(self.device).contiguous(), dst=self.owner_of(j, len(batches)))
        return [batches[j].to(self.device) for j in mine]


class OneProcess:
    """A job without ``torchrun`` (or with one rank): this process is every rank, so what a
    job asks of :class:`Ranks` (:func:`nmprune.job.run`) is trivially true."""

    world = local_world = 1
    is_main = True

    def __init__(self, device: str | torch.device | None):
        self.asked = device

    @property
    def device(self) -> torch.device:
        """The device asked for, else the default (:func:`nmprune.devices.default_device`),
        resolved when first used: after the run's checks have judged the setting."""
        return default_device(self.asked)

    def check(self, phase: str, error: BaseException | None = None, payload: Any = None) -> list[Any]:
        """This process's ``error`` raised, else its ``payload`` as the only rank's."""
        if error is not None:
            raise error
        return [payload]

    def agree(self, digests: dict[str, str]) -> None:
        """One process agrees with itself."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Errors propagate as they are: there is no other rank to tell."""
        return contextlib.nullcontext()


def job_ranks(device: str | torch.device | None = None) -> Ranks | OneProcess:
    """The ranks of a job: :func:`setup` under ``torchrun``, else :class:`OneProcess`."""
    return setup(device) or OneProcess(device)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launched() -> bool:
    """Whether this process was started by ``torchrun`` as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def timeout_seconds() -> float:
    """The collective timeout: ``NMPRUNE_DIST_TIMEOUT`` seconds, default 1800."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return value


def rank_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """This rank's compute device: ``cuda:LOCAL_RANK`` for ``"cuda"`` (or by default when
    CUDA is available, :func:`nmprune.devices.default_device`), else the CPU."""
    want = default_device(device)
    if want.type == "cuda":
        if want.index is not None:
            raise ValueError(f"--device {want} names one GPU; under torchrun give --device cuda "
                             "and each rank uses cuda:LOCAL_RANK")
        return torch.device("cuda", local_rank)
    return want


def current(device: str | torch.device | None = None) -> Ranks | None:
    """The initialised process group as :class:`Ranks`, or ``None`` without one (or with a
    single rank). The device follows the backend: ``cuda:LOCAL_RANK`` with NCCL."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    nccl = dist.get_backend() == "nccl"
    dev = rank_device(device or ("cuda" if nccl else "cpu"), local_rank)
    if nccl and dev.type != "cuda":
        raise ValueError(f"the process group uses NCCL, which needs CUDA; got device {dev}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, dev, local_world)


def setup(device: str | torch.device | None = None) -> Ranks | None:
    """Join the job ``torchrun`` started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``PORT`` from the environment): NCCL when this rank computes on CUDA,
    gloo on the CPU, with the :func:`timeout_seconds` timeout. On the CPU the intra-op
    threads are split so that the ranks on one machine never use more threads than cores.
    Returns ``None`` (and changes nothing) outside ``torchrun`` or with one rank; an
    already initialised group is used as it is."""
    if dist.is_available() and dist.is_initialized():
        return current(device)
    if not launched():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = rank_device(device, local_rank)
    timeout = timedelta(seconds=timeout_seconds())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
    else:
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, _cores() // per_machine))
        dist.init_process_group("gloo", timeout=timeout)
    return current(device)


def teardown(error: BaseException | None = None) -> None:
    """Leave the process group (if this process is in one). After an ``error`` every rank
    raised alike (:class:`RankError`, :class:`JobMismatch`), wait for all ranks first, so
    that each has said why it stops before the launcher ends the slower ones."""
    if dist.is_available() and dist.is_initialized():
        if isinstance(error, (RankError, JobMismatch)) and not isinstance(error, PeerLost):
            dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- assignment


#: A layer solve on an NVIDIA H200 against the reference CPU, per term of :func:`job_cost`:
#: the products with H (``rows x d_in^2 x cost``) about 350x faster, the work on every weight
#: (``rows x d_in x entry_cost``: the prox's float64 torch chain per iteration) only 1.5x.
#: Least-squares fit to prox + exact at Llama-3.1-8B's three shapes (5.2, 15.8 and 18.1 s;
#: benchmarks/results/gpu.md); SparseGPT at 4096x14336 then comes out at 1.2 s against 1.7 s
#: measured. Where the prox's cells go to the Triton kernel, :data:`TRITON_ENTRY_SPEEDUP`
#: replaces the second.
CUDA_SPEEDUP = {"products": 350.0, "entries": 1.5}
#: The work on every weight of a ``prox`` solve on CUDA where its 2:4 cells go to the Triton
#: kernel (:func:`nmprune.algorithms.prox.uses_triton_kernel`), against the reference CPU. An
#: ESTIMATE: no GPU has run the kernel. ``benchmarks/prox_kernel_cost.py`` compiles it for an
#: H200 here, counts its instructions per cell on the loops' trips of real SmolLM2 prox loops
#: (about 3,800), prices them at half the H200's issue rate and the loop's other work on every
#: weight at 3 TB/s, and divides the CPU kernel's time on the same cells (AMD EPYC znver5, 2
#: threads) by that: median 26x over six layers (benchmarks/results/prox_kernel_cost.md).
#: ``benchmarks/gpu_check.py --parts prox`` measures it where a GPU is lent.
TRITON_ENTRY_SPEEDUP = 26.0


def job_cost(rows: int, d_in: int, method: str, refine: str | None, device_type: str = "cpu",
             triton_prox: bool = False) -> float:
    """Estimated seconds of one layer solve: ``rows x d_in^2 x cost + rows x d_in x
    entry_cost``, summed over its method and refiner (``None``: none), with the costs they
    were registered with (:func:`nmprune.registry.register_method`,
    :data:`nmprune.registry.DEFAULT_COST`): seconds on the reference CPU, or on CUDA
    (``device_type``) each term divided by its :data:`CUDA_SPEEDUP`, the entries by
    :data:`TRITON_ENTRY_SPEEDUP` where the prox runs in the Triton kernel (``triton_prox``).
    An unregistered name is a ValueError."""
    solvers = [get_method(method)] + ([get_refiner(refine)] if refine is not None else [])
    products = sum(float(rows) * float(d_in) ** 2 * s.cost for s in solvers)
    entries = sum(float(rows) * float(d_in) * s.entry_cost for s in solvers)
    if device_type == "cuda":
        return products / CUDA_SPEEDUP["products"] + entries / (TRITON_ENTRY_SPEEDUP if triton_prox
                                                                else CUDA_SPEEDUP["entries"])
    return products + entries


def plan_cost(shape: Sequence[int], plan: Any, device_type: str = "cpu") -> float:
    """:func:`job_cost` of a layer of ``shape`` (rows, d_in) solved as its
    :class:`~nmprune.stages.plan.LayerPlan` ``plan`` says (its method, its options and refiner)."""
    from .algorithms.prox import uses_triton_kernel

    triton_prox = plan.method.name == "prox" and uses_triton_kernel(plan.pattern, plan.method_options)
    return job_cost(shape[0], shape[1], plan.method.name, plan.refiner.name if plan.refiner is not None else None,
                    device_type, triton_prox)


def assign(costs: Sequence[float], world: int) -> list[int]:
    """Longest-processing-time-first: jobs in decreasing cost, each to the rank with the
    least assigned cost so far (lowest rank on ties). Returns each job's rank; at most 4/3 of
    the optimal makespan. Deterministic, so every rank computes the same assignment."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    load = [0.0] * world
    owner = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[j] = r
        load[r] += costs[j]
    return owner


BALANCE_TOLERANCE = 1.1


def makespan(costs: Sequence[float], world: int) -> float:
    """The busiest rank's total cost under :func:`assign`."""
    load = [0.0] * world
    for c, r in zip(costs, assign(costs, world)):
        load[r] += c
    return max(load)


def balance_window(block_costs: Sequence[Sequence[float]], world: int,
                   tolerance: float = BALANCE_TOLERANCE) -> int:
    """How many of the next blocks (``block_costs``: their layer costs, in order) to solve
    together: the fewest whose layers, spread by :func:`assign`, keep the busiest rank within
    ``tolerance`` x the mean rank's cost (all of them when none do). One block needs no
    more when its largest layer is small against its total; Llama-3.1-8B's down projection
    (56% of a block) needs about ``world / 2`` blocks at a time."""
    jobs: list[float] = []
    for k, costs in enumerate(block_costs, start=1):
        jobs.extend(costs)
        if not jobs or makespan(jobs, world) <= tolerance * sum(jobs) / world:
            return k
    return max(len(block_costs), 1)


#: Fewest rows a rank solves of a layer whose rows are split (fewer make each rank's products
#: too thin to run at speed, and the per-iteration totals cost more than they save).
MIN_SHARE_ROWS = 64


#: How much longer than an equal share of a block's solve time the busiest rank takes when
#: every layer's rows are split, as a fraction of that share, per device kind: the round trips
#: of the solvers' totals (every prox and PCG iteration) and the work every share repeats (the
#: step size, the preconditioner's factorisation). CPU: measured with gloo, 2 ranks of one
#: thread, on the random 4-block Llama of ``benchmarks/distributed.py --scaling`` (hidden
#: 512; docs/distributed.md). CUDA: an estimate (NCCL's round trips are a few microseconds
#: against a layer's seconds) until a GPU measures it.
SPLIT_OVERHEAD = {"cpu": 0.35, "cuda": 0.05}


def split_rows(rows: Sequence[int], costs: Sequence[float], splittable: bool, world: int,
               device_type: str = "cpu") -> bool:
    """Whether the ranks solve shares of every layer's rows (True) rather than whole layers,
    for a block of layers with these output ``rows`` and estimated ``costs``
    (:func:`job_cost`): on several ranks, when ``splittable`` (every solver of the block is
    registered ``rows="independent"`` or ``"reduced"``), every layer gives each rank at least
    :data:`MIN_SHARE_ROWS` rows, and an equal share, lengthened by the device's
    :data:`SPLIT_OVERHEAD`, is shorter than the whole layers' makespan (:func:`assign`): many
    ranks, or one layer that outweighs the rest, as Llama-3.1-8B's down projection does."""
    if not (world >= 2 and splittable and rows and all(r >= world * MIN_SHARE_ROWS for r in rows)):
        return False
    return split_cost(costs, world, device_type) < makespan(costs, world)


def split_cost(costs: Sequence[float], world: int, device_type: str = "cpu") -> float:
    """The busiest rank's cost when every layer's rows are split: an equal share of ``costs``
    lengthened by the device's :data:`SPLIT_OVERHEAD`."""
    return sum(costs) / world * (1.0 + SPLIT_OVERHEAD["cuda" if device_type == "cuda" else "cpu"])


def busiest_rank_cost(costs: Sequence[float], rows: Sequence[int], splittable: bool, world: int,
                      device_type: str = "cpu") -> float:
    """The busiest rank's cost of solving one block's layers as :class:`DistributedExecutor`
    does (:func:`split_rows`): an equal share of the total with the split's overhead, or the
    whole layers' makespan."""
    if split_rows(rows, costs, splittable, world, device_type):
        return split_cost(costs, world, device_type)
    return makespan(costs, world)


def splittable(plans: Sequence[Any]) -> bool:
    """Whether every one of these :class:`~nmprune.stages.plan.LayerPlan` s lets processes
    split a layer's rows (:attr:`~nmprune.stages.plan.LayerPlan.splits_rows`)."""
    return all(p.splits_rows for p in plans)


def row_share(rank: int, world: int, rows: int) -> range:
    """Rank ``rank``'s contiguous share of a layer's ``rows`` output rows."""
    return range(rank * rows // world, (rank + 1) * rows // world)


def merge_records(parts: Sequence[dict[str, Any]], shares: Sequence[range]) -> dict[str, Any]:
    """One layer's record (:func:`nmprune.stages.executor.run_job`) from its ranks' records of
    their shares of its rows: losses are sums over rows, so they add up; times are the
    slowest share's (the ranks solve together), CPU time all of theirs. ``rank`` is None and
    ``shares`` says which rows each rank solved and in how many seconds."""
    record = dict(parts[0])
    for key in ("loss_method", "loss_refined", "loss_wanda"):
        record[key] = None if record[key] is None else sum(p[key] for p in parts)
    for key in ("seconds_method", "seconds_refine", "seconds_wanda_reference", "seconds"):
        record[key] = max(p[key] for p in parts)
    record["cpu_seconds"] = sum(p["cpu_seconds"] for p in parts)
    final = record["loss_refined"] if record["loss_refined"] is not None else record["loss_method"]
    record["loss_vs_wanda"] = final / record["loss_wanda"] if record["loss_wanda"] > 0 else None
    record["rank"] = None
    record["shares"] = [{"rank": r, "rows": [rows.start, rows.stop], "seconds": p["seconds"],
                         "cpu_seconds": p["cpu_seconds"]} for r, (p, rows) in enumerate(zip(parts, shares))]
    return record


class RankTotals:
    """:class:`~nmprune.registry.RowShards` over the ranks, for the layer whose weights (on
    every rank) are ``whole``: each total is one all-reduce of a float64 vector (the same
    calls on every rank, as the solvers make them)."""

    def __init__(self, ranks: "Ranks", whole: Tensor):
        self.ranks, self.whole = ranks, whole

    def _started(self, values: Sequence[float], op: Any) -> Callable[[], list[float]]:
        """The all-reduce of ``values`` started; calling the result waits for it."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.ranks.device)
        with _peer_lost("a total over a layer's rows"):
            work = dist.all_reduce(t, op=op, async_op=True)

        def finish() -> list[float]:
            with _peer_lost("a total over a layer's rows"):
                work.wait()
            return t.tolist()
        return finish

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._started(values, dist.ReduceOp.SUM)()

    def max(self, values: Sequence[float]) -> list[float]:
        return self._started(values, dist.ReduceOp.MAX)()

    def sum_started(self, values: Sequence[float]) -> Callable[[], list[float]]:
        return self._started(values, dist.ReduceOp.SUM)


# ----------------------------------------------------------------------------- executor


class DistributedExecutor:
    """The executor (:mod:`nmprune.stages.executor`) of one rank in a process group.

    Calibration batches: this rank's :meth:`Ranks.share` (:meth:`shard`); statistics:
    all-reduced (:meth:`reduce`); layer solves: each layer's rows split over the ranks, or
    whole layers spread by :func:`assign` (:func:`split_rows` decides per block), the pruned
    rows or weights broadcast from the rank that solved them so every rank hands every job to
    ``done`` (:meth:`solve`).
    Every exchange starts with a status check (:meth:`Ranks.check`).
    """

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.device = ranks.device
        self.rank, self.world, self.is_main = ranks.rank, ranks.world, ranks.is_main

    def phase(self, name: str):
        return self.ranks.phase(name)

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of the calibration batches."""
        items = list(items)
        return [items[j] for j in self.ranks.share(len(items))]

    def reduce(self, stats: list[Any]) -> None:
        """Sum each :class:`~nmprune.stages.statistics.InputStats` (``xtx``, ``xsum``, ``count``) over
        all ranks, in place (``stats`` in the same order on every rank); they must still be
        sums (not :meth:`~nmprune.stages.statistics.InputStats.average_`-d)."""
        self.ranks.check("calibration")
        if any(s.averaged for s in stats):
            raise ValueError("statistics are summed over ranks before they are averaged")
        for s in stats:
            count = torch.tensor([s.count], dtype=torch.float64, device=self.device)
            self.ranks.all_reduce_sum([s.xtx, s.xsum, count])
            s.count = int(count.item())

    def all_reduce(self, tensors: Sequence[Tensor]) -> None:
        """Sum each tensor over all ranks, in place (a reconstruction step's gradients and
        errors, the same tensors in the same order on every rank)."""
        self.ranks.all_reduce_sum(tensors)

    @contextmanager
    def training_model(self, source: Any, sink: Any, dtype: torch.dtype | None,
                       offloaded: bool = False) -> Iterator[torch.nn.Module]:
        """The whole pruned model for the global distillation, sharded over the ranks with
        FSDP2 on this rank's device, its blocks computing in ``dtype``, the rank's rows in CPU
        memory between uses where ``offloaded``
        (:func:`~nmprune.stages.sharded_pass.sharded_whole`). FSDP's own collectives run in
        the body: a rank lost meanwhile ends it as :class:`PeerLost`."""
        self.ranks.check("the global distillation")
        with _peer_lost("the global distillation"), \
                sharded_whole(source, sink, self.device, dtype, offloaded) as model:
            yield model

    def solve(self, jobs: Sequence[Any], done, progress=iter) -> None:
        """Solve ``jobs`` (:class:`~nmprune.stages.executor.LayerJob`) with the other ranks --
        shares of every layer's rows, or whole layers, as :func:`split_rows` decides -- then
        hand every job, in order, with its whole pruned weight (broadcast from the ranks that
        solved it) and record to ``done`` on every rank."""
        costs = [plan_cost(job.weight.shape, job.plan, self.device.type) for job in jobs]
        if split_rows([job.weight.shape[0] for job in jobs], costs, splittable([job.plan for job in jobs]), self.world,
                      self.device.type):
            self._solve_rows(jobs, done, progress)
        else:
            self._solve_layers(jobs, assign(costs, self.world), done, progress)

    def _solve_rows(self, jobs: Sequence[Any], done, progress) -> None:
        """Every rank solves its :func:`row_share` of each layer, all ranks one layer at a
        time (the solvers' totals are collectives; :func:`~nmprune.stages.executor.run_job`
        checks the whole layer's inputs first, so that bad inputs fail on every rank alike)."""
        from .stages.executor import run_job

        for job in progress(jobs):
            d_out = job.weight.shape[0]
            shares = [row_share(r, self.world, d_out) for r in range(self.world)]
            mine = shares[self.rank]
            error, record, part = None, None, None
            try:
                # the weights as run_job hands them to the solver (the same tensor, no copy)
                whole = replace(job, weight=job.weight.detach().to(self.device, job.stats.xtx.dtype))
                part, record = run_job(whole, self.device, rows=mine, shards=RankTotals(self.ranks, whole.weight))
                del whole
            except Exception as e:  # noqa: BLE001 - reported to every rank by check
                error = e
            parts = self.ranks.check(f"layer {job.name}", error, record)
            weight = torch.empty(tuple(job.weight.shape), dtype=part.dtype, device=self.device)
            weight[mine.start:mine.stop] = part
            del part
            for r, rows in enumerate(shares):
                self.ranks.broadcast_into(weight[rows.start:rows.stop], r)
            done(job, weight, merge_records(parts, shares))
            del weight

    def _solve_layers(self, jobs: Sequence[Any], owner: list[int], done, progress) -> None:
        """This rank solves the whole layers ``owner`` gives it; each weight is then
        broadcast from its owner."""
        from .stages.executor import run_job

        weights: dict[int, Tensor] = {}
        records: dict[int, dict[str, Any]] = {}
        error = None
        try:
            for k in progress([k for k in range(len(jobs)) if owner[k] == self.rank]):
                weights[k], record = run_job(jobs[k], self.device)
                records[k] = {**record, "rank": self.rank}
        except Exception as e:  # noqa: BLE001 - reported to every rank by check
            error = e
        blocks = sorted({job.block for job in jobs})
        for payload in self.ranks.check(f"the layers of blocks {blocks[0]}-{blocks[-1]}"
                                        if len(blocks) > 1 else f"the layers of block {blocks[0]}",
                                        error, records):
            records.update(payload)
        for k, job in enumerate(jobs):
            weight = weights.pop(k, None)
            if weight is None:
                weight = torch.empty(tuple(job.weight.shape), dtype=job.stats.xtx.dtype, device=self.device)
            self.ranks.broadcast_into(weight, owner[k])
            done(job, weight, records[k])
            del weight

    def token_sharing(self, total: int) -> TokenSharing:
        """The ranks share every reconstruction step's sample by tokens; batch ``g`` of
        ``total`` comes from the rank whose :meth:`Ranks.share` holds it."""
        return TokenSharing(self.rank, self.world, lambda g: self.ranks.owner_of(g, total), self.ranks.broadcast_into,
                            lambda value: self.ranks.check("sharing a reconstruction step by tokens", None, value))

    def broadcast_object(self, value: T) -> T:
        return self.ranks.broadcast_object(value)

    def broadcast_tensors(self, tensors: Sequence[Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank (e.g. resumed weights)."""
        for t in tensors:
            self.ranks.broadcast_into(t, src=0)

    def gather_batches(self, local: list[Tensor], sizes: Sequence[int]) -> list[Tensor] | None:
        return self.ranks.gather_batches(local, sizes)

    def scatter_batches(self, batches: list[Tensor] | None, local_like: list[Tensor]) -> list[Tensor]:
        return self.ranks.scatter_batches(batches, local_like)

    def per_rank(self, value: T) -> list[T]:
        """Every rank's ``value``, by rank (after a status check)."""
        return self.ranks.check("finishing", None, value)
