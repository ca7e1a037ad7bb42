"""Sample text from a minite.train checkpoint.

    python -m minite.sample --ckpt out/ckpt.pt --prompt "ROMEO." --max_new_tokens 500 --temperature 0.8 --top_k 40
    python -m minite.sample --compile reduce-overhead ...     # CUDA: each decode step replayed as one CUDA graph

The checkpoint carries the model configuration and the tokenizer, so no data directory is needed. Any checkpoint
of minite.train: ``ckpt.pt`` (the last), ``ckpt_best.pt`` (the best val loss), or a LoRA run's (its base with the
adapters merged in). It is checked as ``train --resume`` checks it: each tensor's shape against the configuration,
no NaN/inf weights, and a tokenizer that fits the model (as many symbols as the model's vocabulary, no symbol
twice); a tokenizer altered into another consistent one of the same size cannot be told from the real one.

Tokens are printed as they are sampled (``stream``: a chunk of STREAM_CHUNK tokens at a time; the context slides
over the last block_size tokens, so the model's context is no limit). ``--max_new_tokens`` may not exceed
MAX_NEW_TOKENS (100,000: about 100 KB of text from a char model): a larger number is refused, not run for days.
"""
from __future__ import annotations

import argparse
import codecs
import sys
from collections.abc import Iterator

import torch

from minite.checkpoint import CheckpointError, check_finite, load_checkpoint, load_model_state
from minite.data import Tokenizer
from minite.finetune import dense_weights
from minite.models.gpt import GPT, GPTConfig
from minite.resources import pick_decode_threads

__all__ = ["load_model", "sample", "stream", "main", "MAX_NEW_TOKENS"]

MAX_NEW_TOKENS = 100_000  # the most tokens one command samples (per sample)
STREAM_CHUNK = 32  # tokens generated per model.generate call, then printed


def load_model(path: str, device: str = "cpu") -> tuple[GPT, Tokenizer]:
    """(model in eval mode, tokenizer) from a checkpoint written by minite.train, checked as train --resume checks
    it (a CheckpointError names what is wrong)."""
    state = load_checkpoint(path)
    if "tokenizer" not in state:
        raise CheckpointError(f"checkpoint {path} carries no tokenizer")
    cfg = state["config"].get("model")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"checkpoint {path}: its config has no model section")
    try:  # backend "auto": a model trained with a forced backend (e.g. triton on a GPU) still samples anywhere.
        model = GPT(GPTConfig(**{**cfg, "backend": "auto"}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its model configuration builds no model ({e})") from e
    weights = dense_weights(state, path)  # a LoRA run's checkpoint: its base + merged adapters
    check_finite(weights, path)
    load_model_state(model, weights, path)
    return model.to(device).eval(), _tokenizer(state["tokenizer"], model.config.vocab_size, path)


def _tokenizer(d, vocab_size: int, path) -> Tokenizer:
    """The checkpoint's tokenizer, refused when it cannot be the one the model was trained with."""
    try:
        tok = Tokenizer.from_json(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: its tokenizer is malformed ({type(e).__name__}: {e})") from e
    if tok.kind == "char" and (not all(isinstance(c, str) and len(c) == 1 for c in tok.chars)
                               or len(set(tok.chars)) != len(tok.chars)):
        raise CheckpointError(f"checkpoint {path}: its char tokenizer's symbols are not distinct single characters")
    if d.get("vocab_size", tok.vocab_size) != tok.vocab_size or tok.vocab_size != vocab_size:
        raise CheckpointError(f"checkpoint {path}: its tokenizer has {tok.vocab_size} symbols (it says "
                              f"{d.get('vocab_size')}), its model a vocabulary of {vocab_size}: the tokenizer was "
                              "altered; use the checkpoint as minite.train wrote it")
    return tok


def _check(max_new_tokens, num_samples) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int from 0 to {MAX_NEW_TOKENS:,} (the most "
                         "one command samples; run again with another --seed for more)")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r}: must be an int >= 1")


def stream(model: GPT, tok: Tokenizer, prompt: str = "\n", *, max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = None, num_samples: int = 1, generator: torch.Generator | None = None, seed: int = 0,
           use_cache: bool = True, compile: str | None = None) -> Iterator[list[str]]:
    """Sample as `sample` does, yielding each sample's new text every STREAM_CHUNK tokens (not the prompt). The
    context passed on is the last block_size tokens: memory and time per token stay flat however long it runs."""
    _check(max_new_tokens, num_samples)
    dev = next(model.parameters()).device
    ids = tok.encode(prompt or "\n")  # raises a clear error for characters the tokenizer does not know
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=dev)  # (num_samples, T)
    g = generator if generator is not None else torch.Generator(device=dev).manual_seed(seed)
    decoder = None
    if compile is not None:
        from minite.decoding import Decoder
        if not use_cache:
            raise ValueError("compile: the compiled decode step works on the KV cache; drop --no_cache")
        if dev.type != "cuda":  # traced whole (fullgraph): the CPU reference MoE reads its offsets on the host
            raise ValueError(f"compile={compile}: the compiled decode step (CUDA graphs) is for a GPU; the model is "
                             f"on {dev}")
        decoder = Decoder(model, compile=compile)
    # bytes: a character split between two chunks is decoded when its last byte comes
    utf8 = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(num_samples)]
    done, bs = 0, model.config.block_size
    while done < max_new_tokens:
        n = min(STREAM_CHUNK, max_new_tokens - done)
        idx = model.generate(idx[:, -bs:], n, temperature=temperature, top_k=top_k, generator=g,
                             use_cache=use_cache, decoder=decoder)
        new = idx[:, -n:].tolist()
        if tok.kind == "byte":
            yield [d.decode(bytes(i for i in row if i < 256)) for d, row in zip(utf8, new)]
        else:
            yield [tok.decode(row) for row in new]
        done += n


def sample(model: GPT, tok: Tokenizer, prompt: str = "\n", *, max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = None, num_samples: int = 1, seed: int = 0, use_cache: bool = True,
           compile: str | None = None) -> list[str]:
    """Generate `num_samples` continuations of `prompt` (returned with the prompt in front). use_cache: decode
    with a KVCache (chapter 08), one token per step instead of the whole context again. compile: a torch.compile
    mode for the decode step (minite/decoding.py; "reduce-overhead" = a CUDA graph a step), None = eager.
    At most MAX_NEW_TOKENS new tokens per sample."""
    texts = [tok.decode(tok.encode(prompt or "\n"))] * num_samples
    for pieces in stream(model, tok, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         num_samples=num_samples, seed=seed, use_cache=use_cache, compile=compile):
        texts = [t + p for t, p in zip(texts, pieces)]
    return texts


def _set_threads(model: GPT, tok: Tokenizer, args: argparse.Namespace) -> None:
    """--threads N, or (0, on the CPU) the faster of all cores and 1 for this decode, as minite.train does."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    elif next(model.parameters()).device.type == "cpu":
        n = pick_decode_threads(model, 1, len(tok.encode(args.prompt or "\n")), use_cache=not args.no_cache)
        torch.set_num_threads(n)


def _device(p: argparse.ArgumentParser, name: str) -> str:
    """--device, refused at parse time when this machine does not have it."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        p.error(f"--device={name!r}: {e}")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device={name!r}: must be cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device={name}: no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        p.error(f"--device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minite.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="out/ckpt.pt", help="checkpoint file (default: out/ckpt.pt)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max_new_tokens", type=int, default=500,
                   help=f"tokens to generate per sample, printed as they come (default: 500; at most "
                        f"{MAX_NEW_TOKENS:,})")
    p.add_argument("--temperature", type=float, default=0.8, help="<1 sharper, >1 flatter, 0 greedy (default: 0.8)")
    p.add_argument("--top_k", type=int, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--num_samples", type=int, default=1, help="independent samples, one after another (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--no_cache", action="store_true", help="recompute the whole context every token (no KV cache)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", default=None, choices=["default", "reduce-overhead"],
                   help="torch.compile the decode step (GPU only): reduce-overhead replays it as one CUDA graph")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: 0 = as minite.train picks them: "
                   "the faster of all cores and 1, timed on a few tokens; one token at a time is small ops, where "
                   "threads on busy cores mostly wait for each other)")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads={args.threads}: must be >= 0 (0 = picked)")
    try:
        _check(args.max_new_tokens, args.num_samples)
    except ValueError as e:
        p.error(f"--{e}")
    device = _device(p, args.device)
    started = False  # text printed: an error then starts on a line of its own
    try:
        model, tok = load_model(args.ckpt, device)
        _set_threads(model, tok, args)
        g = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
        for i in range(args.num_samples):
            if args.num_samples > 1:
                print(f"--- sample {i + 1} ---")
            print(tok.decode(tok.encode(args.prompt or "\n")), end="", flush=True)
            started = True
            for (piece,) in stream(model, tok, args.prompt, max_new_tokens=args.max_new_tokens, generator=g,
                                   temperature=args.temperature, top_k=args.top_k, use_cache=not args.no_cache,
                                   compile=args.compile):
                print(piece, end="", flush=True)
            print()
    except (CheckpointError, ValueError) as e:
        print(("\n" if started else "") + f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
