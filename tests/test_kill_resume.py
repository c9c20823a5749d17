"""``kill -9`` at several points of ``nmprune prune`` (during calibration, mid-block, between
a block's checkpoint files, after the global distillation trained, during the final save), each followed by the same command again,
which resumes and is killed at the next point: the weights finally saved are bit-identical
to an uninterrupted run's, and a killed save never leaves a directory a loader would take
for a model. (One chain of kills, not one rerun per point: every process start costs
seconds.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from nmprune.cli import main
from test_models_tiny import save_tiny_model_dir, write_text

# Runs the CLI with one function wrapped to SIGKILL the process at its n-th call, before or
# after the call: argv = module, attribute (Class.method allowed), n, before|after, CLI args.
CHILD = """
import importlib, os, signal, sys
module, attribute, n, when = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
owner = importlib.import_module(module)
*path, name = attribute.split(".")
for part in path:
    owner = getattr(owner, part)
original, calls = getattr(owner, name), [0]
def wrapper(*args, **kwargs):
    calls[0] += 1
    if calls[0] == n and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = original(*args, **kwargs)
    if calls[0] == n and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return result
setattr(owner, name, wrapper)
from nmprune.cli import main
sys.exit(main(sys.argv[5:]))
"""

# The kills in the order they happen, each in a run resuming from the previous one's
# checkpoint: (what, module, attribute, n, when, blocks finished after the kill). The run has
# 3 blocks of 7 layers and 2 calibration batches per block; a resumed run starts counting
# calls again at its first unfinished block.
KILLS = [
    ("calibration of block 0", "nmprune.stages.statistics", "run_block", 2, "before", 0),
    ("mid-block 1 (3 of 7 layers pruned)", "nmprune.stages.executor", "run_job", 7 + 3, "after", 1),
    ("between block 2's files", "nmprune.checkpoint", "_save_tensors", 3, "after", 2),
    ("the global distillation, trained", "nmprune.stages.distillation", "fit_masked", 1, "after", 3),
    ("final save, after the weights", "transformers.tokenization_utils_base",
     "PreTrainedTokenizerBase.save_pretrained", 1, "before", 3),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The command's arguments and the uninterrupted run's weights."""
    base = tmp_path_factory.mktemp("kill")
    text = write_text(base / "text.txt")
    model = save_tiny_model_dir(base / "model", "llama", layers=3, text=text.read_text())
    settings = base / "run.yaml"  # evaluation on the small text only (no packaged wiki)
    settings.write_text(f"eval: ['{text}']\neval_seqlen: 16\neval_max_tokens: 128\n")
    args = ["prune", "--config", str(settings), "--model", str(model), "--method", "wanda",
            "--refine", "none", "--hessian-inputs", "pruned", "--calib", str(text), "--nsamples", "4",
            "--seqlen", "16", "--batch-size", "2", "--quiet"]
    assert main(args + ["--out", str(base / "straight")]) == 0
    return args, load_file(str(base / "straight" / "model.safetensors"))


@pytest.mark.slow  # a real kill -9 and two reruns: in `pytest -m slow` (test_cli and test_pipeline resume killed runs in the default suite)
def test_kill_9_then_rerun_is_bit_identical(run, tmp_path):
    args, reference = run
    out = tmp_path / "out"
    for what, module, attribute, n, when, finished in KILLS:
        killed = subprocess.run([sys.executable, "-c", CHILD, module, attribute, str(n), when,
                                 *args, "--out", str(out)],
                                cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert killed.returncode == -signal.SIGKILL, (what, killed.stderr)
        assert not out.exists(), what
        manifest = json.loads((tmp_path / "out.checkpoint" / "manifest.json").read_text())
        assert manifest["done_blocks"] == finished, what
        for d in [tmp_path, *tmp_path.glob("out*")]:
            assert not (d / "config.json").exists(), (what, d)
    # killed inside the save: staged, but not where a loader would look for a model
    assert (tmp_path / "out.partial" / "unfinished" / "model.safetensors").is_file()

    assert main([*args, "--out", str(out)]) == 0
    report = json.loads((out / "nmprune_report.json").read_text())
    assert report["resumed_from_block"] == 3
    assert report["distillation"]["epochs"] == 1  # the default's pass, made again from the checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # checkpoint and staging gone
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(weights[key], value), key


def test_a_pass_killed_after_saving_its_progress_resumes_from_it_to_the_same_model(run, tmp_path):
    """The global distillation saves its progress every round here (``SAVE_SECONDS = 0``); a
    kill -9 right after its second save, and the same command again: the rerun takes up the
    pass at its second round, not at its start, and saves the uninterrupted run's weights."""
    args, reference = run
    out = tmp_path / "out"
    saving = "import nmprune.stages.distillation as stage\nstage.SAVE_SECONDS = 0.0\n" + CHILD
    killed = subprocess.run([sys.executable, "-c", saving, "nmprune.stages.distillation", "SavedPass.save", "2",
                             "after", *args, "--out", str(out)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    manifest = json.loads((tmp_path / "out.checkpoint" / "manifest.json").read_text())
    assert manifest["done_blocks"] == 3 and manifest["extra"]["distillation"]["steps"] == 2
    assert [f for f in manifest["files"] if f.startswith("distillation_")] == ["distillation_1.safetensors"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads((out / "nmprune_report.json").read_text())
    assert report["distillation"]["resumed_from_step"] == 2 and report["distillation"]["steps"] > 2
    assert report["distillation"]["kept"] == "distilled"  # the trained weights are the ones compared
    weights = load_file(str(out / "model.safetensors"))
    for key, value in reference.items():
        assert torch.equal(weights[key], value), key


def _killed(args: list[str], cwd, module: str, attribute: str, n: int, when: str) -> None:
    killed = subprocess.run([sys.executable, "-c", CHILD, module, attribute, str(n), when, *args], cwd=cwd,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def test_finished_blocks_resume_under_other_pass_settings(run, tmp_path):
    """A run killed in the global distillation, its blocks finished, resumes with other
    settings of the pass (``--distill-lr``, ``--distill-epochs 0``) without redoing a block
    (issue 65 case 1: the checkpoint was refused as another run's); the pass itself starts
    afresh under its new settings."""
    args, _ = run
    out = tmp_path / "out"
    _killed([*args, "--out", str(out)], tmp_path, "nmprune.stages.distillation", "fit_masked", 1, "before")
    assert main([*args, "--out", str(out), "--distill-lr", "3e-3"]) == 0
    report = json.loads((out / "nmprune_report.json").read_text())
    assert report["resumed_from_block"] == 3 and report["distillation"]["lr"] == 3e-3

    again = tmp_path / "again"
    _killed([*args, "--out", str(again)], tmp_path, "nmprune.stages.distillation", "fit_masked", 1, "before")
    assert main([*args, "--out", str(again), "--distill-epochs", "0"]) == 0
    report = json.loads((again / "nmprune_report.json").read_text())
    assert report["resumed_from_block"] == 3 and not report.get("distillation")
    straight = tmp_path / "straight"
    assert main([*args, "--out", str(straight), "--distill-epochs", "0"]) == 0
    reference = load_file(str(straight / "model.safetensors"))
    weights = load_file(str(again / "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in reference.items())


def test_a_streamed_runs_checkpoint_resumes_in_memory_to_the_in_memory_runs_model(run, tmp_path):
    """A run with ``--offload`` (which makes no global distillation) killed mid-block 1, then
    the same command without it: the rerun computes the pass's dense distribution on the
    model still dense, keeps the finished block and saves what an uninterrupted in-memory run
    saves (issue 65 case 2: refused, "the checkpoint holds no dense distribution")."""
    args, reference = run
    out = tmp_path / "out"
    _killed([*args, "--out", str(out), "--offload"], tmp_path, "nmprune.stages.executor", "run_job", 7 + 3, "after")
    manifest = json.loads((tmp_path / "out.checkpoint" / "manifest.json").read_text())
    assert manifest["done_blocks"] == 1
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads((out / "nmprune_report.json").read_text())
    assert report["resumed_from_block"] == 1 and report["distillation"]["epochs"] == 1
    weights = load_file(str(out / "model.safetensors"))
    for key, value in reference.items():
        assert torch.equal(weights[key], value), key


def test_a_head_that_overflows_perplexity_is_refused_on_a_resumed_run_too(run, tmp_path, capsys):
    """A large but finite ``lm_head`` (x1e20) crashed with ``OverflowError: math range error``
    in the end-to-end check, the dense evaluation and ``nmprune eval``; the rerun of the killed
    prune skipped the check and saved the model (issue 65 case 6). Now the perplexity is
    infinite, and ``eval`` and a prune, resumed or not, refuse the model in one line."""

    from test_models_tiny import tiny_model, tiny_tokenizer

    args, _ = run
    text = args[args.index("--calib") + 1]
    model = tiny_model("llama", layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e20)
    directory = tmp_path / "big_head"
    model.save_pretrained(directory)
    tiny_tokenizer(open(text).read()).save_pretrained(directory)
    assert torch.isfinite(load_file(str(directory / "model.safetensors"))["lm_head.weight"]).all()

    assert main(["eval", "--model", str(directory), "--data", text, "--seqlen", "16", "--max-tokens", "128",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"the perplexity of {directory} on {text} is inf" in err, err

    argv = [*args, "--model", str(directory), "--no-eval", "--out", str(tmp_path / "out")]
    _killed(argv, tmp_path, "nmprune.stages.executor", "run_job", 7 + 3, "after")  # block 0 finished
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "the dense model's next-token distribution" in err and "not finite" in err
    assert not (tmp_path / "out").exists()
