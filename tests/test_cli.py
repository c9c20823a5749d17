"""``nmprune`` command line: settings from YAML and flags, a whole prune run on a tiny model
directory (save, report, reload), resume after a crash, eval, methods, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from nmprune.cli import build_parser, config_from_args, main
from nmprune.job import run as run_prune
from nmprune.models import find_blocks, find_linears, weight_matrix
from nmprune.pattern import is_nm_sparse


def _config(argv):
    return config_from_args(build_parser().parse_args(["prune", *argv]))


def test_yaml_then_flags(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("method: sparsegpt\nrefine: gd\nnsamples: 16\noptions: {blocksize: 8}\n"
                 "overrides:\n  '*.mlp.down_proj': skip\neval: [austen]\n")
    c = _config(["--config", str(y), "--out", "o", "--nsamples", "32", "--option", "percdamp=0.05",
                 "--override", "*.q_proj=wanda+none", "--eval", "wiki"])
    assert c.prune.method == "sparsegpt" and c.prune.refine == "gd"
    assert c.prune.nsamples == 32 and c.prune.seqlen == 512  # flag beats YAML; default kept
    assert c.prune.options == {"blocksize": 8, "percdamp": 0.05}
    assert c.prune.overrides == {"*.mlp.down_proj": "skip", "*.q_proj": {"method": "wanda", "refine": "none"}}
    assert c.eval == ["austen", "wiki"] and c.out == "o"
    assert _config(["--config", str(y), "--no-eval"]).eval == []
    assert _config([]).prune.method == "prox" and _config([]).eval == ["wiki"]
    assert _config(["--refine", "none"]).prune.planner().default.refiner is None


def test_bad_settings_are_clear_errors(tmp_path, capsys):
    y = tmp_path / "bad.yaml"
    y.write_text("metod: wanda\n")
    assert main(["prune", "--config", str(y), "--out", str(tmp_path / "o")]) == 2
    assert "unknown setting 'metod'" in capsys.readouterr().err
    assert main(["prune", "--out", str(tmp_path / "o"), "--option", "oops"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert main(["prune", "--out", str(tmp_path / "o"), "--method", "wanda", "--option", "zz=1"]) == 2
    assert "unknown option 'zz'" in capsys.readouterr().err
    assert main(["prune", "--out", str(tmp_path / "o"), "--eval", "nosuchdata"]) == 2
    assert "unknown text source 'nosuchdata'" in capsys.readouterr().err
    assert main(["prune", "--out", str(tmp_path / "o"), "--eval", "wiki:x"]) == 2
    assert "unknown text source 'wiki:x'" in capsys.readouterr().err
    assert main(["prune", "--out", str(tmp_path / "o"), "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["prune", "--model", str(tmp_path / "missing")]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["prune", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [
    (["--distill-nsamples", "1000000000000"], "distill_nsamples must be at most 1,048,576"),
    (["--nsamples", "2000000"], "nsamples must be at most 1,048,576"),
    (["--reconstruct-epochs", "100000"], "reconstruct_epochs must be at most 1,000"),
    (["--distill-epochs", "100000"], "distill_epochs must be at most 1,000"),
    (["--seqlen", "10000000"], "seqlen must be at most 1,048,576"),
    (["--reconstruct-lanes", "1000000000"], "reconstruct_lanes must be at most the number of calibration batches, 64"),
    (["--nsamples", "8", "--batch-size", "2", "--reconstruct-lanes", "5"],
     "reconstruct_lanes must be at most the number of calibration batches, 4"),
    (["--eval-max-tokens", "99999999999"], "eval_max_tokens must be at most"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_settings_that_size_work_are_bounded_before_anything_is_allocated(tmp_path, capsys, flags, expected, dry_run):
    """Every setting that sizes work has an upper bound, checked in one line (exit 2) before
    any allocation, in the run and the dry run alike (issue 65 cases 4, 5: 10^12 windows took
    18 GB in a dry run; 10^9 lanes never answered; lanes beyond the batches went unremarked)."""
    argv = ["prune", "--out", str(tmp_path / "o"), *flags] + (["--dry-run"] if dry_run else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and expected in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.checkpoint").exists()


def test_methods_lists_registry(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "wanda" in out and "exact" in out and "refine_" in out


def test_global_distillation_from_the_command_line_in_memory_and_streamed(tiny_dir, tmp_path, capsys):
    """``--distill-epochs`` runs the pass after the last block and reports it, on the run's
    windows and ``--distill-nsamples`` minus those of its own (batches of 2: 8 and 4, one of
    each held out). A streamed run in one process (``--offload``) makes the same pass: its
    dense distribution on the pass's own windows block by block, then the pruned model loaded
    whole from the shards it wrote, trained, and written back; the saved model is the
    in-memory run's up to float rounding (issue 63: it was refused, or skipped by auto)."""
    base, model_dir, text, yaml_file = tiny_dir
    flags = ["--config", str(yaml_file), "--quiet", "--reconstruct", "block", "--nsamples", "16",
             "--distill-epochs", "2", "--distill-lr", "1e-2", "--distill-nsamples", "24"]
    out = tmp_path / "distilled"
    assert main(["prune", *flags, "--out", str(out)]) == 0
    assert "global distillation (2 epoch(s), 20 steps" in capsys.readouterr().out
    record = json.loads((out / "nmprune_report.json").read_text())["distillation"]
    assert record["kept"] == "distilled" and record["heldout_batches"] == 2 and record["batches"] == 12
    streamed = tmp_path / "streamed"
    assert main(["prune", *flags, "--offload", "--out", str(streamed)]) == 0
    assert "global distillation (2 epoch(s), 20 steps" in capsys.readouterr().out
    report = json.loads((streamed / "nmprune_report.json").read_text())
    assert report["streamed"] and report["distillation"]["kept"] == "distilled"
    assert report["distillation"]["heldout_after"] == pytest.approx(record["heldout_after"], rel=1e-3)
    from safetensors.torch import load_file
    from nmprune.streaming.files import SafetensorsFiles

    whole = load_file(str(out / "model.safetensors"))
    files = SafetensorsFiles.open(streamed)
    trained = [k for k in whole if k.endswith("proj.weight")]
    assert trained and all(torch.allclose(files.get(k), whole[k], atol=1e-5) for k in trained)
    # and the pass moved them: the solved weights of a run without it differ
    solved = tmp_path / "solved"
    assert main(["prune", *flags[:-6], "--distill-epochs", "0", "--out", str(solved)]) == 0
    plain = load_file(str(solved / "model.safetensors"))
    assert any(not torch.allclose(plain[k], whole[k], atol=1e-5) for k in trained)


def test_the_pass_is_planned_wherever_the_model_streams(tiny_dir):
    """A model streamed in one process (loaded whole for the pass) or on several ranks
    (sharded over them) gets the pass: ``--distill-epochs N`` and ``auto`` plan it alike."""
    from nmprune.config import build_config
    from nmprune.resources import plan_run

    base, model_dir, text, yaml_file = tiny_dir
    for ranks in (1, 2):
        for epochs in (1, "auto"):
            config = build_config({"model": str(model_dir), "out": str(base / "o"), "distill_epochs": epochs})
            assert plan_run(config, ranks=ranks, streamed=True).distill_epochs == 1, (ranks, epochs)


def test_a_text_too_short_for_the_distillations_own_windows_is_refused_before_anything_is_written(
        tiny_dir, tmp_path, capsys):
    base, model_dir, text, yaml_file = tiny_dir
    out = tmp_path / "short"
    assert main(["prune", "--config", str(yaml_file), "--out", str(out), "--quiet", "--reconstruct", "block",
                 "--distill-epochs", "1", "--distill-nsamples", "100000"]) == 2
    err = capsys.readouterr().err
    assert "the global distillation's 99996 windows of its own (--distill-nsamples)" in err, err
    assert not out.exists() and not out.with_name("short.checkpoint").exists()


def test_a_distillation_pass_that_would_not_fit_is_refused_before_any_weight_is_read(tiny_dir, tmp_path,
                                                                                   capsys, monkeypatch):
    import nmprune.streaming.fit as fit

    base, model_dir, text, yaml_file = tiny_dir
    monkeypatch.setattr(fit, "available_memory", lambda: 1 << 20)  # a machine with 1 MiB to spare
    out = tmp_path / "o"
    assert main(["prune", "--config", str(yaml_file), "--quiet", "--distill-epochs", "1", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "the global distillation pass needs about" in err and "and 1 MiB are available" in err, err
    assert not out.exists()
    # auto (the default) prunes without the pass, and says why in one line and in the report
    assert main(["prune", "--config", str(yaml_file), "--quiet", "--reconstruct", "block", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("skipping the global distillation (distill_epochs: auto): the global distillation pass "
                     "needs about") == 1, err
    assert "and 1 MiB are available" in json.loads((out / "nmprune_report.json").read_text())["distillation"]["skipped"]


def test_sigterm_stops_a_run_with_one_line_and_the_same_command_resumes(tiny_dir, tmp_path, capsys, monkeypatch):
    """What torchrun sends every rank once one fails: the run ends as after Ctrl-C (exit
    143, one line, the checkpoint kept), and the same command resumes."""
    import os
    import signal

    import nmprune.job as job

    base, model_dir, text, yaml_file = tiny_dir
    out = tmp_path / "o"
    args = ["prune", "--config", str(yaml_file), "--quiet", "--out", str(out)]
    real = job.run
    monkeypatch.setattr(job, "run", lambda config, **kw: real(
        config, **kw, on_block_done=lambda i: i == 0 and os.kill(os.getpid(), signal.SIGTERM)))
    assert main(args) == 143
    # one process (a scheduler's stop): how to resume, not torchrun's story (issue 65 case 10)
    err = capsys.readouterr().err
    assert "nmprune: error: stopped by SIGTERM; rerun the same command to resume from the checkpoint" in err, err
    assert "torchrun" not in err
    assert not out.exists() and out.with_name("o.checkpoint").is_dir()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the process's again
    monkeypatch.setattr(job, "run", real)
    assert main(args) == 0
    assert json.loads((out / "nmprune_report.json").read_text())["resumed_from_block"] >= 1


def test_prune_with_reconstruction_reports_each_block_before_and_after(tiny_dir, tmp_path, capsys):
    base, model_dir, text, yaml_file = tiny_dir
    out = tmp_path / "pruned"
    assert main(["prune", "--config", str(yaml_file), "--out", str(out), "--quiet", "--reconstruct", "submodule",
                 "--reconstruct-lr", "5e-2", "--reconstruct-batch-size", "2", "--reconstruct-epochs", "2",
                 "--nsamples", "16"]) == 0
    printed = capsys.readouterr().out
    assert "wanda+gd 2:4 +submodule reconstruction" in printed
    report = json.loads((out / "nmprune_report.json").read_text())
    recon = report["reconstruction"]
    assert recon["granularity"] == "submodule" and recon["epochs"] == 2 and recon["lr"] == 5e-2
    assert [b["block"] for b in recon["blocks"]] == [0, 1, 2]
    for b in recon["blocks"]:
        assert b["heldout_after"] <= b["heldout_before"] and b["heldout_batches"] == 1  # of 8
        assert (f"| {b['block']} | {b['heldout_before']:.4g} | {b['heldout_after']:.4g} | "
                f"{'-' if b['error_before'] is None else format(b['error_before'], '.4g')} | "
                f"{b['error_after']:.4g} | {b['kept']} |") in printed
    assert recon["mean_heldout_after"] < recon["mean_heldout_before"]
    # the training error before is a mean over every block, or unknown
    known = [b["error_before"] for b in recon["blocks"]]
    assert recon["mean_error_before"] == (None if None in known else pytest.approx(sum(known) / len(known)))
    saved = _weights(out)
    for name, w in saved.items():
        if name.endswith("proj.weight"):
            assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) <= 2, name


def _weights(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def test_prune_run_saves_loadable_model_and_report(tiny_dir, tmp_path, capsys):
    base, model_dir, text, yaml_file = tiny_dir
    out = tmp_path / "pruned"
    assert main(["prune", "--config", str(yaml_file), "--out", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "dense" in captured.out and "wanda+gd 2:4" in captured.out  # the perplexity table
    assert not (tmp_path / "pruned.checkpoint").exists()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "nmprune_report.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "nmprune_report.json").read_text())
    assert report["config"]["method"] == "wanda" and report["versions"]["nmprune"]
    assert set(report["perplexity"]["dense"]) == {str(text)}
    assert report["perplexity"]["pruned"][str(text)] > 1.0
    assert report["summary"]["layers_pruned"] == 21 and len(report["layers"]) == 21
    model = AutoModelForCausalLM.from_pretrained(out)
    _, blocks = find_blocks(model)
    for block in blocks:
        for name, layer in find_linears(block).items():
            assert is_nm_sparse(weight_matrix(layer), "2:4"), name
    dense = _weights(model_dir)
    assert torch.equal(model.model.embed_tokens.weight, dense["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, dense["lm_head.weight"])
    # the same command again refuses to overwrite a finished run
    assert main(["prune", "--config", str(yaml_file), "--out", str(out), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    # nmprune eval on the saved model prints a table
    assert main(["eval", "--model", str(out), "--data", str(text), "--seqlen", "16",
                 "--max-tokens", "256", "--quiet"]) == 0
    assert f"{report['perplexity']['pruned'][str(text)]:.2f}"[:4] in capsys.readouterr().out


class _Crash(Exception):
    pass


def test_killed_run_resumes_to_identical_model(tiny_dir, tmp_path):
    base, model_dir, text, yaml_file = tiny_dir
    args = ["prune", "--config", str(yaml_file), "--hessian-inputs", "pruned", "--quiet"]
    assert main(args + ["--out", str(tmp_path / "straight")]) == 0

    out = tmp_path / "resumed"

    def crash(i):
        if i == 1:
            raise _Crash

    with pytest.raises(_Crash):
        run_prune(_config(args[1:] + ["--out", str(out)]), progress=False, on_block_done=crash)
    assert not out.exists() and (tmp_path / "resumed.checkpoint" / "manifest.json").is_file()
    # another setting cannot resume it ...
    assert main(args + ["--out", str(out), "--seed", "3"]) == 2
    # ... the same command does
    assert main(args + ["--out", str(out)]) == 0
    report = json.loads((out / "nmprune_report.json").read_text())
    assert report["resumed_from_block"] == 2
    a, b = _weights(tmp_path / "straight"), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_too_short_text_is_a_clear_error(tiny_dir, tmp_path, capsys):
    base, model_dir, text, yaml_file = tiny_dir
    short = tmp_path / "short.txt"
    short.write_text("only a few words here.\n")
    assert main(["prune", "--config", str(yaml_file), "--calib", str(short), "--no-eval",
                 "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "nmprune: error:" in err and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_packaged_model_end_to_end(tmp_path, capsys):
    """The README's first command on the real packaged GGUF model, with small calibration."""
    out = tmp_path / "smollm2"
    assert main(["prune", "--out", str(out), "--nsamples", "4", "--seqlen", "128",
                 "--eval-max-tokens", "2048", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "| dense |" in table and "prox+exact 2:4" in table  # the default method
    report = json.loads((out / "nmprune_report.json").read_text())
    assert report["summary"]["layers_pruned"] == 30 * 7 and report["summary"]["layers_skipped"] == 0
    dense, pruned = report["perplexity"]["dense"]["wiki"], report["perplexity"]["pruned"]["wiki"]
    assert 1.0 < dense < pruned < 50 * dense
    # the saved model is a plain transformers checkpoint: loads without gguf, same sparsity
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(out)
    _, blocks = find_blocks(model)
    assert all(is_nm_sparse(weight_matrix(m), "2:4") for b in blocks for m in find_linears(b).values())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, still dense


def test_python_api_runs_the_whole_job(tiny_dir, tmp_path):
    """``nmprune.run`` is the command's job from Python: same settings, same saved model."""
    import nmprune
    from nmprune.config import load_yaml

    base, model_dir, text, yaml_file = tiny_dir
    out = tmp_path / "api"
    report = nmprune.run(nmprune.build_config(load_yaml(yaml_file), {"out": str(out)}), progress=False)
    assert report["saved_to"] == str(out) and (out / "nmprune_report.json").is_file()
    assert json.loads((out / "nmprune_report.json").read_text())["layers"] == report["layers"]
    table = nmprune.result_table(report)
    assert "dense" in table and "wanda+gd 2:4" in table
    cli_out = tmp_path / "cli"
    assert main(["prune", "--config", str(yaml_file), "--out", str(cli_out), "--quiet"]) == 0
    a, b = _weights(out), _weights(cli_out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_says_each_stage_and_writes_a_clean_log(tiny_dir, tmp_path):
    """Without --quiet and with stderr in a file: one line per stage in the run's order, bars
    that say whose perplexity on which text, and no escape characters (nested bars, which
    tqdm redraws by moving the cursor, show only on a terminal)."""
    base, model_dir, text, yaml_file = tiny_dir
    run = subprocess.run([sys.executable, "-m", "nmprune", "prune", "--config", str(yaml_file),
                          "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    stages = [line.split(":")[1].split()[0] + " " + line.split(":")[1].split()[1]
              for line in run.stderr.splitlines() if line.startswith("nmprune: ")]
    assert stages == ["loading " + str(model_dir).split()[0], "tokenising the", "evaluating the",
                      "pruning block", "computing the", "capturing the", "global distillation", "evaluating the",
                      "saving the"], stages
    assert "dense perplexity on " + str(text) in run.stderr and "pruned perplexity on " + str(text) in run.stderr
    assert "\x1b[" not in run.stderr
