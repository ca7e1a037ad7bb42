"""Chapter 13: the GPT under context parallelism (``torchrun -m minite.train --parallel.cp=N``).

Only attention mixes tokens, so ``CPGPT`` is the dense GPT, its own modules, with each attention layer's core
swapped for ``context.ring_attention`` (or the all-gather variant): every other op runs on my T/cp tokens. RoPE
rotates each token by its GLOBAL position (the load-balanced shard is two non-contiguous chunks).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from minite.layers.attention import CausalSelfAttention
from minite.models.gpt import GPT
from minite.ops import cross_entropy, rope
from minite.parallel import comm
from minite.parallel.context import allgather_attention, check_length, positions, ring_attention

__all__ = ["CPAttention", "CPGPT"]


# ----------------------------------------------------------------------------------- the GPT under CP
class CPAttention(CausalSelfAttention):
    """The dense layer's projections and RoPE tables (shared, not copied), attention by the ring over `group`.
    ``pos`` (set by CPGPT) holds my tokens' global positions; pos None runs the dense layer (sampling)."""

    def __init__(self, dense: CausalSelfAttention, group, variant: str = "ring", balanced: bool = True):
        nn.Module.__init__(self)
        for a in ("n_head", "n_kv_head", "head_dim", "max_seq_len", "backend"):
            setattr(self, a, getattr(dense, a))
        self.qkv, self.proj, self.resid_dropout = dense.qkv, dense.proj, dense.resid_dropout
        self.rotary = dense.rotary  # minite.nn.RotaryEmbedding: its cos/sin tables (T_max, D/2)
        self.group, self.balanced, self.pos = group, balanced, None
        self.fn = {"ring": ring_attention, "allgather": allgather_attention}[variant]

    def forward(self, x, kv_cache=None, layer: int = 0):
        if self.pos is None or kv_cache is not None:
            return super().forward(x, kv_cache, layer)
        B, T, C = x.shape  # T = my T/cp tokens
        H, KVH, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T/cp, D)
        k = k.view(B, T, KVH, D).transpose(1, 2)  # (B, KVH, T/cp, D)
        v = v.view(B, T, KVH, D).transpose(1, 2).contiguous()
        cos, sin = self.rotary.cos[self.pos], self.rotary.sin[self.pos]  # (T/cp, D/2): my GLOBAL positions
        q, k = rope(q, cos, sin, backend=self.backend), rope(k, cos, sin, backend=self.backend)
        y = self.fn(q.contiguous(), k.contiguous(), v, self.group, causal=True, balanced=self.balanced,
                    backend=self.backend)  # (B, H, T/cp, D)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, H * D)))


class CPGPT(nn.Module):
    """The dense GPT (its own modules, so its state_dict) with attention over the cp ranks. forward(idx, targets)
    keeps my tokens of the sequence; the loss VALUE is the global-batch loss (all-reduced), its gradient that of
    my tokens' mean: averaging the parameter gradients over the cp (dp x cp) ranks gives the global gradient
    (exact when every rank holds as many counted targets: true for LM batches without ignore_index)."""

    generate = GPT.generate
    num_params = GPT.num_params

    def __init__(self, dense: GPT, group, *, variant: str = "ring", balanced: bool = True):
        super().__init__()
        self.config, self.backend, self.group, self.balanced = dense.config, dense.backend, group, balanced
        self.wte, self.drop, self.blocks, self.norm_f = dense.wte, dense.drop, dense.blocks, dense.norm_f
        for b in self.blocks:
            b.attn = CPAttention(b.attn, group, variant, balanced)

    @classmethod
    def from_dense(cls, dense: GPT, group, **kw) -> "CPGPT":
        return cls(dense, group, **kw)

    def forward(self, idx, targets=None, **kw):
        if targets is None:  # sampling: every rank holds the weights, the short prompt runs dense
            return GPT.forward(self, idx, **kw)
        B, T = idx.shape
        n, r = comm.size(self.group), comm.rank(self.group)
        check_length(T, n, self.balanced)
        if T > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {T}: block_size is {self.config.block_size}")
        pos = positions(T, n, r, self.balanced).to(idx.device)
        for b in self.blocks:
            b.attn.pos = pos
        x = self.drop(self.wte(idx[:, pos]))  # (B, T/cp, C)
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.norm_f(x), self.wte.weight)  # (B, T/cp, V_pad)
        loss = cross_entropy(logits.reshape(B * pos.numel(), -1), targets[:, pos].reshape(-1), backend=self.backend)
        total = loss.detach().clone().reshape(1)
        comm.all_reduce(total, self.group)
        for b in self.blocks:
            b.attn.pos = None
        return logits, loss + (total[0] / n - loss.detach())  # value: global loss; gradient: my tokens' loss
