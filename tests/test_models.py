"""Model loading and discovery of decoder blocks and their linear layers."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from nmprune.models import (
    evaluating,
    find_blocks,
    find_linears,
    load_model,
    parse_dtype,
    resolve_model,
    set_weight_matrix,
    outside_parameters,
    weight_matrix,
)
from nmprune.output import save_pretrained_atomic
from test_models_tiny import FAMILIES, save_tiny_model_dir, tiny_model, token_batch, write_text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_blocks_and_linears_are_discovered(family):
    model = tiny_model(family, layers=2)
    name, blocks = find_blocks(model)
    assert name == FAMILIES[family][2]
    assert len(blocks) == 2
    layers = find_linears(blocks[0], outside_parameters(model, blocks))
    assert len(layers) >= 4  # attention in/out and the MLP's
    inside = {id(m) for m in blocks.modules()}
    # every nn.Linear / Conv1D of the block is found, nothing outside the blocks is
    expected = [m for m in blocks[0].modules() if isinstance(m, (nn.Linear, Conv1D))]
    assert sorted(map(id, expected)) == sorted(map(id, layers.values()))
    assert all(id(m) in inside for m in layers.values())
    assert model.get_output_embeddings() not in layers.values()


def test_conv1d_weight_is_seen_as_d_out_by_d_in():
    model = tiny_model("gpt2")
    _, blocks = find_blocks(model)
    layers = find_linears(blocks[0])
    c_fc = layers["mlp.c_fc"]
    assert isinstance(c_fc, Conv1D)
    w = weight_matrix(c_fc)
    assert w.shape == (c_fc.nf, c_fc.weight.shape[0])  # (d_out, d_in)
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(c_fc(x), x @ w.T + c_fc.bias)
    new = torch.randn_like(w)
    set_weight_matrix(c_fc, new)
    assert torch.equal(weight_matrix(c_fc), new)


def test_tied_block_weight_stays_out():
    model = tiny_model("llama")
    _, blocks = find_blocks(model)
    # tie a block layer to a module outside the blocks (shapes chosen to fit)
    outside = nn.Linear(32, 32, bias=False)
    model.extra = outside
    blocks[0].self_attn.q_proj.weight = outside.weight
    layers = find_linears(blocks[0], outside_parameters(model, blocks))
    assert "self_attn.q_proj" not in layers and "self_attn.k_proj" in layers


def test_model_without_block_list_is_a_clear_error():
    with pytest.raises(ValueError, match="no list of decoder blocks"):
        find_blocks(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10)))


def test_evaluating_sets_eval_mode_without_grad_and_restores_the_model_on_error():
    model = tiny_model("llama", layers=1).train()
    moves: list[torch.device] = []
    model.to = lambda device: moves.append(torch.device(device)) or model  # record, stay put
    with pytest.raises(RuntimeError, match="inside"):
        with evaluating(model, "meta") as device:
            assert device == torch.device("meta") and moves == [device]
            assert not model.training and not torch.is_grad_enabled()
            raise RuntimeError("inside")
    assert moves == [torch.device("meta"), torch.device("cpu")]
    assert model.training and torch.is_grad_enabled()
    with evaluating(model) as device:  # by default where the input embeddings are: no move
        assert device == torch.device("cpu")
    model.hf_device_map = {"": "cpu"}  # dispatched by accelerate: never moved
    with evaluating(model, "meta"):
        pass
    assert len(moves) == 2


def test_resolve_model_paths(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    src = resolve_model(str(gguf))
    assert (src.path, src.gguf_file) == (str(tmp_path), "m.gguf")
    assert resolve_model(str(tmp_path)).gguf_file == "m.gguf"  # the only .gguf in the directory
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), gguf_file="n.gguf").gguf_file == "n.gguf"
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path), gguf_file="x.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./nowhere/model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(empty))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M").path == "HuggingFaceTB/SmolLM2-135M"  # hub id


def test_packaged_model_is_the_default():
    src = resolve_model(None)
    assert src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("auto") == "auto"
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="floating point"):
        parse_dtype(torch.int32)


def test_load_local_dir_with_dtype_and_tokenizer(tmp_path):
    text = write_text(tmp_path / "t.txt").read_text()
    d = save_tiny_model_dir(tmp_path / "m", "qwen2", text=text)
    model, tok, src = load_model(str(d), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert tok is not None and src.path == str(d)
    model32, _, _ = load_model(str(d), tokenizer=False)
    assert model32.dtype == torch.float32


def test_non_causal_model_is_a_clear_error(tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="encoder-decoder"):
        load_model(str(tmp_path))


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_save_atomic_reloads_same_logits(tmp_path):
    model = tiny_model("gpt2")
    ids = token_batch(2, 8)
    out = save_pretrained_atomic(model, None, tmp_path / "saved", {"note.txt": "hi"})
    assert not (tmp_path / "saved.partial").exists() and (out / "note.txt").read_text() == "hi"
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == \
        {f.name: 0o666 & ~umask for f in out.iterdir()}  # readable like any new file, not 600
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    # (the reloaded model may pick another attention kernel: equal up to float rounding)
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="already exists"):
        save_pretrained_atomic(model, None, out)
