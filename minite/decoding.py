"""Chapter 08, made fast: a decode step with no host value in it, for torch.compile to capture as one CUDA graph.

Batch-1 decoding of a small GPT is launch-bound: every token runs ~20 kernels per block, each behind Python (checks,
an autograd Function, Triton's launcher) that costs more than the kernel (H100, 2026-11-25: 2.1 ms of GPU work for
4 tokens, 47 ms of host time). gpt-fast's answer is to capture the whole step once and replay it: a CUDA graph.
A graph replays fixed kernels on fixed addresses, so the step may not depend on anything the host reads:

* the cache is preallocated (``KVCache``: (B, KVH, T_max, D) per layer) and its tensors are marked static
  (``torch._dynamo.mark_static_address``), so the graph writes them in place instead of copying them in and out;
* positions are the device tensor ``KVCache.lengths``: RoPE gathers its cos/sin rows by position, the new k/v are
  stored at [b, :, lengths[b]] by an index_put, and the split-KV decode kernel reads each sequence's length itself
  (over the whole cache's key blocks, skipping those past the length);
* the step moves ``lengths`` on by one in place; the host's copy (``host_lengths``), which guards against overflow
  and decides when to crop and prefill again, moves outside the graph.

``decode_step(model, tok, cache)`` is that step, eager or compiled; ``Decoder(model, compile=...)`` wraps it with
the host-side checks and is what ``GPT.generate(decoder=...)`` and ``python -m minite.sample --compile`` use.
The prefill (many tokens) stays on the ordinary path (``GPT.forward(kv_cache=...)``).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from minite.kernels.decode import decode_attention
from minite.kernels.rope import rope

__all__ = ["decode_step", "attention_step", "Decoder"]


def attention_step(attn, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
    """One new token per sequence through a CausalSelfAttention, at the positions cache.lengths (B,) on the device.
    x (B, 1, C) -> (B, 1, C); writes this layer's k/v into the cache."""
    B = x.shape[0]
    H, KVH, D = attn.n_head, attn.n_kv_head, attn.head_dim
    pos = cache.lengths  # (B,) int64: each sequence's next position
    q, k, v = attn.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)  # (B, 1, H*D), (B, 1, KVH*D) x 2
    # RoPE with one position per sequence: the B new tokens as the T axis of one "bthd" sequence, each its own row
    # of the cos/sin tables (gathered on the device: no host position).
    cos, sin = attn.rotary.cos[pos], attn.rotary.sin[pos]  # (B, D/2)
    q = rope(q.reshape(1, B, H, D), cos, sin, layout="bthd", backend=attn.backend)  # (1, B, H, D)
    k = rope(k.reshape(1, B, KVH, D), cos, sin, layout="bthd", backend=attn.backend)  # (1, B, KVH, D)
    kc, vc = cache.k[layer], cache.v[layer]  # (B, KVH, T_max, D)
    rows = torch.arange(B, device=x.device)
    kc[rows, :, pos] = k[0].to(kc.dtype)  # (B, KVH, D) stored at [b, :, pos[b]]
    vc[rows, :, pos] = v.reshape(B, KVH, D).to(vc.dtype)
    y = decode_attention(q[0], kc, vc, pos + 1, backend=attn.backend)  # (B, H, D); lengths include the new key
    return attn.resid_dropout(attn.proj(y.reshape(B, 1, H * D)))  # (B, 1, C)


def decode_step(model, tok: torch.Tensor, cache) -> torch.Tensor:
    """tok (B, 1) token ids -> logits (B, 1, V_pad) of a minite GPT, at each sequence's cache position; moves
    cache.lengths (device) on by one. No host value is read: torch.compile(fullgraph=True) traces it as one graph,
    the same graph at every step. The caller keeps cache.host_lengths and checks room (``Decoder`` does both)."""
    x = model.wte(tok)  # (B, 1, C)
    for i, block in enumerate(model.blocks):
        x = x + attention_step(block.attn, block.norm1(x), cache, i)  # (B, 1, C)
        x = x + block.mlp(block.norm2(x))  # (B, 1, C)
    cache.lengths.add_(1)
    return F.linear(model.norm_f(x), model.wte.weight)  # (B, 1, V_pad)


class Decoder:
    """``decode_step`` for one model, with the host's part: room in the cache and in the RoPE tables, the host
    lengths, and (compile) the cache marked static the first time a cache is seen.

    compile: None (eager), or a torch.compile mode: "reduce-overhead" is the CUDA graph (CUDA only), "default" a
    compiled graph without it; `backend` is torch.compile's (tests trace with "aot_eager" on the CPU)."""

    def __init__(self, model, *, compile: str | None = None, backend: str = "inductor") -> None:
        if compile not in (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs"):
            raise ValueError(f"Decoder: compile must be None, 'default', 'reduce-overhead' or "
                             f"'max-autotune-no-cudagraphs', got {compile!r}")
        self.model, self.compile = model, compile
        self._static: dict[int, torch.Tensor] = {}  # the cache tensors already marked static, by id
        if compile is None:
            self.fn = decode_step
        else:
            mode = None if compile == "default" else compile
            self.fn = torch.compile(decode_step, fullgraph=True, mode=mode, backend=backend)

    @torch.no_grad()
    def __call__(self, tok: torch.Tensor, cache) -> torch.Tensor:
        B = cache.batch_size
        if not isinstance(tok, torch.Tensor) or tuple(tok.shape) != (B, 1) or tok.is_floating_point():
            raise ValueError(f"Decoder: tok must be ({B}, 1) integer token ids, got "
                             f"{tuple(tok.shape) if isinstance(tok, torch.Tensor) else type(tok).__name__}")
        cache.check_room(1)
        limit = self.model.config.block_size  # the RoPE tables' length
        if max(cache.host_lengths) >= limit:
            raise ValueError(f"Decoder: position {max(cache.host_lengths)} is past the RoPE tables "
                             f"(block_size={limit}): crop the context and prefill again")
        if self.compile is not None:
            self._mark_static(cache)
        logits = self.fn(self.model, tok.contiguous(), cache)  # fixed strides (idx[:, -1:]'s depend on T)
        cache.host_lengths = [p + 1 for p in cache.host_lengths]  # the device's moved inside the step
        return logits

    def _mark_static(self, cache) -> None:
        # After the prefill (which may have converted a layer's cache to the activations' dtype): fixed addresses
        # the graph writes in place, not inputs to copy in at every replay.
        for t in (*cache.k, *cache.v, cache.lengths):
            if self._static.get(id(t)) is not t:
                torch._dynamo.mark_static_address(t)
                self._static[id(t)] = t
