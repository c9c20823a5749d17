"""Per-method cost factors for the distributed assignment (nmprune/distributed.py).

Times every method (no refiner) and every refiner (after Wanda) on the four layer shapes of
the packaged SmolLM2-135M's block 0 (q 576x576, k 192x576, gate 1536x576, down 576x1536),
with that block's real Hessians from a small calibration set, on one CPU thread (the thread
count each of two ranks gets on this 2-core machine). A solve's cost model is
``rows x d_in^2 x factor``; the factor of each method/refiner is the least-squares fit
through the origin, and the per-shape spread says how well the model holds.

Writes benchmarks/results/layer_costs.{json,md}. Run:
    flock /tmp/nmprune-bench.lock python benchmarks/layer_costs.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_description  # noqa: E402

from nmprune import methods, prune_layer, refiners  # noqa: E402
from nmprune.data import calibration_batch  # noqa: E402
from nmprune.models import find_blocks, load_model, weight_matrix  # noqa: E402
from nmprune.pipeline import collect_hessians  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj")
REPEATS = 3  # best of up to 3, while the runs so far took under a second


def _best(fn) -> float:
    times: list[float] = []
    while len(times) < REPEATS and sum(times) < 1.0:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(None)
    calib = calibration_batch(tokenizer, source="wiki", nsamples=8, seqlen=256, seed=0)
    hessians = collect_hessians(model, calib, device="cpu", batch_size=2, progress=False)
    blocks_name, blocks = find_blocks(model)
    layers = dict(blocks[0].named_modules())
    rows = []
    for sub in SHAPES:
        w = weight_matrix(layers[sub]).detach().float()
        h = hessians[f"{blocks_name}.0.{sub}"].hessian()
        size = w.shape[0] * w.shape[1] ** 2
        for method in methods():
            rows.append({"solver": method, "layer": sub, "shape": list(w.shape), "size": size,
                         "seconds": _best(lambda: prune_layer(w, h, method, damp=0.01))})
        for refine in refiners():
            seconds = min(prune_layer(w, h, "wanda", refine=refine, damp=0.01).seconds_refine
                          for _ in range(2))
            rows.append({"solver": f"refine:{refine}", "layer": sub, "shape": list(w.shape),
                         "size": size, "seconds": seconds})
        print(sub, "done", flush=True)
    factors, spread = {}, {}
    for solver in sorted({r["solver"] for r in rows}):
        mine = [r for r in rows if r["solver"] == solver]
        factors[solver] = sum(r["seconds"] * r["size"] for r in mine) / sum(r["size"] ** 2 for r in mine)
        ratios = [r["seconds"] / (factors[solver] * r["size"]) for r in mine]
        spread[solver] = [min(ratios), max(ratios)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "cpu": cpu_description(), "threads": 1, "rows": rows,
              "factors": factors, "spread": spread}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "layer_costs.json").write_text(json.dumps(result, indent=1))
    lines = ["# Layer solve costs: seconds per (rows x d_in^2)", "",
             f"Packaged SmolLM2-135M block 0 with real Hessians (8 x 256 wiki tokens), one CPU "
             f"thread, best of up to {REPEATS} runs (while under 1 s); {result['cpu']['model']}, commit {commit}. Other agents "
             "shared the machine. `spread`: measured / modelled seconds over the four shapes.", "",
             "| solver | factor (s) | spread | " + " | ".join(SHAPES) + " |",
             "|---|---|---|" + "---|" * len(SHAPES)]
    for solver, f in factors.items():
        secs = [f"{r['seconds']:.3f}" for r in rows if r["solver"] == solver]
        lines.append(f"| {solver} | {f:.3e} | {spread[solver][0]:.2f}-{spread[solver][1]:.2f} | "
                     + " | ".join(secs) + " |")
    (RESULTS / "layer_costs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
