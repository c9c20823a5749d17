"""What the Triton 2:4 prox kernel (nmprune.prox.two_four_triton) should cost on an H200,
estimated on a machine without a GPU, and the CUDA constant of the plan that follows from it
(issue 44: "marked as an estimate until a GPU runs it").

1. **Instructions.** Triton compiles the kernel for sm_90 (an H200) here, with its own
   ``ptxas``; ``cuobjdump`` lists the machine code. Its backward branches are the kernel's
   loops, in the order of :data:`~nmprune.prox.two_four_triton.LOOP_NAMES` (the last two inside
   the third); the code between a loop and the branch that skips it runs only when the loop
   does. What runs once per program, each loop's body and each loop's entry code are counted.
2. **Trips.** The default ``prox`` pruner runs on real SmolLM2-135M layers (Hessians from 16 x
   256 calibration tokens). At every iteration of its loop, ``PROGRAMS`` runs of 128 adjacent
   cells (one GPU program each) are drawn from the cells the prox gets (the pruner's prox wrapped for it), with their lambda; the
   kernel itself reports how often each loop ran on them (``loop_counts``, run in Triton's
   interpreter in a subprocess). The CPU kernel's time on all the iteration's cells is
   measured beside it.
3. **Time.** Instructions per cell, at the H200's issue rate (132 SMs, 4 warp instructions per
   clock, 1.98 GHz) times ``EFFICIENCY`` (assumed; the registers per thread, which bound the
   warps an SM holds, are reported), plus the loop's other work on every weight at ``ELEMENTWISE_BYTES`` per weight and
   ``BANDWIDTH``. Against one bfloat16 gradient product ``(Y - W*) H`` at the issue's measured
   rate (4096x14336 in about 2 ms on an H200). The ratio of the CPU kernel's seconds per
   weight to these is the plan's estimate for the prox's work on every weight on CUDA
   (:data:`nmprune.distributed.TRITON_ENTRY_SPEEDUP`).

No GPU runs here: the figures are estimates, and ``benchmarks/gpu_check.py --parts prox``
measures the real ones when a GPU is lent.

Writes benchmarks/results/prox_kernel_cost.{json,md}.
Run: flock /tmp/nmprune-bench.lock python benchmarks/prox_kernel_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from _machine import code_commit, cpu_description  # noqa: E402

from nmprune.prox import two_four_triton as k  # noqa: E402

LAYERS = ["model.layers.2.self_attn.q_proj", "model.layers.2.mlp.down_proj",
          "model.layers.15.self_attn.o_proj", "model.layers.15.mlp.gate_proj",
          "model.layers.28.self_attn.k_proj", "model.layers.28.mlp.down_proj"]
PROGRAMS = 8  # sampled programs of 128 cells per prox iteration
SMS, ISSUE_PER_CLOCK, CLOCK_HZ = 132, 4, 1.98e9  # H200 (GH100): warp instructions per SM per clock
EFFICIENCY = 0.5  # assumed share of the issue rate the kernel reaches (20 of 64 warps per SM at 96 registers)
ELEMENTWISE_BYTES = 100.0  # the loop's float32 reads and writes per weight and iteration besides the product
BANDWIDTH = 3.0e12  # bytes/s the H200 sustains (4.8e12 peak)
PRODUCT_FLOPS = 2 * 4096 * 14336 ** 2 / 2e-3  # the issue's bfloat16 (Y - W*) H at 4096x14336: ~2 ms
LLAMA_8B = [("q_proj/o_proj", 4096, 4096), ("k/v_proj", 1024, 4096), ("gate/up_proj", 14336, 4096),
            ("down_proj", 4096, 14336)]


def kernel_sass() -> tuple[str, int]:
    """The kernel's machine code for sm_90, compiled by Triton here (no GPU needed), and its
    registers per thread."""
    import triton

    compiled = k.compile_kernel(90)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "prox.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        dump = lambda flag: subprocess.run([str(tool), flag, str(cubin)], capture_output=True,  # noqa: E731
                                           text=True, check=True).stdout
        return dump("-sass"), int(re.search(r"REG:(\d+)", dump("-res-usage")).group(1))


def loop_structure(sass: str) -> dict:
    """Instructions of ``sass`` once per program (``base``), per trip of each loop (``body``,
    without the loops inside it) and per loop entered (``entry``: the code between the branch
    that skips the loop and the loop). Loops are the backward branches, in address order:
    three at the top level, the last holding two."""
    ins = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    branches = [(a, int(m.group(1), 16)) for a, text in ins if (m := re.search(r"BRA (?:!?P\d, )?(0x[0-9a-f]+)", text))]
    loops = sorted((target, a) for a, target in branches if target < a and a - target > 16)
    if len(loops) != len(k.LOOP_NAMES):
        raise SystemExit(f"expected {len(k.LOOP_NAMES)} loops in the kernel's SASS, found {len(loops)}: "
                         "the loop structure changed; update loop_structure")
    inner = [(s, e) for s, e in loops if any(s2 < s and e <= e2 for s2, e2 in loops)]
    top = [loop for loop in loops if loop not in inner]
    if len(top) != 3 or not all(top[2][0] < s and e <= top[2][1] for s, e in inner):
        raise SystemExit(f"unexpected loop nesting in the kernel's SASS: {loops}")
    size = lambda s, e: (e - s) // 16 + 1  # noqa: E731 (instructions from s to e inclusive)
    out = {"instructions": len(ins), "loops": {}}
    counted = 0
    for name, (s, e) in zip(k.LOOP_NAMES, loops):
        guards = [a for a, t in branches if a < s and e < t <= e + 0x40]
        entry = size(max(guards) + 16, s - 16) if guards and (s, e) in top else 0
        body = size(s, e) - sum(size(s2, e2) for s2, e2 in inner if s < s2 and e2 <= e)
        out["loops"][name] = {"body": body, "entry": entry}
        counted += body + entry
    out["base"] = len(ins) - counted
    return out


def per_program(structure: dict, trips: torch.Tensor) -> torch.Tensor:
    """Instructions each program runs (per thread = per warp) for its loop ``trips`` (programs, 5)."""
    total = torch.full((trips.shape[0],), float(structure["base"]), dtype=torch.float64)
    for j, name in enumerate(k.LOOP_NAMES):
        loop = structure["loops"][name]
        t = trips[:, j].double()
        total += t * loop["body"] + (t > 0).double() * loop["entry"]
    return total


def gpu_seconds_per_cell(instructions_per_thread: float) -> float:
    """At the H200's issue rate x EFFICIENCY: one thread per cell, 32 per warp instruction."""
    return instructions_per_thread / 32.0 / (SMS * ISSUE_PER_CLOCK * CLOCK_HZ * EFFICIENCY)


def record_layer(name: str, w: torch.Tensor, h: torch.Tensor, seed: int) -> dict:
    """The default prox (``prune_layer``, the run's default dampening) on one layer: every
    iteration's sampled programs (cells and lambda) and the CPU kernel's seconds on all of its
    cells."""
    from nmprune.algorithms import prox as prox_module
    from nmprune.config import PruneSettings
    from nmprune.solve import prune_layer

    g = torch.Generator().manual_seed(seed)
    cells, lams, cpu_seconds, n_cells = [], [], [], []
    kernel = prox_module.prox_2of4

    def recording_prox(z: torch.Tensor, lam: torch.Tensor, **options) -> torch.Tensor:
        flat = z.reshape(-1, 4)
        lam_c = lam.to(torch.float32).expand(flat.shape[0])
        start = time.perf_counter()
        out = kernel(z, lam, **options)
        cpu_seconds.append(time.perf_counter() - start)
        n_cells.append(flat.shape[0])
        runs = max(1, flat.shape[0] // k.BLOCK)
        for p in torch.randperm(runs, generator=g)[:PROGRAMS].tolist():
            cells.append(flat[p * k.BLOCK:(p + 1) * k.BLOCK].clone())
            lams.append(lam_c[p * k.BLOCK:(p + 1) * k.BLOCK].clone())
        return out

    prox_module.prox_2of4 = recording_prox  # the pruner's cell prox looks it up at each call
    try:
        prune_layer(w, h, "prox", damp=PruneSettings.damp)
    finally:
        prox_module.prox_2of4 = kernel
    return {"name": name, "shape": list(w.shape), "iterations": len(cpu_seconds), "cells": cells, "lams": lams,
            "cpu_seconds_per_cell": sum(cpu_seconds) / sum(n_cells)}


def interpreted_loop_counts(jobs: dict) -> dict:
    """``loop_counts`` of every job's programs, in a subprocess with TRITON_INTERPRET=1."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(jobs, Path(tmp) / "jobs.pt")
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, __file__, "--loop-counts", str(Path(tmp) / "jobs.pt"),
                        str(Path(tmp) / "out.pt")], env=env, check=True)
        return torch.load(Path(tmp) / "out.pt")


def _loop_counts_worker(jobs_path: str, out_path: str) -> None:
    jobs = torch.load(jobs_path)
    torch.save({name: torch.cat([k.loop_counts(z, lam, k.BLOCK) for z, lam in zip(*job)])
                for name, job in jobs.items()}, out_path)


def real_layers() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(W, H)`` of :data:`LAYERS` of the packaged SmolLM2 (16 x 256 wiki calibration tokens)."""
    from nmprune.data import calibration_batch
    from nmprune.models import load_model
    from nmprune.pipeline import collect_hessians
    model, tokenizer, _ = load_model()
    stats = collect_hessians(model, calibration_batch(tokenizer, "wiki", 16, 256, 0), device="cpu", progress=False)
    modules = dict(model.named_modules())
    return {n: (modules[n].weight.detach().float().clone(), stats[n].hessian()) for n in LAYERS}


def main() -> None:
    torch.manual_seed(0)
    start = time.time()
    sass, registers = kernel_sass()
    structure = loop_structure(sass) | {"registers": registers}
    from nmprune.prox import prox_2of4

    prox_2of4(torch.randn(4096, 4), 0.1)  # load the CPU kernel before it is timed
    layers = [record_layer(n, w, h, seed) for seed, (n, (w, h)) in enumerate(real_layers().items())]
    counts = interpreted_loop_counts({r["name"]: (r["cells"], r["lams"]) for r in layers})
    steps, halvings = k.ITER_CONVEX.value, k.CONVEX_HALVINGS.value
    caps = torch.tensor([[k.ITER_3SPARSE.value, k.CONVEX_PULLS.value, steps, steps * halvings, steps * halvings]],
                        dtype=torch.int32)  # every loop at its cap (LOOP_NAMES' order)
    worst = float(per_program(structure, caps)[0])
    rows = []
    for r in layers:
        trips = counts[r["name"]]
        instructions = float(per_program(structure, trips).mean())
        gpu_cell = gpu_seconds_per_cell(instructions)
        elementwise_cell = 4 * ELEMENTWISE_BYTES / BANDWIDTH
        rows.append({"layer": r["name"], "shape": r["shape"], "iterations": r["iterations"],
                     "programs": int(trips.shape[0]),
                     "mean_trips": {n: float(trips[:, j].double().mean()) for j, n in enumerate(k.LOOP_NAMES)},
                     "instructions_per_cell": instructions,
                     "gpu_kernel_seconds_per_cell": gpu_cell,
                     "cpu_kernel_seconds_per_cell": r["cpu_seconds_per_cell"],
                     "entries_speedup": r["cpu_seconds_per_cell"] / (gpu_cell + elementwise_cell)})
    mean_instructions = sum(r["instructions_per_cell"] for r in rows) / len(rows)
    speedups = sorted(r["entries_speedup"] for r in rows)
    llama = []
    for label, d_out, d_in in LLAMA_8B:
        cells = d_out * d_in / 4
        product = 2.0 * d_out * d_in * d_in / PRODUCT_FLOPS
        kernel = cells * gpu_seconds_per_cell(mean_instructions)
        llama.append({"layer": label, "shape": [d_out, d_in], "gradient_product_ms": 1e3 * product,
                      "prox_kernel_ms": 1e3 * kernel, "prox_kernel_worst_ms": 1e3 * cells * gpu_seconds_per_cell(worst),
                      "elementwise_ms": 1e3 * d_out * d_in * ELEMENTWISE_BYTES / BANDWIDTH,
                      "prox_over_product": kernel / product})
    result = {"commit": code_commit(), "cpu": cpu_description(), "threads": torch.get_num_threads(),
              "seconds": time.time() - start, "sass": structure, "worst_instructions_per_cell": worst,
              "mean_instructions_per_cell": mean_instructions, "layers": rows,
              "entries_speedup_median": speedups[len(speedups) // 2], "llama_8b": llama,
              "assumptions": {"sms": SMS, "issue_per_clock": ISSUE_PER_CLOCK, "clock_hz": CLOCK_HZ,
                              "efficiency": EFFICIENCY, "elementwise_bytes": ELEMENTWISE_BYTES,
                              "bandwidth": BANDWIDTH, "product_flops": PRODUCT_FLOPS}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prox_kernel_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "prox_kernel_cost.md").write_text(report(result))
    print(report(result))


def report(r: dict) -> str:
    s = r["sass"]
    loops = ", ".join(f"{n} {v['body']} (+{v['entry']} on entry)" for n, v in s["loops"].items())
    lines = [
        "# The Triton 2:4 prox on an H200, estimated without a GPU",
        "",
        f"Code {r['commit']}; the CPU side on {r['cpu']['model']} ({r['cpu']['llvm_target']}), "
        f"{r['threads']} threads; {r['seconds']:.0f} s. **Estimates**: no GPU ran the kernel "
        "(`benchmarks/prox_kernel_cost.py` says how they are made; `gpu_check.py --parts prox` "
        "measures them when a GPU is lent).",
        "",
        f"Machine code for sm_90 (Triton's compiler, here): {s['instructions']} instructions, "
        f"{s['registers']} registers per thread; "
        f"{s['base']} once per program, per trip: {loops}. With every loop at its cap a cell "
        f"costs {r['worst_instructions_per_cell']:.0f} instructions (one thread per cell).",
        "",
        f"## Real SmolLM2 layers, default prox: the loops' trips per program of {k.BLOCK} cells",
        "",
        "| layer | shape | iterations | programs | 3-sparse steps | pulls | dense steps | line search | slide "
        "| instructions / cell | GPU ns / cell | CPU ns / cell | CPU / GPU per weight |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["layers"]:
        t = x["mean_trips"]
        lines.append(f"| {x['layer']} | {x['shape'][0]}x{x['shape'][1]} | {x['iterations']} | {x['programs']} "
                     f"| {t['newton3']:.2f} | {t['pulls']:.2f} | {t['convex_steps']:.2f} | {t['line_search']:.2f} "
                     f"| {t['slide']:.2f} | {x['instructions_per_cell']:.0f} | {1e9 * x['gpu_kernel_seconds_per_cell']:.3f} "
                     f"| {1e9 * x['cpu_kernel_seconds_per_cell']:.2f} | {x['entries_speedup']:.0f}x |")
    a = r["assumptions"]
    lines += [
        "",
        f"GPU time: instructions / 32 per warp at {a['sms']} SMs x {a['issue_per_clock']} warp instructions "
        f"per clock x {a['clock_hz'] / 1e9:.2f} GHz x efficiency {a['efficiency']} (assumed). The last column "
        f"adds the loop's other work on every weight ({a['elementwise_bytes']:.0f} bytes per weight at "
        f"{a['bandwidth'] / 1e12:.1f} TB/s) to the GPU side: median **{r['entries_speedup_median']:.0f}x**, "
        "the plan's CUDA speed-up of the prox's work on every weight in the kernel (`nmprune.distributed.TRITON_ENTRY_SPEEDUP`).",
        "",
        "## Llama-3.1-8B shapes: one prox against one bfloat16 gradient product",
        "",
        f"At the mean {r['mean_instructions_per_cell']:.0f} instructions per cell of the layers above; the product "
        f"at {a['product_flops'] / 1e12:.0f} TFLOP/s (the issue's 4096x14336 in about 2 ms).",
        "",
        "| layer | shape | gradient product ms | prox kernel ms | every loop at its cap ms | other work on every weight ms | prox / product |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for x in r["llama_8b"]:
        lines.append(f"| {x['layer']} | {x['shape'][0]}x{x['shape'][1]} | {x['gradient_product_ms']:.2f} "
                     f"| {x['prox_kernel_ms']:.2f} | {x['prox_kernel_worst_ms']:.2f} | {x['elementwise_ms']:.2f} "
                     f"| {x['prox_over_product']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loop-counts", nargs=2, metavar=("JOBS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop_counts:
        _loop_counts_worker(*args.loop_counts)
    else:
        main()
