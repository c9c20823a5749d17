"""A user's files are never lost and a resume never mixes two runs, at the command line:
nmprune deletes only what it marked as its own, ``--out`` and ``--checkpoint-dir`` stay
apart, a checkpoint resumes only on the model files and settings it was made with, a kill
before the first checkpoint or after the final rename needs no ``--restart``, a second run
on the same ``--out`` is refused while the first goes on unharmed, sequence lengths beyond
the model's positions are refused, and a full disk ends with exit code 1 and nothing that
blocks the rerun."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from nmprune.cli import main
from nmprune.output import MARKER
from test_kill_resume import CHILD
from test_models_tiny import save_tiny_model_dir, write_text


class _Crash(Exception):
    pass


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two tiny Llama directories (other weights, same layout), a text, and the argv of a
    quick prune of the first (without ``--out``)."""
    base = tmp_path_factory.mktemp("safety")
    text = write_text(base / "text.txt")
    model = save_tiny_model_dir(base / "model", "llama", layers=3, text=text.read_text())
    other = base / "other"
    shutil.copytree(model, other)
    from test_models_tiny import tiny_model

    tiny_model("llama", layers=3, seed=1).save_pretrained(other)
    args = ["prune", "--model", str(model), "--method", "wanda", "--refine", "none",
            "--calib", str(text), "--nsamples", "4", "--seqlen", "16", "--batch-size", "2",
            "--eval", str(text), "--eval-seqlen", "16", "--eval-max-tokens", "128", "--quiet"]
    return base, model, other, text, args


def _one_error(err: str, expected: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("nmprune: error:")]
    assert len(lines) == 1 and expected in lines[0], err


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _crash_after_block(i: int) -> None:
    if i == 0:
        raise _Crash


def _run_until_crash(args: list[str]) -> None:
    from nmprune.cli import build_parser, config_from_args
    from nmprune.job import run as run_prune

    with pytest.raises(_Crash):
        run_prune(config_from_args(build_parser().parse_args(args)), progress=False,
                  on_block_done=_crash_after_block)


# ----------------------------------------------------------------------------- ownership

@pytest.mark.parametrize("restart", [False, True])
def test_unmarked_checkpoint_dir_is_never_deleted(job, tmp_path, capsys, restart):
    *_, args = job
    mine = tmp_path / "my_folder"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    before = _listing(tmp_path)
    argv = args + ["--out", str(tmp_path / "o"), "--checkpoint-dir", str(mine)]
    assert main(argv + (["--restart"] if restart else [])) == 2
    _one_error(capsys.readouterr().err, "not made by nmprune")
    assert _listing(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["my_folder"]


def test_unmarked_partial_folder_is_never_deleted(job, tmp_path, capsys):
    *_, args = job
    mine = tmp_path / "o.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(args + ["--out", str(tmp_path / "o")]) == 2
    _one_error(capsys.readouterr().err, "o.partial exists and was not made by nmprune")
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["o.partial"]


@pytest.mark.parametrize("where", ["same", "inside out", "out inside"])
def test_overlapping_out_and_checkpoint_dir_are_refused(job, tmp_path, capsys, where):
    *_, args = job
    out, ckpt = {"same": ("x", "x"), "inside out": ("x", "x/ck"), "out inside": ("x/o", "x")}[where]
    assert main(args + ["--out", str(tmp_path / out), "--checkpoint-dir", str(tmp_path / ckpt)]) == 2
    _one_error(capsys.readouterr().err, "overlap")
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_removal_keeps_the_users_other_files(job, tmp_path, capsys):
    """A checkpoint in an existing empty folder of the user's: the completed run deletes its
    own files only, and keeps the folder."""
    *_, args = job
    mine = tmp_path / "ck"
    mine.mkdir()
    assert main(args + ["--out", str(tmp_path / "o"), "--checkpoint-dir", str(mine)]) == 0
    assert mine.is_dir() and list(mine.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "o"]


# ----------------------------------------------------------------------------- resume identity

def test_resume_refuses_other_model_files_at_the_same_path(job, tmp_path, capsys):
    _, model, other, _, args = job
    local = tmp_path / "model"
    shutil.copytree(model, local)
    argv = [a if a != str(model) else str(local) for a in args] + ["--out", str(tmp_path / "o")]
    _run_until_crash(argv)
    shutil.rmtree(local)
    shutil.copytree(other, local)  # other weights, same path, same layout
    assert main(argv) == 2
    _one_error(capsys.readouterr().err, "model files")
    assert (tmp_path / "o.checkpoint" / "manifest.json").is_file() and not (tmp_path / "o").exists()


def test_resume_follows_the_files_not_the_path_string(job, tmp_path, monkeypatch, capsys):
    """``--model model`` from two working directories: other files are refused, the same
    files under another spelling of the path resume."""
    _, model, other, _, args = job
    for d, src in (("a", model), ("b", other)):
        shutil.copytree(src, tmp_path / d / "model")
    argv = [a if a != str(model) else "model" for a in args] + ["--out", str(tmp_path / "o")]
    monkeypatch.chdir(tmp_path / "a")
    _run_until_crash(argv)
    monkeypatch.chdir(tmp_path / "b")
    assert main(argv) == 2
    _one_error(capsys.readouterr().err, "model files")
    monkeypatch.chdir(tmp_path)
    assert main([a if a != "model" else "a/model" for a in argv]) == 0
    report = json.loads((tmp_path / "o" / "nmprune_report.json").read_text())
    assert report["resumed_from_block"] == 1


def _killed(args: list[str], cwd: Path, module: str, attribute: str, n: int, when: str) -> None:
    run = subprocess.run([sys.executable, "-c", CHILD, module, attribute, str(n), when, *args],
                         cwd=cwd, capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr


def test_kill_before_the_first_manifest_needs_no_restart(job, tmp_path):
    """Killed right after the checkpoint folder got its marker (no manifest yet): the same
    command starts afresh by itself."""
    *_, args = job
    argv = args + ["--out", str(tmp_path / "o")]
    _killed(argv, tmp_path, "nmprune.checkpoint", "mark", 1, "after")
    ckpt = tmp_path / "o.checkpoint"
    assert (ckpt / MARKER).is_file() and not (ckpt / "manifest.json").exists()
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_checkpoint_left_by_a_completed_run_is_removed(job, tmp_path, capsys):
    """Killed after the output's rename, before the checkpoint's removal: the next run
    removes the checkpoint and refuses to overwrite the finished output."""
    *_, args = job
    argv = args + ["--out", str(tmp_path / "o")]
    _killed(argv, tmp_path, "nmprune.output", "publish_atomic", 1, "after")
    assert (tmp_path / "o" / "nmprune_report.json").is_file()
    assert (tmp_path / "o.checkpoint" / "manifest.json").is_file()
    saved = _listing(tmp_path / "o")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "removed" in captured.err and "o.checkpoint" in captured.err
    _one_error(captured.err, "already exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and _listing(tmp_path / "o") == saved


# ----------------------------------------------------------------------------- concurrency

PAUSED_CHILD = """
import os, signal, sys, time
# Ctrl-C as in a terminal, even when the suite runs in the background (where a shell starts
# its children with SIGINT ignored, which they inherit)
signal.signal(signal.SIGINT, signal.default_int_handler)
import nmprune.stages.statistics as statistics
original, calls = statistics.run_block, [0]
def paused(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 3:  # block 1's calibration: block 0 is in the checkpoint
        open(sys.argv[1] + ".waiting", "w").close()
        while not os.path.exists(sys.argv[1] + ".go"):
            time.sleep(0.05)
    return original(*args, **kwargs)
statistics.run_block = paused
from nmprune.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _paused_run(argv: list[str], cwd: Path, flag: Path) -> subprocess.Popen:
    """A run of ``argv`` in a child process, returned once it waits in block 1's calibration
    (:data:`PAUSED_CHILD`; touch ``FLAG.go`` to let it go on)."""
    child = subprocess.Popen([sys.executable, "-c", PAUSED_CHILD, str(flag), *argv], cwd=cwd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):
        if Path(str(flag) + ".waiting").exists() or child.poll() is not None:
            break
        time.sleep(0.1)
    if not Path(str(flag) + ".waiting").exists():
        child.kill()
        raise AssertionError(child.communicate()[1])
    return child


@pytest.mark.parametrize("second", ["same --out", pytest.param("its default checkpoint as --checkpoint-dir",
                                                                marks=pytest.mark.slow),
                                    "its staged save as --out", pytest.param("its staged save as --checkpoint-dir",
                                                                             marks=pytest.mark.slow)])
def test_second_run_on_the_same_folders_is_refused_and_the_first_finishes(job, tmp_path, capsys, second):
    """Every folder a run writes is locked by that run, whoever named it: its default
    checkpoint ``OUT.checkpoint`` too, when a second run names it with ``--checkpoint-dir``,
    and the folder its save is staged in, ``OUT.partial`` (issue 65 case 3: a second run
    there went ahead, and the first failed at its final save)."""
    *_, args = job
    argv = args + ["--out", str(tmp_path / "o")]
    other = {"same --out": argv,
             "its default checkpoint as --checkpoint-dir":
                 args + ["--out", str(tmp_path / "p"), "--checkpoint-dir", str(tmp_path / "o.checkpoint")],
             "its staged save as --out": args + ["--out", str(tmp_path / "o.partial")],
             "its staged save as --checkpoint-dir":
                 args + ["--out", str(tmp_path / "p"), "--checkpoint-dir", str(tmp_path / "o.partial")]}[second]
    flag = tmp_path / "first"
    first = _paused_run(argv, tmp_path, flag)
    try:
        before = _listing(tmp_path / "o.checkpoint")
        assert main(other) == 2
        _one_error(capsys.readouterr().err, "another nmprune run")
        assert _listing(tmp_path / "o.checkpoint") == before
        Path(str(flag) + ".go").touch()
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert load_file(str(tmp_path / "o" / "model.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("first")) == ["o"]


def test_ctrl_c_ends_in_one_line_and_the_same_command_resumes(job, tmp_path, capsys):
    """Ctrl-C (SIGINT) during block 1: exit code 130, one line saying how to resume, no
    traceback, the lock released; the same command then finishes from the checkpoint."""
    *_, args = job
    argv = args + ["--out", str(tmp_path / "o")]
    flag = tmp_path / "first"
    first = _paused_run(argv, tmp_path, flag)
    try:
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, err
    assert "Traceback" not in err and err.count("nmprune: interrupted; rerun the same command") == 1, err
    assert not (tmp_path / "o.lock").exists() and not (tmp_path / "o").exists()
    assert main(argv) == 0
    assert "resuming from" in capsys.readouterr().err
    assert load_file(str(tmp_path / "o" / "model.safetensors"))


def test_ctrl_c_before_the_first_block_says_nothing_is_kept(job, tmp_path, capsys, monkeypatch):
    """Ctrl-C before any block is finished said "resume from the checkpoint (finished blocks
    are kept)" (issue 65 case 11): now it says that nothing is kept."""
    import nmprune.job

    *_, args = job

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(nmprune.job, "run", interrupted)
    assert main(args + ["--out", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err
    assert "nmprune: interrupted; no block was finished, so nothing is kept" in err and "resume" not in err, err


SECOND_CTRL_C = """
import atexit, os, signal, sys, time
import torch._dynamo  # its atexit handler is the one a second Ctrl-C interrupted
import nmprune.job
def interrupted(*a, **k):
    raise KeyboardInterrupt
nmprune.job.run = interrupted
def second_ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)
atexit.register(second_ctrl_c)  # at exit, before nmprune's handler is registered, so run after it
from nmprune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_while_exiting_prints_no_traceback(job, tmp_path):
    """A second Ctrl-C while a stopped run exits printed torch._dynamo's atexit traceback
    (issue 65 case 7): now the process ends at once, with exit code 130."""
    *_, args = job
    done = subprocess.run([sys.executable, "-c", SECOND_CTRL_C, *args, "--out", str(tmp_path / "o")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "nmprune: interrupted" in done.stderr, done.stderr


# ----------------------------------------------------------------------------- machine errors

@pytest.mark.parametrize("flag", ["--seqlen", "--eval-seqlen"])
def test_window_longer_than_the_models_positions_is_refused(job, tmp_path, capsys, flag):
    *_, args = job
    argv = args + ["--out", str(tmp_path / "o")]
    argv[argv.index(flag) + 1] = "65"  # the tiny Llama knows 64 positions
    assert main(argv) == 2
    _one_error(capsys.readouterr().err, f"{flag} 65 is longer than the 64 positions")
    assert list(tmp_path.iterdir()) == []


def test_eval_window_longer_than_the_models_positions_is_refused(job, capsys):
    _, model, _, text, _ = job
    assert main(["eval", "--model", str(model), "--data", str(text), "--seqlen", "65", "--quiet"]) == 2
    _one_error(capsys.readouterr().err, "--seqlen 65 is longer than the 64 positions")


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _safetensors_disk_full(*args, **kwargs):
    """What safetensors raises on a full disk (seen on a full tmpfs): its own error type."""
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("failure", [_disk_full, _safetensors_disk_full])
def test_full_disk_while_saving_exits_1_and_the_rerun_finishes(job, tmp_path, capsys, monkeypatch, failure):
    import transformers.modeling_utils

    *_, args = job
    argv = args + ["--out", str(tmp_path / "o")]
    with monkeypatch.context() as m:
        m.setattr(transformers.modeling_utils, "safe_save_file", failure)
        assert main(argv) == 1
    # what failed, where, and how to go on (issue 65 case 8: the bare "[Errno 28] ...")
    _one_error(capsys.readouterr().err, f"No space left on device writing {tmp_path / 'o.partial' / 'unfinished'}: free space "
                                        f"there, or choose another --out or --checkpoint-dir; then rerun the same "
                                        f"command to resume from the checkpoint {tmp_path / 'o.checkpoint'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.checkpoint"]  # no output, no staging
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_full_disk_while_checkpointing_leaves_no_temporary_file(job, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    *_, args = job
    argv = args + ["--out", str(tmp_path / "o")]
    real = safetensors.torch.save_file

    def half_written(tensors, path, *a, **k):
        Path(path).write_bytes(b"\0" * 100)
        _disk_full()

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", half_written)
        assert main(argv) == 1
    _one_error(capsys.readouterr().err, f"No space left on device writing {tmp_path / 'o.checkpoint'}")
    assert not [p for p in (tmp_path / "o.checkpoint").iterdir() if p.name.endswith(".tmp")]
    assert safetensors.torch.save_file is real
    assert main(argv) == 0
    assert os.listdir(tmp_path) == ["o"]
