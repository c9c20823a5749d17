"""Every bad input to ``nmprune prune`` / ``nmprune eval`` is refused with exit code 2, one
line ``nmprune: error: ...`` naming the input, no traceback, and nothing left on disk (no
``OUT``, no ``OUT.checkpoint``, no ``OUT.partial``, no probe directory).

The table runs the CLI in-process (``nmprune.cli.main``) on tiny models; two cases also run
it as a subprocess, where the exit code and the absence of a traceback are observed on the
real process (one of them with ``y`` piped into its stdin, which must answer no question
about running a model's code). An internal error (a bug) is not caught, so it keeps its
traceback (exit 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmprune.cli import main
from test_models_tiny import save_tiny_model_dir, tiny_model, write_text

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Model directories and text files every case draws from (made once)."""
    from transformers import (BartConfig, BartForConditionalGeneration, BertConfig,
                              BertForMaskedLM, T5Config, T5ForConditionalGeneration)

    base = tmp_path_factory.mktemp("inputs")
    text = write_text(base / "text.txt")
    model = save_tiny_model_dir(base / "model", "llama", layers=2, text=text.read_text())
    tok_files = [f for f in model.iterdir() if f.name.startswith(("tokenizer", "special"))]

    def variant(name, build):
        d = base / name
        build(d)
        for f in tok_files:
            (d / f.name).write_bytes(f.read_bytes())
        return d

    def with_weights(change):
        def build(d):
            m = tiny_model("llama", layers=2)
            with torch.no_grad():
                change(m)
            m.save_pretrained(d)
        return build

    def pickled(d):
        m = tiny_model("llama", layers=2)
        m.config.save_pretrained(d)
        torch.save(m.state_dict(), d / "pytorch_model.bin")

    def truncated(d):
        save_tiny_model_dir(d, "llama", layers=2)
        w = d / "model.safetensors"
        w.write_bytes(w.read_bytes()[:-100])

    def stored(change):
        """A tiny model whose safetensors file ``change`` edits (name -> tensor, in place)."""
        def build(d):
            from safetensors.torch import load_file, save_file

            tiny_model("llama", layers=2).save_pretrained(d)
            tensors = load_file(d / "model.safetensors")
            change(tensors)
            save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        return build

    def configured(**entries):
        """A tiny model with ``entries`` added to its config.json; with an ``auto_map``, the
        folder also ships the module it names, which leaves a file ``CODE_RAN`` if it runs."""
        def build(d):
            tiny_model("llama", layers=2).save_pretrained(d)
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**config, **entries}))
            if "auto_map" in entries:
                (d / "code.py").write_text(f"open({str(d / 'CODE_RAN')!r}, 'w').close()\n")
        return build

    def unconfigured(*keys):
        """A tiny model whose config.json lacks ``keys``."""
        def build(d):
            tiny_model("llama", layers=2).save_pretrained(d)
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in keys}))
        return build

    def tokenizer_code(d):
        """The tiny model with an ``auto_map`` naming a tokenizer class of its own."""
        tok = d / "tokenizer_config.json"
        tok.write_text(json.dumps({**json.loads(tok.read_text()),
                                   "auto_map": {"AutoTokenizer": [None, "code.Tokenizer"]}}))
        (d / "code.py").write_text(f"open({str(d / 'CODE_RAN')!r}, 'w').close()\n")
        return d

    paths = {
        "text": text, "model": model,
        "bert": variant("bert", lambda d: BertForMaskedLM(BertConfig(
            vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64)).save_pretrained(d)),
        "bart": variant("bart", lambda d: BartForConditionalGeneration(BartConfig(
            vocab_size=320, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)).save_pretrained(d)),
        "t5": variant("t5", lambda d: T5ForConditionalGeneration(T5Config(
            vocab_size=320, d_model=16, num_layers=1, num_heads=2, d_ff=32)).save_pretrained(d)),
        "pickle": variant("pickle", pickled),
        "truncated": variant("truncated", truncated),
        "nan": variant("nan", with_weights(lambda m: m.model.layers[1].mlp.up_proj.weight[3, 5].fill_(float("nan")))),
        "nan norm": variant("nan_norm", with_weights(lambda m: m.model.norm.weight[0].fill_(float("nan")))),
        "nan down_proj": variant("nan_down_proj", with_weights(
            lambda m: m.model.layers[1].mlp.down_proj.weight[0, 0].fill_(float("inf")))),
        "overflow": variant("overflow", with_weights(lambda m: m.model.norm.weight.fill_(3e38))),
        "huge weight": variant("huge_weight", with_weights(lambda m: m.model.layers[0].mlp.up_proj.weight[0, 0].fill_(3e38))),
        "huge norm": variant("huge_norm", with_weights(lambda m: m.model.layers[1].input_layernorm.weight.fill_(3e38))),
        "missing tensor": variant("missing_tensor", stored(
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))),
        "missing block": variant("missing_block", configured(num_hidden_layers=3)),
        "extra block": variant("extra_block", configured(num_hidden_layers=1)),
        "int8 weight": variant("int8_weight", stored(lambda t: t.update({
            "model.layers.0.self_attn.q_proj.weight":
                (100 * t["model.layers.0.self_attn.q_proj.weight"]).to(torch.int8)}))),
        "wrong shape": variant("wrong_shape", stored(lambda t: t.update({
            "model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"][:32]}))),
        "auto_map": variant("auto_map", configured(auto_map={"AutoModelForCausalLM": "code.Model"})),
        "remote code": variant("remote_code", configured(
            model_type="nmprune_remote", auto_map={"AutoConfig": "code.Config",
                                                   "AutoModelForCausalLM": "code.Model"})),
        "tokenizer code": tokenizer_code(variant("tokenizer_code", with_weights(lambda m: None))),
        # configurations transformers' own validation refuses, or that leave it to guess
        "heads do not divide width": variant("heads", configured(num_attention_heads=3)),
        "width as a string": variant("width_string", configured(hidden_size="32")),
        "no block count": variant("no_blocks", unconfigured("num_hidden_layers")),
        "no width": variant("no_width", unconfigured("hidden_size")),
        "10^12 blocks": variant("huge", configured(num_hidden_layers=10 ** 12)),
        "binary": base / "binary.txt",
        "empty": base / "empty.txt",
        "short": base / "short.txt",
        "jsonl": base / "bad.jsonl",
        "file": base / "a_file",
    }
    paths["binary"].write_bytes(bytes(range(256)) * 40)
    paths["empty"].write_text("")
    paths["short"].write_text("only a few words here.\n")
    paths["jsonl"].write_bytes(b'{"text": "fine"}\n\xff\xfe not utf-8\n')
    paths["file"].write_text("x")
    return paths


def _fast(p) -> list[str]:
    """A valid quick prune of the tiny model; a case appends what makes it bad."""
    return ["prune", "--model", str(p["model"]), "--method", "magnitude", "--refine", "none",
            "--calib", str(p["text"]), "--nsamples", "2", "--seqlen", "16", "--no-eval", "--quiet"]


def _eval(p, model="model") -> list[str]:
    return ["eval", "--model", str(p[model]), "--data", str(p["text"]), "--seqlen", "16",
            "--max-tokens", "128", "--quiet"]


def _dry(p) -> list[str]:
    """The plan of :func:`_fast` (``--dry-run``): it refuses what the run refuses before
    reading a weight, with the same checks."""
    return _fast(p) + ["--dry-run"]


# case -> (argv builder given the inputs and the output path, text the message must contain)
CASES = {
    "prune --device nonsense": (lambda p, o: _fast(p) + ["--out", o, "--device", "nonsense"], "--device 'nonsense'"),
    "prune --device meta": (lambda p, o: _fast(p) + ["--out", o, "--device", "meta"], "--device 'meta'"),
    "prune --device cuda:99": (lambda p, o: _fast(p) + ["--out", o, "--device", "cuda:99"], "--device 'cuda:99'"),
    "prune --device mps": (lambda p, o: _fast(p) + ["--out", o, "--device", "mps"], "--device 'mps'"),
    "eval --device nonsense": (lambda p, o: _eval(p) + ["--device", "nonsense"], "--device 'nonsense'"),
    "eval --device cuda:99": (lambda p, o: _eval(p) + ["--device", "cuda:99"], "--device 'cuda:99'"),
    "prune --dtype int8": (lambda p, o: _fast(p) + ["--out", o, "--dtype", "int8"], "'int8'"),
    "binary --calib": (lambda p, o: _fast(p) + ["--out", o, "--calib", str(p["binary"])], "binary.txt"),
    "missing --calib": (lambda p, o: _fast(p) + ["--out", o, "--calib", str(Path(o).parent / "nope.txt")], "nope.txt"),
    "empty --calib": (lambda p, o: _fast(p) + ["--out", o, "--calib", str(p["empty"])], "empty.txt"),
    "undecodable .jsonl --calib": (lambda p, o: _fast(p) + ["--out", o, "--calib", str(p["jsonl"])], "bad.jsonl"),
    "binary --eval": (lambda p, o: _fast(p)[:-2] + ["--out", o, "--eval", str(p["binary"])], "binary.txt"),
    "binary eval --data": (lambda p, o: _eval(p)[:4] + [str(p["binary"])], "binary.txt"),
    "unknown eval --data": (lambda p, o: _eval(p)[:4] + ["nosuchdata"], "nosuchdata"),
    "calibration text too short": (lambda p, o: _fast(p) + ["--out", o, "--calib", str(p["short"]),
                                                            "--nsamples", "64"], "short.txt: the calibration text"),
    "evaluation text too short": (lambda p, o: _fast(p)[:-2] + ["--out", o, "--eval", str(p["short"]),
                                                                "--eval-seqlen", "64"], "short.txt"),
    "--eval-seqlen 1": (lambda p, o: _fast(p) + ["--out", o, "--eval-seqlen", "1"], "--eval-seqlen"),
    "--reconstruct-lr 0": (lambda p, o: _fast(p) + ["--out", o, "--reconstruct", "block", "--reconstruct-lr", "0"],
                           "reconstruct_lr must be a positive number, got 0.0"),
    "--reconstruct-lr nan": (lambda p, o: _fast(p) + ["--out", o, "--reconstruct-lr", "nan"],
                             "'reconstruct_lr' must be a finite number"),
    "--reconstruct-epochs -1": (lambda p, o: _fast(p) + ["--out", o, "--reconstruct-epochs", "-1"],
                                "reconstruct_epochs must be a positive integer, got -1"),
    "--reconstruct-batch-size 3": (lambda p, o: _fast(p) + ["--out", o, "--reconstruct", "block", "--batch-size", "2",
                                                            "--reconstruct-batch-size", "3"],
                                   "multiple of batch_size"),
    "diverging --reconstruct-lr": (lambda p, o: _fast(p) + ["--out", o, "--reconstruct", "block", "--reconstruct-lr",
                                                            "1e30", "--reconstruct-epochs", "20",
                                                            "--reconstruct-batch-size", "1", "--batch-size", "1"],
                                   ("block 0: ", "lower the learning rate")),
    "huge --reconstruct-lr": (lambda p, o: _fast(p) + ["--out", o, "--reconstruct", "block", "--reconstruct-lr",
                                                       "1e300"], ("block 0: ", "lower the learning rate (now 1e+300)")),
    # finite weights the arithmetic cannot hold are the model's fault, not the learning rate's,
    # and leave no checkpoint (the corrected weights are another model)
    "prune overflowing weight": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["huge weight"])],
                                 ("model.layers.0.mlp.up_proj", "too large for float32")),
    "prune overflowing activations": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["huge norm"])],
                                      ("model.layers.1.self_attn.q_proj", "overflow before this layer")),
    "prune overflowing final norm": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["overflow"])],
                                     "the dense model's next-token distribution"),
    "prune overflowing final norm, evaluated": (
        lambda p, o: _fast(p)[:-2] + ["--quiet", "--out", o, "--model", str(p["overflow"]), "--eval", str(p["text"]),
                                      "--eval-seqlen", "16"], "the dense model's perplexity"),
    "eval --seqlen 1": (lambda p, o: _eval(p) + ["--seqlen", "1"], "--seqlen"),
    "--out /proc/x": (lambda p, o: _fast(p) + ["--out", "/proc/nmprune-x"], "--out /proc/nmprune-x"),
    "--out under a file": (lambda p, o: _fast(p) + ["--out", str(p["file"] / "sub")], "a_file"),
    "--out exists": (lambda p, o: _fast(p) + ["--out", str(p["file"])], "already exists"),
    "--checkpoint-dir /proc/y": (lambda p, o: _fast(p) + ["--out", o, "--checkpoint-dir", "/proc/nmprune-y"],
                                 "--checkpoint-dir /proc/nmprune-y"),
    "encoder-only model": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["bert"])], "encoder-only"),
    "encoder-decoder model (BART)": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["bart"])], "encoder-decoder"),
    "encoder-decoder model (T5)": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["t5"])], "encoder-decoder"),
    "eval encoder-only model": (lambda p, o: _eval(p, "bert"), "encoder-only"),
    "pickle weights": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["pickle"])], "--allow-pickle"),
    "eval pickle weights": (lambda p, o: _eval(p, "pickle"), "--allow-pickle"),
    "truncated safetensors": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["truncated"])], "truncated"),
    "eval non-finite weights": (lambda p, o: _eval(p, "nan"), "model.layers.1.mlp.up_proj.weight"),
    "eval non-finite perplexity": (lambda p, o: _eval(p, "overflow"), "perplexity"),
    "--strict with an indivisible layer": (lambda p, o: _fast(p) + ["--out", o, "--pattern", "2:3", "--strict"],
                                           "not divisible by M=3"),
    "--option beta=abc": (lambda p, o: _fast(p) + ["--out", o, "--method", "prox", "--option", "beta=abc"],
                          "beta"),
    "--option refine_tol=abc": (lambda p, o: _fast(p) + ["--out", o, "--refine", "exact", "--option",
                                                         "refine_tol=abc"], "refine_tol"),
    "--option lambda0=-1": (lambda p, o: _fast(p) + ["--out", o, "--method", "prox", "--option", "lambda0=-1"],
                            "lambda0"),
    "no layer would be pruned": (lambda p, o: _fast(p) + ["--out", o, "--pattern", "2:3"], "pattern 2:3"),
    "prune non-finite weights": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["nan"])],
                                 "model.layers.1.mlp.up_proj.weight"),
    # streamed: the same one check of every tensor before any work, in the blocks or not
    "prune non-finite weights --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model", str(p["nan"])],
                                           "model.layers.1.mlp.up_proj.weight"),
    "prune non-finite final norm --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model",
                                                                       str(p["nan norm"])], "model.norm.weight"),
    "prune non-finite final norm": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["nan norm"])],
                                    "model.norm.weight"),
    "prune non-finite skipped layer --offload": (
        lambda p, o: _fast(p) + ["--out", o, "--offload", "--override", "*.down_proj=skip", "--model",
                                 str(p["nan down_proj"])], "model.layers.1.mlp.down_proj.weight"),
    "missing model": (lambda p, o: _fast(p) + ["--out", o, "--model", str(Path(o).parent / "nomodel")], "nomodel"),
    # every tensor of the saved model is one that was loaded: missing, integer or misshapen
    # tensors are refused, in memory and streamed alike
    "missing tensor": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["missing tensor"])],
                       ("'model.layers.1.mlp.up_proj.weight'", "random")),
    "missing tensor --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model",
                                                          str(p["missing tensor"])],
                                 "'model.layers.1.mlp.up_proj.weight'"),
    "eval missing tensor": (lambda p, o: _eval(p, "missing tensor"), "'model.layers.1.mlp.up_proj.weight'"),
    "missing block": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["missing block"])],
                      ("'model.layers.2.", "(and 8 more)")),
    "missing block --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model",
                                                         str(p["missing block"])], "'model.layers.2."),
    "extra block": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["extra block"])],
                    ("holds decoder block 1", "beyond the 1 blocks")),
    "extra block --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model",
                                                       str(p["extra block"])], "holds decoder block 1"),
    "int8 weight": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["int8 weight"])],
                    ("'model.layers.0.self_attn.q_proj.weight'", "I8")),
    "int8 weight --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model", str(p["int8 weight"])],
                              ("'model.layers.0.self_attn.q_proj.weight'", "I8")),
    "eval int8 weight": (lambda p, o: _eval(p, "int8 weight"), ("'model.layers.0.self_attn.q_proj.weight'", "I8")),
    "eval int8 weight --offload": (lambda p, o: _eval(p, "int8 weight") + ["--offload"],
                                   ("'model.layers.0.self_attn.q_proj.weight'", "I8")),
    "wrong shape": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["wrong shape"])],
                    ("'model.layers.0.mlp.up_proj.weight'", "(32, 32)", "(64, 32)")),
    "wrong shape --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model", str(p["wrong shape"])],
                              ("'model.layers.0.mlp.up_proj.weight'", "(32, 32)", "(64, 32)")),
    "eval wrong shape --offload": (lambda p, o: _eval(p, "wrong shape") + ["--offload"],
                                   ("'model.layers.0.mlp.up_proj.weight'", "(32, 32)", "(64, 32)")),
    # a model's own code never runs, even when its model_type is one transformers knows
    "auto_map in config.json": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["auto_map"])],
                                ("ships its own model code (auto_map in config.json)", "never runs")),
    "auto_map in config.json --offload": (lambda p, o: _fast(p) + ["--out", o, "--offload", "--model",
                                                                   str(p["auto_map"])], "auto_map in config.json"),
    "eval auto_map in config.json": (lambda p, o: _eval(p, "auto_map"), "auto_map in config.json"),
    "remote code only": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["remote code"])],
                         "auto_map in config.json"),
    "auto_map in tokenizer_config.json": (lambda p, o: _fast(p) + ["--out", o, "--model", str(p["tokenizer code"])],
                                          "auto_map in tokenizer_config.json"),
    "eval auto_map in tokenizer_config.json": (lambda p, o: _eval(p, "tokenizer code"),
                                               "auto_map in tokenizer_config.json"),
    # the dry run refuses what the run refuses before it reads a weight: the same checks
    "dry run --out exists": (lambda p, o: _dry(p) + ["--out", str(p["file"])], "already exists"),
    "dry run missing --calib": (lambda p, o: _dry(p) + ["--out", o, "--calib", str(Path(o).parent / "nope.txt")],
                                "nope.txt"),
    "dry run --seqlen beyond positions": (lambda p, o: _dry(p) + ["--out", o, "--seqlen", "65"],
                                          "--seqlen 65 is longer than the 64 positions"),
    "dry run --device bogus": (lambda p, o: _dry(p) + ["--out", o, "--device", "bogus"], "--device 'bogus'"),
    "dry run --device-memory inf": (lambda p, o: _dry(p) + ["--out", o, "--device-memory", "inf"], "--device-memory"),
    "dry run --device-memory nan": (lambda p, o: _dry(p) + ["--out", o, "--device-memory", "nan"], "--device-memory"),
    "dry run --device-memory -5": (lambda p, o: _dry(p) + ["--out", o, "--device-memory", "-5"], "--device-memory"),
    "dry run --device-memory 0": (lambda p, o: _dry(p) + ["--out", o, "--device-memory", "0"], "--device-memory"),
    "--ranks without --dry-run": (lambda p, o: _fast(p) + ["--out", o, "--ranks", "2"], ("--ranks", "--dry-run")),
    "--device-memory without --dry-run": (lambda p, o: _fast(p) + ["--out", o, "--device-memory", "80"],
                                          ("--device-memory", "--dry-run")),
    **{f"{kind}{name}": (lambda p, o, name=name, build=build: build(p) + ["--out", o, "--model", str(p[name])], text)
       for kind, build in (("", _fast), ("dry run ", _dry))
       for name, text in (("heads do not divide width", ("not a multiple of the number of attention heads",
                                                           "correct its config.json")),
                          ("width as a string", ("hidden_size", "correct its config.json")),
                          ("no block count", "does not give num_hidden_layers"),
                          ("no width", "does not give hidden_size"),
                          ("10^12 blocks", ("num_hidden_layers = 1000000000000", "at most 10,000")))},
    "eval heads do not divide width": (lambda p, o: _eval(p, "heads do not divide width"), "correct its config.json"),
}
if HAS_CUDA:  # "not available" cases need a machine without the backend
    del CASES["prune --device cuda:99"], CASES["eval --device cuda:99"]


def _snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _check_refusal(err: str, expected: str | tuple[str, ...]) -> None:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "nmprune: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("nmprune: error: "), err
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in errors[0], errors[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused(inputs, tmp_path, capsys, case):
    build, expected = CASES[case]
    root = tmp_path / "work"
    root.mkdir()
    out = root / "out"
    inputs_before = _snapshot(inputs["model"].parent)
    assert main(build(inputs, str(out))) == 2, case
    _check_refusal(capsys.readouterr().err, expected)
    assert _snapshot(root) == set(), _snapshot(root)  # no OUT, OUT.checkpoint, OUT.partial
    assert _snapshot(inputs["model"].parent) == inputs_before


def _cli(args, cwd, stdin: str = "", **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "nmprune.cli", *args], cwd=cwd, env=environ,
                          input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["prune --device nonsense"])
def test_real_process_exits_2_without_traceback(inputs, tmp_path, case):
    build, expected = CASES[case]
    result = _cli(build(inputs, str(tmp_path / "out")), tmp_path)
    assert result.returncode == 2, result.stderr
    _check_refusal(result.stderr, expected)
    assert _snapshot(tmp_path) == set()


def test_model_code_never_runs_when_stdin_says_yes(inputs, tmp_path):
    """A model folder shipping its own code is refused before transformers could ask "Do you
    wish to run the custom code? [y/N]", so a ``y`` piped into the process answers nothing."""
    build, expected = CASES["remote code only"]
    result = _cli(build(inputs, str(tmp_path / "out")), tmp_path, stdin="y\n")
    assert result.returncode == 2, result.stderr
    _check_refusal(result.stderr, expected)
    assert "custom code" not in result.stdout + result.stderr
    assert not (inputs["remote code"] / "CODE_RAN").exists()
    assert _snapshot(tmp_path) == set()


def test_crafted_pickle_with_allow_pickle_is_one_line(inputs, tmp_path, capsys):
    """--allow-pickle still loads through torch's weights-only unpickler: a pickle that would
    run code is refused, as a one-line error naming the model."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "PWNED"),))

    evil = tmp_path / "evil"
    tiny_model("llama").config.save_pretrained(evil)
    (evil / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Payload()}, protocol=2))
    assert main(["eval", "--model", str(evil), "--allow-pickle", "--data", str(inputs["text"]),
                 "--seqlen", "16", "--quiet"]) == 2
    _check_refusal(capsys.readouterr().err, f"could not load the model {evil}")
    assert not (tmp_path / "PWNED").exists()


def test_allow_pickle_loads_pickle_weights(inputs, tmp_path, capsys):
    assert main(_eval(inputs, "pickle") + ["--allow-pickle"]) == 0
    assert "| model |" in capsys.readouterr().out


def test_internal_error_keeps_traceback(inputs, tmp_path, monkeypatch):
    """A bug (here: a ZeroDivisionError inside the pipeline) is not dressed up as a user
    error: ``main`` lets it propagate, so the process prints the traceback and exits 1."""
    import nmprune.pipeline

    def broken(*args, **kwargs):
        return 1 / 0

    monkeypatch.setattr(nmprune.pipeline, "prune_model", broken)
    with pytest.raises(ZeroDivisionError):
        main(_fast(inputs) + ["--out", str(tmp_path / "out")])

