"""The pieces of a pipeline stage (chapter 12): where to cut the GPT, and one stage as a module.

``partition`` balances the stages by parameter count with the embedding on the first stage and the tied head on the
last; ``Stage`` holds deep copies of the dense GPT's modules under their dense names, so a test compares
gradients by name and the stages' state dicts together are the dense state dict. ``StageMoE``: a stage's
mixture-of-experts duties in one schedule (the balance loss per micro-batch, the routing stats). The "bias" balance
needs nothing here: every micro-batch's forward adds its load to its layers' ``routed`` and the bias moves at the
optimizer step (minite.layers.moe.step_expert_bias), so every micro-batch routes with the same bias.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.nn import functional as F

from minite.models.gpt import GPT, _take_aux_loss
from minite.ops import cross_entropy
from minite.parallel import comm
from minite.parallel.dims import ParallelError
from minite.parallel.expert import moe_layers
from minite.parallel.sequence import TPGPT

__all__ = ["partition", "Stage", "StageMoE"]


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
        if not getattr(model.config, "tie_embeddings", True):  # the last stage's head is its wte
            raise ParallelError("pipeline Stage: tie_embeddings=False (an untied LM head) is not supported")
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
        ctx.model._accumulate(ctx.model._pending, float(g) / ctx.model._seed)  # the seed's scale is in them
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


class StageMoE:
    """One schedule's mixture-of-experts duties on a stage (nothing to do for a dense GPT). Under balance "aux" in
    training, micro-batch i's backward includes moe_aux_weight * (my blocks' Switch loss) / m: added to the loss
    on the last stage, a second root of the backward with gradient 1/m elsewhere (Megatron's per-micro-batch
    balance loss). ``stats``: the routing, summed."""

    def __init__(self, stage: Stage, cfg, training: bool, m: int, device):
        self.moes, self.cfg, self.m = moe_layers(stage), cfg, m
        self.blocks = list(stage.blocks.values())
        self.aux = bool(self.moes) and cfg.moe_balance == "aux" and cfg.moe_aux_weight > 0 and training
        self.held = {}  # micro-batch -> its balance loss term, until its backward
        self.stats = torch.zeros(cfg.moe_num_experts + 3, dtype=torch.float64, device=device)
        self.stats[-1] = len(self.moes) * m  # [load per expert..., dropped, sum of Switch losses, their count]

    def after_forward(self, i: int, out: torch.Tensor, last: bool):
        """(the stage's output, its share of the reported loss) after micro-batch i's forward."""
        if not self.moes:
            return out, 0.0
        aux = _take_aux_loss(self.cfg, self.blocks)
        self.stats[:-3] += sum(mo.load for mo in self.moes).double()
        self.stats[-3] += sum(mo.dropped for mo in self.moes)
        self.stats[-2] += aux.detach().double()
        if not self.aux:
            return out, 0.0
        if last:  # the loss of micro-batch i, its balance share included
            return out + self.cfg.moe_aux_weight * aux, 0.0
        self.held[i] = self.cfg.moe_aux_weight * aux
        return out, self.held[i].detach().double() / self.m

    def backward(self, i: int, out: torch.Tensor, grad: torch.Tensor, seed: float) -> None:
        """Micro-batch i's backward from `grad`, its balance loss seeded with `seed` (loss scale / m)."""
        torch.autograd.backward(*self.roots(i, out, grad, seed))

    def roots(self, i: int, out: torch.Tensor, grad: torch.Tensor, seed: float) -> tuple[list, list]:
        """Micro-batch i's backward roots and their gradients: out with `grad`, its balance loss with `seed`."""
        aux = self.held.pop(i, None)
        return ([out], [grad]) if aux is None else ([out, aux], [grad, torch.full_like(aux, seed)])

    def gather_stats(self, group) -> dict | None:
        """Every stage's routing (a collective over `group`, the pp group, then over the ranks of the global batch,
        dp x cp, by the MoE's exchange): assignments per expert summed over the layers and micro-batches (the global
        load already), dropped summed over the ranks, the Switch loss (global f_i, my tokens' P_i) averaged over
        them all (1.0 = uniform)."""
        if not self.moes:
            return None
        t = self.stats.clone()
        comm.all_reduce(t, group)
        mine = torch.cat([t[-3:-1], t.new_ones(1)])  # dropped and Switch losses: per rank; 1: counts the ranks
        mine = self.moes[0].exchange.batch_sum(mine)
        t[-3], t[-2] = mine[0], mine[1] / mine[2]
        return {"tokens_per_expert": [int(v) for v in t[:-3]], "dropped": int(t[-3]),
                "balance_loss": round(float(t[-2] / t[-1]), 4)}

