"""Streaming from safetensors checkpoints (nmprune.streaming): up-front checks of the files,
the meta-device skeleton, the sharded writer and block-by-block perplexity, on tiny models
of several families saved like hub checkpoints (one file and sharded with an index)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nmprune.evaluate import perplexity
from nmprune.models import find_blocks, find_linears, load_model, weight_matrix
from nmprune.pattern import is_nm_sparse
from nmprune.pipeline import prune_model
from nmprune.streaming import SafetensorsFiles, ShardedWriter, StreamingModel
from nmprune.streaming.evaluate import streaming_perplexity
from nmprune.streaming.files import INDEX
from test_models_tiny import FAMILIES, VOCAB, tiny_model, token_batch


def _save(path: Path, family: str = "llama", layers: int = 3, shard: str | None = None) -> Path:
    model = tiny_model(family, layers)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path


def _stream(seed: int = 0, n: int = 100) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    path = _save(tmp_path_factory.mktemp("sharded") / "model", shard="40KB")
    assert (path / INDEX).is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path


def test_skeleton_holds_no_weights_and_loads_one_block(sharded):
    source = StreamingModel(sharded)
    reference = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert all(p.is_meta for p in source.model.parameters())
    block = source.load(1)
    loaded = {n for n, p in source.model.named_parameters() if not p.is_meta}
    assert loaded and all(n.startswith("model.layers.1.") for n in loaded)
    for name, p in block.named_parameters():
        assert torch.equal(p, reference[f"model.layers.1.{name}"]), name
    source.release(1)
    assert all(p.is_meta for p in source.model.parameters())


def _watch_logits(model: torch.nn.Module) -> list:
    """Hooks failing a forward pass that starts while the previous call's logits are alive;
    returns the list of weak references to each call's logits."""
    made: list = []

    def before(module, args, kwargs):
        assert not made or made[-1]() is None, "the previous batch's logits are still alive"

    def after(module, args, kwargs, out):
        made.append(weakref.ref(out.logits))

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    return made


def test_evaluation_holds_one_batch_of_logits_at_a_time(sharded):
    """In memory and streamed, a batch's logits are freed before the next batch's forward
    pass starts (a zip over the batches would keep the last ones alive one batch longer)."""
    ids = _stream(2, 100)  # 6 windows of 16
    source = StreamingModel(sharded)
    made = _watch_logits(source.model)
    streamed = streaming_perplexity(source, ids, seqlen=16, batch_size=1, progress=False)
    assert len(made) == 6
    model = AutoModelForCausalLM.from_pretrained(sharded)
    made = _watch_logits(model)
    assert perplexity(model, ids, seqlen=16, batch_size=1, progress=False) == streamed
    assert len(made) == 6


def _copy_through_writer(source: StreamingModel, out: Path) -> Path:
    writer = ShardedWriter(source, out)
    for i in range(len(source)):
        with source.block(i):
            writer.write(i, {name: m.weight for name, m in source.layers(i).items()})
    writer.close()
    return writer.publish()


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_writer_output_reloads_with_every_tensor_once(family, tmp_path):
    path = _save(tmp_path / "in", family)
    out = _copy_through_writer(StreamingModel(path), tmp_path / "out")
    assert not (tmp_path / "out.partial").exists()
    # every tensor once: the index parses with duplicate detection and covers each shard's keys
    files = SafetensorsFiles.open(out)
    index = json.loads((out / INDEX).read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards and len(shards) > 3
    assert sorted(files.keys()) == sorted(SafetensorsFiles.open(path).keys())
    a = AutoModelForCausalLM.from_pretrained(path).state_dict()
    b = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()


def test_writer_casts_to_the_run_dtype(tmp_path):
    path = _save(tmp_path / "in")
    out = _copy_through_writer(StreamingModel(path, dtype="bfloat16"), tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16
    dense, _, _ = load_model(path, dtype="bfloat16", tokenizer=False)
    b = reloaded.state_dict()
    assert all(torch.equal(v, b[k]) for k, v in dense.state_dict().items())


def _damage_missing(path: Path) -> Path:
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    return victim


def _damage_truncated(path: Path) -> Path:
    victim = sorted(path.glob("model-*.safetensors"))[2]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 64])
    return victim


def _damage_duplicate(path: Path) -> Path:
    index = path / INDEX
    text = index.read_text()
    # name the first tensor a second time, pointing at another shard
    data = json.loads(text)
    first, shard = next(iter(data["weight_map"].items()))
    other = next(s for s in data["weight_map"].values() if s != shard)
    index.write_text(text.replace('"weight_map": {', f'"weight_map": {{\n    "{first}": "{other}",', 1))
    return index


@pytest.mark.parametrize("damage", [_damage_missing, _damage_truncated, _damage_duplicate])
def test_bad_checkpoint_is_an_error_naming_the_file(damage, tmp_path):
    path = _save(tmp_path / "in", shard="40KB")
    victim = damage(path)
    with pytest.raises(ValueError, match=victim.name):
        StreamingModel(path)


def test_tensor_in_two_shards_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _save(tmp_path / "in", shard="40KB")
    a, b = sorted(path.glob("model-*.safetensors"))[:2]
    save_file({**load_file(b), **load_file(a)}, str(b), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="both hold tensor"):
        SafetensorsFiles.open(path)


def _prune_streamed(path: Path, out: Path, **settings) -> Path:
    source = StreamingModel(path)
    sink = ShardedWriter(source, out)
    prune_model(None, source=source, sink=sink, progress=False, **settings)
    sink.close()
    return sink.publish()


@pytest.mark.parametrize("family,hessian_inputs", [(f, "dense") for f in sorted(FAMILIES)]
                         + [("llama", "pruned"), ("opt", "pruned")])
def test_streamed_pruning_is_bit_identical_to_in_memory(family, hessian_inputs, tmp_path):
    """Same pruned weights and the same perplexity (dense and pruned, block by block) as
    the in-memory path; the output reloads, exactly 2:4 in every pruned layer."""
    path = _save(tmp_path / "in", family, layers=2)
    # distill_epochs 0: the global pass needs the whole model, so the streamed run makes none
    settings = dict(calibration=token_batch(4, 12), method="sparsegpt", refine=None, batch_size=3,
                    hessian_inputs=hessian_inputs, distill_epochs=0)
    model, _, _ = load_model(path, tokenizer=False)
    ids = _stream()
    assert streaming_perplexity(StreamingModel(path), ids, seqlen=16, batch_size=2, progress=False) == \
        perplexity(model, ids, seqlen=16, batch_size=2, progress=False)
    prune_model(model, progress=False, **settings)
    out = _prune_streamed(path, tmp_path / "out", **settings)
    streamed = AutoModelForCausalLM.from_pretrained(out)
    a, b = model.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _, blocks = find_blocks(streamed)
    for block in blocks:
        for name, layer in find_linears(block).items():
            w = weight_matrix(layer)
            assert is_nm_sparse(w, "2:4") and (w == 0).sum() == w.numel() // 2, name
    assert streaming_perplexity(StreamingModel(out), ids, seqlen=16, progress=False) == \
        perplexity(model, ids, seqlen=16, progress=False)


@pytest.mark.parametrize("family,granularity", [("llama", "submodule"), ("opt", "block"), ("gemma2", "submodule")])
def test_streamed_reconstruction_is_bit_identical_to_in_memory(family, granularity, tmp_path):
    """Reconstruction trains the block the streaming source loaded: the same weights as in
    memory, still exactly 2:4."""
    path = _save(tmp_path / "in", family, layers=2)
    settings = dict(calibration=token_batch(4, 12), method="wanda", refine=None, batch_size=2,
                    reconstruct=granularity, reconstruct_batch_size=2, reconstruct_epochs=2, reconstruct_lr=5e-2,
                    distill_epochs=0)
    model, _, _ = load_model(path, tokenizer=False)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    report = prune_model(model, progress=False, **settings)
    assert any(b["kept"] == "reconstructed" for b in report.blocks)
    out = _prune_streamed(path, tmp_path / "out", **settings)
    streamed = AutoModelForCausalLM.from_pretrained(out)
    a, b = model.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _, blocks = find_blocks(streamed)
    for i, block in enumerate(blocks):
        for name, layer in find_linears(block).items():
            assert is_nm_sparse(weight_matrix(layer), "2:4"), name
    trained = [k for k in a if not torch.equal(a[k], dense[k])]
    assert trained and all(k.endswith(".weight") and ".layers." in k for k in trained)


# ----------------------------------------------------------------------------- command line

@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    from test_models_tiny import save_tiny_model_dir, write_text

    base = tmp_path_factory.mktemp("cli")
    text = write_text(base / "text.txt")
    model_dir = save_tiny_model_dir(base / "model", "llama", layers=3, text=text.read_text())
    args = ["--model", str(model_dir), "--method", "wanda", "--refine", "none", "--calib", str(text),
            "--nsamples", "4", "--seqlen", "16", "--eval", str(text), "--eval-seqlen", "16",
            "--eval-max-tokens", "256", "--quiet", "--distill-epochs", "0"]  # streamed runs make none
    return base, model_dir, text, args


def test_offload_run_equals_in_memory_run(cli_model, tmp_path):
    from nmprune.cli import main

    base, model_dir, text, args = cli_model
    assert main(["prune", *args, "--out", str(tmp_path / "memory")]) == 0
    assert main(["prune", *args, "--offload", "--out", str(tmp_path / "streamed")]) == 0
    a = json.loads((tmp_path / "memory" / "nmprune_report.json").read_text())
    b = json.loads((tmp_path / "streamed" / "nmprune_report.json").read_text())
    assert not a["streamed"] and b["streamed"]
    assert a["perplexity"] == b["perplexity"]
    assert (tmp_path / "streamed" / INDEX).is_file() and (tmp_path / "streamed" / "tokenizer.json").is_file()
    x = AutoModelForCausalLM.from_pretrained(tmp_path / "memory").state_dict()
    y = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").state_dict()
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.checkpoint"))


def test_offload_eval_equals_in_memory_eval(cli_model, capsys):
    from nmprune.cli import main

    base, model_dir, text, _ = cli_model
    args = ["eval", "--model", str(model_dir), "--data", str(text), "--seqlen", "16",
            "--max-tokens", "256", "--quiet"]
    assert main(args) == 0
    in_memory = capsys.readouterr().out
    assert main(args + ["--offload"]) == 0
    assert capsys.readouterr().out == in_memory


def test_killed_streamed_run_resumes_to_identical_model(cli_model, tmp_path):
    from nmprune.cli import build_parser, config_from_args, main
    from nmprune.job import run as run_prune

    class Crash(Exception):
        pass

    def crash(i):
        if i == 1:
            raise Crash

    base, model_dir, text, args = cli_model
    args = [*args, "--offload", "--no-eval"]
    assert main(["prune", *args, "--out", str(tmp_path / "straight")]) == 0
    with pytest.raises(Crash):
        config = config_from_args(build_parser().parse_args(["prune", *args, "--out", str(tmp_path / "resumed")]))
        run_prune(config, progress=False, on_block_done=crash)
    assert not (tmp_path / "resumed").exists() and not (tmp_path / "resumed.partial").exists()
    assert main(["prune", *args, "--out", str(tmp_path / "resumed")]) == 0
    assert json.loads((tmp_path / "resumed" / "nmprune_report.json").read_text())["resumed_from_block"] == 2
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_streamed_reconstruction_resumes_to_identical_model(cli_model, tmp_path):
    """kill -9 after block 1 (a real process), then resume: the model of an uninterrupted run."""
    import signal
    import subprocess
    import sys

    base, model_dir, text, args = cli_model
    args = [*args, "--offload", "--no-eval", "--reconstruct", "block", "--reconstruct-lr", "5e-2",
            "--reconstruct-batch-size", "2"]
    from nmprune.cli import main

    assert main(["prune", *args, "--out", str(tmp_path / "straight")]) == 0
    script = ("import os, signal, sys; from nmprune.cli import build_parser, config_from_args; "
              "from nmprune.job import run; "
              "config = config_from_args(build_parser().parse_args(sys.argv[1:])); "
              "run(config, progress=False, on_block_done=lambda i: i == 1 and os.kill(os.getpid(), signal.SIGKILL))")
    killed = subprocess.run([sys.executable, "-c", script, "prune", *args, "--out", str(tmp_path / "resumed")],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert main(["prune", *args, "--out", str(tmp_path / "resumed")]) == 0
    report = json.loads((tmp_path / "resumed" / "nmprune_report.json").read_text())
    assert report["resumed_from_block"] == 2 and [b["block"] for b in report["reconstruction"]["blocks"]] == [0, 1, 2]
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("damage", [_damage_missing, _damage_truncated, _damage_duplicate])
def test_bad_checkpoint_stops_the_run_before_any_work(damage, cli_model, tmp_path, capsys):
    from nmprune.cli import main

    base, model_dir, text, args = cli_model
    model = tmp_path / "model"
    tiny_model("llama", 3).save_pretrained(model, max_shard_size="40KB")
    for f in model_dir.glob("tokenizer*"):
        (model / f.name).write_bytes(f.read_bytes())
    victim = damage(model)
    args = [a if a != str(model_dir) else str(model) for a in args]
    assert main(["prune", *args, "--offload", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nmprune: error:" in err and victim.name in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no output, checkpoint or .partial


def test_offload_of_a_gguf_file_is_a_clear_error(tmp_path, capsys):
    from nmprune.cli import main

    assert main(["prune", "--offload", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "GGUF file, which loads whole" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_streaming_is_picked_when_the_model_does_not_fit(cli_model, monkeypatch):
    from nmprune.models import packaged_model, resolve_model
    from nmprune.streaming import fit

    base, model_dir, text, _ = cli_model
    local = resolve_model(str(model_dir))
    weights = fit.weight_bytes(local)
    assert weights == 4 * sum(p.numel() for p in tiny_model("llama", 3).parameters())
    monkeypatch.setattr(fit, "available_memory", lambda: int(fit.IN_MEMORY_FACTOR * weights) + 1)
    assert not fit.choose_streaming(local, "auto", None)
    monkeypatch.setattr(fit, "available_memory", lambda: int(fit.IN_MEMORY_FACTOR * weights) - 1)
    assert fit.choose_streaming(local, "auto", None)
    assert not fit.choose_streaming(local, "auto", False)
    with pytest.raises(ValueError, match="GGUF files load whole"):
        fit.choose_streaming(packaged_model(), "auto", None)


@pytest.mark.slow
def test_packaged_model_streams_bit_identically(tmp_path):
    """SmolLM2-135M (the packaged GGUF, saved as safetensors): streamed and in-memory
    pruning give the same weights and the same perplexity."""
    from nmprune.data import calibration_batch, eval_tokens

    model, tokenizer, _ = load_model(None)
    model.save_pretrained(tmp_path / "smollm2")
    calibration = calibration_batch(tokenizer, nsamples=8, seqlen=128)
    ids = eval_tokens(tokenizer, source="wiki", max_tokens=1024, seqlen=128)
    settings = dict(calibration=calibration, method="sparsegpt", refine=None)
    dense = perplexity(model, ids, seqlen=128, progress=False)
    assert streaming_perplexity(StreamingModel(tmp_path / "smollm2"), ids, seqlen=128, progress=False) == dense
    prune_model(model, progress=False, **settings)
    out = _prune_streamed(tmp_path / "smollm2", tmp_path / "out", **settings)
    streamed = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, streamed[k]) for k, v in model.state_dict().items())
    assert streaming_perplexity(StreamingModel(out), ids, seqlen=128, progress=False) == \
        perplexity(model, ids, seqlen=128, progress=False)


def test_offload_setting_from_yaml_and_flag(tmp_path):
    from nmprune.cli import build_parser, config_from_args
    from nmprune.config import build_config

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("offload: true\n")
    parse = lambda *argv: config_from_args(build_parser().parse_args(["prune", *argv]))  # noqa: E731
    assert parse("--config", str(yaml_file)).offload is True
    assert parse("--offload").offload is True and parse().offload is None
    assert parse().identity() == parse("--offload").identity()  # same result, same checkpoint
    with pytest.raises(ValueError, match="offload"):
        build_config({"offload": "sometimes"})


def test_streamed_pruning_with_precomputed_hessians_equals_in_memory(tmp_path):
    """``hessians=`` (no calibration passes) reads each streamed block's weights all the same."""
    from nmprune.pipeline import collect_hessians

    path = _save(tmp_path / "in", "llama", layers=2)
    model, _, _ = load_model(path, tokenizer=False)
    hessians = collect_hessians(model, token_batch(4, 12), progress=False)
    settings = dict(method="sparsegpt", refine=None, hessians=hessians, reconstruct="none")
    prune_model(model, progress=False, **settings)
    out = _prune_streamed(path, tmp_path / "out", **settings)
    a, b = model.state_dict(), AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_offload_with_downstream_tasks_is_refused_before_anything_is_written(cli_model, tmp_path, capsys):
    from nmprune.cli import main

    base, model_dir, text, args = cli_model
    assert main(["prune", *args, "--offload", "--eval-tasks", "nmprune_wiki_cloze",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # why, and what to run instead
    assert "--eval-tasks cannot run on a streamed model" in err and "nmprune eval OUT --tasks" in err
    assert not list(tmp_path.iterdir())


def test_a_streamed_block_is_freed_once_it_is_written(sharded, tmp_path, monkeypatch):
    """The memory bound of a streamed run: once block i is written (``on_block_done(i)``),
    nothing holds its weights any more (they came from the input checkpoint and went to the
    sink)."""
    import weakref

    from nmprune.stages import executor

    source = StreamingModel(sharded)
    sink = ShardedWriter(source, tmp_path / "out")
    refs: dict[int, list[weakref.ref]] = {}
    held: dict[int, int] = {}
    real = executor.run_job

    def watching(job, device):
        refs.setdefault(job.block, []).append(weakref.ref(job.weight))
        return real(job, device)

    def written(i: int) -> None:
        held[i] = sum(r() is not None for r in refs[i])

    monkeypatch.setattr(executor, "run_job", watching)
    prune_model(None, source=source, sink=sink, calibration=token_batch(4, 12), method="wanda",
                refine=None, progress=False, on_block_done=written)
    assert held == {i: 0 for i in range(len(source))}
