"""Cross-entropy (chapter 06). PLACEHOLDER: reference path only until chapter 06 lands its kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_ref(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)


def cross_entropy(logits, target, *, ignore_index: int = -100, reduction: str = "mean", backend: str | None = None):
    return cross_entropy_ref(logits, target, ignore_index, reduction)
