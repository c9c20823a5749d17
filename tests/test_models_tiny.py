"""Tiny random causal LMs of several families, a tiny tokenizer and text, for the pipeline
tests (imported by test_models / test_hessian / test_pipeline / test_cli)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

VOCAB = 320


# family -> (config class name, extra config kwargs, blocks attribute path)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "model.layers"),
    "qwen2": ("Qwen2Config", {}, "model.layers"),
    "qwen3": ("Qwen3Config", {"head_dim": 8}, "model.layers"),
    "mistral": ("MistralConfig", {"sliding_window": 8}, "model.layers"),
    "gemma": ("GemmaConfig", {"head_dim": 8}, "model.layers"),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": 4,
                                "layer_types": ["sliding_attention", "full_attention"]}, "model.layers"),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, "model.layers"),
    "opt": ("OPTConfig", {"ffn_dim": 64, "word_embed_proj_dim": 32, "max_position_embeddings": 64},
            "model.decoder.layers"),
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}, "transformer.h"),
}


def tiny_config(family: str, layers: int = 2, intermediate: int = 64):
    import transformers

    cls_name, extra, _ = FAMILIES[family]
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "opt":
        common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4)
    if family == "gpt2":
        common = dict(vocab_size=VOCAB, n_layer=layers)
    extra = dict(extra)
    if family == "gpt2":
        extra["n_layer"] = layers
    if "layer_types" in extra:
        extra["layer_types"] = (extra["layer_types"] * layers)[:layers]
    config = getattr(transformers, cls_name)(**{**common, **extra})
    config._attn_implementation = "eager"
    return config


def tiny_model(family: str = "llama", layers: int = 2, seed: int = 0, intermediate: int = 64):
    """A random tiny causal LM in eval mode, float32, CPU."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers, intermediate))
    # random (not zero) biases and norm weights, so "unchanged" checks mean something
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def token_batch(n: int = 6, seqlen: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, seqlen), generator=g)


WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches in old castles near rivers and mountains of distant lands").split()


def write_text(path: Path, nwords: int = 6000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    sentences = []
    for _ in range(nwords // 10):
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + ".")
    path.write_text("\n".join(sentences) + "\n")
    return path


def tiny_tokenizer(text: str):
    """A byte-level BPE tokenizer with VOCAB entries trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def save_tiny_model_dir(path: Path, family: str = "llama", layers: int = 2, text: str | None = None) -> Path:
    """Save a tiny model (and a tokenizer trained on ``text``) like a hub checkpoint."""
    model = tiny_model(family, layers)
    model.save_pretrained(path)
    if text is not None:
        tiny_tokenizer(text).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_models_build_and_run(family):
    model = tiny_model(family)
    logits = model(token_batch(2, 8)).logits
    assert logits.shape == (2, 8, VOCAB)
    assert torch.isfinite(logits).all()


def test_tiny_tokenizer_round_trip(tmp_path):
    text = write_text(tmp_path / "t.txt").read_text()
    tok = tiny_tokenizer(text)
    ids = tok("the quick brown fox")["input_ids"]
    assert max(ids) < VOCAB and tok.decode(ids) == "the quick brown fox"
