"""Chapter 08, made fast: a decode step with no host value in it, for torch.compile to capture as one CUDA graph.

Batch-1 decoding of a small GPT is launch-bound: every token runs ~20 kernels per block, each behind Python (checks,
an autograd Function, Triton's launcher) that costs more than the kernel (H100, 2026-11-25: 2.1 ms of GPU work for
4 tokens, 47 ms of host time). gpt-fast's answer is to capture the whole step once and replay it: a CUDA graph.
A graph replays fixed kernels on fixed addresses, so the step may not depend on anything the host reads:

* the cache is preallocated (``KVCache``: (B, KVH, T_max, D) per layer) and its tensors are marked static
  (``torch._dynamo.mark_static_address``), so the graph writes them in place instead of copying them in and out;
* positions are the device tensor ``KVCache.lengths``: RoPE gathers its cos/sin rows by position, the new k/v are
  stored at [b, :, lengths[b]] by an index_put, and the decode kernel reads each sequence's length itself;
* the step moves ``lengths`` on by one in place; the host's copy (``host_lengths``), which guards against overflow
  and decides when to crop and prefill again, moves outside the graph.

Once captured, the graph is bound by how many kernels it replays, not by bytes (H200, 2026-11-28: 244 kernels a
token, 1688 tok/s, 5.4 % of the HBM roofline). So the step is written for Inductor to fuse, on purpose in plain
torch ops rather than minite's Triton kernels: at batch 1 on a GPU, Inductor's fusion beats per-op kernels, because
each minite op is a fusion barrier and a launch of its own, while a (1, C) row costs nothing to compute. Per block:

* the residual add and RMSNorm: one torch expression, which Inductor fuses into one kernel (minite's RMSNorm op
  would be a kernel plus the add's kernel);
* RoPE with its cos/sin gather by position and the cache write: torch ops, fused into the scatter that writes k/v;
* silu(gate) * up: one fused pointwise kernel;
* attention: minite's decode kernel (a registered op: one launch) on the Triton backend, single-pass (one program
  per kv head reads the whole context: no merge kernel) up to ``SINGLE_PASS_MAX_LEN`` keys, the split-KV kernel of
  chapter 08 (partials + merge) past it, where parallel splits pay for their second launch. ``Decoder`` chooses by
  the host length (two graphs at most). On the torch backend (CPU): SDPA over the cache with a length mask.

The arithmetic is the references' (fp32 math, results in the activations' dtype): the step gives the ordinary
cached forward's logits. Counted on the CPU (tests/models/test_decoding.py), Inductor makes 110 launches a token of
a 12-layer step (49 generated kernels, 49 GEMMs, 12 decode ops; 135 before the step was written for it).
``decode_step(model, tok, cache)`` is that step, eager or compiled; ``Decoder(model,
compile=...)`` wraps it with the host-side checks and is what ``GPT.generate(decoder=...)`` and
``python -m minite.sample --compile`` use. The prefill (many tokens) stays on the ordinary path
(``GPT.forward(kv_cache=...)``).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from minite.backend import resolve_backend
from minite.kernels._common import op
from minite.kernels.decode import SINGLE_PASS_MAX_LEN, decode_attention_triton
from minite.kernels.rmsnorm import RMSNorm, rmsnorm_ref
from minite.kernels.rope import rope_ref
from minite.kernels.swiglu import swiglu_ref
from minite.layers.mlp import SwiGLU

__all__ = ["decode_step", "attention_step", "Decoder", "SINGLE_PASS_MAX_LEN"]


def _norm(mod, x: torch.Tensor) -> torch.Tensor:
    # minite's RMSNorm as torch ops (its reference): Inductor fuses it with the residual add that produced x.
    return rmsnorm_ref(x, mod.weight, mod.eps) if isinstance(mod, RMSNorm) else mod(x)


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    # The dense SwiGLU MLP with silu(gate) * up in torch ops (one fused pointwise kernel); any other MLP (a MoE) as is.
    if not (isinstance(mlp, SwiGLU) and mlp.fused):
        return mlp(x)
    gate, up = mlp.gate_up(x).split(mlp.hidden, dim=-1)  # (B, 1, hidden) each
    y = mlp.down(swiglu_ref(gate, up))  # (B, 1, C)
    return mlp.dropout(y) if hasattr(mlp, "dropout") else y


def attention_step(attn, x: torch.Tensor, cache, layer: int, *, moved: bool = False,
                   split_kv: bool = False) -> torch.Tensor:
    """One new token per sequence through a CausalSelfAttention, at the positions cache.lengths (B,) on the device.
    x (B, 1, C) -> (B, 1, C); writes this layer's k/v into the cache. moved: cache.lengths already counts the new
    token (decode_step moves it once, first: no other kernel for the lengths in the step); split_kv: the split-KV
    kernel instead of the single pass (the Triton backend only)."""
    B = x.shape[0]
    H, KVH, D = attn.n_head, attn.n_kv_head, attn.head_dim
    lengths = cache.lengths if moved else cache.lengths + 1  # (B,) keys per sequence, the new token's included
    pos = lengths - 1  # (B,) int64: each sequence's new position (an index expression inside Inductor's kernels)
    q, k, v = attn.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)  # (B, 1, H*D), (B, 1, KVH*D) x 2
    # RoPE with one position per sequence: the B new tokens as the T axis of one "bthd" sequence, each its own row
    # of the cos/sin tables (gathered on the device: no host position). Torch ops: fused into the cache write.
    cos, sin = attn.rotary.cos[pos], attn.rotary.sin[pos]  # (B, D/2)
    q = rope_ref(q.view(1, B, H, D), cos, sin, layout="bthd")[0]  # (B, H, D)
    k = rope_ref(k.view(1, B, KVH, D), cos, sin, layout="bthd")[0]  # (B, KVH, D)
    kc, vc = cache.k[layer], cache.v[layer]  # (B, KVH, T_max, D)
    rows = torch.arange(B, device=x.device)
    kc[rows, :, pos] = k.to(kc.dtype)  # (B, KVH, D) stored at [b, :, pos[b]]
    vc[rows, :, pos] = v.view(B, KVH, D).to(vc.dtype)
    if resolve_backend(q, attn.backend) == "triton" and D <= 128:
        # One registered op under torch.compile (torch.ops.minite.decode_attention): a single launch when one pass
        # reads the whole context (num_splits=1), partials + merge when split (None: the wave heuristic on T_max).
        y = op("decode_attention", decode_attention_triton)(q, kc, vc, lengths, None, None if split_kv else 1, None)
    else:
        keep = torch.arange(kc.shape[2], device=x.device) < lengths[:, None]  # (B, T_max)
        y = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=keep[:, None, None],
                                           enable_gqa=True)[:, :, 0]  # (B, H, D)
    return attn.resid_dropout(attn.proj(y.reshape(B, 1, H * D)))  # (B, 1, C)


def decode_step(model, tok: torch.Tensor, cache, split_kv: bool = False) -> torch.Tensor:
    """tok (B, 1) token ids -> logits (B, 1, V_pad) of a minite GPT, at each sequence's cache position; moves
    cache.lengths (device) on by one. No host value is read: torch.compile(fullgraph=True) traces it as one graph,
    the same graph at every step. The caller keeps cache.host_lengths and checks room (``Decoder`` does both).
    split_kv: attend with the split-KV kernel (long contexts; see SINGLE_PASS_MAX_LEN), not the single pass."""
    cache.lengths.add_(1)  # first: the keys each sequence holds once this token's are written; positions - 1
    x = model.wte(tok)  # (B, 1, C)
    for i, block in enumerate(model.blocks):
        # x + branch, then the next norm: Inductor fuses each residual add with the norm that reads it
        x = x + attention_step(block.attn, _norm(block.norm1, x), cache, i, moved=True, split_kv=split_kv)
        x = x + _mlp(block.mlp, _norm(block.norm2, x))  # (B, 1, C)
    head = model.wte.weight if model.config.tie_embeddings else model.lm_head.weight  # (V_pad, C)
    return F.linear(_norm(model.norm_f, x), head)  # (B, 1, V_pad)


class Decoder:
    """``decode_step`` for one model, with the host's part: room in the cache and in the RoPE tables, the host
    lengths, the choice between the single-pass and the split-KV attention (by the host length: past
    ``SINGLE_PASS_MAX_LEN`` keys, split), and (compile) the cache marked static the first time a cache is seen.

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
        longest = max(cache.host_lengths)
        if longest >= limit:
            raise ValueError(f"Decoder: position {longest} is past the RoPE tables "
                             f"(block_size={limit}): crop the context and prefill again")
        if self.compile is not None:
            self._mark_static(cache)
        split_kv = longest + 1 > SINGLE_PASS_MAX_LEN  # a bool: one graph each side of the threshold
        logits = self.fn(self.model, tok.contiguous(), cache, split_kv)  # fixed strides (idx[:, -1:]'s depend on T)
        cache.host_lengths = [p + 1 for p in cache.host_lengths]  # the device's moved inside the step
        return logits

    def _mark_static(self, cache) -> None:
        # After the prefill (which may have converted a layer's cache to the activations' dtype): fixed addresses
        # the graph writes in place, not inputs to copy in at every replay.
        for t in (*cache.k, *cache.v, cache.lengths):
            if self._static.get(id(t)) is not t:
                torch._dynamo.mark_static_address(t)
                self._static[id(t)] = t
