"""Local reconstruction with the N:M mask held: train the kept weights of a pruned submodel to
reproduce the dense model's activations at its output.

The layer solves minimise each layer's own loss (paper eq. ``squared_loss``) on inputs of the
dense model, so the errors of consecutive layers and blocks add up. Local reconstruction
(Wagner, Roux, Zimmer, Pokutta, arXiv 2510.14444; Wanda++'s regional optimisation,
arXiv 2503.04992; EBFT, arXiv 2402.12419) then fits a small submodel -- a decoder block, or
its attention and its MLP one after the other -- on the calibration set: its inputs are the
hidden states of the model pruned so far, its targets the dense model's outputs of the same
submodel, and its loss the mean squared error between the two. Only the nonzero weights move:
every gradient is masked and the weights are masked again after each optimiser step, so the
pattern the solve chose is kept exactly.

:func:`fit_masked` is the training loop and knows nothing of models: it takes a function that
runs the submodel on one of this process's calibration batches, the targets, and the weights
to train. Data parallelism is a sum: every process adds the gradients of its own batches of
a step, and ``all_reduce`` sums them (and the squared errors and their counts) over
processes before the step, so any number of processes takes the same steps.

One-sample steps train best (two samples a step cost SmolLM2 2.0 points of wiki perplexity),
but a step's sample lives on one process, so the others would wait. *Lanes* let every process
train: the calibration batches are split into contiguous lanes (one per process under
torchrun), and in each *round* every lane computes one step's gradient at the same weights;
the steps are then taken one after another. A step's gradient is thus up to ``lanes - 1``
steps old (delayed gradients, as in pipelined and asynchronous SGD; Zinkevich et al.,
NeurIPS 2009), the number of steps is unchanged, and the result depends on the number of
lanes, never on the number of processes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .checks import NonFiniteModel, all_finite
from .devices import PRECISIONS, low_precision, products_in


class ReconstructionDiverged(ValueError):
    """The reconstruction loss became NaN or infinite (a learning rate too high)."""


@dataclass(frozen=True)
class FitOptions:
    """How :func:`fit_masked` trains: ``epochs`` passes over the calibration batches, in a
    fresh order each (drawn from ``seed``), ``batches_per_step`` batches per AdamW step,
    learning rate ``lr`` (relative to each weight's scale, :class:`CompactAdamW`) decayed
    linearly to zero over all steps, the batches split into ``lanes`` lanes whose gradients
    of a round are computed at the same weights (module docstring; :func:`lane_of`), the
    forward and backward passes in the dtype of ``precision`` (:func:`training_dtype`)."""

    epochs: int
    lr: float
    batches_per_step: int
    seed: int = 0
    lanes: int = 1
    precision: str = "full"

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"reconstruction needs at least one epoch, got {self.epochs}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"the reconstruction learning rate must be a positive number, got {self.lr}")
        if self.batches_per_step < 1:
            raise ValueError(f"batches_per_step must be at least 1, got {self.batches_per_step}")
        if self.lanes < 1:
            raise ValueError(f"reconstruction needs at least one lane, got {self.lanes}")
        if self.precision not in TRAIN_PRECISIONS:
            raise ValueError(f"train_precision must be one of {', '.join(TRAIN_PRECISIONS)}, got {self.precision!r}")


#: ``auto``: bfloat16 where the device computes it natively and the submodel is wide enough to
#: gain (:func:`training_dtype`); ``full``: the weights' own dtype (float32); ``bfloat16``: always
TRAIN_PRECISIONS = PRECISIONS
#: narrower submodels gain little from bfloat16: one Llama block's forward and backward on a
#: 512-token sample took 1.1x less time at hidden size 64, 1.3x at 128, 1.8x at 256 and 2.1x at
#: 576 (AMD EPYC znver5, AVX512-BF16, 2 threads)
BF16_MIN_WIDTH = 256


def training_dtype(precision: str, weights: Sequence[Tensor], device: torch.device | None = None
                   ) -> torch.dtype | None:
    """The dtype :func:`fit_masked` runs the forward and backward passes in under autocast
    (None: the weights' own, no autocast) for ``precision`` (:data:`TRAIN_PRECISIONS`), on
    ``device`` (default: where the weights are). The weights, their AdamW state and the loss
    stay float32: only the products are bfloat16, whose 8-bit mantissa leaves a gradient about
    1% off, noise beside a one-sample step's."""
    wide = bool(weights) and max(min(w.shape) for w in weights) >= BF16_MIN_WIDTH
    if device is None:
        device = compute_device(weights[0]) if weights else torch.device("cpu")
    return low_precision(precision, device, wide)


def lane_of(index: int, total: int, lanes: int) -> int:
    """The lane of batch ``index`` among ``total``: the lanes are contiguous shares of the
    batches, ``range(k * total // lanes, (k + 1) * total // lanes)`` for lane ``k`` -- the
    shares :meth:`nmprune.distributed.Ranks.share` gives the ranks, so that with one lane per
    rank every lane's batches live on one rank."""
    return next(k for k in range(lanes) if index < (k + 1) * total // lanes)


def epoch_steps(lanes: Sequence[int], batches_per_step: int) -> int:
    """The optimiser steps of one epoch over batches in ``lanes`` (each batch's lane): every
    lane's batches in steps of ``batches_per_step``."""
    sizes = [0] * (max(lanes, default=0) + 1)
    for lane in lanes:
        sizes[lane] += 1
    return sum(-(-n // batches_per_step) for n in sizes)


@dataclass
class FitResult:
    """What :func:`fit_masked` did: optimiser steps, the mean squared error of the first
    and the last epoch (over all processes' batches, measured while training) and seconds."""

    steps: int
    first_epoch_mse: float
    last_epoch_mse: float
    seconds: float
    dtype: str = "float32"


@dataclass
class FitState:
    """Where :func:`fit_masked` stands between two rounds, to save and resume from: the epoch
    under way, its rounds and steps done, the optimiser's steps, the epoch's summed error and
    count (float64, ``tensors["sums"]``), the mean errors of the epochs done, and
    :meth:`CompactAdamW.state` (``tensors``)."""

    epoch: int
    round: int
    epoch_steps: int
    steps: int
    epoch_mse: list[float]
    tensors: dict[str, Tensor]


class FitProgress(Protocol):
    """Where :func:`fit_masked` saves its state and resumes from (the global distillation's
    :class:`~nmprune.stages.distillation.SavedPass`)."""

    def resume(self, like: dict[str, Tensor]) -> FitState | None:
        """The state to resume from, its tensors shaped as ``like`` (None: start afresh);
        every process calls it, and all get the same state."""

    def due(self) -> bool:
        """Whether to save the state now (a process may answer alone)."""

    def save(self, state: FitState) -> None:
        """Keep ``state`` durably."""


def local_part(t: Tensor) -> Tensor:
    """This process's part of ``t``: an FSDP2-sharded parameter's (or gradient's) local rows,
    which writes reach (:mod:`nmprune.stages.sharded_pass`); any other tensor itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def shard_of(t: Tensor) -> tuple[int, int] | None:
    """``(rank, ranks)`` of a sharded tensor's mesh; None for any other tensor."""
    if not isinstance(t, DTensor):
        return None
    return t.device_mesh.get_local_rank(), t.device_mesh.size()


def compute_device(t: Tensor) -> torch.device:
    """Where ``t`` computes: a sharded tensor's mesh device (its local rows may wait in CPU
    memory, FSDP's CPU offload), any other tensor's own."""
    if not isinstance(t, DTensor) or t.device_mesh.device_type == t.device.type:
        return local_part(t).device
    kind = t.device_mesh.device_type
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def kept_scales(weights: Sequence[Tensor], entries: Sequence[KeptEntries],
                all_reduce: Callable[[Sequence[Tensor]], None], device: torch.device) -> list[float]:
    """:class:`CompactAdamW`'s scale of each weight (the root mean square of its kept
    entries; 1 for one all zeros) where each process holds some rows of it (``weights``: the
    processes' parts, :func:`local_part`): the square sums and counts summed over the
    processes (on ``device``, where their collectives run)."""
    norms = [float(torch.linalg.vector_norm(w.detach(), dtype=torch.promote_types(w.dtype, torch.float32)))
             for w in weights]
    sums = torch.tensor([n * n for n in norms] + [e.count for e in entries], dtype=torch.float64, device=device)
    all_reduce([sums])
    totals, counts = sums[:len(norms)].sqrt().tolist(), sums[len(norms):].tolist()
    return [n / max(c, 1) ** 0.5 if n > 0 else 1.0 for n, c in zip(totals, counts)]


def most_over_processes(count: int, shard: tuple[int, int], all_reduce: Callable[[Sequence[Tensor]], None],
                        device: torch.device) -> int:
    """The largest of every process's ``count`` (``shard``: this process's rank and the number
    of processes, :func:`shard_of`)."""
    counts = torch.zeros(shard[1], dtype=torch.float64, device=device)
    counts[shard[0]] = count
    all_reduce([counts])
    return int(counts.max())


class KeptEntries:
    """Where a weight's nonzeros are, to move them between the weight and a compact vector.

    The positions are held as flat indices, in order: int32 (int64 for a weight of 2**31
    entries or more), 4 bytes per kept entry, so moving values is one indexed gather or add:
    a packed bit mask would take 32 times less memory and ten times as long to unpack and
    scan at every step.
    They are found ``CHUNK`` weights at a time and moved ``CHUNK`` kept entries at a time, so
    the temporaries stay a few tens of MiB whatever the layer's size.
    """

    CHUNK = 1 << 22

    def __init__(self, weight: Tensor):
        if not weight.is_contiguous():
            raise ValueError("KeptEntries needs a contiguous weight")
        #: while the weight is held narrowed (:func:`narrowed`), its kept entries' rounding
        #: error in that dtype: the weight plus this is its value to about 16 bits
        self.residual: Tensor | None = None
        flat = weight.detach().reshape(-1)
        n = flat.numel()
        starts = range(0, n, self.CHUNK)
        # counted first, then found chunk by chunk: nonzero's int64 positions of one chunk at a time
        counts = [int(torch.count_nonzero(flat[a:a + self.CHUNK])) for a in starts]
        self.index = torch.empty(sum(counts), dtype=torch.int64 if n >= 2 ** 31 else torch.int32,
                                 device=weight.device)
        offset = 0
        for a, count in zip(starts, counts):
            self.index[offset:offset + count] = torch.nonzero(flat[a:a + self.CHUNK]).view(-1) + a
            offset += count

    @property
    def count(self) -> int:
        return self.index.numel()

    def chunks(self) -> Iterator[tuple[slice, Tensor]]:
        """The kept entries ``CHUNK`` at a time: their slice of the compact vector and their
        flat positions in the weight."""
        for a in range(0, self.count, self.CHUNK):
            yield slice(a, a + self.CHUNK), self.index[a:a + self.CHUNK]

    def gather(self, dense: Tensor, into: Tensor | None = None) -> Tensor:
        """``dense``'s entries at the kept positions, in order; added to ``into`` if given."""
        flat = dense.detach().reshape(-1)
        if into is None:
            return flat.index_select(0, self.index)
        for kept, positions in self.chunks():
            into[kept] += flat.index_select(0, positions)
        return into

    def scatter(self, values: Tensor, weight: Tensor) -> None:
        """Write ``values`` into ``weight``'s kept positions (the others are left as they are)."""
        flat = weight.detach().view(-1)
        for kept, positions in self.chunks():
            flat.index_copy_(0, positions.long(), values[kept].to(flat.dtype))

    def add(self, kept: slice, positions: Tensor, change: Tensor, weight: Tensor) -> None:
        """Add ``change`` (float32) to the kept entries ``kept`` of ``weight`` (at flat
        ``positions``: one of :meth:`chunks`); for a weight held narrowed, compensated: the
        float32 sum of entry, :attr:`residual` and change is rounded into the weight and what
        rounding lost goes to the residual (Kahan summation), so that steps far below the
        narrow dtype's resolution still add up."""
        flat = weight.detach().view(-1)
        if self.residual is None:
            flat.index_add_(0, positions, change.to(flat.dtype))
            return
        positions = positions.long()
        exact = flat.index_select(0, positions).float().add_(self.residual[kept].float()).add_(change)
        rounded = exact.to(flat.dtype)
        flat.index_copy_(0, positions, rounded)
        self.residual[kept] = exact.sub_(rounded.float())


@contextmanager
def narrowed(weights: Sequence[Tensor], entries: Sequence[KeptEntries], dtype: torch.dtype) -> Iterator[None]:
    """Inside, each of ``weights`` is held in ``dtype`` (the same tensor objects), its kept
    entries' rounding error in :attr:`KeptEntries.residual` (in ``dtype``); afterwards it is
    back in its own dtype with the value weight plus residual, as the optimiser left it. The
    global distillation's lean pass: a bfloat16 weight and residual take 4 bytes a kept entry
    where a float32 weight took 8 at 2:4, and its products read the weight as it is, where
    autocast cached a bfloat16 copy of every trained float32 weight."""
    own = [w.dtype for w in weights]
    for w, where in zip(weights, entries):
        narrow = w.data.to(dtype)
        where.residual = where.gather(w).float().sub_(where.gather(narrow).float()).to(dtype)
        w.data = narrow
    try:
        yield
    finally:
        for w, where, dtype_own in zip(weights, entries, own):
            if where.residual is None:
                continue
            value = where.gather(w).float().add_(where.residual.float())
            where.residual = None
            w.data = w.data.to(dtype_own)
            where.scatter(value, w)


class CompactAdamW:
    """AdamW without weight decay on the kept entries of dense weights, with each weight's
    step relative to its own scale: weight ``i`` takes torch.optim.AdamW's update, step for
    step, at learning rate ``lr * scales[i]``, where ``scales[i]`` is the root mean square of
    its kept entries when training starts (1 for a weight that is all zeros), as LAMB and
    LARS scale a layer's step by its norm (You et al., arXiv 1904.00962). Adam's step is
    otherwise in the weights' own units: the same rate moves Gemma-3-270M's weights (RMS
    about 0.04) five times as far, relative to their size, as SmolLM2-135M's (about 0.19),
    and within one model SmolLM2's block-0 ``v_proj`` (0.047) six times as far as its
    ``q_proj`` (0.28). ``grads`` and the two moments are compact vectors, one per weight;
    the parameters are the weights' kept entries themselves: each step's change is computed
    compact and added at the kept positions (:class:`KeptEntries`), so no compact copy
    of them is held. ``summed`` holds the tensors the gradients live in, to sum over
    processes: one buffer that ``grads`` are views of, where the weights share a dtype and
    device. ``scales`` are given where each process holds some rows of each weight (its
    shard, :func:`local_part`): the whole weights' (:func:`kept_scales`)."""

    def __init__(self, weights: Sequence[Tensor], entries: Sequence[KeptEntries],
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, scales: Sequence[float] | None = None):
        self.weights, self.entries = list(weights), list(entries)
        self.betas, self.eps = betas, eps
        if scales is None:
            # in float32 at least (a bfloat16 weight's square sums would lose digits)
            norms = [float(torch.linalg.vector_norm(w.detach(), dtype=torch.promote_types(w.dtype, torch.float32)))
                     for w in self.weights]
            scales = [n / max(e.count, 1) ** 0.5 if n > 0 else 1.0 for n, e in zip(norms, self.entries)]
        self.scales = list(scales)
        # the compact gradients are views of one buffer where the weights share a dtype and
        # device: a sum over processes is then one collective on it, with no copies
        if len({(w.dtype, w.device) for w in self.weights}) == 1:
            buffer = torch.zeros(sum(e.count for e in self.entries), dtype=self.weights[0].dtype,
                                 device=self.weights[0].device)
            self.grads = list(buffer.split([e.count for e in self.entries]))
            self.summed = [buffer]
        else:
            self.grads = [torch.zeros(e.count, dtype=w.dtype, device=w.device) for w, e in zip(weights, entries)]
            self.summed = self.grads
        self.exp_avg = [torch.zeros_like(g) for g in self.grads]
        # float32 at least: a bfloat16 square average would stop decaying, 0.999 of it
        # rounding back to itself
        self.exp_avg_sq = [torch.zeros_like(g, dtype=torch.promote_types(g.dtype, torch.float32)) for g in self.grads]
        self.steps = 0

    def state(self) -> dict[str, Tensor]:
        """Everything a step reads and writes, by name: each weight's kept entries as the
        weight holds them (``value{i}``) and their rounding error where it is narrowed
        (``residual{i}``), and the two moments (``avg{i}``, ``avg_sq{i}``); copies on the CPU,
        made one tensor at a time (a device holds no second copy of the state)."""
        out: dict[str, Tensor] = {}
        for i, (w, where) in enumerate(zip(self.weights, self.entries)):
            out[f"value{i}"] = where.gather(w).to("cpu", copy=True)
            if where.residual is not None:
                out[f"residual{i}"] = where.residual.to("cpu", copy=True)
            out[f"avg{i}"] = self.exp_avg[i].to("cpu", copy=True)
            out[f"avg_sq{i}"] = self.exp_avg_sq[i].to("cpu", copy=True)
        return out

    @torch.no_grad()
    def load(self, state: dict[str, Tensor], steps: int) -> None:
        """Take up :meth:`state` after ``steps`` steps."""
        for i, (w, where) in enumerate(zip(self.weights, self.entries)):
            where.scatter(state[f"value{i}"].to(w.device), w)
            if where.residual is not None:
                where.residual.copy_(state[f"residual{i}"])
            self.exp_avg[i].copy_(state[f"avg{i}"])
            self.exp_avg_sq[i].copy_(state[f"avg_sq{i}"])
        self.steps = steps

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One step of relative learning rate ``lr`` along ``grads``."""
        self.steps += 1
        beta1, beta2 = self.betas
        step_size = lr / (1 - beta1 ** self.steps)
        correction = (1 - beta2 ** self.steps) ** 0.5
        for w, where, grad, avg, avg_sq, scale in zip(self.weights, self.entries, self.grads, self.exp_avg,
                                                      self.exp_avg_sq, self.scales):
            avg.lerp_(grad, 1 - beta1)
            avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            for kept, positions in where.chunks():
                # a step beyond the weights' range becomes Inf (and the next loss says so)
                change = (avg[kept] / (avg_sq[kept].sqrt() / correction).add_(self.eps)).mul_(-step_size * scale)
                where.add(kept, positions, change, w)


def _no_reduce(tensors: Sequence[Tensor]) -> None:
    """One process: its sums are already the totals."""


def channel_weights(targets: Sequence[Tensor],
                    all_reduce: Callable[[Sequence[Tensor]], None] = _no_reduce) -> Tensor:
    """Per output channel (the last dimension), the inverse of the targets' mean square
    over every token of every process, so that each channel's error counts relative to the
    channel's own scale (float32; all ones without targets).

    Residual streams hold a few channels of massive activations (Gemma-3: 87-98% of the
    hidden state's energy in four of 640 channels), which the next RMS norms scale down.
    A plain squared error is almost only their error: training against it, or judging a
    block by it, can leave every other channel worse while the error falls. Weighted,
    ``sum_c w_c (y_c - t_c)^2 / n`` is the mean over channels of each channel's relative
    error. A channel that is zero everywhere gets the weight of one at 1e-6 of the mean
    square."""
    if not targets:
        return torch.ones(())
    width = targets[0].shape[-1]
    sums = torch.zeros(width + 1, dtype=torch.float64, device=targets[0].device)
    for t in targets:
        sums[:width] += t.detach().float().square().reshape(-1, width).sum(0).double()
        sums[width] += t.numel() // width
    all_reduce([sums])
    mean = sums[:width] / sums[width].clamp(min=1)
    return (1.0 / mean.clamp(min=1e-6 * float(mean.mean()) + 1e-30)).float()


def _finite(target: Any) -> bool:
    """Whether a target (a tensor, or an object holding tensors) is all finite."""
    parts = [target] if isinstance(target, Tensor) else [v for v in vars(target).values() if isinstance(v, Tensor)]
    return all(all_finite(t) for t in parts)


def _not_finite(loss: float, epoch: int, step: int, steps_taken: int, targets: Sequence[Tensor],
                lr: float, all_reduce: Callable[[Sequence[Tensor]], None]) -> tuple[str, bool]:
    """Why a reconstruction loss is not finite, and whether the model itself is to blame (a
    :class:`~nmprune.checks.NonFiniteModel`): the learning rate is blamed only when training
    made it so, not when the dense outputs it trains towards, or the block's outputs before
    any step, were not finite already (weights or activations beyond their dtype's range).
    Every process reads each of its targets (a collective for shared ones) and they agree."""
    where = f"in epoch {epoch + 1}, step {step + 1}"
    broken = torch.tensor([float(sum(not _finite(targets[j]) for j in range(len(targets))))], dtype=torch.float64)
    all_reduce([broken])
    if float(broken) > 0:
        return (f"the dense model's outputs hold NaN or Inf ({where}, before training could cause "
                "it): its weights or activations overflow their dtype; check the model's weights, "
                "or use --dtype float32"), True
    if steps_taken == 0:
        return (f"the reconstruction loss is {loss} before any training step: the block's outputs "
                "with its solved weights overflow (its inputs or weights are too large for float32); "
                "check the model's weights"), True
    return f"the reconstruction loss became {loss} {where}; lower the learning rate (now {lr:g})", False


@dataclass(frozen=True)
class FitData:
    """What :func:`fit_masked` fits on this process: ``run(j)`` computes the submodel's output
    on this process's calibration batch ``j`` (with autograd on the trained weights), and
    ``targets[j]`` is the dense output it should match; ``positions[j]`` is batch ``j``'s index
    among the ``total`` batches of all processes. The loss is the squared error with each
    output channel's (the last dimension) weighed by ``channel_weight`` (default all 1;
    :func:`channel_weights`), or ``loss(out, target)`` where given: a batch's summed loss
    (differentiable) and the count it is a sum over (``targets`` may then hold anything it
    reads)."""

    run: Callable[[int], Tensor]
    targets: Sequence[Any]
    positions: Sequence[int]
    total: int
    channel_weight: Tensor | None = None
    loss: Callable[[Tensor, Any], tuple[Tensor, int]] | None = None


@dataclass(frozen=True)
class FitSharing:
    """How :func:`fit_masked` shares its work: ``all_reduce`` sums tensors over the processes
    in place (default: one process, whose sums are the totals), and ``lanes`` gives each of
    the ``total`` batches its lane (default: :func:`lane_of` with ``FitOptions.lanes``,
    contiguous shares of the batches)."""

    all_reduce: Callable[[Sequence[Tensor]], None] = _no_reduce
    lanes: Sequence[int] | None = None


class _MaskedFit:
    """One call of :func:`fit_masked`: the optimiser on the weights' kept entries, the rounds
    of an epoch (which batches of which lane each takes), the hooks that move every weight's
    gradient into its compact one, and the loop over rounds and steps."""

    def __init__(self, data: FitData, weights: Sequence[Tensor], options: FitOptions, sharing: FitSharing,
                 entries: Sequence[KeptEntries] | None):
        self.data, self.weights, self.options, self.all_reduce = data, weights, options, sharing.all_reduce
        self.shard = shard_of(weights[0]) if weights else None
        self.entries = list(entries) if entries is not None else [KeptEntries(local_part(w)) for w in weights]
        parts = [local_part(w) for w in weights]
        self.device = compute_device(weights[0])  # of the errors and the collectives
        self.optimiser = CompactAdamW(parts, self.entries,
                                      scales=kept_scales(parts, self.entries, self.all_reduce, self.device)
                                      if self.shard is not None else None)
        self.local = {int(g): j for j, g in enumerate(data.positions)}
        self.per_step = options.batches_per_step
        self.lane, self.members, self.rounds, self.all_steps = self._schedule(sharing.lanes)
        # each lane's gradient of a round, for the lanes this process holds batches of (one lane:
        # the optimiser's own buffer, filled and stepped at once)
        grads = self.optimiser.grads
        self.slots = {k: grads if len(self.members) == 1 else [torch.zeros_like(g) for g in grads]
                      for k in sorted({self.lane[g] for g in self.local})}
        self.into = grads  # where the hooks move the gradients
        self.low = training_dtype(options.precision, weights)

    def _schedule(self, lanes: Sequence[int] | None) -> tuple[list[int], list[list[int]], int, int]:
        """Each batch's lane, each lane's batches, the rounds of an epoch and the steps of the
        fit. One process or lanes: every lane's next ``batches_per_step`` batches make a step
        of a round. Sharded over processes: this process's batches are its one lane, and every
        round makes one step of all processes' batches (the rounds of the process with most)."""
        per_step, total = self.per_step, self.data.total
        if self.shard is None:
            lane = list(lanes) if lanes is not None else [lane_of(g, total, self.options.lanes) for g in range(total)]
            members: list[list[int]] = [[] for _ in range(max(lane, default=0) + 1)]
            for g, k in enumerate(lane):
                members[k].append(g)
            rounds = max(-(-len(m) // per_step) for m in members)
            return lane, members, rounds, self.options.epochs * epoch_steps(lane, per_step)
        if not self.data.positions:
            raise ValueError("training sharded over processes needs at least one batch on each")
        rounds = -(-most_over_processes(len(self.data.positions), self.shard, self.all_reduce, self.device)
                   // per_step)
        return [0] * total, [sorted(self.local)], rounds, self.options.epochs * rounds

    @contextmanager
    def compact_gradients(self) -> Iterator[None]:
        """Inside, the weights take gradients, and each weight's moves into its compact
        gradient (in :attr:`into`) as soon as backpropagation has passed its layer, the dense
        one then freed; afterwards the weights hold no gradient and want one as before."""
        flags = [w.requires_grad for w in self.weights]

        def compact(i: int, where: KeptEntries) -> Callable[[Tensor], None]:
            def hook(w: Tensor) -> None:
                where.gather(local_part(w.grad), into=self.into[i])
                w.grad = None
            return hook

        handles = []
        for i, (w, where) in enumerate(zip(self.weights, self.entries)):
            w.requires_grad_(True)
            w.grad = None
            handles.append(w.register_post_accumulate_grad_hook(compact(i, where)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for w, flag in zip(self.weights, flags):
                w.grad = None
                w.requires_grad_(flag)

    def _resume(self, progress: FitProgress | None, on_step: Callable[[], None] | None) -> FitState | None:
        """The state ``progress`` holds, taken up by the optimiser (``on_step`` called once per
        step it took); None to start afresh."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # error, count over the epoch
        resumed = progress.resume({**self.optimiser.state(), "sums": sums.cpu()}) if progress is not None else None
        if resumed is not None:
            self.optimiser.load(resumed.tensors, resumed.steps)
            for _ in range(resumed.steps if on_step is not None else 0):
                on_step()
        return resumed

    def train(self, on_step: Callable[[], None] | None, progress: FitProgress | None) -> list[float]:
        """Every epoch's rounds, in an order drawn afresh each epoch from ``options.seed``
        (resumed from ``progress`` where it holds a state, and saved there between two rounds
        where it is due). Returns the mean error of each epoch."""
        generator = torch.Generator().manual_seed(self.options.seed)
        resumed = self._resume(progress, on_step)
        epoch_mse: list[float] = list(resumed.epoch_mse) if resumed is not None else []
        per_step = self.per_step
        for epoch in range(self.options.epochs):
            # every epoch's order is drawn, so that the generator is where it was at the epoch resumed
            orders = [[m[i] for i in torch.randperm(len(m), generator=generator).tolist()] for m in self.members]
            if epoch < len(epoch_mse):
                continue
            first = resumed.round if resumed is not None and epoch == resumed.epoch else 0
            sums = resumed.tensors["sums"].to(self.device) if first else \
                torch.zeros(2, dtype=torch.float64, device=self.device)
            step = resumed.epoch_steps if first else 0
            for r in range(first, self.rounds):
                if progress is not None and r > first and progress.due():
                    progress.save(FitState(epoch, r, step, self.optimiser.steps, epoch_mse,
                                           {**self.optimiser.state(), "sums": sums.cpu()}))
                groups = [order[r * per_step:(r + 1) * per_step] for order in orders]
                step = self._round(groups, epoch, step, sums, on_step)
            epoch_mse.append(float(sums[0] / sums[1]) if sums[1] > 0 else 0.0)
        return epoch_mse

    def _round(self, groups: Sequence[Sequence[int]], epoch: int, step: int, sums: Tensor,
               on_step: Callable[[], None] | None) -> int:
        """One round: the gradient of each lane's ``groups[k]`` (its batches of the round) at
        the round's weights, by the processes holding them; then each lane's step, in lane
        order, its error added to ``sums``. Returns the epoch's steps taken after it."""
        sharded = self.shard is not None
        errors = {k: self._gradient(group, self.slots[k]) for k, group in enumerate(groups)
                  if (group or sharded) and k in self.slots}
        for k, group in enumerate(groups):
            if not group and not sharded:
                continue
            error = errors.get(k, torch.zeros(2, dtype=torch.float64, device=self.device))
            self._take_lane_gradient(k)
            # sharded, FSDP's backward pass has averaged the gradients over the processes
            self.all_reduce([*self.optimiser.summed, error] if not sharded else [error])
            self._check_finite(error, epoch, step)
            self._step(error)
            sums += error
            step += 1
            if on_step is not None:
                on_step()
        return step

    def _take_lane_gradient(self, k: int) -> None:
        """Put lane ``k``'s gradient of the round in the optimiser's (zero where none of the
        step's batches are on this process: it adds nothing to the sum over processes)."""
        if k not in self.slots:
            for grad in self.optimiser.grads:
                grad.zero_()
        elif self.slots[k] is not self.optimiser.grads:
            for grad, held in zip(self.optimiser.grads, self.slots[k]):
                grad.copy_(held)

    def _check_finite(self, error: Tensor, epoch: int, step: int) -> None:
        """Stop where a step's summed loss is not finite: :class:`~nmprune.checks.NonFiniteModel`
        where the model is to blame, :class:`ReconstructionDiverged` where training is
        (:func:`_not_finite`)."""
        if not math.isfinite(float(error[0])):
            why, broken = _not_finite(float(error[0]), epoch, step, self.optimiser.steps, self.data.targets,
                                      self.options.lr, self.all_reduce)
            raise (NonFiniteModel if broken else ReconstructionDiverged)(why)

    def _step(self, error: Tensor) -> None:
        """The optimiser's step on the summed gradient, as a mean over the step's count (sharded:
        FSDP's average over the processes made a sum again), at the learning rate decayed
        linearly to zero over all steps."""
        for grad in self.optimiser.grads:
            grad.div_(max(float(error[1]), 1.0) / (self.shard[1] if self.shard is not None else 1))
        self.optimiser.step(self.options.lr * (1.0 - self.optimiser.steps / self.all_steps))

    def _padded(self, group: Sequence[int]) -> list[int | None]:
        """The batches of ``group`` that this process runs: sharded, every process runs as many
        (None: its first batch again, weighted 0, where it has fewer), since FSDP's collectives
        in the forward and backward passes must pair up."""
        padding = [None] * (self.per_step - len(group)) if self.shard is not None else []
        return [*group, *padding]

    def _gradient(self, group: Sequence[int], grads: list[Tensor]) -> Tensor:
        """The summed gradients of this process's batches of ``group`` into ``grads``; their
        summed error and count (float64)."""
        for grad in grads:
            grad.zero_()
        self.into = grads
        error = torch.zeros(2, dtype=torch.float64, device=self.device)
        for g in self._padded(group):
            j = self.local.get(g) if g is not None else 0
            if j is None:
                continue
            total, count = self._batch_loss(j)
            if g is None:
                total, count = total * 0, 0
            total.backward()
            error += torch.stack([total.detach().double(), torch.tensor(float(count), dtype=torch.float64,
                                                                        device=self.device)])
        return error

    def _batch_loss(self, j: int) -> tuple[Tensor, int]:
        """Batch ``j``'s summed loss (:class:`FitData`), its products in the training dtype, and
        the count it is a sum over. The squared error is accumulated in float32."""
        with products_in(self.device, self.low):
            out = self.data.run(j)
        if self.data.loss is not None:
            return self.data.loss(out, self.data.targets[j])
        diff = out.float() - self.data.targets[j].float()
        weight = self.data.channel_weight
        squared = diff.square() if weight is None else diff.square() * weight
        return squared.sum(), diff.numel()


def fit_masked(data: FitData, weights: Sequence[Tensor], options: FitOptions, sharing: FitSharing = FitSharing(),
               on_step: Callable[[], None] | None = None, entries: Sequence[KeptEntries] | None = None,
               progress: FitProgress | None = None) -> FitResult:
    """Lower ``sum_b ||(run(b) - targets[b]) * sqrt(channel_weight)||^2 / count`` (or
    ``data.loss``; :class:`FitData`) over the nonzero entries of ``weights``.

    ``sharing.lanes`` gives each of the ``data.total`` batches its lane (default: contiguous
    shares, :func:`lane_of` with ``options.lanes``): every process draws the same order of
    each lane's batches per epoch, and in each round every lane's next ``batches_per_step``
    batches make one step whose gradient is computed at the round's weights (by whichever
    processes hold them); the round's steps are then taken in lane order (module docstring).
    With one lane that is one step at a time. ``sharing.all_reduce`` sums the gradients,
    errors and counts over processes before each step, so every process takes the same
    steps. ``weights`` (leaf tensors, float32 or wider) are trained in place with AdamW (no
    weight decay) and a linear decay of the learning rate to zero; their zeros stay zero.
    ``on_step()`` runs after every step (a progress bar); ``entries`` are the weights'
    :class:`KeptEntries` when the caller holds them already. Raises
    :class:`ReconstructionDiverged` (the weights then hold an unfinished step and must be
    discarded) when a step's loss is not finite. With ``progress``, training resumes from the
    state it holds, if any, and saves its state after each round where it is due: a resumed
    fit takes the uninterrupted one's steps, to the bit.

    The optimiser is :class:`CompactAdamW`: a weight's gradient and AdamW's two moments are
    compact vectors of its kept entries (``N/M`` of the weight), and the weights themselves
    are the parameters. A weight's dense gradient lives only while backpropagation passes
    through its layer (a hook moves its kept entries into the compact gradient), so training
    holds twice the weights beyond them (at 2:4, the kept entries' int32 positions and three
    compact float32 vectors, each half a weight's bytes), not three times; with several
    lanes, one more compact gradient per lane this process computes. AdamW on the kept
    entries is AdamW on the weight with its pruned entries' gradients zeroed: those entries
    would never move.

    ``weights`` may be FSDP2-sharded parameters (:mod:`nmprune.stages.sharded_pass`): each
    process then trains its rows of them (:func:`local_part`), FSDP's backward pass averages
    the gradients over the processes, and the batches are scheduled data-parallel: each
    process's batches (``data.positions``) are its own lane, and every round takes the next
    ``batches_per_step`` of each process's order for one step of their summed gradient
    (``sharing.lanes`` and ``options.lanes`` are not read). A step thus learns from ``R``
    times the batches, and an epoch has ``R`` times fewer steps (docs/distributed.md).
    """
    started = time.perf_counter()
    fit = _MaskedFit(data, weights, options, sharing, entries)
    with fit.compact_gradients():
        epoch_mse = fit.train(on_step, progress)
    return FitResult(fit.all_steps, epoch_mse[0], epoch_mse[-1], time.perf_counter() - started,
                     str(fit.low or weights[0].dtype).removeprefix("torch."))
