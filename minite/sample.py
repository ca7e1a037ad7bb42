"""Sample text from a minite.train checkpoint.

    python -m minite.sample --ckpt out/ckpt.pt --prompt "ROMEO." --max_new_tokens 500 --temperature 0.8 --top_k 40
    python -m minite.sample --compile reduce-overhead ...     # CUDA: each decode step replayed as one CUDA graph

The checkpoint carries the model configuration and the tokenizer, so no data directory is needed. Any checkpoint
of minite.train: ``ckpt.pt`` (the last), ``ckpt_best.pt`` (the best val loss), or a LoRA run's (its base with the
adapters merged in).
"""
from __future__ import annotations

import argparse
import sys

import torch

from minite.checkpoint import CheckpointError, load_checkpoint
from minite.data import Tokenizer
from minite.finetune import dense_weights
from minite.models.gpt import GPT, GPTConfig
from minite.resources import pick_decode_threads

__all__ = ["load_model", "sample", "main"]


def load_model(path: str, device: str = "cpu") -> tuple[GPT, Tokenizer]:
    """(model in eval mode, tokenizer) from a checkpoint written by minite.train."""
    state = load_checkpoint(path)
    if "tokenizer" not in state:
        raise CheckpointError(f"checkpoint {path} carries no tokenizer")
    # backend "auto": a model trained with a forced backend (e.g. triton on a GPU) still samples anywhere.
    model = GPT(GPTConfig(**{**state["config"]["model"], "backend": "auto"}))
    model.load_state_dict(dense_weights(state, path))  # a LoRA run's checkpoint: its base + merged adapters
    return model.to(device).eval(), Tokenizer.from_json(state["tokenizer"])


def sample(model: GPT, tok: Tokenizer, prompt: str = "\n", *, max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = None, num_samples: int = 1, seed: int = 0, use_cache: bool = True,
           compile: str | None = None) -> list[str]:
    """Generate `num_samples` continuations of `prompt` (returned with the prompt in front). use_cache: decode
    with a KVCache (chapter 08), one token per step instead of the whole context again. compile: a torch.compile
    mode for the decode step (minite/decoding.py; "reduce-overhead" = a CUDA graph a step), None = eager."""
    dev = next(model.parameters()).device
    ids = tok.encode(prompt or "\n")  # raises a clear error for characters the tokenizer does not know
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=dev)  # (num_samples, T)
    g = torch.Generator(device=dev).manual_seed(seed)
    decoder = None
    if compile is not None:
        from minite.decoding import Decoder
        if not use_cache:
            raise ValueError("compile: the compiled decode step works on the KV cache; drop --no_cache")
        if dev.type != "cuda":  # traced whole (fullgraph): the CPU reference MoE reads its offsets on the host
            raise ValueError(f"compile={compile}: the compiled decode step (CUDA graphs) is for a GPU; the model is "
                             f"on {dev}")
        decoder = Decoder(model, compile=compile)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=g, use_cache=use_cache,
                         decoder=decoder)
    return [tok.decode(row.tolist()) for row in out]


def _set_threads(model: GPT, tok: Tokenizer, args: argparse.Namespace) -> None:
    """--threads N, or (0, on the CPU) the faster of all cores and 1 for this decode, as minite.train does."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    elif next(model.parameters()).device.type == "cpu":
        n = pick_decode_threads(model, args.num_samples, len(tok.encode(args.prompt or "\n")),
                                use_cache=not args.no_cache)
        torch.set_num_threads(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minite.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="out/ckpt.pt", help="checkpoint file (default: out/ckpt.pt)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens to generate (default: 500)")
    p.add_argument("--temperature", type=float, default=0.8, help="<1 sharper, >1 flatter, 0 greedy (default: 0.8)")
    p.add_argument("--top_k", type=int, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--num_samples", type=int, default=1, help="independent samples (default: 1)")
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
        model, tok = load_model(args.ckpt, args.device)
        _set_threads(model, tok, args)
        texts = sample(model, tok, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, num_samples=args.num_samples, seed=args.seed,
                       use_cache=not args.no_cache, compile=args.compile)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1} ---")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
