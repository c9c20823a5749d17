"""The README's main job, timed and measured: ``nmprune prune --out DIR`` on the packaged
SmolLM2-135M-Instruct with the default settings (issue targets: at most 15 minutes on this
2-core CPU; peak resident memory below twice the model's size plus its Hessians).

Runs the command as a subprocess, takes its peak RSS from ``getrusage(RUSAGE_CHILDREN)``
(exact, like ``/usr/bin/time -v``), reads the stage timings and perplexities from the run's
``nmprune_report.json``, and writes ``benchmarks/results/main_job.{json,md}`` (with extra
flags: ``main_job_<flags>.{json,md}``, for example the run without reconstruction that issue 32's
time target compares against, measured back to back, :data:`BASELINES`). The memory
bound counts the model in float32 (the size of the saved safetensors) and one float32
``d_in x d_in`` Hessian per distinct layer input of the decoder blocks (q/k/v and gate/up
share theirs), i.e. all the Hessians a dense-input run computes.

    flock /tmp/nmprune-bench.lock python benchmarks/main_job.py [extra nmprune prune flags]
    python benchmarks/main_job.py --rewrite   # main_job.{md,json} again, after a baseline's run
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _machine import code_commit, cpu_description

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LIMIT_SECONDS = 15 * 60


def hessian_bytes(report: dict) -> int:
    """float32 bytes of one Hessian per distinct block input (layers sharing an input share it)."""
    groups = {("qkv" if any(k in r["name"] for k in ("q_proj", "k_proj", "v_proj")) else
               "gateup" if any(k in r["name"] for k in ("gate_proj", "up_proj")) else r["name"],
               r["block"]): r["shape"][1] for r in report["layers"]}
    return sum(4 * d * d for d in groups.values())


#: the runs the default job's wall time is held against, run back to back on the same CPU: the
#: file of each (``main_job_<stem>.json``), what it ran, the issue that set the bound, and the
#: bound. Issue 45 bounds the time against the default job of the code it was filed on
#: (c8021ee), run by that commit's own copy of this script:
#: ``git worktree add --detach /tmp/old c8021ee && cd /tmp/old && PYTHONPATH=/tmp/old/src
#: python3 benchmarks/main_job.py``, its ``main_job.json`` copied to ``main_job_code_c8021ee.json``
BASELINES = (("reconstruct_none", "`--reconstruct none`", "issue 32", 2.0),
             ("code_c8021ee", "the default of c8021ee", "issue 45", 1.3))


def baseline_rows(res: dict, extra: list[str]) -> list[str]:
    """The rows of the default run's table that hold its wall time against each of
    :data:`BASELINES`; nothing when this run has extra flags, and none for a baseline whose
    file is missing or from another CPU."""
    rows = []
    for stem, flags, issue, bound in BASELINES if not extra else ():
        path = RESULTS / f"main_job_{stem}.json"
        if not path.exists():
            continue
        base = json.loads(path.read_text())
        if base["cpu"] != res["cpu"]:
            continue
        ratio = res["wall_seconds"] / base["wall_seconds"]
        res[f"vs_{stem}"] = ratio
        rows.append(f"| wall time vs {flags} ({base['wall_seconds'] / 60:.1f} min, code of "
                    f"{base.get('commit', '?')}; {issue}) | {ratio:.2f}x | {bound:g}x | {'yes' if ratio <= bound else 'NO'} |")
    return rows


def main(extra: list[str]) -> None:
    out = ROOT / "runs" / "main_job_bench"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(Path(f"{out}.checkpoint"), ignore_errors=True)
    cmd = ["nmprune", "prune", "--out", str(out), *extra]
    load = os.getloadavg()
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = usage.ru_maxrss * 1024
    report = json.loads((out / "nmprune_report.json").read_text())
    model_bytes = (out / "model.safetensors").stat().st_size
    hess = hessian_bytes(report)
    bound = 2 * model_bytes + hess
    res = {"command": " ".join(cmd), "extra": extra, "wall_seconds": wall,
           "cpu_seconds": usage.ru_utime + usage.ru_stime, "limit_seconds": LIMIT_SECONDS,
           "time_ok": wall <= LIMIT_SECONDS, "peak_rss_bytes": peak, "model_bytes": model_bytes,
           "hessian_bytes": hess, "memory_bound_bytes": bound, "memory_ok": peak < bound,
           "stage_seconds": report["seconds"], "perplexity": report["perplexity"],
           "summary": report["summary"], "method": report["config"]["method"],
           "refine": report["config"]["refine"], "reconstruct": report["config"]["reconstruct"],
           "cpus": os.cpu_count(), "cpu": cpu_description(),
           "load_average_start": load, "load_average_end": os.getloadavg(), "commit": code_commit()}
    write(res)


def write(res: dict) -> None:
    """``main_job[_<flags>].{md,json}`` of the run ``res`` (the table holds the run's wall time
    against each baseline measured so far, :func:`baseline_rows`)."""
    extra = res["extra"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "_".join(["main_job", *(a.strip("-").replace("=", "") for a in extra)])
    mb = 1 << 20
    st, wall, peak, load = res["stage_seconds"], res["wall_seconds"], res["peak_rss_bytes"], res["load_average_start"]
    model_bytes, hess, bound = res["model_bytes"], res["hessian_bytes"], res["memory_bound_bytes"]
    lines = ["# Main job: `" + res["command"].replace(str(ROOT) + "/", "") + "`", "",
             f"Packaged SmolLM2-135M-Instruct, default settings{' but ' + ' '.join(extra) if extra else ''} "
             f"({res['method']} + {res['refine']}"
             f"{', reconstruction ' + res['reconstruct'] if 'reconstruct' in res else ''}), code of {res['commit']}, "
             f"this 2-core CPU ({res['cpu']['model']}, LLVM target {res['cpu']['llvm_target']}); "
             f"load average {load[0]:.1f} at the start, {res['load_average_end'][0]:.1f} at the end.", "",
             "| target | measured | limit | met |", "|---|---|---|---|",
             f"| wall time | {wall / 60:.1f} min ({res['cpu_seconds'] / 60:.1f} CPU min) | "
             f"{LIMIT_SECONDS / 60:.0f} min | {'yes' if res['time_ok'] else 'NO'} |",
             *baseline_rows(res, extra),
             f"| peak RSS | {peak / mb:.0f} MiB | {bound / mb:.0f} MiB = 2 x model {model_bytes / mb:.0f} MiB "
             f"+ Hessians {hess / mb:.0f} MiB | {'yes' if res['memory_ok'] else 'NO'} |", "",
             "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in st.items() if isinstance(v, (int, float))]
    lines += [f"| prune: {k} | {v:.1f} |" for k, v in st.get("pipeline", {}).items()]
    ppl = res["perplexity"]
    lines += ["", f"Perplexity (first {ppl['max_tokens']} held-out tokens, windows of {ppl['seqlen']}):", "",
              "| model | " + " | ".join(ppl["dense"]) + " |", "|---|" + "---|" * len(ppl["dense"])]
    for name in ("dense", "pruned"):
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in ppl[name].values()) + " |")
    lines += ["", f"Mean layer loss relative to Wanda: {res['summary'].get('mean_loss_vs_wanda', float('nan')):.3f}"]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:] == ["--rewrite"]:  # the default run's files again, with the baselines measured since
        last = json.loads((RESULTS / "main_job.json").read_text())
        last.setdefault("extra", last["command"].split()[4:])  # files of before the script recorded it
        write(last)
    else:
        main(sys.argv[1:])
