"""Attention (chapter 07 brings flash attention). Reference: torch's scaled_dot_product_attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_ref(q, k, v, causal: bool = True, scale: float | None = None):
    """q (B, H, T, D), k/v (B, KVH, T, D) with H % KVH == 0 (grouped-query attention)."""
    H, KVH = q.shape[1], k.shape[1]
    if H != KVH:
        k = k.repeat_interleave(H // KVH, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(H // KVH, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def attention(q, k, v, *, causal: bool = True, scale: float | None = None, backend: str | None = None):
    return attention_ref(q, k, v, causal, scale)
