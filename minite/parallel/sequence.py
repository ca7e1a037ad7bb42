"""Chapter 11: sequence parallelism, and the GPT under tensor (+ sequence) parallelism, built from the dense GPT.

With TP alone, everything outside the column/row pairs (the norms, dropout, the residual adds) runs on the whole
(B, T, C) activation on every tp rank: the same work, and the same memory, tp times. Sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models") cuts those regions along
the sequence instead: each rank keeps (B, T/tp, C). The all-reduce g after a row-parallel linear becomes a
reduce-scatter (each rank keeps its sequence chunk of the sum), and the f before a column-parallel linear becomes
an all-gather. A ring all-reduce *is* a reduce-scatter then an all-gather, so SP moves the same bytes as TP.
The norm weights then see only 1/tp of the tokens: their gradients are summed over the tp group (a hook).

Activation memory per layer (bytes, 16-bit activations, no recomputation; s sequence, b batch, h width, a heads,
t = tp), from the paper:   TP only:  s b h (10 + 24/t + 5 a s / (h t))     TP + SP:  s b h / t (34 + 5 a s / h)
``activation_bytes`` evaluates them; the lesson measures peak memory per rank against them.

A mixture-of-experts feed-forward (chapter 16) is not sharded over tp here, the simplest correct design: every tp
rank holds the whole MoE and runs it on the same tokens (under SP it all-gathers the sequence first, each rank
keeping the gradient of its own chunk, and keeps its chunk of the output, whose backward all-gathers the gradient).
Every tp rank then computes the same full MoE gradients, tp times the same work: no tp reduction, and the router's
balance statistics see every token of the sequence (summed over dp as without tp). Its Switch loss joins the loss.
With ep (expert.py) each tp rank holds the same E/ep experts and dispatches to the ranks of its own tp index.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from minite.layers.moe import MoE
from minite.models.gpt import GPT, _take_aux_loss
from minite.parallel import comm
from minite.parallel.dims import ParallelError
from minite.parallel.tensor import TPMLP, TPAttention, VocabParallelEmbedding, tag, vocab_parallel_cross_entropy

__all__ = ["TPBlock", "TPGPT", "activation_bytes", "gather_dense"]


def _norm(dense: nn.Module, group, name: str, sequence_parallel: bool) -> nn.Module:
    m = copy.deepcopy(dense)
    n = comm.size(group)
    tag(m.weight, name + ".weight", replicas=n)
    if sequence_parallel and n > 1:  # each rank saw T/tp tokens: the full gradient is the sum over the tp group
        m.weight.register_hook(lambda g: _summed(g, group))
    return m


def _summed(g: torch.Tensor, group) -> torch.Tensor:
    g = g.clone()
    comm.all_reduce(g, group)
    return g


class TPBlock(nn.Module):
    def __init__(self, dense, group, *, name: str, sequence_parallel: bool):
        super().__init__()
        self.norm1 = _norm(dense.norm1, group, name + ".norm1", sequence_parallel)
        self.attn = TPAttention(dense.attn, group, name=name + ".attn", sequence_parallel=sequence_parallel)
        self.norm2 = _norm(dense.norm2, group, name + ".norm2", sequence_parallel)
        self.group, self.moe = group, isinstance(dense.mlp, MoE)
        self.sp = sequence_parallel and comm.size(group) > 1
        if self.moe:  # replicated on every tp rank, whole (see the module's docstring)
            self.mlp = copy.deepcopy(dense.mlp)
            for n, p in self.mlp.named_parameters():
                tag(p, f"{name}.mlp.{n}", replicas=comm.size(group))
        else:
            self.mlp = TPMLP(dense.mlp, group, name=name + ".mlp", sequence_parallel=sequence_parallel)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))  # x: (B, T, C), or (B, T/tp, C) with SP
        if self.moe and self.sp:  # the whole sequence through the MoE; my chunk back (full gradients both ways)
            h = comm.gather_split(self.norm2(x), self.group, 1)  # (B, T, C); backward: my chunk of the full grad
            return x + comm.scatter_to_sequence(self.mlp(h), self.group, 1)  # backward: the grad all-gathered
        return x + self.mlp(self.norm2(x))


class TPGPT(nn.Module):
    """The GPT sharded over `group` (tp ranks), optionally sequence-parallel. ``forward(idx, targets)`` returns
    (my vocabulary slice of the logits, the loss); without targets, the last position's full logits (gathered)."""

    def generate(self, idx, max_new_tokens, **kw):
        """GPT.generate without the KV cache (chapter 08's cache is not sharded by heads here): forward(idx) only."""
        return GPT.generate(self, idx, max_new_tokens, **{**kw, "use_cache": False})

    def __init__(self, dense: GPT, group, *, sequence_parallel: bool = False):
        super().__init__()
        cfg, n = dense.config, comm.size(group)
        self.config = cfg
        self.group = group
        self.sp = sequence_parallel and n > 1
        self.backend = dense.backend
        if not getattr(cfg, "tie_embeddings", True):  # head(): the vocab-parallel head is the wte shard
            raise ParallelError("TPGPT: tie_embeddings=False (an untied LM head) is not supported: the "
                                "vocab-parallel head is the embedding's shard")
        if sequence_parallel and n > 1 and cfg.block_size % n:
            raise ValueError(f"sequence parallelism needs T divisible by tp={n}; block_size={cfg.block_size}")
        self.wte = VocabParallelEmbedding(dense.wte, group, sequence_parallel=self.sp)
        self.drop = nn.Dropout(dense.drop.p)
        self.blocks = nn.ModuleList([TPBlock(b, group, name=f"blocks.{i}", sequence_parallel=self.sp)
                                     for i, b in enumerate(dense.blocks)])
        self.norm_f = _norm(dense.norm_f, group, "norm_f", self.sp)

    @classmethod
    def from_dense(cls, dense: GPT, group, *, sequence_parallel: bool = False) -> "TPGPT":
        return cls(dense, group, sequence_parallel=sequence_parallel)

    def num_params(self) -> int:
        """Parameters of the whole model (each sharded one summed over the tp ranks, replicated ones once)."""
        return sum(round(float((torch.ones(p.shape) / getattr(p, "tp_replicas", 1)).sum())) * comm.size(self.group)
                   for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {T}: block_size is {self.config.block_size}")
        pad = (-T) % comm.size(self.group) if self.sp else 0
        if pad and targets is not None:
            raise ValueError(f"sequence parallelism: T={T} is not divisible by tp={comm.size(self.group)}")
        if pad:  # sampling: pad on the right (causal: the real positions never see the padding)
            idx = F.pad(idx, (0, pad))
        x = self.drop(self.wte(idx))  # (B, T, C), or (B, T/tp, C) with SP
        for block in self.blocks:
            x = block(x)
        aux = _take_aux_loss(self.config, self.blocks)  # MoE: the Switch losses (the same on every tp rank)
        logits, loss = self.head(self.norm_f(x), targets, T - 1)
        c = self.config
        if loss is not None and aux is not None and c.moe_balance == "aux" and c.moe_aux_weight and self.training:
            loss = loss + c.moe_aux_weight * aux  # as GPT.forward
        return logits, loss

    moe_stats = GPT.moe_stats  # the last forward's routing (every tp rank routed every token)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None, last: int = -1):
        """The tied LM head and loss on the final norm's output x: (my vocabulary slice of the logits, the loss),
        or without targets (the full logits at position `last`, None). Also the last pipeline stage's tail."""
        x = comm.gather_from_sequence(x, self.group, 1) if self.sp else comm.copy_to_parallel(x, self.group)
        if targets is None:
            logits = F.linear(x[:, [last], :], self.wte.weight)  # (B, 1, V/tp)
            return comm.gather_split(logits, self.group, 2), None  # (B, 1, V_pad)
        B, T, _ = x.shape
        logits = F.linear(x, self.wte.weight)  # (B, T, V/tp): my vocabulary slice, never gathered
        loss = vocab_parallel_cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), self.group,
                                            self.wte.start, backend=self.backend)
        return logits, loss

    def dense_state_dict(self) -> dict:
        """The dense GPT's state dict, gathered from the shards (a collective over the tp group)."""
        state = {p.dense_name: gather_dense(p.detach(), p, self.group) for p in self.parameters()}
        for i, b in enumerate(self.blocks):  # MoE: the balance bias buffer, whole on every rank
            if b.moe:
                state[f"blocks.{i}.mlp.expert_bias"] = b.mlp.expert_bias.detach().clone()
        return state


def gather_dense(t: torch.Tensor, p: nn.Parameter, group) -> torch.Tensor:
    """The dense tensor of which `t` holds p's slice (p's tag: dim and index): p itself, or a same-shaped state
    such as its AdamW moments. A collective over the tp group when p is sharded."""
    dim, index = getattr(p, "dense_index", (None, None))
    if dim is None:
        return t.detach().clone()
    full = comm.all_gather(t.detach().contiguous(), group, dim)
    idx = comm.all_gather(index.to(t.device), group, 0)
    shape = list(full.shape)
    shape[dim] = int(idx.max()) + 1  # replicated kv heads arrive more than once (identical copies)
    return full.new_empty(shape).index_copy_(dim, idx, full)


def activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. (2022) activation bytes per transformer layer, 16-bit activations, no recomputation."""
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
