"""Downstream accuracy through lm-evaluation-harness (nmprune.downstream, nmprune.tasks):
the offline tasks load and score on a tiny random model, the in-memory path equals lm-eval's
own ``hf`` path on a saved pruned model, the CLI reports accuracies beside perplexities, and
bad requests are one-line errors before any model loads. Offline (see conftest.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="nmprune[eval] (lm-eval) is part of the dev install")

from nmprune.cli import main  # noqa: E402
from nmprune.downstream import (  # noqa: E402
    OFFLINE_TASKS,
    TASKS_DIR,
    DownstreamSettings,
    check_tasks,
    evaluate_tasks,
    results_of,
    task_manager,
)
from test_models_tiny import tiny_config, tiny_tokenizer, write_text  # noqa: E402

LIMIT = 12
#: The task versions the YAML files declare (cloze 2.0: the space before the target word is
#: part of the scored continuation).
VERSIONS = {t: "2.0" if t.endswith("_cloze") else "1.0" for t in OFFLINE_TASKS}


def _long_context_model(seed: int = 0):
    """A tiny random Llama whose positions reach past the longest task item (~1000 tokens of
    the tiny byte-level tokenizer)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.max_position_embeddings = 2048
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("downstream")
    text = write_text(base / "text.txt")
    return _long_context_model(), tiny_tokenizer(text.read_text()), base, text


def _records(task: str) -> list[dict]:
    name = task.removeprefix("nmprune_")
    with open(TASKS_DIR / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_task_files_hold_a_few_hundred_well_formed_items():
    for task in OFFLINE_TASKS:
        records = _records(task)
        assert 200 <= len(records) <= 1000, task
        assert [r["id"] for r in records] == list(range(len(records)))
        for r in records:
            assert r["context"].strip()
            if task.endswith("_cloze"):
                assert r["target"].isalpha() and r["context"] == r["context"].rstrip()
            else:
                assert len(r["endings"]) == 4 and len(set(r["endings"])) == 4
                assert 0 <= r["label"] < 4


def test_offline_tasks_score_through_lm_eval_on_a_tiny_model(tiny):
    model, tok, _, _ = tiny
    settings = DownstreamSettings(["nmprune"], limit=LIMIT, batch_size=4)  # the tag of all four
    assert check_tasks(settings) == VERSIONS
    result = evaluate_tasks(model, tok, settings)
    assert set(result) == set(OFFLINE_TASKS)
    for task, metrics in result.items():
        assert metrics["n"] == LIMIT and metrics["version"] == VERSIONS[task]
        assert 0.0 <= metrics["acc"] <= 1.0
        if task.endswith("_next"):
            assert 0.0 <= metrics["acc_norm"] <= 1.0 and "acc_norm_stderr" in metrics
    assert model.training is False


def test_requests_score_exactly_the_item_text():
    """The (context, continuation) pairs lm-eval scores are the item's context and ``" " +``
    the target word or each ending, for every item of every task (lm-eval joins no
    delimiter into a loglikelihood continuation itself: a target without its space would
    be scored glued to the last context word)."""
    from lm_eval.tasks import get_task_dict

    tasks = get_task_dict(list(OFFLINE_TASKS), task_manager(OFFLINE_TASKS))
    for name, task in tasks.items():
        task.build_all_requests(limit=None, rank=0, world_size=1)
        records = {r["id"]: r for r in _records(name)}
        pairs: dict[int, list] = {}
        for inst in task.instances:
            pairs.setdefault(inst.doc["id"], []).append(inst.args)
        assert set(pairs) == set(records), name
        for i, args in pairs.items():
            r = records[i]
            wanted = [" " + r["target"]] if "target" in r else [" " + e for e in r["endings"]]
            assert args == [(r["context"], c) for c in wanted], (name, i, args)


def test_uniform_model_picks_the_ending_with_fewest_tokens(tiny):
    """With all logits equal every token costs log V: ``acc`` must pick the ending of fewest
    continuation tokens and ``acc_norm`` the one of most bytes per token, on the very items of
    the JSON-lines file (so lm-eval reads our context, endings and label)."""
    import copy
    import math

    model, tok, _, _ = tiny
    uniform = copy.deepcopy(model)
    with torch.no_grad():
        uniform.lm_head.weight.zero_()
    task = "nmprune_wiki_next"
    got = evaluate_tasks(uniform, tok, DownstreamSettings([task], limit=LIMIT))[task]
    acc = acc_norm = 0
    for r in _records(task)[:LIMIT]:
        ctx = tok(r["context"])["input_ids"]
        counts = [len(tok(r["context"] + " " + e)["input_ids"]) - len(ctx) for e in r["endings"]]
        nbytes = [len((" " + e).encode()) for e in r["endings"]]
        acc += min(range(4), key=lambda i: counts[i]) == r["label"]
        acc_norm += max(range(4), key=lambda i: -counts[i] * math.log(320) / nbytes[i]) == r["label"]
    assert got["acc"] == pytest.approx(acc / LIMIT) and got["acc_norm"] == pytest.approx(acc_norm / LIMIT)


def test_in_memory_path_equals_lm_eval_hf_path_on_a_saved_pruned_model(tiny, tmp_path):
    from lm_eval import simple_evaluate

    from nmprune.pattern import is_nm_sparse
    from nmprune.pipeline import prune_model

    _, tok, _, _ = tiny
    model = _long_context_model(seed=1)
    g = torch.Generator().manual_seed(0)
    prune_model(model, calibration=torch.randint(0, 320, (4, 32), generator=g), device="cpu",
                method="wanda", refine=None, progress=False)
    assert is_nm_sparse(model.model.layers[0].mlp.down_proj.weight, "2:4")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    task = "nmprune_wiki_next"
    settings = DownstreamSettings([task], limit=LIMIT, batch_size=4)
    in_memory = evaluate_tasks(model, tok, settings)[task]
    out = simple_evaluate(model="hf", model_args=f"pretrained={tmp_path},device=cpu,batch_size=4",
                          tasks=[task], limit=LIMIT, task_manager=task_manager([task]),
                          log_samples=False, bootstrap_iters=0)
    from_disk = results_of(out)[task]
    assert from_disk["n"] == in_memory["n"] == LIMIT
    assert from_disk["acc"] == in_memory["acc"] and from_disk["acc_norm"] == in_memory["acc_norm"]


def test_settings_reject_bad_options(tmp_path):
    with pytest.raises(ValueError, match="--limit must be a positive integer"):
        DownstreamSettings(["nmprune_wiki_next"], limit=0)
    with pytest.raises(ValueError, match="--num-fewshot must be an integer >= 0"):
        DownstreamSettings(["nmprune_wiki_next"], num_fewshot=-1)
    with pytest.raises(ValueError, match="--batch-size"):
        DownstreamSettings(["nmprune_wiki_next"], batch_size=0)
    with pytest.raises(ValueError, match="is not a folder"):
        DownstreamSettings(["nmprune_wiki_next"], include_path=[str(tmp_path / "none")])
    with pytest.raises(ValueError, match="no lm-eval task given"):
        check_tasks(DownstreamSettings([]))
    with pytest.raises(ValueError, match="unknown lm-eval task 'no_such_task'"):
        check_tasks(DownstreamSettings(["nmprune_wiki_next", "no_such_task"]))


def _user_tasks(folder):
    """An include-path folder: a copy of our wiki_next task under another name with its data
    file absent, and a task naming a Hugging Face dataset that is not in the cache."""
    folder.mkdir()
    shutil.copy(TASKS_DIR / "local_data.py", folder)
    yaml = (TASKS_DIR / "wiki_next.yaml").read_text().replace("nmprune_wiki_next", "my_copy")
    (folder / "my_copy.yaml").write_text(yaml.replace("tag: [nmprune]\n", ""))
    (folder / "hub_task.yaml").write_text(
        "task: my_hub_task\ndataset_path: nmprune-tests/not-downloaded\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{c}}'\ndoc_to_target: 0\n")
    return folder


def test_task_data_that_cannot_be_found_offline_is_named(tmp_path):
    folder = _user_tasks(tmp_path / "mine")
    with pytest.raises(ValueError, match=r"task 'my_copy' could not be loaded .*wiki_next.jsonl is missing"):
        check_tasks(DownstreamSettings(["my_copy"], include_path=[str(folder)]))
    with pytest.raises(ValueError, match=r"task 'my_hub_task' could not be loaded .*--include-path"):
        check_tasks(DownstreamSettings(["my_hub_task"], include_path=[str(folder)]))


def _one_line_error(capsys, needle: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("nmprune: error: ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("flags, needle", [
    (["--tasks", "no_such_task"], "unknown lm-eval task 'no_such_task'"),
    (["--tasks", "my_copy", "--include-path", "MINE"], "task 'my_copy' could not be loaded"),
    (["--tasks", "nmprune_wiki_next", "--limit", "0"], "--limit must be a positive integer"),
    (["--tasks", "nmprune_wiki_next", "--num-fewshot", "-1"], "--num-fewshot must be an integer >= 0"),
])
def test_bad_task_requests_fail_before_any_model_loads(flags, needle, tmp_path, capsys):
    """The model path does not exist: the error must be about the tasks, found first."""
    folder = str(_user_tasks(tmp_path / "mine"))
    flags = [folder if f == "MINE" else f for f in flags]
    missing_model = str(tmp_path / "no_model")
    assert main(["eval", "--model", missing_model, *flags]) == 2
    _one_line_error(capsys, needle)
    prune_flags = [f.replace("--tasks", "--eval-tasks") for f in flags]
    assert main(["prune", "--model", missing_model, "--out", str(tmp_path / "out"), *prune_flags]) == 2
    _one_line_error(capsys, needle)


def test_cli_error_is_one_line_without_traceback_in_a_real_process(tmp_path):
    """lm-eval indexes and loads the task in this process: nothing but our line reaches stderr."""
    folder = _user_tasks(tmp_path / "mine")
    proc = subprocess.run([sys.executable, "-m", "nmprune.cli", "prune", "--out", str(tmp_path / "o"),
                           "--eval-tasks", "nmprune_wiki_next,my_copy", "--include-path", str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("nmprune: error: the data of lm-eval task 'my_copy' could not be loaded")
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_eval_and_prune_report_accuracy_beside_perplexity(tiny, tmp_path, capsys):
    model, tok, base, text = tiny
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    task = "nmprune_austen_next"
    assert main(["eval", "--model", str(model_dir), "--tasks", task, "--limit", "4", "--quiet",
                 "--data", str(text), "--seqlen", "16", "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert f"{task} acc_norm% v1.0" in out and str(text) in out

    run = tmp_path / "pruned"
    assert main(["prune", "--model", str(model_dir), "--out", str(run), "--method", "wanda",
                 "--refine", "none", "--calib", str(text), "--nsamples", "4", "--seqlen", "16",
                 "--no-eval", "--eval-tasks", f"{task},nmprune_wiki_cloze",
                 "--limit", "4", "--eval-batch-size", "2", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "| dense |" in table and "| wanda" in table and "nmprune_wiki_cloze acc% v2.0" in table
    report = json.loads((run / "nmprune_report.json").read_text())
    down = report["downstream"]
    assert down["settings"] == {"tasks": [task, "nmprune_wiki_cloze"], "num_fewshot": None,
                                "limit": 4, "batch_size": 2, "include_path": []}
    for which in ("dense", "pruned"):
        assert set(down[which]) == {task, "nmprune_wiki_cloze"}
        assert down[which][task]["n"] == 4 and down[which][task]["version"] == "1.0"
    assert report["config"]["eval_tasks"] == [f"{task},nmprune_wiki_cloze"]


# ------------------------------------------------------------------ real model (slow)


def _smollm2():
    from nmprune.models import load_model

    model, tok, _ = load_model(None)
    return model, tok


@pytest.mark.slow
def test_smollm2_scores_above_chance_where_a_random_model_does_not():
    """Dense SmolLM2-135M beats chance on every offline task (cloze: chance ~0; four-way:
    25%, and "above" means by more than two standard errors of 100 items, 0.34); the same
    architecture with random weights does not."""
    from transformers import AutoModelForCausalLM

    model, tok = _smollm2()
    settings = DownstreamSettings(OFFLINE_TASKS, limit=100, batch_size=8)
    dense = evaluate_tasks(model, tok, settings)
    torch.manual_seed(0)
    random_model = AutoModelForCausalLM.from_config(model.config).eval()
    rand = evaluate_tasks(random_model, tok, settings)
    for task in OFFLINE_TASKS:
        if task.endswith("_cloze"):
            assert dense[task]["acc"] > 0.05 and rand[task]["acc"] < 0.05, (task, dense, rand)
        else:
            assert dense[task]["acc_norm"] > 0.34 and rand[task]["acc_norm"] < 0.34, (task, dense, rand)


@pytest.mark.slow
def test_lm_eval_command_line_matches_the_in_memory_path(tiny, tmp_path):
    """lm-eval's own CLI (``--model hf --model_args pretrained=DIR --include_path``)."""
    model, tok, _, _ = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    task = "nmprune_wiki_cloze"
    proc = subprocess.run(["lm_eval", "run", "--model", "hf", "--model_args",
                           f"pretrained={tmp_path / 'm'}", "--device", "cpu", "--tasks", task,
                           "--include_path", str(TASKS_DIR), "--limit", str(LIMIT),
                           "--output_path", str(tmp_path / "res")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = list((tmp_path / "res").rglob("results_*.json"))
    from_cli = results_of(json.loads(files[0].read_text()))[task]
    in_memory = evaluate_tasks(model, tok, DownstreamSettings([task], limit=LIMIT))[task]
    assert from_cli["acc"] == in_memory["acc"] and from_cli["n"] == LIMIT


@pytest.mark.slow
def test_lm_eval_task_without_local_data_is_a_clear_error_offline(tmp_path):
    """A task of lm-eval's own (HellaSwag) whose data is not in the cache, offline."""
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "nmprune.cli", "eval", "--tasks", "hellaswag"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "task 'hellaswag' could not be loaded" in proc.stderr and "--include-path" in proc.stderr
