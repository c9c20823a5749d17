"""What a prune run will need, from the model's configuration and the settings alone
(``nmprune prune --dry-run``): no weight is read.

The model is built on the meta device, without initialising weights, to count its
parameters and its prunable layers' shapes, as a streamed run does
(:class:`nmprune.stages.source.DecoderBlocks`). Each stage states what it needs beside its own
code, from a :class:`~nmprune.stages.needs.RunShape` (the layers' shapes and plans, the blocks'
sizes, the settings, the ranks and their rates):
the layer solves (:func:`nmprune.stages.executor.solve_needs`), the statistics stage
(:func:`nmprune.stages.statistics.statistics_needs`), the reconstruction
(:func:`nmprune.stages.reconstruction.reconstruction_needs`) and the global distillation
(:func:`nmprune.stages.distillation.distillation_needs`). :func:`plan_run` adds them up:

* **Memory per rank.** The process itself (:data:`PROCESS_BYTES`: torch, transformers,
  tokenizer and nmprune, measured on the CPU with a one-megabyte model); the modules outside
  the blocks (embeddings, LM head) and the calibration streams while the block inputs are
  captured and evaluated; then the block phase: one block's weights, the streams and what
  each stage holds while a block is worked on; the global distillation's own peak. A run that
  loads the model whole adds all its weights. On a CUDA device the block phase is device
  memory and the CPU holds the process, the outside modules and one block on its way.
* **Disk.** The output (every parameter in the run dtype) and the checkpoint (the pruned
  layers' weights and the hidden states of every stream).
* **Time.** Each stage's seconds. The solvers' costs are seconds on the reference CPU
  (:func:`nmprune.distributed.plan_cost`; on CUDA by :data:`nmprune.distributed.CUDA_SPEEDUP`,
  the prox's work on every weight by the estimate :data:`nmprune.distributed.TRITON_ENTRY_SPEEDUP`
  where its Triton kernel runs it);
  the passes are floating-point operations (2 per parameter and token forward, 6 forward and
  backward) at :data:`FLOPS` per device kind. On the CPU both scale with the threads each rank
  has (:func:`cpu_threads`, :data:`CPU_THREAD_SCALING`). Training that computes in bfloat16
  (:func:`nmprune.reconstruct.training_dtype`) runs :data:`BF16_TRAINING_SPEEDUP` faster; each
  of its steps also costs what does not grow with the tokens (:data:`STEP_COSTS`: the weights'
  own passes, the optimiser, the collectives between ranks). The
  evaluation: dense and pruned perplexity, forward passes over the evaluation tokens.

Every figure is an estimate; ``benchmarks/memory.py`` checks the memory ones against
measured peaks.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from .config import AUTO, RunConfig
from .stages.distillation import PASS_PARTS

MIB = float(1 << 20)
GIB = float(1 << 30)
#: the resident set of a run's process before its model: 440 MiB per rank with a 1 MiB model
#: (benchmarks/results/memory_ranks.json, 2 ranks on the CPU)
PROCESS_BYTES = 440 * (1 << 20)
#: sustained float32 operations per second of the passes through a block: the reference CPU (AMD
#: EPYC znver5 at 2 threads) and an H200 (an 8B-shaped block, gpu.md). The CPU's, with the
#: training steps' other costs priced apart (STEP_COSTS): the SmolLM2 main job's passes,
#: reconstruction and distillation took 541 s (code of 05b9fac, 2 threads:
#: benchmarks/results/main_job.md) and the scaling Llama's 67.7 s on one rank of one thread
#: (code of 8325873), where 1.35e11 planned 1.27x and 1.04x that and 1.5e11 plans 1.18x and 0.97x
FLOPS = {"cpu": 1.5e11, "cuda": 6e13}
#: the reference CPU's constants (FLOPS["cpu"], the solvers' registered costs) were measured
#: with this many threads per process; one process of 2 threads ran the default job 1.73x as
#: fast as one of 1 thread (the scaling benchmark's Llama, medians of 3: 61.4 s against
#: 106.5 s, AMD EPYC znver5, code of 5406168; benchmarks/results/distributed_scaling.md), so a
#: process with ``t`` threads runs at ``(t / 2) ** CPU_THREAD_SCALING`` of those rates
CPU_REFERENCE_THREADS = 2
CPU_THREAD_SCALING = 0.79
#: how much faster the training passes (reconstruction, distillation) run where they compute in
#: bfloat16 (``--train-precision``, :func:`nmprune.reconstruct.training_dtype`) than at the
#: float32 rate of :data:`FLOPS`. CPU: one Llama block's forward and backward, 2.1x at hidden
#: size 576 and 1.8x at 256 (AMD EPYC znver5, AVX512-BF16, 2 threads). CUDA: an estimate until
#: ``benchmarks/gpu_check.py`` times it (an H200's bfloat16 tensor cores against the float32
#: rate measured there)
BF16_TRAINING_SPEEDUP = {"cpu": 2.0, "cuda": 4.0}
#: a training step's costs beside its floating-point work (:class:`~nmprune.stages.needs.StepCosts`),
#: per device kind. CPU (AMD EPYC znver5, torch 2.13): one Llama block's forward and backward in
#: bfloat16 on 8 tokens, 1.6-1.9 ns per trained weight at 2 threads (2.5 at 1; hidden sizes 512
#: and 1024), scaled with the threads as :data:`FLOPS`; CompactAdamW's step and the gradient's
#: compaction, 2.9-5.0 ns per kept entry at 1 or 2 threads (3.9 taken; memory-bound, not
#: scaled); gloo between two processes, a sum of 6.4 MB in 5.4 ms and a broadcast of 1 MB in
#: 0.36 ms (1.2 GB/s and 2.9 GB/s by the formulas of StepCosts; the sum's taken). CUDA: estimates
#: no GPU has checked -- the bytes the code moves at 3 TB/s of an H200's 4.8 (about 14 per weight:
#: its bfloat16 cast and its gradient's back; about 120 per kept entry: the compaction's gather
#: and sum, 28, and CompactAdamW.step's nine elementwise passes, 92), and NCCL over NVLink at
#: 350 GB/s per rank
STEP_COSTS = {"cpu": (1.75e-9, 3.9e-9, 1.2e9), "cuda": (5e-12, 4e-11, 3.5e11)}


@dataclass
class RunNeeds:
    """What :func:`plan_run` estimates (bytes and seconds)."""

    ranks: int
    device: str
    streamed: bool
    blocks: int
    parameters: int
    cpu_peak_per_rank: int
    device_peak_per_rank: int | None
    block_phase: int
    output_disk: int
    checkpoint_disk: int
    seconds: dict[str, float]
    distill_epochs: int = 0
    #: the calibration windows the global distillation trains on (the run's and its own)
    distill_windows: int = 0
    #: the peak on the device (the CPU's on the CPU) while the global distillation pass runs
    distill_peak_per_rank: int = 0
    #: whether the pass recomputes each decoder block's activations in its backward pass
    distill_checkpointed: bool = False
    #: whether the pass, sharded over the ranks, keeps their rows and training state in CPU
    #: memory (:class:`~nmprune.stages.distillation.PassMemory`)
    distill_offloaded: bool = False
    #: the pass's own memory on the rank by part (:func:`~nmprune.stages.distillation.distill_parts`)
    distill_parts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _skeleton(config: RunConfig, model=None):
    """The model on the meta device, its dtype's size and where it is (no weights read);
    ``model``: its ``(source, configuration)`` when the caller has read them
    (:func:`nmprune.job.check_run`). No initialiser runs on the empty weights, so that the
    plan of a 1,000-block model takes about a second."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from .models import check_causal, parse_dtype, resolve_model

    if model is None:
        resolved = resolve_model(config.model, config.gguf_file)
        model = resolved, check_causal(resolved)
    resolved, model_config = model
    dtype = parse_dtype(config.dtype)
    if dtype == "auto":
        dtype = parse_dtype(getattr(model_config, "dtype", None) or "float32")
    with torch.device("meta"), no_init_weights():
        skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(model_config), dtype=dtype,
                                                    trust_remote_code=False)
    skeleton.tie_weights()
    return skeleton, torch.empty((), dtype=dtype).element_size(), resolved


def size_text(n: float) -> str:
    """``n`` bytes for a message: GiB with one decimal, MiB below one GiB (never "0.0 GiB")."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2 ** 20:.0f} MiB"


def distill_shortfall(needs: "RunNeeds", available: int) -> str | None:
    """Why the run's global distillation pass does not fit ``available`` bytes of the device
    (of this machine, on the CPU), or None where it fits or there is none: its peak and what
    it is made of, largest first."""
    peak = needs.distill_peak_per_rank
    if not needs.distill_epochs or peak <= available:
        return None
    parts = {**needs.distill_parts}
    if needs.device != "cuda":
        parts["the process and the model it loaded"] = peak - sum(parts.values())
    listed = ", ".join(f"{name} {size_text(n)}" for name, n in sorted(parts.items(), key=lambda kv: -kv[1]) if n)
    return (f"the global distillation pass needs about {size_text(peak)} ({listed}"
            + ("; its blocks checkpointed" if needs.distill_checkpointed else "")
            + f") and {size_text(available)} are available")


def plan_distillation(config: RunConfig, ranks: int, model, available: int | None) -> tuple[RunNeeds, str | None]:
    """The run's plan on a device of ``available`` bytes (the CPU's on the CPU; None: unknown)
    and why ``distill_epochs: auto`` skips the pass there (None: it runs, or none was asked
    for): the one decision the run (:func:`nmprune.job.run`) and ``--dry-run`` both take.
    ``distill_epochs: N`` that does not fit is refused (ValueError), with fewer windows
    suggested where their dense distribution is the largest part. ``model``: the model's
    ``(source, configuration)``."""
    needs = plan_run(config, ranks, model=model, available=available)
    shortfall = distill_shortfall(needs, available) if available is not None else None
    if shortfall is not None and config.prune.distill_epochs != AUTO:
        parts = needs.distill_parts
        windows = parts and max(parts, key=parts.get) == PASS_PARTS[2]
        ways = [f"with fewer windows (--distill-nsamples, now {needs.distill_windows})"] if windows else []
        ways += ["without --distill-epochs", "on a device with more memory"]
        raise ValueError(f"{shortfall}: prune {', '.join(ways[:-1])} or {ways[-1]}")
    return needs, shortfall


def cpu_threads(ranks: int) -> int:
    """The threads each of ``ranks`` CPU processes will compute with: ``OMP_NUM_THREADS`` where
    it is set, else one under torchrun (which sets it to 1 for several processes), else
    torch's own count for this machine."""
    import os

    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    return 1 if ranks > 1 else torch.get_num_threads()


def _trains_in_bfloat16(precision: str, device: str, wide: bool) -> bool:
    """Whether training on a ``device`` kind computes in bfloat16, as
    :func:`nmprune.reconstruct.training_dtype` will decide there (``wide``: the pruned layers
    are wide enough). A CUDA device planned from a machine without one is taken to have
    bfloat16 (every one since Ampere)."""
    import torch

    from .devices import low_precision

    if device == "cuda" and not torch.cuda.is_available():
        return precision == "bfloat16" or (precision == "auto" and wide)
    return low_precision(precision, torch.device(device), wide) is not None


def plan_run(config: RunConfig, ranks: int = 1, streamed: bool | None = None, model=None,
             available: int | None = None) -> RunNeeds:
    """The estimates of the module docstring for ``config`` on ``ranks`` ranks; ``streamed``
    says whether the weights stream (default: as the run decides from ``config.offload``, the
    number of ranks and the model's files, :func:`~nmprune.streaming.fit.ranks_offload`);
    ``model``: the model's ``(source, configuration)`` when already read; ``available``: the
    bytes of the device the global distillation runs on (the CPU's, on the CPU), where known:
    the pass checkpoints its decoder blocks where it would not fit them without."""
    from .devices import default_device
    from .reconstruct import BF16_MIN_WIDTH
    from .stages.distillation import distillation_needs
    from .stages.executor import solve_needs
    from .stages.needs import RunShape, StepCosts
    from .stages.reconstruction import reconstruction_needs
    from .stages.source import DecoderBlocks
    from .stages.statistics import statistics_needs
    from .streaming.fit import ranks_offload

    model, itemsize, resolved = _skeleton(config, model)
    source = DecoderBlocks(model)
    s = config.prune
    if streamed is None:  # as the run decides before memory is considered (nmprune.job.run)
        streamed = bool(ranks_offload(config.offload, ranks, resolved))
    device = default_device(config.device).type
    shapes = source.layer_shapes()
    rate, speed = FLOPS[device], 1.0
    if device != "cuda":  # the reference CPU's constants at the threads each rank will have
        speed = (cpu_threads(ranks) / CPU_REFERENCE_THREADS) ** CPU_THREAD_SCALING
        rate = rate * speed
    wide = max((min(shape) for shape in shapes.values()), default=0) >= BF16_MIN_WIDTH
    low = _trains_in_bfloat16(s.train_precision, device, wide)
    train_rate = rate * (BF16_TRAINING_SPEEDUP[device] if low else 1)
    per_parameter, per_entry, link = STEP_COSTS[device]
    run = RunShape(s, ranks, device, itemsize, [{n: shapes[n] for n in source.layers(i)} for i in range(len(source))],
                   s.planner().plan_layers(shapes, warn=False),
                   [sum(p.numel() for p in b.parameters()) for b in source.blocks],
                   sum(p.numel() for p in model.parameters()), model.config.hidden_size, model.config.vocab_size,
                   getattr(model.config, "num_attention_heads", 0) or 0, low, rate, train_rate, speed,
                   StepCosts(per_parameter / speed, per_entry, link))
    # the stages the run will have (nmprune.pipeline): the solves, the statistics stage (with
    # reconstruction, the one that also fits each block and carries the streams) and the pass
    recon = s.reconstruct != "none"
    solves, statistics = solve_needs(run), statistics_needs(run)
    fitting = reconstruction_needs(run) if recon else None
    epochs = s.distill_passes()
    windows = s.nsamples + s.distill_extra_windows()
    distilling = distillation_needs(run, epochs, windows) if epochs else None
    model_bytes = run.params * itemsize
    whole = 0 if streamed else model_bytes  # held through the block phase
    # one process's pass holds the whole model, a streamed one too (loaded whole for it once the
    # blocks are done); several ranks' pass holds a copy sharded over them (in its own parts)
    beside_pass = model_bytes if ranks == 1 else whole
    # the pass checkpoints its blocks where it would not fit without (a second forward pass a step)
    checkpointed = bool(distilling and available is not None
                        and _distill_peak(device, beside_pass, distilling.peak_bytes) > available)
    if checkpointed:
        distilling = distillation_needs(run, epochs, windows, checkpointed=True)
    # several GPU ranks keep their rows and training state in CPU memory where even that does not fit
    offloaded = bool(checkpointed and ranks > 1 and device == "cuda"
                     and _distill_peak(device, beside_pass, distilling.peak_bytes) > available)
    if offloaded:
        distilling = distillation_needs(run, epochs, windows, checkpointed=True, offloaded=True)
    streams = (fitting or statistics).stream_bytes
    block = max(run.block_params) * itemsize
    block_phase = (block + statistics.block_bytes + solves.block_bytes + streams
                   + (fitting.block_bytes if fitting else 0))
    distill_peak = distilling.peak_bytes if distilling else 0
    outside = run.params - sum(run.block_params)
    if device == "cuda":
        cpu_peak = PROCESS_BYTES + whole + outside * itemsize + block + (distilling.host_bytes if distilling else 0)
        device_peak = max(block_phase, distill_peak)
    else:
        cpu_peak = PROCESS_BYTES + whole + max(outside * itemsize + streams, block_phase,
                                               distill_peak + (beside_pass - whole if distilling else 0))
        device_peak = None
    seconds = {**solves.seconds, **statistics.seconds, **(fitting.seconds if fitting else {}),
               **(distilling.seconds if distilling else {})}
    if config.eval:
        seconds["evaluation"] = 2 * len(config.eval) * 2.0 * run.params * (config.eval_max_tokens or run.tokens) / rate
    pruned_weights = sum(r * d for r, d in shapes.values()) * itemsize
    return RunNeeds(ranks=ranks, device=device, streamed=bool(streamed), blocks=len(source), parameters=run.params,
                    cpu_peak_per_rank=cpu_peak, device_peak_per_rank=device_peak, block_phase=block_phase,
                    output_disk=run.params * itemsize,
                    checkpoint_disk=pruned_weights + run.tokens * run.hidden_size * itemsize * (2 if recon else 1),
                    seconds=seconds, distill_epochs=epochs, distill_windows=windows if epochs else 0,
                    distill_peak_per_rank=_distill_peak(device, beside_pass, distill_peak),
                    distill_checkpointed=checkpointed, distill_offloaded=offloaded,
                    distill_parts=distilling.peak_parts if distilling else {})


def _distill_peak(device: str, whole: int, pass_peak: int) -> int:
    """The global distillation's peak where it is judged: on the device, or, on the CPU, beside
    the process and the ``whole`` model it loaded."""
    return pass_peak if device == "cuda" else PROCESS_BYTES + whole + pass_peak


def check_device_fits(needs: RunNeeds, device_bytes: int | None) -> None:
    """Refuse a device too small for one block's phase (weights, Hessians, solver, states)."""
    if device_bytes is not None and needs.device_peak_per_rank is not None and needs.block_phase > device_bytes:
        raise ValueError(f"one block's phase needs about {size_text(needs.block_phase)} of device memory and "
                         f"the device has {size_text(device_bytes)}: use more ranks (the calibration states "
                         "are shared), fewer or shorter calibration samples (--nsamples, --seqlen)"
                         + ("" if needs.distill_epochs else ", or --reconstruct none"))


def needs_table(needs: RunNeeds) -> str:
    """The estimates as a Markdown table."""
    rows = [("ranks", str(needs.ranks)), ("device", needs.device),
            ("weights", "streamed block by block" if needs.streamed else
             "loaded whole" + (" (a copy per rank)" if needs.ranks > 1 else "")),
            ("decoder blocks", str(needs.blocks)), ("parameters", f"{needs.parameters / 1e9:.3f} B"),
            ("peak CPU memory per rank", f"{needs.cpu_peak_per_rank / GIB:.2f} GiB")]
    if needs.device_peak_per_rank is not None:
        rows.append(("peak device memory per rank", f"{needs.device_peak_per_rank / GIB:.2f} GiB"))
    rows.append(("global distillation", f"{needs.distill_epochs} epoch(s) on {needs.distill_windows} windows"
                 + (", decoder blocks checkpointed" if needs.distill_checkpointed else "")
                 + (", weights and training state in CPU memory (offloaded)" if needs.distill_offloaded else "")
                 if needs.distill_epochs else "none"))
    if needs.distill_epochs:
        rows.append(("peak memory of the global distillation per rank", f"{needs.distill_peak_per_rank / GIB:.2f} GiB"))
    rows += [("disk: output", f"{needs.output_disk / GIB:.2f} GiB"),
             ("disk: checkpoint (deleted at the end)", f"{needs.checkpoint_disk / GIB:.2f} GiB")]
    rows += [(f"time: {k.replace('_', ' ')}", f"{v / 60:.1f} min") for k, v in needs.seconds.items()]
    rows.append(("time: total", f"{sum(needs.seconds.values()) / 60:.1f} min"))
    if needs.device == "cuda":
        rows.append(("not yet measured on a GPU", "the Triton 2:4 prox kernel's speed "
                     "(distributed.TRITON_ENTRY_SPEEDUP), bfloat16 training's speed-up "
                     "(resources.BF16_TRAINING_SPEEDUP), a training step's other costs "
                     "(resources.STEP_COSTS)" + (" and an offloaded pass's transfers and steps "
                                                 "(stages.distillation.OFFLOAD_BYTES_PER_SECOND, "
                                                 "OFFLOADED_SECONDS_PER_ENTRY)" if needs.distill_offloaded else "")))
    return "\n".join(["| estimate | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
