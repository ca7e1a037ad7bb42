"""SwiGLU (chapter 05). PLACEHOLDER: reference path only until chapter 05 lands its kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_ref(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu(gate, up, *, backend: str | None = None):
    return swiglu_ref(gate, up)


class SwiGLU(nn.Module):
    """The gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, backend: str | None = None):
        super().__init__()
        from minite.layers.linear import Linear
        self.gate = Linear(dim, hidden, bias=bias)
        self.up = Linear(dim, hidden, bias=bias)
        self.down = Linear(hidden, dim, bias=bias)
        self.backend = backend

    def forward(self, x):
        return self.down(swiglu(self.gate(x), self.up(x), backend=self.backend))
