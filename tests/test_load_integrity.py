"""What a load accepts: every tensor of a loaded model is one its checkpoint stores, and no
model's own code ever runs.

tests/test_bad_inputs.py checks the refusals where the user meets them (the CLI, in memory
and streamed); these tests check what must still load (tied embeddings, integer tensors
that are integer in the model too, the packaged GGUF model, a hub id from the cache), the
checks on sharded checkpoints and hub ids, and that a tokenizer's own code never runs even
when stdin would say yes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nmprune.models import ModelSource, find_blocks, load_model, load_tokenizer
from nmprune.streaming import SafetensorsFiles, StreamingModel
from nmprune.streaming.files import INDEX, SINGLE
from test_models_tiny import save_tiny_model_dir, tiny_config, tiny_model, write_text

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _store_as_int8(path: Path, key: str = Q_PROJ) -> None:
    """Store tensor ``key`` of the checkpoint in ``path`` as int8 (in its shard)."""
    index = path / INDEX
    shard = path / (json.loads(index.read_text())["weight_map"][key] if index.is_file() else SINGLE)
    tensors = load_file(shard)
    tensors[key] = (100 * tensors[key]).to(torch.int8)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_tied_embeddings_load_in_memory_and_streamed(tmp_path):
    """An LM head tied to the embeddings is not in the file and is not missing."""
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert "lm_head.weight" not in SafetensorsFiles.open(tmp_path)
    model, _, _ = load_model(tmp_path, tokenizer=False)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    streamed = StreamingModel(tmp_path)
    assert streamed.model.lm_head.weight is streamed.model.model.embed_tokens.weight


def test_check_fits_compares_shapes_and_floating_point(tmp_path):
    save_file({"w": torch.ones(2, 3, dtype=torch.float16), "pos": torch.arange(4),
               "flag": torch.ones(2, 3, dtype=torch.bool)}, tmp_path / SINGLE)
    files = SafetensorsFiles.open(tmp_path)
    assert (files.dtype("w"), files.dtype("pos"), files.dtype("flag")) == ("F16", "I64", "BOOL")
    # another float dtype is cast as usual; an integer tensor that is integer in the model
    # too is fine; names the checkpoint does not hold are not looked at
    files.check_fits({"w": torch.empty(2, 3, device="meta"), "pos": torch.empty(4, dtype=torch.long),
                      "absent": torch.empty(1)})
    with pytest.raises(ValueError, match=r"'flag' as BOOL, not floating point, where the model's tensor is float32"):
        files.check_fits({"flag": torch.empty(2, 3)})
    with pytest.raises(ValueError, match=r"'w' with shape \(2, 3\), but its configuration makes it \(3, 2\)"):
        files.check_fits({"w": torch.empty(3, 2)})


def test_integer_tensor_in_a_sharded_checkpoint_is_refused(tmp_path):
    tiny_model("llama", layers=3).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / INDEX).is_file()
    _store_as_int8(tmp_path)
    for load in (lambda: load_model(tmp_path, tokenizer=False), lambda: StreamingModel(tmp_path)):
        with pytest.raises(ValueError, match=rf"'{Q_PROJ}' as I8"):
            load()


def test_model_code_is_refused_by_the_python_api(tmp_path):
    """load_model and StreamingModel refuse an ``auto_map`` themselves, not only the CLI."""
    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "code.Config"}}))
    for load in (lambda: load_model(tmp_path, tokenizer=False), lambda: StreamingModel(tmp_path)):
        with pytest.raises(ValueError, match=r"ships its own model code \(auto_map in config.json\)"):
            load()


def test_tokenizer_code_never_runs_even_when_stdin_says_yes(tmp_path, monkeypatch):
    """The tokenizer loader itself passes trust_remote_code=False: transformers neither asks
    (here every question would be answered yes) nor runs the tokenizer's module."""
    save_tiny_model_dir(tmp_path, "llama", text=write_text(tmp_path / "t.txt").read_text())
    tok = tmp_path / "tokenizer_config.json"
    tok.write_text(json.dumps({**json.loads(tok.read_text()), "tokenizer_class": "CodeTokenizer",
                               "auto_map": {"AutoTokenizer": ["code.CodeTokenizer", None]}}))
    (tmp_path / "code.py").write_text(f"open({str(tmp_path / 'CODE_RAN')!r}, 'w').close()\n")
    asked = []
    monkeypatch.setattr("builtins.input", lambda *args: asked.append(args) or "y")
    assert load_tokenizer(ModelSource(str(tmp_path))) is None
    assert asked == [] and not (tmp_path / "CODE_RAN").exists()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache (the tests run offline) into which ``put(repo)`` saves a tiny
    model as the snapshot of ``nmprune/<repo>``; returns ``put``."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    commit = "0123456789abcdef0123456789abcdef01234567"

    def put(repo: str) -> Path:
        folder = cache / f"models--nmprune--{repo}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(commit)
        return save_tiny_model_dir(folder / "snapshots" / commit)

    return put


def test_hub_id_is_checked_from_the_cache(hub_cache):
    hub_cache("good")
    model, _, source = load_model("nmprune/good", tokenizer=False)
    assert str(source) == "nmprune/good" and type(model).__name__ == "LlamaForCausalLM"
    _store_as_int8(hub_cache("int8"))
    with pytest.raises(ValueError, match=rf"'{Q_PROJ}' as I8"):
        load_model("nmprune/int8", tokenizer=False)
    config = hub_cache("code") / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "auto_map": {"AutoConfig": "code.Config"}}))
    with pytest.raises(ValueError, match=r"nmprune/code ships its own model code"):
        load_model("nmprune/code", tokenizer=False)


def test_packaged_gguf_model_still_loads():
    """The packaged SmolLM2 GGUF file (de-quantised by transformers, tied embeddings) has
    every tensor its configuration asks for."""
    model, tokenizer, source = load_model(None)
    assert source.gguf_file and tokenizer is not None
    assert len(find_blocks(model)[1]) == model.config.num_hidden_layers
    assert all(p.is_floating_point() for p in model.parameters())
