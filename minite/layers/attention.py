"""CausalSelfAttention: the attention block of the GPT, built from minite parts only.

    x (B, T, C) -> qkv projection -> RoPE on q and k -> attention (causal, GQA) -> out projection

q, k and v stay views of the projection's output, (B, T, H + 2 KVH, D), and the attention output is written
(B, T, H, D), whose (B, T, C) view feeds the out projection: no transpose is copied either way, and the backward
writes dq, dk and dv into one d(qkv) buffer (``minite.kernels.attention.attention_qkv``).

Grouped-query attention (GQA): ``n_head`` query heads share ``n_kv_head`` key/value heads (each K/V head serves
``n_head // n_kv_head`` query heads). ``n_kv_head == n_head`` is ordinary multi-head attention, ``n_kv_head == 1``
is multi-query attention. Fewer K/V heads shrink the qkv projection and, at inference, the KV cache.

Every projection is a ``minite.nn.Linear`` so ``fp8_autocast`` can take it over; RoPE and attention go through
``minite.ops`` so the backend switch (PyTorch reference or Triton kernel) decides how they run: on the Triton
backend attention is the flash-attention kernel of chapter 07.

With a ``KVCache`` (chapter 08) the layer takes only the new tokens: it rotates q and k at each sequence's cache
position, stores k and v, and attends over the cache: the split-KV decode kernel for one new token, the flash
kernel (bottom-right causal, T_q < T_k) for a prefill.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minite.kernels.attention import attention_qkv
from minite.kernels.decode import decode_attention
from minite.kernels.rope import RotaryEmbedding
from minite.layers.linear import Linear
from minite.ops import attention

if TYPE_CHECKING:
    from minite.layers.kv_cache import KVCache

__all__ = ["CausalSelfAttention"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary position embeddings and grouped-query attention.

    Args:
        n_embd: model width C.
        n_head: number of query heads H (C % H == 0, head size D = C // H, D even for RoPE).
        n_kv_head: number of key/value heads KVH (H % KVH == 0); None means KVH = H.
        max_seq_len: longest sequence the RoPE tables cover (the model's block_size).
        rope_base: RoPE frequency base (10000 as in RoFormer / LLaMA).
        dropout: dropout on the output projection (residual dropout).
        bias: whether the projections carry a bias.
        backend: "auto" | "torch" | "triton" | None, passed to every minite.ops call.
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int | None = None, *, max_seq_len: int,
                 rope_base: float = 10000.0, dropout: float = 0.0, bias: bool = False, backend: str | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        if n_head % n_kv_head != 0:
            raise ValueError(f"n_head={n_head} must be divisible by n_kv_head={n_kv_head} (grouped-query attention)")
        head_dim = n_embd // n_head
        if head_dim % 2 != 0:
            raise ValueError(f"head size n_embd // n_head = {head_dim} must be even for RoPE")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.max_seq_len, self.backend = max_seq_len, backend
        # One fused projection for q, k and v: C -> (H + 2 * KVH) * D (one matmul instead of three).
        self.qkv = Linear(n_embd, (n_head + 2 * n_kv_head) * head_dim, bias=bias, device=device, dtype=dtype)
        self.proj = Linear(n_head * head_dim, n_embd, bias=bias, device=device, dtype=dtype)
        self.resid_dropout = nn.Dropout(dropout)
        # minite.nn.RotaryEmbedding: the cos/sin tables (max_seq_len, D/2), not saved in checkpoints.
        self.rotary = RotaryEmbedding(head_dim, max_seq_len, base=rope_base, backend=backend, device=device,
                                      dtype=dtype)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape  # batch, sequence length, model width
        pos = kv_cache.host_lengths if kv_cache is not None else [0] * B  # first position of x, per sequence
        if max(pos) + T > self.max_seq_len:
            raise ValueError(f"sequence length {max(pos) + T} is longer than max_seq_len={self.max_seq_len} of the "
                             "RoPE tables")
        H, KVH, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x)  # (B, T, (H + 2 KVH) * D): per token, H query heads, then KVH key and KVH value heads
        if kv_cache is None:  # training / a full forward: RoPE and attention on views of qkv, no layout copy
            cos, sin = self.rotary.cos[:T], self.rotary.sin[:T]  # (T, D/2) views
            y = attention_qkv(qkv, cos, sin, H, KVH, causal=True, backend=self.backend)  # (B, T, H, D), dense
            return self.resid_dropout(self.proj(y.reshape(B, T, H * D)))  # a view: heads side by side already
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, KVH, D).transpose(1, 2)  # (B, KVH, T, D)
        v = v.view(B, T, KVH, D).transpose(1, 2)  # (B, KVH, T, D)
        q, k = self._rope(q, pos), self._rope(k, pos)  # (B, H, T, D), (B, KVH, T, D)
        kv_cache.write(layer, k, v)
        y = self._cached_attention(q, kv_cache, layer, pos)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.proj(y))  # (B, T, C)

    def _rope(self, x: torch.Tensor, pos: list[int]) -> torch.Tensor:
        # Rotate token t of sequence b by the angle of position pos[b] + t (its place in the cache, not 0).
        if all(p == pos[0] for p in pos):
            return self.rotary(x, offset=pos[0])
        return torch.cat([self.rotary(x[b:b + 1], offset=p) for b, p in enumerate(pos)])  # (B, H, T, D)

    def _cached_attention(self, q, cache: KVCache, layer: int, pos: list[int]) -> torch.Tensor:
        # q (B, H, T, D) of the new tokens; the cache's k/v (B, KVH, T_max, D) already hold them at pos[b] ...
        kc, vc = cache.k[layer], cache.v[layer]
        T = q.shape[2]
        if T == 1:  # decode: one query per sequence, its own length: the split-KV kernel
            # The cache's own device lengths (not yet advanced) + 1, the new token: a host list turned into a
            # tensor would be a host-to-device copy, and a stream sync, in every layer on CUDA.
            lengths = cache.lengths + 1
            return decode_attention(q[:, :, 0], kc, vc, lengths, max_len=max(pos) + 1,
                                    backend=self.backend)[:, :, None]  # (B, H, 1, D)
        if all(p == pos[0] for p in pos):  # prefill / chunk: T queries against pos + T keys, bottom-right causal
            n = pos[0] + T
            return attention(q, kc[:, :, :n], vc[:, :, :n], causal=True, backend=self.backend)
        return torch.cat([attention(q[b:b + 1], kc[b:b + 1, :, :p + T], vc[b:b + 1, :, :p + T], causal=True,
                                    backend=self.backend) for b, p in enumerate(pos)])

    def extra_repr(self) -> str:
        return f"n_head={self.n_head}, n_kv_head={self.n_kv_head}, head_dim={self.head_dim}"
