"""Local reconstruction on SmolLM2 (issue 32) and Gemma-3-270M (``--model gemma3``, after
``bash scripts/install.sh --gemma``): {wanda, sparsegpt, prox+exact} x {none,
submodule, block} with the main job's calibration (``PruneSettings`` defaults: 64 x 512 wiki
tokens), each row's wiki and Austen perplexity, the mean accuracy on nmprune's four offline
lm-eval tasks, the pruning stage's wall time and the process's peak RSS during the row.

One process loads the packaged model once and evaluates the dense model once; every row
restores the dense weights, prunes (``nmprune.prune_model``, timed) and evaluates. The peak
RSS of a row is the kernel's high-water mark (``VmHWM``) reset before the row
(``/proc/self/clear_refs``); it includes this script's float32 copy of the dense weights
(``dense_copy_bytes``). ``main_job_seconds`` adds the load and the wiki evaluations (dense and
pruned, measured here) to a row's pruning time: what ``nmprune prune`` with that row's
settings takes; rows are compared back to back on one CPU.

Each row is written to ``benchmarks/results/reconstruct/ROW.json`` as soon as it is done
and skipped by a later run (``--force`` redoes it), so a stopped run continues. The summary
is ``benchmarks/results/reconstruct.{json,md,png}`` (perplexity against wall time); Gemma-3's
rows and summary are ``reconstruct_gemma3/`` and ``reconstruct_gemma3.{json,md,png}``.

    flock /tmp/nmprune-bench.lock python benchmarks/reconstruct.py [--rows wanda:none,...]
        [--tasks-limit N] [--tasks-rows ROWS] [--force] [--lr 1e-3 --epochs 1 --batch 2]
    python benchmarks/reconstruct.py --rows prox+exact:block --sweep reconstruct_lr=2e-3 \\
        --sweep batch_size=1,reconstruct_batch_size=1
    python benchmarks/reconstruct.py --model gemma3 --rows prox+exact:none,prox+exact:block --no-tasks
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from _machine import code_commit, cpu_description

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: --model: the model (None: the packaged default), its name in titles, and its results' stem
MODELS = {"smollm2": (lambda: None, "SmolLM2-135M-Instruct", "reconstruct"),
          "gemma3": (lambda: __import__("nmprune.models").models.installed_gemma3(), "Gemma-3-270M",
                     "reconstruct_gemma3")}
ROWS_DIR = RESULTS / "reconstruct"
TITLE = "SmolLM2"  # the model of the sweep's table (main() sets both)
METHODS = {"wanda": ("wanda", None), "sparsegpt": ("sparsegpt", None), "prox+exact": ("prox", "exact")}
GRANULARITIES = ("none", "submodule", "block")
EVAL = ("wiki", "austen")
EVAL_TOKENS, EVAL_SEQLEN = 8192, 512


def reset_peak() -> None:
    """Start a new high-water mark of this process's resident set (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    """This process's resident-set high-water mark since :func:`reset_peak`, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class Bench:
    """The model loaded once, its dense weights, calibration and evaluation data."""

    def __init__(self, tasks_limit: int | None, model: str | None = None):
        import torch

        from nmprune.data import calibration_batch
        from nmprune.job import open_model
        from nmprune.config import PruneSettings

        t = time.perf_counter()
        self.source, self.tokenizer, _ = open_model(model, None, "auto", False)
        self.model = self.source.whole_model("the benchmark")
        self.load_seconds = time.perf_counter() - t
        self.commit = code_commit()  # the code this process runs, whatever is committed meanwhile
        self.dense = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.dense_bytes = sum(v.numel() * v.element_size() for v in self.dense.values())
        d = PruneSettings()
        self.calibration = calibration_batch(self.tokenizer, source=d.calib, nsamples=d.nsamples,
                                             seqlen=d.seqlen, seed=d.seed)
        self.cache: dict[str, Any] = {}
        self.tasks_limit = tasks_limit
        torch.manual_seed(0)

    def restore(self) -> None:
        self.model.load_state_dict(self.dense)

    def evaluate(self, tasks: bool = True) -> dict[str, Any]:
        """Perplexities (with the seconds of the wiki one), the offline tasks' accuracies and
        their mean (each task's headline metric; None without ``tasks``)."""
        from nmprune.downstream import OFFLINE_TASKS, DownstreamSettings, evaluate_tasks, headline
        from nmprune.job import evaluate

        ppl, seconds = {}, {}
        for name in EVAL:
            t = time.perf_counter()
            ppl.update(evaluate(self.source, self.tokenizer, [name], EVAL_SEQLEN, EVAL_TOKENS, "cpu", False,
                                self.cache))
            seconds[f"eval_{name}"] = time.perf_counter() - t
        if not tasks:
            return {"perplexity": ppl, "accuracy": None, "mean_accuracy": None, "tasks": None, "seconds": seconds}
        t = time.perf_counter()
        result = evaluate_tasks(self.model, self.tokenizer,
                                DownstreamSettings(OFFLINE_TASKS, limit=self.tasks_limit, batch_size=4))
        seconds["tasks"] = time.perf_counter() - t
        accuracy = {task: headline(m)[1] for task, m in result.items()}
        return {"perplexity": ppl, "accuracy": accuracy,
                "mean_accuracy": sum(accuracy.values()) / len(accuracy), "tasks": result, "seconds": seconds}


def row_name(method: str, granularity: str) -> str:
    return f"{method} / {granularity}"


def row_path(method: str, granularity: str) -> Path:
    return ROWS_DIR / f"{method.replace('+', '_')}_{granularity}.json"


def run_row(bench: Bench, method: str, granularity: str, fit: dict[str, Any], tasks: bool) -> dict[str, Any]:
    from nmprune.config import PruneSettings
    from nmprune.job import reconstruction_summary
    from nmprune.pipeline import distill_windows, prune_model

    name, refine = METHODS[method]
    bench.restore()
    settings = PruneSettings(method=name, refine=refine, reconstruct=granularity,
                             **({} if granularity == "none" else fit))
    reset_peak()
    t = time.perf_counter()
    # the global distillation's own windows, drawn as the job draws them (prune_model draws
    # none when it is given the calibration)
    extra = distill_windows(bench.tokenizer, settings) if settings.distill_passes() else None
    report = prune_model(bench.model, calibration=bench.calibration, distill_calibration=extra, device="cpu",
                         progress=False, settings=settings)
    prune_seconds = time.perf_counter() - t
    peak = peak_rss()
    result = bench.evaluate(tasks)
    blocks = report.blocks
    means = reconstruction_summary(settings, blocks, report.end_to_end)  # as the run's report has them
    return {"row": row_name(method, granularity), "method": method, "reconstruct": granularity,
            "settings": report.settings, "prune_seconds": prune_seconds,
            "layer_seconds": report.seconds["layers"],
            "reconstruct_seconds": sum(b["seconds"] for b in blocks),
            "peak_rss_bytes": peak, **result,
            **{f"mean_block_{k}": means[f"mean_{k}"]
               for k in ("error_before", "error_after", "heldout_before", "heldout_after")},
            "end_to_end": report.end_to_end, "distillation": report.distillation,
            "blocks": blocks, "machine": cpu_description(), "load_average": os.getloadavg(),
            "commit": bench.commit}


def parse_variant(text: str) -> dict[str, Any]:
    """``"KEY=VALUE,KEY=VALUE"`` as ``PruneSettings`` overrides (numbers parsed as numbers)."""
    variant: dict[str, Any] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        for kind in (int, float):
            try:
                variant[key.strip()] = kind(value)
                break
            except ValueError:
                continue
        else:
            variant[key.strip()] = value.strip()
    return variant


def variant_name(variant: dict[str, Any]) -> str:
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(variant.items()))


def sweep(bench: Bench, rows: list[tuple[str, str]], variants: list[dict[str, Any]], fit: dict[str, Any],
          dense: dict[str, Any]) -> None:
    """Each row with each variant of its settings (perplexities only; rows already written are
    skipped), into ``reconstruct/sweep/`` and the table ``reconstruct_sweep.md`` (Gemma-3: ``reconstruct_gemma3_sweep.md``), next to
    the grid's row of the same method and granularity (the defaults)."""
    folder = ROWS_DIR / "sweep"
    folder.mkdir(parents=True, exist_ok=True)
    for method, granularity in rows:
        for variant in variants:
            name = variant_name(variant)
            path = folder / f"{row_path(method, granularity).stem}_{name.replace('=', '').replace(',', '_')}.json"
            if not path.exists():
                record = run_row(bench, method, granularity, {**fit, **variant}, tasks=False)
                path.write_text(json.dumps({**record, "variant": variant}, indent=1, default=str))
                print(f"{record['row']} {name}: wiki {record['perplexity']['wiki']:.2f}", flush=True)
    records = [json.loads(f.read_text()) for f in folder.glob("*.json")]
    for method, granularity in rows:  # the grid's row of each: the defaults
        if row_path(method, granularity).exists():
            records.append({**json.loads(row_path(method, granularity).read_text()), "variant": {}})
    records.sort(key=lambda r: (r["row"], variant_name(r["variant"])))
    lines = [f"# Reconstruction settings on {TITLE} (2:4)", "",
             f"Calibration and settings as `benchmarks/results/reconstruct.md` except the ones named; "
             f"{records[0]['machine']['model']} ({records[0]['machine']['llvm_target']}). Dense wiki "
             f"{dense['perplexity']['wiki']:.2f}. Rows of the sweep may share the CPU with other work (each "
             "row's JSON holds the load average): compare their perplexities, and their times only with "
             "rows run alone. The defaults are those of each row's code (`distill_epochs: auto`, one epoch "
             "of global distillation after reconstruction, from 58dd905 on).", "",
             "| row | changed from the defaults | wiki | x dense | austen | prune s | code |",
             "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['row']} | {variant_name(r['variant']) or '(defaults)'} | {r['perplexity']['wiki']:.2f} | "
              f"{r['perplexity']['wiki'] / dense['perplexity']['wiki']:.3f} | {r['perplexity']['austen']:.2f} | "
              f"{r['prune_seconds']:.0f} | {r.get('commit') or 'not recorded'} |" for r in records]
    (RESULTS / f"{ROWS_DIR.name}_sweep.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{ROWS_DIR.name}_sweep.json").write_text(json.dumps(
        [{k: r[k] for k in ("row", "variant", "perplexity", "prune_seconds", "settings")} for r in records],
        indent=1, default=str) + "\n")


def plot(rows: list[dict[str, Any]], dense: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    markers = {"wanda": "o", "sparsegpt": "s", "prox+exact": "D"}
    colours = {"none": "tab:grey", "submodule": "tab:blue", "block": "tab:orange"}
    for r in rows:
        ax.scatter(r["main_job_seconds"] / 60, r["perplexity"]["wiki"], marker=markers[r["method"]],
                   color=colours[r["reconstruct"]], s=50, label=r["row"] + (" (time shared, see notes)" if r.get("note") else ""),
                   facecolors="none" if r.get("note") else None)
    ax.axhline(dense["perplexity"]["wiki"], color="black", lw=0.8, ls=":", label="dense")
    ax.axhline(2 * dense["perplexity"]["wiki"], color="tab:red", lw=0.8, ls="--", label="2x dense (target)")
    ax.set_xlabel("main job wall time (min; load + prune + wiki evaluations)")
    ax.set_ylabel("wiki perplexity (8192 held-out tokens)")
    ax.set_yscale("log")
    ax.set_title(f"{title} 2:4: reconstruction after pruning")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarise(bench_info: dict[str, Any], dense: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if r["method"] == "prox+exact" and r["reconstruct"] == "none"), None)
    for r in rows:
        r["main_job_seconds"] = bench_info["load_seconds"] + dense["seconds"]["eval_wiki"] + \
            r["prune_seconds"] + r["seconds"]["eval_wiki"]
    for r in rows:
        r["wall_vs_default"] = r["main_job_seconds"] / base["main_job_seconds"] if base else None
    stem = bench_info["stem"]
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"bench": bench_info, "dense": dense, "rows": rows}, indent=1, default=str))
    mib = 1 << 20
    acc = lambda r: f"{100 * r['mean_accuracy']:.1f}" if r["mean_accuracy"] is not None else "not run"
    items = "/".join(sorted({str(m.get("n", "?")) for m in (dense["tasks"] or {}).values()})) or "no"
    done = {(r["method"], r["reconstruct"]) for r in rows}
    missing = [row_name(m, g) for m in METHODS for g in GRANULARITIES if (m, g) not in done]
    lines = [
        f"# Local reconstruction on {bench_info['model']} (2:4)", "",
        f"CPU: {bench_info['machine']['model']} ({bench_info['machine']['llvm_target']}), 2 threads; "
        f"calibration {bench_info['calibration']}; reconstruction lr {bench_info['fit']['reconstruct_lr']:g}, "
        f"{bench_info['fit']['reconstruct_epochs']} epoch(s), the samples per step of each row; perplexity on the first "
        f"{EVAL_TOKENS} held-out tokens in windows of {EVAL_SEQLEN} (each starting with the tokenizer's "
        f"BOS where it adds one); accuracy: mean headline metric of "
        f"{', '.join(dense['accuracy'] or ['the offline tasks'])} ({items} items each; only in the rows that have it). "
        f"Peak RSS includes the "
        f"benchmark's copy of the dense weights ({bench_info['dense_copy_bytes'] / mib:.0f} MiB). "
        "Main job = load + dense and pruned wiki evaluation + pruning, the stages `nmprune prune` runs.", "",
        "Global distillation: the held-out KL from the dense model before -> after the pass, in rows of "
        "code where the default (`distill_epochs: auto`) makes one epoch after reconstruction.", "",
        "| row | samples / step | wiki ppl | x dense | austen ppl | mean acc % | block error before -> after "
        "| global distillation | prune s | main job min | vs prox+exact/none | peak RSS MiB | code |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| dense | | {dense['perplexity']['wiki']:.2f} | 1.00 | {dense['perplexity']['austen']:.2f} "
        f"| {acc(dense)} | | | | | | | |"]
    for r in rows:
        if r.get("mean_block_heldout_before") is not None:
            err = f"{r['mean_block_heldout_before']:.4f} -> {r['mean_block_heldout_after']:.4f} (held out)"
        elif r["mean_block_error_before"] is not None:  # rows of code before the held-out batches
            err = f"{r['mean_block_error_before']:.4f} -> {r['mean_block_error_after']:.4f}"
        else:
            err = ""
        vs = f"{r['wall_vs_default']:.2f}x" if r["wall_vs_default"] else ""
        distilled = r.get("distillation")
        kl = (f"{distilled['epochs']} epoch: {distilled['heldout_before']:.3f} -> {distilled['heldout_after']:.3f}"
              if distilled else "none")
        step = r["settings"]["reconstruct_batch_size"] if r["reconstruct"] != "none" else ""
        lines.append(f"| {r['row']} | {step} | {r['perplexity']['wiki']:.2f} | "
                     f"{r['perplexity']['wiki'] / dense['perplexity']['wiki']:.2f} | "
                     f"{r['perplexity']['austen']:.2f} | {acc(r)} | {err} | {kl} | "
                     f"{r['prune_seconds']:.0f} | {r['main_job_seconds'] / 60:.1f} | {vs} | "
                     f"{r['peak_rss_bytes'] / mib:.0f} | {r.get('commit', 'not recorded')} |")
    notes = [f"- {r['row']}: {r['note']}" for r in rows if r.get("note")]
    lines += ["", *notes] if notes else []
    if missing:
        lines += ["", f"Not run yet: {', '.join(missing)}."]
    lines += ["", f"![perplexity against wall time]({stem}.png)", ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    plot(rows, dense, RESULTS / f"{stem}.png", bench_info["model"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(f"{m}:{g}" for m in METHODS for g in GRANULARITIES),
                        help="METHOD:GRANULARITY,... (default: all nine)")
    parser.add_argument("--tasks-limit", type=int, default=None, help="items per task (default: all)")
    parser.add_argument("--tasks-rows", default=None,
                        help="METHOD:GRANULARITY,... that also get the offline tasks (default: every row)")
    parser.add_argument("--force", action="store_true", help="redo rows already written")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                        help="smollm2 (default, packaged) or gemma3 (scripts/install.sh --gemma)")
    parser.add_argument("--no-tasks", action="store_true", help="perplexities only, dense model included")
    parser.add_argument("--lr", type=float, default=None, help="reconstruction lr (default: the setting's)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="reconstruction batch size in samples")
    parser.add_argument("--sweep", action="append", default=None, metavar="KEY=VALUE,...",
                        help="run --rows with these settings changed instead (perplexities only), into "
                             "reconstruct[_gemma3]_sweep.{md,json}; repeat for more variants")
    args = parser.parse_args()
    import torch

    from nmprune.config import PruneSettings

    torch.set_num_threads(2)
    d = PruneSettings()
    fit = {"reconstruct_lr": args.lr or d.reconstruct_lr, "reconstruct_epochs": args.epochs or d.reconstruct_epochs,
           "reconstruct_batch_size": args.batch or d.reconstruct_batch_size or d.batch_size}
    wanted = [tuple(r.split(":")) for r in args.rows.split(",")]
    spec, title, stem = MODELS[args.model]
    global ROWS_DIR, TITLE
    ROWS_DIR, TITLE = RESULTS / stem, title
    ROWS_DIR.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.tasks_limit, spec())
    dense_path = ROWS_DIR / "dense.json"
    if dense_path.exists() and not args.force:
        dense = json.loads(dense_path.read_text())
    else:
        dense = bench.evaluate(tasks=not args.no_tasks)
        dense_path.write_text(json.dumps(dense, indent=1, default=str))
    print(f"dense: {dense['perplexity']} mean acc {dense['mean_accuracy']}", flush=True)
    if args.sweep:
        sweep(bench, wanted, [parse_variant(v) for v in args.sweep], fit, dense)
        return
    for method, granularity in wanted:
        path = row_path(method, granularity)
        if path.exists() and not args.force:
            continue
        record = run_row(bench, method, granularity, fit, not args.no_tasks and (
            args.tasks_rows is None or f"{method}:{granularity}" in args.tasks_rows.split(",")))
        path.write_text(json.dumps(record, indent=1, default=str))
        print(f"{record['row']}: wiki {record['perplexity']['wiki']:.2f} austen "
              f"{record['perplexity']['austen']:.2f} acc {record['mean_accuracy']} "
              f"prune {record['prune_seconds']:.0f}s peak {record['peak_rss_bytes'] >> 20} MiB", flush=True)
    rows = [json.loads(row_path(m, g).read_text()) for m in METHODS for g in GRANULARITIES
            if row_path(m, g).exists()]
    info = {"model": title, "stem": stem, "machine": cpu_description(), "load_seconds": bench.load_seconds,
            "dense_copy_bytes": bench.dense_bytes, "tasks_limit": args.tasks_limit, "fit": fit,
            "calibration": f"{d.calib} {d.nsamples} x {d.seqlen}, seed {d.seed}"}
    summarise(info, dense, rows)


if __name__ == "__main__":
    main()
