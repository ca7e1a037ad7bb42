"""The pieces of a pipeline stage (chapter 12): where to cut the GPT, and one stage as a module.

``partition`` balances the stages by parameter count with the embedding on the first stage and the tied head on the
last; ``Stage`` holds deep copies of the dense GPT's modules under their dense names, so a test compares
gradients by name and the stages' state dicts together are the dense state dict.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from minite.models.gpt import GPT
from minite.ops import cross_entropy
from minite.parallel.dims import ParallelError

__all__ = ["partition", "Stage"]


def partition(model: GPT, p: int) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the largest stage's parameter count (every stage >= 1
    block). The embedding's parameters count on stage 0, norm_f and the (tied) head's on stage p-1."""
    n = len(model.blocks)
    if not 1 <= p <= n:
        raise ParallelError(f"pp={p} stages but only n_layer={n} layers: every stage needs at least one block")
    cost = [sum(q.numel() for q in b.parameters()) for b in model.blocks]
    emb, head = model.wte.weight.numel(), model.wte.weight.numel() + model.norm_f.weight.numel()

    def stage_cost(k, i, j):  # stage k holds blocks i..j-1
        return sum(cost[i:j]) + (emb if k == 0 else 0) + (head if k == p - 1 else 0)

    best = {(0, 0): (0, [])}  # (stages used, blocks used) -> (largest stage, cut points)
    for k in range(p):
        for i in range(k, n):
            if (k, i) not in best:
                continue
            worst, cuts = best[(k, i)]
            for j in range(i + 1, n - (p - k - 1) + 1):
                if k == p - 1 and j != n:
                    continue
                cand = (max(worst, stage_cost(k, i, j)), cuts + [j])
                if (k + 1, j) not in best or cand[0] < best[(k + 1, j)][0]:
                    best[(k + 1, j)] = cand
    cuts = [0] + best[(p, n)][1]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


class Stage(nn.Module):
    """Blocks ``layers`` of the dense GPT (deep copies, the dense parameter names), plus the embedding on the first
    stage and norm_f + tied head + loss on the last. forward: ids or activations -> activations, or the loss."""

    def __init__(self, dense: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.layers, self.backend = first, last, layers, dense.backend
        if first or last:
            self.wte = copy.deepcopy(dense.wte)
        self.drop = copy.deepcopy(dense.drop)
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(dense.blocks[i]) for i in layers})
        if last:
            self.norm_f = copy.deepcopy(dense.norm_f)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x))  # (b, T) ids -> (b, T, C)
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x  # (b, T, C): sent to the next stage
        x = self.norm_f(x)
        if targets is None:
            return F.linear(x[:, [-1], :], self.wte.weight)  # (b, 1, V_pad): generation needs the last position
        logits = F.linear(x, self.wte.weight)  # (b, T, V_pad)
        return cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), backend=self.backend)
