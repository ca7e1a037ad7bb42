"""The gated MLP of the GPT (chapter 05): ``down(swiglu(gate(x), up(x)))``, x (..., dim) -> (..., dim).

The SwiGLU op itself (reference, kernels, autograd) is minite/kernels/swiglu.py; this module holds the three
projections around it, as ``minite.nn.Linear`` layers so that ``fp8_autocast`` runs them in FP8.
"""
from __future__ import annotations

import torch
from torch import nn

from minite.kernels.swiglu import swiglu
from minite.layers.linear import Linear

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """The gated MLP: down(silu(gate(x)) * up(x)); x (..., dim) -> (..., dim) through a (..., hidden) middle.
    ``fused=True`` computes gate and up with one (dim -> 2 * hidden) projection ``gate_up`` (one GEMM instead of
    two; the kernel reads the two halves as strided views): the GPT's MLP is this module."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, backend: str | None = None, *,
                 fused: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        where = {"bias": bias, "device": device, "dtype": dtype}
        if fused:
            self.gate_up = Linear(dim, 2 * hidden, **where)  # (dim) -> (2 * hidden): [gate | up]
        else:
            self.gate = Linear(dim, hidden, **where)  # (dim) -> (hidden)
            self.up = Linear(dim, hidden, **where)  # (dim) -> (hidden)
        self.down = Linear(hidden, dim, **where)  # (hidden) -> (dim)
        self.dim = dim
        self.hidden = hidden
        self.backend = backend
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up(x).split(self.hidden, dim=-1)  # (..., hidden) each, strided views
        else:
            gate = self.gate(x)
            up = self.up(x)
        return self.down(swiglu(gate, up, backend=self.backend))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}, fused={self.fused}, backend={self.backend!r}"
