"""What a prune run will need, from the model's configuration and the settings alone
(``nmprune prune --dry-run``): no weight is read.

The model is built on the meta device, without initialising weights, to count its
parameters and its prunable layers' shapes, as a streamed run does
(:class:`nmprune.stages.source.DecoderBlocks`). From those and the settings:

* **Memory per rank.** The process itself (:data:`PROCESS_BYTES`: torch, transformers,
  tokenizer and nmprune, measured on the CPU with a one-megabyte model); the modules outside
  the blocks (embeddings, LM head) while the block inputs are captured and evaluated; then
  the block phase: one block's weights, its float32 Hessians (one per distinct input: layers
  named ``q/k/v_proj`` share one, ``gate/up_proj`` one, every other layer its own), the
  largest layer's solver memory (its float32 working weight and result, two ``d_in x d_in``
  factorisations), this rank's share of the calibration hidden states (one set per stream:
  two without reconstruction, the states in and the states out; two with block
  reconstruction, the dense stream (also the targets) and the pruned stream, whose states
  in wait on disk while its states out are computed; four with submodule reconstruction,
  whose targets are their own; with reconstruction of a model narrower than float32, the
  pruned stream in float32 besides), the float32 activations of one calibration batch, and
  with reconstruction the block in float32, 16 bytes per kept entry of a pruned weight (its
  position and :class:`nmprune.reconstruct.CompactAdamW`'s compact gradient and two moments; the
  solved weights' backup waits on disk in the checkpoint folder) and 4 more per lane the
  rank computes when there are several, one layer's
  dense gradient and autograd's activations of one batch. A
  run that loads the model whole adds all its weights. On a CUDA device the block phase is
  device memory and the CPU holds the process, the outside modules and one block on its way.
* **Disk.** The output (every parameter in the run dtype) and the checkpoint (the pruned
  layers' weights and the hidden states of every stream).
* **Time.** The layer solves from the cost model (:func:`nmprune.distributed.job_cost`,
  seconds on the reference CPU, or on CUDA by :data:`nmprune.distributed.CUDA_SPEEDUP`), spread over the
  ranks as the run spreads them: when blocks are solved one at a time (with reconstruction or
  pruned inputs), the busiest rank's cost of each block under the executor's own choice
  between shares of rows and whole layers (:func:`nmprune.distributed.busiest_rank_cost`),
  the mean otherwise (a window of blocks balances them); and the forward and backward passes from their floating-point
  operations (2 per parameter and token forward, 6 forward and backward) at
  :data:`FLOPS` per device kind (on the CPU scaled to the threads each rank has,
  :func:`cpu_threads`): the calibration passes spread over the ranks; the reconstruction's
  training of whole blocks in one lane (the default) shared by tokens, at the busiest
  rank's share (:func:`busiest_token_share`), and otherwise a round's training (one step per
  lane, :mod:`nmprune.reconstruct`) over as many ranks as the round has batches. Training
  that computes in bfloat16 (:func:`nmprune.reconstruct.training_dtype`) runs
  :data:`BF16_TRAINING_SPEEDUP` faster.

Every figure is an estimate; ``benchmarks/memory.py`` checks the memory ones against
measured peaks.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from .config import RunConfig

MIB = float(1 << 20)
GIB = float(1 << 30)
#: the resident set of a run's process before its model: 440 MiB per rank with a 1 MiB model
#: (benchmarks/results/memory_ranks.json, 2 ranks on the CPU)
PROCESS_BYTES = 440 * (1 << 20)
#: sustained float32 operations per second of the passes through a block: the reference CPU
#: (2 threads, SmolLM2's reconstruction) and an H200 (an 8B-shaped block, gpu.md)
FLOPS = {"cpu": 9e10, "cuda": 6e13}
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
#: layers that share their input (one Hessian) when they sit side by side in one module
SHARED_INPUTS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"w1", "w3"})


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


def distill_bytes(params: int, pruned: int, kept: float, blocks: int, batch_tokens: int, hidden_size: int,
                  intermediate: int, vocab: int, positions: int = 0) -> int:
    """Memory of the global distillation pass (:mod:`nmprune.stages.distillation`) on its
    device: the whole model in float32, 16 bytes per kept entry of a pruned weight (its
    position, compact gradient and AdamW's two moments) and the solved values kept aside (4
    per kept entry), autograd's activations of one batch through every block, its logits four
    times over (logits, log-probabilities and their gradients), and the dense distribution
    of the rank's ``positions`` (DISTILL_TOPK tokens of 8 bytes each)."""
    from .distill import DISTILL_TOPK

    return int(4 * params + pruned * 20 * kept
               + blocks * batch_tokens * (16 * hidden_size + 4 * intermediate) * 4
               + 4 * batch_tokens * vocab * 4 + positions * min(DISTILL_TOPK, vocab) * 8)


def distill_shortfall(needs: "RunNeeds", available: int) -> str | None:
    """Why the run's global distillation pass does not fit ``available`` bytes of the device
    (of this machine, on the CPU), or None where it fits or there is none."""
    peak = needs.distill_peak_per_rank
    if not needs.distill_epochs or peak <= available:
        return None
    return (f"the global distillation pass needs about {peak / GIB:.1f} GiB (the whole model in float32 with "
            f"its optimiser state and one batch's activations) and {available / GIB:.1f} GiB are available")


#: layers whose output at one token reaches later tokens (keys and values; fused ones too)
CAUSAL_LAYERS = ("k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "Wqkv")


def busiest_token_share(shapes: dict[str, tuple[int, int]], ranks: int) -> float:
    """The part of a block's training step the busiest of ``ranks`` computes when the
    sample is shared by tokens (:func:`nmprune.stages.token_shares.token_shares`): the keys'
    and values' layers (by name, :data:`CAUSAL_LAYERS`; the run measures them) run on every
    token up to the end of a share, the other layers on the share alone."""
    if ranks < 2:
        return 1.0
    sizes = [(r * d, name.rsplit(".", 1)[-1] in CAUSAL_LAYERS) for name, (r, d) in shapes.items()]
    total = sum(size for size, _ in sizes)
    c = 1.0 - sum(size for size, causal in sizes if causal) / total if total else 1.0
    return 1.0 / ranks if c >= 1.0 else (1 - c) / (1 - c ** ranks)


def hessian_inputs(shapes: dict[str, tuple[int, int]]) -> list[int]:
    """``d_in`` of each distinct layer input of one block (module docstring)."""
    seen: dict[tuple[str, int], int] = {}
    widths = []
    for name, (_, d_in) in shapes.items():
        parent, _, leaf = name.rpartition(".")
        group = next((i for i, g in enumerate(SHARED_INPUTS) if leaf in g), None)
        key = (parent, group) if group is not None else (name, -1)
        if key not in seen:
            seen[key] = d_in
            widths.append(d_in)
    return widths


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


def plan_run(config: RunConfig, ranks: int = 1, streamed: bool | None = None, model=None) -> RunNeeds:
    """The estimates of the module docstring for ``config`` on ``ranks`` ranks; ``streamed``
    says whether the weights stream (default: as the run decides from ``config.offload``, the
    number of ranks and the model's files, :func:`~nmprune.streaming.fit.ranks_offload`);
    ``model``: the model's ``(source, configuration)`` when already read."""
    from .devices import default_device
    from .distributed import busiest_rank_cost, plan_cost, splittable
    from .reconstruct import BF16_MIN_WIDTH
    from .stages.source import DecoderBlocks
    from .streaming.fit import ranks_offload

    model, itemsize, resolved = _skeleton(config, model)
    source = DecoderBlocks(model)
    s = config.prune
    plan = s.planner()
    if streamed is None:  # as the run decides before memory is considered (nmprune.job.run)
        streamed = bool(ranks_offload(config.offload, ranks, resolved))
    device = default_device(config.device).type
    params = sum(p.numel() for p in model.parameters())
    block_params = [sum(p.numel() for p in b.parameters()) for b in source.blocks]
    outside = params - sum(block_params)
    shapes = source.layer_shapes()
    hidden_size = model.config.hidden_size
    intermediate = max((d_out for d_out, _ in shapes.values()), default=hidden_size)
    recon = s.reconstruct != "none"
    per_block = [{n: shapes[n] for n in source.layers(i)} for i in range(len(source))]
    plans = plan.plan_layers(shapes, warn=False)
    largest = max(block_params)
    block = largest * itemsize
    hessians = max(sum(4 * d * d for d in hessian_inputs(b)) for b in per_block)
    solver = max(4 * (2 * r * d + 2 * d * d) for r, d in shapes.values())
    tokens = s.nsamples * s.seqlen
    sets = {"none": 2, "block": 2, "submodule": 4}[s.reconstruct]
    # with reconstruction, training reads the pruned stream in float32
    hidden = -(-s.nsamples // ranks) * s.seqlen * hidden_size * (itemsize * sets + (4 if recon and itemsize < 4 else 0))
    batch_tokens = s.batch_size * s.seqlen
    activations = batch_tokens * (3 * intermediate + 4 * hidden_size) * 4
    # the block in float32, then per kept entry of a pruned weight: 16 bytes (its position,
    # compact gradient and two AdamW moments) and 4 more per lane the rank
    # computes (with several lanes); one layer's dense gradient in flight, and autograd's
    # activations of one batch
    fit = s.fit_options()
    slots = 0 if fit.lanes == 1 else -(-fit.lanes // ranks)
    kept = max((p.pattern.n / p.pattern.m for p in plans.values() if p is not None), default=1.0)
    pruned = max(sum(r * d for n, (r, d) in b.items() if plans[n] is not None) for b in per_block)
    training = ((4 - itemsize) * largest + pruned * (16 + 4 * slots) * kept
                + 4 * max(r * d for r, d in shapes.values())
                + batch_tokens * (16 * hidden_size + 4 * intermediate) * 4) if recon else 0
    block_phase = block + hessians + solver + hidden + activations + training
    distilled_weights = sum(r * d for n, (r, d) in shapes.items() if plans[n] is not None)
    epochs = s.distill_passes(whole=not streamed)
    # the pass trains on the run's windows and its own (each rank on its share)
    windows = s.nsamples + s.distill_extra_windows()
    distilling = distill_bytes(params, distilled_weights, kept, len(source), batch_tokens, hidden_size, intermediate,
                               model.config.vocab_size, -(-windows // ranks) * s.seqlen) if epochs else 0
    whole = 0 if streamed else params * itemsize
    if device == "cuda":
        cpu_peak = PROCESS_BYTES + whole + outside * itemsize + block
        device_peak = max(block_phase, distilling)
    else:
        cpu_peak = PROCESS_BYTES + whole + max(outside * itemsize + hidden, block_phase, distilling)
        device_peak = None
    costs = [[plan_cost(b[n], p, device) for n in b if (p := plans[n]) is not None] for b in per_block]
    if recon or s.hessian_inputs == "pruned":  # one block at a time: the busiest rank's share
        solve = sum(busiest_rank_cost(c, [b[n][0] for n in b if plans[n] is not None],
                                      splittable([plans[n] for n in b if plans[n] is not None]), ranks, device)
                    for c, b in zip(costs, per_block))
    else:  # a window of blocks keeps the ranks near balance (nmprune.distributed.balance_window)
        solve = sum(map(sum, costs)) / ranks
    rate = FLOPS[device]
    if device != "cuda":  # the reference CPU's constants at the threads each rank will have
        speed = (cpu_threads(ranks) / CPU_REFERENCE_THREADS) ** CPU_THREAD_SCALING
        solve, rate = solve / speed, rate * speed
    wide = max((min(shape) for shape in shapes.values()), default=0) >= BF16_MIN_WIDTH
    train_rate = rate * (BF16_TRAINING_SPEEDUP[device] if _trains_in_bfloat16(s.train_precision, device, wide) else 1)
    passes = 2 + (1 if s.hessian_inputs == "pruned" else 0)  # statistics and propagation
    forward = 2.0 * sum(block_params) * tokens
    seconds = {"layer_solves": solve, "calibration_passes": passes * forward / rate / ranks}
    if recon:
        # the passes before and after training are data-parallel. Whole blocks in one lane:
        # every step's sample is shared by tokens, the busiest rank's share of the work
        # (nmprune.stages.token_shares). Otherwise a training round runs the batches of every
        # lane's step on the ranks that hold them, so ranks beyond the round's batches wait
        if s.reconstruct == "block" and fit.lanes == 1:
            share = busiest_token_share(shapes, ranks)
        else:
            batches = fit.lanes * fit.batches_per_step
            share = -(-batches // ranks) / batches
        training = 3 * fit.epochs * forward * share
        seconds["reconstruction"] = training / train_rate + 2 * forward / ranks / rate
    if epochs:  # the whole model forward and backward on every batch, each epoch
        # the dense model's forward pass on the pass's own windows (in the pass's dtype), then
        # every window's forward and backward each epoch
        own_tokens = s.distill_extra_windows() * s.seqlen
        seconds["distillation"] = (2.0 * params * own_tokens / train_rate
                                   + 3 * epochs * 2.0 * params * windows * s.seqlen / train_rate) / ranks
    if config.eval:
        seconds["evaluation"] = 2 * len(config.eval) * 2.0 * params * (config.eval_max_tokens or tokens) / rate
    pruned_weights = sum(r * d for r, d in shapes.values()) * itemsize
    return RunNeeds(ranks=ranks, device=device, streamed=bool(streamed), blocks=len(source), parameters=params,
                    cpu_peak_per_rank=cpu_peak, device_peak_per_rank=device_peak, block_phase=block_phase,
                    output_disk=params * itemsize,
                    checkpoint_disk=pruned_weights + tokens * hidden_size * itemsize * (2 if recon else 1),
                    seconds=seconds, distill_epochs=epochs, distill_windows=windows if epochs else 0,
                    distill_peak_per_rank=distilling if device == "cuda" else PROCESS_BYTES + whole + distilling)


def check_device_fits(needs: RunNeeds, device_bytes: int | None) -> None:
    """Refuse a device too small for one block's phase (weights, Hessians, solver, states)."""
    if device_bytes is not None and needs.device_peak_per_rank is not None \
            and needs.device_peak_per_rank > device_bytes:
        raise ValueError(f"one block's phase needs about {needs.device_peak_per_rank / GIB:.1f} GiB of "
                         f"device memory and the device has {device_bytes / GIB:.1f} GiB: use more ranks "
                         "(the calibration states are shared), fewer or shorter calibration samples "
                         "(--nsamples, --seqlen), or --reconstruct none")


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
                 if needs.distill_epochs else "none"))
    rows += [("disk: output", f"{needs.output_disk / GIB:.2f} GiB"),
             ("disk: checkpoint (deleted at the end)", f"{needs.checkpoint_disk / GIB:.2f} GiB")]
    rows += [(f"time: {k.replace('_', ' ')}", f"{v / 60:.1f} min") for k, v in needs.seconds.items()]
    rows.append(("time: total", f"{sum(needs.seconds.values()) / 60:.1f} min"))
    return "\n".join(["| estimate | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
