"""RMSNorm and LayerNorm (chapter 03). PLACEHOLDER: reference paths only until chapter 03 lands its kernels."""
from __future__ import annotations

import torch
from torch import nn


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def layernorm_ref(x, weight, bias, eps: float = 1e-5):
    return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


def rmsnorm(x, weight, *, eps: float = 1e-6, backend: str | None = None):
    return rmsnorm_ref(x, weight, eps)


def layernorm(x, weight, bias, *, eps: float = 1e-5, backend: str | None = None):
    return layernorm_ref(x, weight, bias, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, backend: str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.backend = eps, backend

    def forward(self, x):
        return rmsnorm(x, self.weight, eps=self.eps, backend=self.backend)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, backend: str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps, self.backend = eps, backend

    def forward(self, x):
        return layernorm(x, self.weight, self.bias, eps=self.eps, backend=self.backend)
