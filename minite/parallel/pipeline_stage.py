"""The pieces of a pipeline stage (chapter 12): where to cut the GPT, and one stage as a module.

``partition`` balances the stages by parameter count with the embedding on the first stage and the tied head on the
last; ``Stage`` holds deep copies of the dense GPT's modules under their dense names, so a test compares
gradients by name and the stages' state dicts together are the dense state dict.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.nn import functional as F

from minite.models.gpt import GPT
from minite.ops import cross_entropy
from minite.parallel import comm
from minite.parallel.dims import ParallelError
from minite.parallel.sequence import TPGPT

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
    """Blocks ``layers`` of the model, plus the embedding on the first stage and norm_f + tied head + loss on the
    last. forward: ids or activations -> activations, or the loss. The model is the dense GPT (its modules are
    deep-copied: the caller keeps an untouched reference) or a tensor-parallel ``TPGPT`` built for this stage (its
    modules are taken as they are: their gradient hooks belong to them), so pp composes with tp (and sp)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        own = copy.deepcopy if isinstance(model, GPT) else (lambda m: m)
        self.first = first
        self.last = last
        self.layers = layers
        self.backend = model.backend
        tp = isinstance(model, TPGPT) or getattr(model, "inner", None) is TPGPT  # TPGPT, or CPGPT over one
        self.tp_head = TPGPT.head if tp else None  # the vocab-parallel head, run on this stage's modules
        self.group, self.sp = getattr(model, "group", None), getattr(model, "sp", False)  # what that head reads
        if first or last:
            self.wte = own(model.wte)
        self.drop = own(model.drop)
        self.blocks = nn.ModuleDict({str(i): own(model.blocks[i]) for i in layers})
        if last:
            self.norm_f = own(model.norm_f)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, last: int = -1) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x))  # (b, T) ids -> (b, T, C), or (b, T/tp, C) with sequence parallelism
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x  # (b, T, C): sent to the next stage
        x = self.norm_f(x)
        if self.tp_head is not None:  # vocab-parallel head and loss (chapter 11), on this stage's wte shard
            logits, loss = self.tp_head(self, x, targets, last)
            return logits if targets is None else loss
        if targets is None:
            return F.linear(x[:, [last], :], self.wte.weight)  # (b, 1, V_pad): generation needs the last position
        logits = F.linear(x, self.wte.weight)  # (b, T, V_pad)
        return cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), backend=self.backend)


class _PendingGrads(torch.autograd.Function):
    """forward: the loss the schedule computed / backward: add upstream * the schedule's gradients to .grad."""

    @staticmethod
    def forward(ctx, loss, anchor, model):
        ctx.model = model
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.model._accumulate(ctx.model._pending, float(g))
        ctx.model._pending = None
        return None, None, None


@contextlib.contextmanager
def my_tokens(stage: Stage, cp_group, x: torch.Tensor):
    """pp x cp: yields my tokens' global positions (None without cp) and sets them on every attention of the stage
    (CPGPT's layers: RoPE by global position, attention by the ring, chapter 13) for the schedule's duration."""
    n = comm.size(cp_group)
    if n == 1:
        yield None
        return
    from minite.parallel.context import positions
    pos = positions(x.shape[1], n, comm.rank(cp_group)).to(x.device)
    attns = [b.attn for b in stage.blocks.values()]
    try:
        for a in attns:
            a.pos = pos
        yield pos
    finally:
        for a in attns:
            a.pos = None
