"""Attention. Chapter 07 brings the flash-attention kernels; until then only the reference exists, and every
backend runs it: a forced "triton" that could run Triton warns once and uses the reference (so a whole model can
run with backend="triton"); a forced "triton" where Triton cannot run raises like every other op.

Layout (B, H, T, D) like SDPA; k/v may have fewer heads (grouped-query attention, H % KVH == 0).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from minite.backend import get_backend, resolve_backend

__all__ = ["attention_ref", "attention"]

_warned = False  # the "no Triton kernel yet" warning is given once per process


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D (B, H, T, D) tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (B, H, _, D), (Bk, KVH, _, Dk) = q.shape, k.shape
    if B != Bk or D != Dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if KVH == 0 or H % KVH:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads KVH={KVH}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"attention needs floating-point tensors, got {q.dtype}")


# ------------------------------------------------------------------------------------------ 1. reference
def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v, with k/v heads repeated for GQA. Returns q's dtype."""
    H, KVH = q.shape[1], k.shape[1]
    if H != KVH:
        k = k.repeat_interleave(H // KVH, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(H // KVH, dim=1)  # (B, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# ------------------------------------------------------------------------------------------ 5. functional
def attention(q, k, v, *, causal: bool = True, scale: float | None = None, backend: str | None = None):
    """Scaled dot-product attention; q (B, H, T, D), k/v (B, KVH, T, D). No Triton kernel yet (chapter 07):
    a forced "triton" (argument, use_backend() or $MINITE_BACKEND) warns once and runs the reference."""
    global _warned
    _check(q, k, v)
    # Validates the name (unknown -> ValueError) and raises the usual RuntimeError when a forced "triton"
    # cannot run here at all; "auto" never raises.
    if resolve_backend(q, backend) == "triton" and (backend or get_backend()) == "triton" and not _warned:
        _warned = True
        warnings.warn("attention has no Triton kernel yet (chapter 07): backend='triton' runs the PyTorch "
                      "reference for it", stacklevel=2)
    return attention_ref(q, k, v, causal, scale)
