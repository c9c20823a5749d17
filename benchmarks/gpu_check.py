"""The layer solvers on a GPU: every method and refiner against the CPU, and solve times and
peak device memory on Llama-3.1-8B-shaped layers. Writes ``benchmarks/results/gpu.{json,md}``.

1. **Agreement.** Every registered method, alone and followed by each registered refiner, on
   one correlated layer (``_problems.correlated_layer``) solved on the device and on the CPU:
   the fraction of N:M cells with the same mask and the relative difference of the local
   losses (paper eq. ``squared_loss``).
2. **Speed and memory.** Seconds of one solve (median of ``--repeats``, after one warm-up) of
   sparsegpt, wanda and prox + exact refinement on the shapes of Llama-3.1-8B's layers
   (4096x4096, 14336x4096, 4096x14336), and the peak device memory of each
   (``torch.cuda.max_memory_allocated``).
3. **The whole pipeline.** ``nmprune.run`` (wanda + exact refinement, then the default block
   reconstruction) on the packaged SmolLM2-135M-Instruct (saved as safetensors first, so that
   it can also stream) on the device in memory and streamed, in float32 and bfloat16, against
   the same run on the CPU in float32: the pruned wiki perplexities, wall seconds and the peak
   device memory of each run.
4. **One Llama-3.1-8B-shaped block.** ``nmprune.run`` on a random one-block Llama with the
   8B model's block in bfloat16: wanda's layer solves and the block reconstruction stage
   (:mod:`nmprune.stages.reconstruction`) on 128 x 2048 calibration tokens, training in
   float32 and then in bfloat16 (``--train-precision``): their seconds, the block's output
   error before and after, and the peak device memory.

0. **The prox kernel.** On each Llama-3.1-8B layer shape: one 2:4 prox of the whole matrix
   (``nmprune.prox.prox_2of4``: the Triton kernel on CUDA where triton is installed, the
   float64 torch solver otherwise) at lambda near the median cell's threshold, against one
   bfloat16 gradient product ``(Y - W*) H`` (issue target: the prox at most one product), and
   the prox method and the exact refinement of one solve timed apart. With the Triton kernel,
   the share of the issue rate it reached (``_issue_efficiency``), which
   ``benchmarks/prox_kernel_cost.py`` assumes to be 0.5 for the plan's
   ``distributed.TRITON_ENTRY_SPEEDUP``: a measured share there replaces the assumption.

5. **A reconstruction step's other costs.** On one Llama-3.1-8B-shaped block, 2:4-pruned: the
   forward and backward passes on a few tokens per trained weight, and the optimiser's step and
   the gradients' compaction per kept entry, beside the plan's ``resources.STEP_COSTS`` (on
   CUDA estimates until this part replaces them).
6. **The default job against its plan.** ``nmprune.run`` with the default settings on a
   random two-block Llama with Llama-3.1-8B's blocks, bfloat16, streamed, on the block part's
   calibration tokens: each stage's measured seconds beside the dry run's plan of the same run.

7. **The global distillation's lean pass.** On a random two-block Llama with Llama-3.1-8B's
   blocks in bfloat16, one epoch with its decoder blocks checkpointed and one without: the
   peak device memory and seconds beside the plan's peak (``distill_bytes``).
8. **The pass sharded with FSDP2.** The same model and epoch through
   ``stages.sharded_pass.sharded_whole`` on a process group of one rank (NCCL on CUDA): the
   path several ranks take, its peak device memory and seconds, and the mask held.

The parts run in the order ``prox, agreement, pipeline, speed, block, step, job, distill, sharded``
(``--parts`` picks some) and
the results are written after each, so a run stopped at a time limit keeps what it finished;
``--merge`` adds the parts of this run to an earlier ``gpu.json`` of the same device.

On a machine without CUDA it runs the same code on the CPU against itself, with every shape
divided by ``--scale`` (16 by default there), so that the script always imports and runs
(tests/test_gpu_check.py, which also gives a tiny ``--model``); such results name the CPU and
say ``fallback``.

    python benchmarks/gpu_check.py [--device cuda] [--scale 1] [--repeats 2] [--out DIR]
                                   [--parts agreement,pipeline,speed,block] [--merge]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from _machine import cpu_description
from _problems import correlated_layer
from nmprune.loss import local_loss
from nmprune.pattern import same_mask_cells
from nmprune.registry import get_method, methods, refiners
from nmprune.solve import prune_layer

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA_8B_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
TIMED = [("sparsegpt", None), ("wanda", None), ("prox", "exact")]
#: The layer every method is compared on (GPU, CPU fallback): small enough for the slowest
#: solvers (prox-l2, gd refinement) on the CPU side.
AGREEMENT_SHAPE = {False: (512, 512), True: (128, 128)}


def _solve(w: torch.Tensor, h: torch.Tensor, mean: torch.Tensor, method: str, refine: str | None):
    """:func:`prune_layer` with the statistics the method declares (DSnoT's input mean)."""
    extra = {"input_mean": mean} if "input_mean" in get_method(method).statistics else {}
    return prune_layer(w, h, method, "2:4", refine, damp=0.01, **extra)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreement(device: torch.device, d_out: int, d_in: int) -> list[dict]:
    """Part 1: every method and method + refiner on ``device`` against the CPU."""
    w, h, mean = correlated_layer(d_out, d_in, seed=0)
    rows = []
    for method in methods():
        for refine in [None, *refiners()]:
            cpu = _solve(w, h, mean, method, refine)
            dev = _solve(w.to(device), h.to(device), mean.to(device), method, refine)
            loss_cpu = local_loss(cpu.weight, w, h)
            loss_dev = local_loss(dev.weight.cpu(), w, h)
            same = same_mask_cells(cpu.weight, dev.weight.cpu(), 4)
            rows.append({"method": method, "refine": refine, "shape": [d_out, d_in],
                         "same_mask_cells": float(same.float().mean()),
                         "loss_cpu": loss_cpu, "loss_device": loss_dev,
                         "loss_rel_diff": abs(loss_dev - loss_cpu) / max(abs(loss_cpu), 1e-30)})
    return rows


def speed(device: torch.device, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Part 2: median solve seconds and peak device memory on ``shapes``."""
    rows = []
    for d_out, d_in in shapes:
        w, h, mean = (t.to(device) for t in correlated_layer(d_out, d_in, seed=1))
        for method, refine in TIMED:
            _solve(w, h, mean, method, refine)  # warm-up: kernels compiled, caches filled
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(repeats):
                _sync(device)
                start = time.perf_counter()
                _solve(w, h, mean, method, refine)
                _sync(device)
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            rows.append({"method": method, "refine": refine, "shape": [d_out, d_in],
                         "seconds_median": statistics.median(times), "seconds": times,
                         "peak_device_bytes": peak})
        del w, h, mean
    return rows


def packaged_model_dir(folder: Path) -> Path:
    """The packaged SmolLM2 (GGUF) saved into ``folder`` as safetensors, so it can stream."""
    from nmprune.models import load_model
    from nmprune.output import save_pretrained_atomic

    model, tokenizer, _ = load_model(None, dtype="float32")
    return save_pretrained_atomic(model, tokenizer, folder / "smollm2")


def pipeline(device: torch.device, model_dir: Path, work: Path, settings: dict) -> list[dict]:
    """Part 3: ``nmprune.run`` on ``device`` in memory and streamed, float32 and bfloat16,
    against the CPU in float32 (the first row)."""
    import nmprune

    runs = [("cpu", "float32", False)] + [(str(device), dtype, offload)
                                          for dtype in ("float32", "bfloat16") for offload in (False, True)]
    rows = []
    for i, (where, dtype, offload) in enumerate(runs):
        if where != "cpu" and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # distill_epochs 0: the runs compare the blocks' phase alone (part 7 measures the pass)
        config = nmprune.build_config({"method": "wanda", "refine": "exact", "distill_epochs": 0, **settings},
                                      {"model": str(model_dir), "out": str(work / f"run{i}"),
                                       "device": where, "dtype": dtype, "offload": offload})
        start = time.perf_counter()
        report = nmprune.run(config, progress=False)
        peak = torch.cuda.max_memory_allocated(device) if where != "cpu" and device.type == "cuda" else None
        rows.append({"device": where, "dtype": dtype, "streamed": offload,
                     "seconds": time.perf_counter() - start, "peak_device_bytes": peak,
                     "perplexity": report["perplexity"]["pruned"]})
    reference = rows[0]["perplexity"]
    for row in rows:
        row["perplexity_rel_diff"] = max(abs(row["perplexity"][k] - v) / v for k, v in reference.items())
    return rows


def block_config(scale: int, layers: int, vocab_size: int):
    """A Llama configuration with Llama-3.1-8B's block (hidden 4096, MLP 14336, 32 query and 8
    key-value heads; widths and head counts divided by ``scale``), ``layers`` blocks and tied
    embeddings."""
    from transformers import LlamaConfig

    heads = max(1, 32 // scale)
    return LlamaConfig(hidden_size=4096 // scale, intermediate_size=14336 // scale,
                       num_attention_heads=heads, head_dim=4096 // scale // heads,
                       num_key_value_heads=max(1, 8 // scale), num_hidden_layers=layers, vocab_size=vocab_size,
                       tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0,
                       torch_dtype="bfloat16")


def block_model_dir(folder: Path, tokenizer_dir: Path, scale: int = 1, layers: int = 1) -> Path:
    """A random Llama of :func:`block_config` with the tokenizer saved in ``tokenizer_dir``,
    saved as safetensors in bfloat16."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(block_config(scale, layers, len(tokenizer))).to(torch.bfloat16)
    path = folder / "llama8b-block"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def block_reconstruction(device: torch.device, model_dir: Path, work: Path, settings: dict) -> list[dict]:
    """Part 4: one Llama-3.1-8B-shaped block pruned by wanda and reconstructed (the block
    granularity, the default) by ``nmprune.run`` on ``device`` in bfloat16, once for each
    training precision of :data:`BLOCK_PRECISIONS`: seconds of the layer solves and of the
    reconstruction (their ratio measures ``resources.BF16_TRAINING_SPEEDUP``), the dtype the
    training computed in, the block's output error before and after, and the peak device memory."""
    import nmprune

    rows = []
    for precision in BLOCK_PRECISIONS:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        config = nmprune.build_config({"method": "wanda", "refine": None, "reconstruct": "block", "distill_epochs": 0,
                                       "train_precision": precision, **settings},
                                      {"model": str(model_dir), "out": str(work / f"block-{precision}"),
                                       "device": str(device), "dtype": "bfloat16"})
        report = nmprune.run(config, progress=False)
        block = report["reconstruction"]["blocks"][0]
        rows.append({"settings": {k: settings[k] for k in ("nsamples", "seqlen")}, "train_precision": precision,
                     "train_dtype": block["train_dtype"],
                     "layer_seconds": sum(r["seconds"] for r in report["layers"]),
                     "reconstruction_seconds": block["seconds"], "steps": block["steps"],
                     "error_before": block["error_before"], "error_after": block["error_after"],
                     "heldout_before": block["heldout_before"], "heldout_after": block["heldout_after"],
                     "kept": block["kept"], "prune_seconds": report["seconds"]["prune"],
                     "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None})
    return rows


def default_job(device: torch.device, tokenizer_dir: Path, work: Path, settings: dict, scale: int) -> list[dict]:
    """Part 6: the default job (prox + exact, block reconstruction) on a random two-block
    Llama with Llama-3.1-8B's blocks (:func:`block_config`) in bfloat16, streamed as a model
    larger than its device is, without evaluation: each stage's seconds from the run's report
    beside the dry run's plan of the same run (``nmprune.resources.plan_run``), which is how
    the plan's CUDA constants are checked. Without the global distillation pass (part 7
    measures it), which a model streamed in one process makes too."""
    import nmprune
    from nmprune.resources import plan_run

    model_dir = block_model_dir(work / "job-model", tokenizer_dir, scale, layers=2)
    config = nmprune.build_config({**settings, "eval": [], "distill_epochs": 0},
                                  {"model": str(model_dir), "out": str(work / "job"), "device": str(device),
                                   "dtype": "bfloat16", "offload": True})
    planned = plan_run(config, 1).seconds
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report = nmprune.run(config, progress=False)
    reconstruction = sum(b["seconds"] for b in report["reconstruction"]["blocks"])
    measured = {"layer_solves": report["seconds"]["pipeline"]["layers"],
                "calibration_passes": report["per_rank"][0]["calibration_seconds"] - reconstruction
                + report["seconds"]["pipeline"]["capture"],
                "reconstruction": reconstruction}
    return [{"settings": {k: settings[k] for k in ("nsamples", "seqlen")}, "stage": stage,
             "planned_seconds": planned.get(stage, 0.0), "measured_seconds": measured.get(stage, 0.0)}
            for stage in sorted(set(planned) | set(measured))] + \
        [{"settings": {k: settings[k] for k in ("nsamples", "seqlen")}, "stage": "prune (all)",
          "planned_seconds": sum(planned.values()), "measured_seconds": report["seconds"]["prune"],
          "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}]


#: the tokens of the step part's forward and backward passes: few enough that their products
#: are a small part of the time, which is then the weights' own work
STEP_TOKENS = 8


def step_costs(device: torch.device, scale: int, repeats: int) -> list[dict]:
    """Part 5: what one reconstruction step costs beside its products
    (``resources.STEP_COSTS``, :class:`nmprune.stages.needs.StepCosts`), on one
    Llama-3.1-8B-shaped block in float32 with its linear layers 2:4-pruned: the forward and
    backward passes on :data:`STEP_TOKENS` tokens with bfloat16 products, as
    ``reconstruct.fit_masked`` runs them, per trained weight; ``CompactAdamW``'s step and the
    gradients' compaction (``KeptEntries.gather``) per kept entry; beside the plan's constants
    for this device kind."""
    from transformers import LlamaForCausalLM

    from nmprune.devices import products_in
    from nmprune.pattern import parse_pattern, topn_mask
    from nmprune.reconstruct import CompactAdamW, KeptEntries
    from nmprune.resources import STEP_COSTS
    from nmprune.stages.block_runner import capture_block_inputs, run_block

    torch.manual_seed(0)
    model = LlamaForCausalLM(block_config(scale, 1, 256)).to(device)
    block = model.model.layers[0]
    # the block's input and arguments as the pipeline records them
    inputs = capture_block_inputs(model, "model.layers", model.model.layers,
                                  [torch.randint(0, 256, (1, STEP_TOKENS))], device, place=False)
    hidden = inputs.hidden[0]
    call = inputs.call(0, hidden)
    weights = [m.weight for m in block.modules() if isinstance(m, torch.nn.Linear)]
    for p in block.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        for w in weights:
            w.mul_(topn_mask(w.abs(), parse_pattern("2:4")))
            w.requires_grad_(True)
    entries = [KeptEntries(w) for w in weights]
    optimiser = CompactAdamW(weights, entries)

    def passes() -> None:
        with products_in(device, torch.bfloat16):
            out = run_block(block, hidden, call)
        out.float().square().sum().backward()
        for w in weights:
            w.grad = None

    dense = [torch.randn_like(w) for w in weights]

    def compaction() -> None:
        for where, grad, into in zip(entries, dense, optimiser.grads):
            where.gather(grad, into=into)

    trained, kept = sum(w.numel() for w in weights), sum(e.count for e in entries)
    seconds = {"passes": _timed(passes, device, repeats), "optimiser": _timed(lambda: optimiser.step(1e-4), device,
                                                                             repeats),
               "compaction": _timed(compaction, device, repeats)}
    planned = STEP_COSTS[device.type]
    return [{"trained_weights": trained, "kept_entries": kept, "tokens": STEP_TOKENS,
             **{f"{k}_seconds": v for k, v in seconds.items()},
             "per_parameter": seconds["passes"] / trained,
             "per_entry": (seconds["optimiser"] + seconds["compaction"]) / kept,
             "planned_per_parameter": planned[0], "planned_per_entry": planned[1]}]


def distillation(device: torch.device, scale: int, settings: dict) -> list[dict]:
    """Part 7: the global distillation's lean pass (:func:`nmprune.stages.distillation.distill`)
    on a random two-block Llama-3.1-8B-shaped model in bfloat16, its linear layers 2:4, one
    epoch on ``settings``' windows towards a random dense distribution, once with its decoder
    blocks checkpointed and once without: peak device memory and seconds beside the plan's
    (:func:`~nmprune.stages.distillation.distill_bytes`; a random teacher's top-64 is as large
    as a real one's)."""
    from transformers import LlamaForCausalLM

    from nmprune.distill import DISTILL_TOPK, teacher_topk
    from nmprune.pattern import parse_pattern, topn_mask
    from nmprune.reconstruct import FitOptions, KeptEntries
    from nmprune.stages.distillation import (PassBatch, PassModelSize, PassRuntime, PassWindows, distill, distill_bytes,
                                             uses_eager_attention)
    from nmprune.stages.reconstruction import held_out_batches

    nsamples, seqlen, vocab = settings["nsamples"], settings["seqlen"], 128256 // scale
    config = block_config(scale, 2, vocab)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    weights = [m.weight for block in model.model.layers for m in block.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for w in weights:
            w.mul_(topn_mask(w.abs(), parse_pattern("2:4")))
    batches = list(torch.randint(0, vocab, (nsamples, seqlen)).split(1))
    teachers = [teacher_topk(torch.randn(1, seqlen, vocab), DISTILL_TOPK) for _ in batches]
    pruned, kept = sum(w.numel() for w in weights), sum(KeptEntries(w).count for w in weights)
    params = sum(p.numel() for p in model.parameters())
    eager = uses_eager_attention(device.type, True, seqlen)
    solved = [w.detach().clone() for w in weights]
    rows = []
    for checkpointed in (True, False):
        with torch.no_grad():
            for w, value in zip(weights, solved):
                w.copy_(value)
        model.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        record = distill(model, weights, PassWindows(batches, teachers, list(range(nsamples)), nsamples,
                                                     held_out_batches(nsamples)),
                         FitOptions(1, 1e-3, 1, precision="bfloat16"), PassRuntime(lambda tensors: None, device),
                         checkpoint_blocks=checkpointed)
        _sync(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
        model.to("cpu")
        # the plan's peak less the model, which sat on the device before the pass began
        sizes = PassModelSize(params, pruned, kept / pruned, 2, 2, config.hidden_size, config.intermediate_size,
                              vocab)
        batch = PassBatch(seqlen, nsamples * seqlen, 6 * config.num_attention_heads * seqlen ** 2 if eager else 0)
        planned = distill_bytes(sizes, batch, True, checkpointed) - 2 * params
        rows.append({"checkpointed": checkpointed, "windows": nsamples, "seqlen": seqlen, "steps": record["steps"],
                     "train_dtype": record["train_dtype"], "seconds": seconds, "peak_device_bytes": peak,
                     "planned_peak_bytes": planned, "first_epoch_kl": record["first_epoch_kl"],
                     "last_epoch_kl": record["last_epoch_kl"]})
    return rows


def sharded_distillation(device: torch.device, scale: int, settings: dict) -> list[dict]:
    """Part 8: the global distillation pass sharded with FSDP2
    (:func:`nmprune.stages.sharded_pass.sharded_whole`) over a process group of one rank (NCCL
    on CUDA, gloo on the CPU), on part 7's two-block Llama-3.1-8B-shaped model: the sharded
    copy built and filled, one epoch trained in bfloat16 products, the weights gathered back;
    peak device memory and seconds, and whether the mask held."""
    import socket

    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from nmprune.distill import DISTILL_TOPK, teacher_topk
    from nmprune.pattern import parse_pattern, topn_mask
    from nmprune.reconstruct import FitOptions
    from nmprune.stages.distillation import PassRuntime, PassWindows, distill
    from nmprune.stages.reconstruction import held_out_batches
    from nmprune.stages.sharded_pass import sharded_whole
    from nmprune.stages.sink import ModelSink
    from nmprune.stages.source import ModelBlocks

    nsamples, seqlen, vocab = settings["nsamples"], settings["seqlen"], 128256 // scale
    torch.manual_seed(0)
    model = LlamaForCausalLM(block_config(scale, 2, vocab)).to(torch.bfloat16).eval()
    source = ModelBlocks(model)
    names = [n for i in range(len(source)) for n in source.layers(i)]
    with torch.no_grad():
        for n in names:
            w = model.get_submodule(n).weight
            w.mul_(topn_mask(w.abs(), parse_pattern("2:4")))
    zeros = {n: model.get_submodule(n).weight == 0 for n in names}
    batches = list(torch.randint(0, vocab, (nsamples, seqlen)).split(1))
    teachers = [teacher_topk(torch.randn(1, seqlen, vocab), DISTILL_TOPK) for _ in batches]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            world_size=1, rank=0)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with sharded_whole(source, ModelSink(source), device, torch.bfloat16) as sharded:
            record = distill(sharded, [sharded.get_submodule(n).weight for n in names],
                             PassWindows(batches, teachers, list(range(nsamples)), nsamples,
                                         held_out_batches(nsamples)),
                             FitOptions(1, 1e-3, 1, precision="bfloat16"), PassRuntime(lambda tensors: None, device))
        _sync(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        dist.destroy_process_group()
    held = all(torch.equal(model.get_submodule(n).weight == 0, zeros[n]) for n in names)
    return [{"ranks": 1, "windows": nsamples, "seqlen": seqlen, "steps": record["steps"],
             "train_dtype": record["train_dtype"], "seconds": seconds, "peak_device_bytes": peak,
             "first_epoch_kl": record["first_epoch_kl"], "last_epoch_kl": record["last_epoch_kl"],
             "kept": record["kept"], "mask_held": held}]


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prox_kernel(device: torch.device, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Part 0: the 2:4 prox of a whole layer against one gradient product (module docstring)."""
    import importlib.util

    # the path prox_2of4 takes for float32 cells (nmprune.prox.two_four)
    kernel = "numba (CPU)" if device.type == "cpu" else \
        "triton" if importlib.util.find_spec("triton") is not None else "torch float64"

    # one shape at a time in its own call: its tensors are freed before the next one's
    return [_prox_row(device, d_out, d_in, kernel, repeats) for d_out, d_in in shapes]


def _prox_row(device: torch.device, d_out: int, d_in: int, kernel: str, repeats: int) -> dict:
    """Part 0 on one layer shape."""
    from nmprune.prox import prox_2of4

    w, h, mean = (t.to(device) for t in correlated_layer(d_out, d_in, seed=2))
    z = w + 0.01 * torch.randn_like(w)
    lam = torch.tensor(float(z.abs().median()) ** 3, device=device)  # near the median threshold
    cells = z.reshape(-1, 4)
    h_low, diff = h.to(torch.bfloat16), (z - w).to(torch.bfloat16)
    gradient = _timed(lambda: torch.mm(diff, h_low), device, repeats)
    prox = _timed(lambda: prox_2of4(cells, lam), device, repeats)
    method = _timed(lambda: _solve(w, h, mean, "prox", None), device, max(1, repeats // 2))
    whole = _timed(lambda: _solve(w, h, mean, "prox", "exact"), device, max(1, repeats // 2))
    row = {"shape": [d_out, d_in], "kernel": kernel,
           "gradient_product_seconds": gradient, "prox_seconds": prox,
           "prox_over_gradient": prox / gradient, "prox_method_seconds": method,
           "exact_refine_seconds": whole - method, "prox_exact_seconds": whole}
    if kernel == "triton":
        row["issue_efficiency"] = _issue_efficiency(device, cells, lam, prox)
    return row


def _issue_efficiency(device: torch.device, cells: torch.Tensor, lam: torch.Tensor, seconds: float) -> float:
    """The share of the device's issue rate the Triton prox reached on ``cells`` in
    ``seconds``: its instructions on them (its sm_90 machine code and the loops' trips it
    reports, as benchmarks/prox_kernel_cost.py counts them) over the time at the full rate of
    this device's SMs (4 warp instructions per clock at 1.98 GHz, an H200's). The estimate in
    prox_kernel_cost.md assumes 0.5."""
    from prox_kernel_cost import CLOCK_HZ, ISSUE_PER_CLOCK, kernel_sass, loop_structure, per_program

    from nmprune.prox.two_four_triton import BLOCK, loop_counts

    trips = loop_counts(cells.float(), lam.float().expand(cells.shape[0]).contiguous()).cpu()
    instructions = float(per_program(loop_structure(kernel_sass()[0]), trips).sum()) * BLOCK / 32  # warp instructions
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return instructions / (sms * ISSUE_PER_CLOCK * CLOCK_HZ) / seconds


def report_markdown(result: dict) -> str:
    """The results (the parts done so far) as Markdown tables."""
    lines = [f"# Layer solvers on {result['device_name']}", "",
             f"Device `{result['device']}`{' (CPU fallback: no CUDA here)' if result['fallback'] else ''}, "
             f"torch {result['torch']}, CPU {result['cpu']['model']} ({result['cpu']['llvm_target']}); "
             f"shapes divided by {result['scale']}. Seconds per part: "
             + ", ".join(f"{k} {v:.0f}" for k, v in result["seconds"].items()) + ".", ""]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    for name, trace in result.get("failed", {}).items():
        lines += [f"## Part {name} FAILED", "", "```", trace.rstrip(), "```", ""]
    if "prox" in result:
        lines += ["## The 2:4 prox of a whole layer against one gradient product", "",
                  "| shape | prox kernel | gradient product s (bf16) | prox s | prox / product | "
                  "prox method s | exact refinement s | kernel's share of the issue rate |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['shape'][0]}x{r['shape'][1]} | {r['kernel']} | {r['gradient_product_seconds']:.4f} | "
                  f"{r['prox_seconds']:.4f} | {r['prox_over_gradient']:.2f} | {r['prox_method_seconds']:.2f} | "
                  f"{r['exact_refine_seconds']:.2f} | "
                  + (f"{r['issue_efficiency']:.2f} |" if "issue_efficiency" in r else "- |") for r in result["prox"]]
        lines.append("")
    if "agreement" in result:
        lines += ["## Agreement with the CPU", "",
                  "| method | refine | shape | same mask cells | loss CPU | loss device | rel. diff |",
                  "|---|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['method']} | {r['refine'] or '-'} | {r['shape'][0]}x{r['shape'][1]} | "
                  f"{r['same_mask_cells']:.4f} | {r['loss_cpu']:.6g} | {r['loss_device']:.6g} | "
                  f"{r['loss_rel_diff']:.2e} |" for r in result["agreement"]]
    if "pipeline" in result:
        lines += ["", f"## The whole pipeline ({result['pipeline_model']}), against the CPU", "",
                  "| device | dtype | streamed | perplexity | rel. diff | seconds | peak device MiB |",
                  "|---|---|---|---|---:|---:|---:|"]
        for r in result["pipeline"]:
            ppl = ", ".join(f"{k}: {v:.4f}" for k, v in r["perplexity"].items())
            lines.append(f"| {r['device']} | {r['dtype']} | {'yes' if r['streamed'] else 'no'} | {ppl} | "
                         f"{r['perplexity_rel_diff']:.2e} | {r['seconds']:.1f} | {mib(r['peak_device_bytes'])} |")
    if "speed" in result:
        lines += ["", "## Solve time and peak device memory", "",
                  "| method | refine | shape | median s | peak device MiB |", "|---|---|---|---:|---:|"]
        lines += [f"| {r['method']} | {r['refine'] or '-'} | {r['shape'][0]}x{r['shape'][1]} | "
                  f"{r['seconds_median']:.3f} | {mib(r['peak_device_bytes'])} |" for r in result["speed"]]
    if "block" in result:
        rows = result["block"]
        lines += ["", "## One Llama-3.1-8B-shaped block: wanda, then block reconstruction (bfloat16 weights)", "",
                  "| samples x tokens | training | layer solves s | reconstruction s | steps | held-out error "
                  "before | held-out after | kept | peak device MiB |", "|---|---|---:|---:|---:|---:|---:|---|---:|"]
        lines += [f"| {b['settings']['nsamples']} x {b['settings']['seqlen']} | {b['train_dtype']} | "
                  f"{b['layer_seconds']:.1f} | {b['reconstruction_seconds']:.1f} | {b['steps']} | "
                  f"{b['heldout_before']:.4g} | {b['heldout_after']:.4g} | {b['kept']} | "
                  f"{mib(b['peak_device_bytes'])} |" for b in rows]
        lines += ["", f"Reconstruction in {rows[0]['train_dtype']} over {rows[-1]['train_dtype']}: "
                  f"{rows[0]['reconstruction_seconds'] / rows[-1]['reconstruction_seconds']:.2f}x the time "
                  "(resources.BF16_TRAINING_SPEEDUP prices bfloat16 training on this device kind)."]
    if "step" in result:
        lines += ["", "## A reconstruction step's costs beside its products (one 8B-shaped block, 2:4)", "",
                  "| trained weights | kept entries | passes on "
                  f"{result['step'][0]['tokens']} tokens s | optimiser s | compaction s | "
                  "s per weight (planned) | s per kept entry (planned) |", "|---:|---:|---:|---:|---:|---|---|"]
        lines += [f"| {r['trained_weights']} | {r['kept_entries']} | {r['passes_seconds']:.4f} | "
                  f"{r['optimiser_seconds']:.4f} | {r['compaction_seconds']:.4f} | "
                  f"{r['per_parameter']:.3g} ({r['planned_per_parameter']:.3g}) | "
                  f"{r['per_entry']:.3g} ({r['planned_per_entry']:.3g}) |" for r in result["step"]]
        lines += ["", "The planned figures are resources.STEP_COSTS for this device kind."]
    if "job" in result:
        rows = result["job"]
        lines += ["", "## The default job on a two-block Llama-3.1-8B-shaped model (bfloat16, streamed), "
                  "against its plan", "",
                  f"{rows[0]['settings']['nsamples']} x {rows[0]['settings']['seqlen']} calibration tokens.", "",
                  "| stage | planned s | measured s | measured / planned |", "|---|---:|---:|---:|"]
        lines += [f"| {r['stage']} | {r['planned_seconds']:.1f} | {r['measured_seconds']:.1f} | "
                  + (f"{r['measured_seconds'] / r['planned_seconds']:.2f} |" if r["planned_seconds"] else "- |")
                  for r in rows]
        lines += ["", f"Peak device memory: {mib(rows[-1]['peak_device_bytes'])} MiB."]
    if "distill" in result:
        rows = result["distill"]
        lines += ["", "## The global distillation's lean pass on a two-block Llama-3.1-8B-shaped model (bfloat16)",
                  "", f"One epoch on {rows[0]['windows']} x {rows[0]['seqlen']} tokens, one window a step; the "
                  "peak is the rise over the model on the device, the plan's is distill_bytes less the model.", "",
                  "| blocks checkpointed | steps | s | peak MiB | planned MiB | KL first -> last epoch |",
                  "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {'yes' if r['checkpointed'] else 'no'} | {r['steps']} | {r['seconds']:.1f} | "
                  f"{mib(r['peak_device_bytes'])} | {mib(r['planned_peak_bytes'])} | "
                  f"{r['first_epoch_kl']:.4f} -> {r['last_epoch_kl']:.4f} |" for r in rows]
    if "sharded" in result:
        rows = result["sharded"]
        lines += ["", "## The pass sharded with FSDP2 (one rank) on the same model", "",
                  "| ranks | steps | s | peak MiB | KL first -> last epoch | kept | mask held |",
                  "|---:|---:|---:|---:|---|---|---|"]
        lines += [f"| {r['ranks']} | {r['steps']} | {r['seconds']:.1f} | {mib(r['peak_device_bytes'])} | "
                  f"{r['first_epoch_kl']:.4f} -> {r['last_epoch_kl']:.4f} | {r['kept']} | {r['mask_held']} |"
                  for r in rows]
    return "\n".join(lines) + "\n"


def _write(result: dict, out: Path) -> None:
    """Write what is done so far, so that a run stopped at its time limit leaves its parts."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "gpu.md").write_text(report_markdown(result))


PARTS = ("prox", "agreement", "pipeline", "speed", "block", "step", "job", "distill", "sharded")
#: the block part's training precisions: float32, then bfloat16 products (--train-precision)
BLOCK_PRECISIONS = ("full", "bfloat16")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=int, help="divide every shape by this (default 1 on a GPU, "
                        "16 on the CPU)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, of {', '.join(PARTS)} (default all)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other parts of an earlier gpu.json in --out (same device)")
    parser.add_argument("--model", type=Path, help="safetensors model directory for the pipeline "
                        "part (default: the packaged SmolLM2, saved as safetensors)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory for the block and job parts "
                        "(default: the pipeline model's)")
    parser.add_argument("--calib", default="wiki", help="calibration and evaluation text (default wiki)")
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--eval-max-tokens", dest="eval_max_tokens", type=int, default=4096)
    parser.add_argument("--block-nsamples", dest="block_nsamples", type=int,
                        help="calibration samples of the block and job parts (Llama-3.1-8B-shaped "
                        "blocks; default 128 on a GPU, 8 on the CPU)")
    parser.add_argument("--block-seqlen", dest="block_seqlen", type=int,
                        help="their length (default 2048 on a GPU, 128 on the CPU)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    device = torch.device(args.device)
    fallback = device.type != "cuda"
    scale = args.scale or (16 if fallback else 1)
    shapes = [(d_out // scale, d_in // scale) for d_out, d_in in LLAMA_8B_SHAPES]
    result = {
        "device": str(device), "fallback": fallback, "scale": scale, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if not fallback else "the CPU",
        "cpu": cpu_description(), "seconds": {},
    }
    earlier = args.out / "gpu.json"
    if args.merge and earlier.exists():
        old = json.loads(earlier.read_text())
        if (old["device_name"], old["scale"]) != (result["device_name"], scale):
            parser.error(f"{earlier} is of {old['device_name']} at scale {old['scale']}, not of "
                         f"{result['device_name']} at scale {scale}: nothing to merge")
        result = {**old, **{k: v for k, v in result.items() if k != "seconds"}}

    def part(name: str, compute) -> None:
        """Run one part; a part that fails is recorded (its traceback) and the next one runs."""
        start = time.perf_counter()
        result.pop(name, None)
        result["failed"] = {k: v for k, v in result.get("failed", {}).items() if k != name}
        try:
            result[name] = compute()
        except Exception:  # noqa: BLE001 -- the check reports every path, the failing ones too
            result["failed"][name] = traceback.format_exc()
            print(f"gpu_check: part {name} failed:\n{result['failed'][name]}", file=sys.stderr)
        result["seconds"][name] = time.perf_counter() - start
        _write(result, args.out)

    settings = {"calib": args.calib, "eval": [args.calib], "nsamples": args.nsamples,
                "seqlen": args.seqlen, "eval_seqlen": args.seqlen, "eval_max_tokens": args.eval_max_tokens}
    # the block and job parts: Llama-3.1-8B-shaped blocks on the issue's calibration tokens
    block_settings = {**settings, "eval": [], "nsamples": args.block_nsamples or (8 if fallback else 128),
                      "seqlen": args.block_seqlen or (128 if fallback else 2048)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None and ("pipeline" in parts or {"block", "job"} & set(parts) and args.tokenizer is None):
            model_dir = packaged_model_dir(Path(tmp))
        for name in parts:
            if name == "prox":
                part(name, lambda: prox_kernel(device, shapes, args.repeats))
            elif name == "agreement":
                part(name, lambda: agreement(device, *AGREEMENT_SHAPE[fallback]))
            elif name == "pipeline":
                result["pipeline_model"] = "SmolLM2-135M-Instruct" if args.model is None else model_dir.name
                result["pipeline_settings"] = settings
                part(name, lambda: pipeline(device, model_dir, Path(tmp), settings))
            elif name == "speed":
                part(name, lambda: speed(device, shapes, args.repeats))
            elif name == "step":
                part(name, lambda: step_costs(device, scale, args.repeats))
            elif name == "distill":
                part(name, lambda: distillation(device, scale, block_settings))
            elif name == "sharded":
                part(name, lambda: sharded_distillation(device, scale, block_settings))
            elif name == "job":
                part(name, lambda: default_job(device, args.tokenizer or model_dir, Path(tmp), block_settings,
                                               scale))
            else:
                part(name, lambda: block_reconstruction(
                    device, block_model_dir(Path(tmp), args.tokenizer or model_dir, scale), Path(tmp),
                    block_settings))
    return result


if __name__ == "__main__":
    main()
