"""Rotary position embeddings (chapter 04). PLACEHOLDER: reference path only until chapter 04 lands its kernel."""
from __future__ import annotations

import torch
from torch import nn


def rope_cos_sin(T: int, D: int, *, base: float = 10000.0, offset: int = 0, device=None):
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))  # (D/2,)
    t = torch.arange(offset, offset + T, device=device, dtype=torch.float32)  # (T,)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    return freqs.cos(), freqs.sin()


def rope_ref(x, cos, sin):
    """x (B, H, T, D); cos/sin (T, D/2); rotate pairs (x[..., :D/2], x[..., D/2:])."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    y = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return y.to(x.dtype)


def rope(x, cos, sin, *, backend: str | None = None):
    return rope_ref(x, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0, backend: str | None = None):
        super().__init__()
        cos, sin = rope_cos_sin(max_seq_len, head_dim, base=base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.backend = backend

    def forward(self, x, offset: int = 0):
        T = x.shape[-2]
        return rope(x, self.cos[offset:offset + T], self.sin[offset:offset + T], backend=self.backend)
