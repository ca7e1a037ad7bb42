"""Row softmax (chapter 00). PLACEHOLDER: reference only until chapter 00 lands its kernel."""
from __future__ import annotations

import torch
from torch import nn


def softmax_ref(x, dim: int = -1):
    return torch.softmax(x.float(), dim=dim).to(x.dtype)


def softmax(x, *, dim: int = -1, backend: str | None = None):
    return softmax_ref(x, dim)


class Softmax(nn.Module):
    def __init__(self, dim: int = -1, backend: str | None = None):
        super().__init__()
        self.dim, self.backend = dim, backend

    def forward(self, x):
        return softmax(x, dim=self.dim, backend=self.backend)
