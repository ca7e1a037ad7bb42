"""Chapter 13: the GPT under context parallelism (``torchrun -m minite.train --parallel.cp=N [--parallel.tp=M]``).

Only attention mixes tokens, so ``CPGPT`` is the model it wraps, its own modules, with each attention layer's core
swapped for ``context.ring_attention`` (or the all-gather variant, or ``ulysses.ulysses_attention``: the all-to-all
and its hybrid with the ring): every other op runs on my T/cp tokens. RoPE
rotates each token by its GLOBAL position (the load-balanced shard is two non-contiguous chunks).

It wraps the dense GPT, or the tensor-parallel ``sequence.TPGPT`` (CP x TP): then each cp rank's T/cp tokens are
shared by its tp group, each tp rank rings ITS heads (K/V travel between the ranks with the same tp rank), and with
sequence parallelism the regions outside attention and the MLP hold T/(cp tp) tokens.

A mixture of experts (chapter 16) mixes no tokens either: each cp rank routes its T/cp tokens through the same MoE
modules (through its own ep group's experts under ep, ``expert.py``). Its routed counts are summed over dp x cp
(the exchange ``runtime.Parallel.wrap`` installs), the load of the whole global batch: the Switch loss (global f_i,
my tokens' P_i) averaged over dp x cp is one process's, and the DeepSeek bias moves the same on every rank. The
capacity limit (capacity_factor > 0) is taken per rank over its own tokens, as under dp: it matches one process
only dropless (capacity_factor = 0) or when no expert overflows.
"""
from __future__ import annotations

from torch import nn

from minite.layers.attention import CausalSelfAttention
from minite.models.gpt import GPT
from minite.ops import rope
from minite.parallel import comm
from minite.parallel.context import allgather_attention, check_length, positions, ring_attention
from minite.parallel.sequence import TPGPT
from minite.parallel.ulysses import check_heads, ulysses_attention

__all__ = ["CPAttention", "CPGPT", "ring_core"]


VARIANTS = ("ring", "allgather", "a2a", "hybrid")


def ring_core(group, variant: str = "ring", balanced: bool = True, backend: str | None = None, hybrid=None):
    """The attention core over the cp ranks: (q, k, v) of my tokens, (B, heads, T/cp, D) -> o, causal.
    variant "a2a": Ulysses over `group`; "hybrid": Ulysses inside hybrid[0], the ring across hybrid[1]."""
    if variant == "hybrid":
        a2a, ring = hybrid
        return lambda q, k, v: ulysses_attention(q, k, v, a2a, ring_group=ring, balanced=balanced, backend=backend)
    fn = {"ring": ring_attention, "allgather": allgather_attention, "a2a": ulysses_attention}[variant]
    return lambda q, k, v: fn(q.contiguous(), k.contiguous(), v.contiguous(), group, causal=True,
                              balanced=balanced, backend=backend)


# ----------------------------------------------------------------------------------- the GPT under CP
class CPAttention(CausalSelfAttention):
    """The dense layer's projections and RoPE tables (shared, not copied), attention by the ring over `group`.
    ``pos`` (set by CPGPT) holds my tokens' global positions; pos None runs the dense layer (sampling)."""

    def __init__(self, dense: CausalSelfAttention, group, variant: str = "ring", balanced: bool = True,
                 hybrid=None):
        nn.Module.__init__(self)
        for a in ("n_head", "n_kv_head", "head_dim", "max_seq_len", "backend"):
            setattr(self, a, getattr(dense, a))
        self.qkv, self.proj, self.resid_dropout = dense.qkv, dense.proj, dense.resid_dropout
        self.rotary = dense.rotary  # minite.nn.RotaryEmbedding: its cos/sin tables (T_max, D/2)
        self.pos, self.core = None, ring_core(group, variant, balanced, self.backend, hybrid)

    def forward(self, x, kv_cache=None, layer: int = 0):
        if self.pos is None or kv_cache is not None:
            return super().forward(x, kv_cache, layer)
        B, T, C = x.shape  # T = my T/cp tokens
        H, KVH, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T/cp, D)
        k = k.view(B, T, KVH, D).transpose(1, 2)  # (B, KVH, T/cp, D)
        v = v.view(B, T, KVH, D).transpose(1, 2)
        cos, sin = self.rotary.cos[self.pos], self.rotary.sin[self.pos]  # (T/cp, D/2): my GLOBAL positions
        q, k = rope(q, cos, sin, backend=self.backend), rope(k, cos, sin, backend=self.backend)
        y = self.core(q, k, v)  # (B, H, T/cp, D)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, H * D)))


class CPGPT(nn.Module):
    """A GPT (dense, or TPGPT) with attention over the cp ranks: the same modules, so the same state_dict names.
    forward(idx, targets) keeps my tokens of the sequence and runs the wrapped model's forward on them; the loss
    VALUE is the global-batch loss (all-reduced), its gradient that of my tokens' mean: averaging the parameter
    gradients over the cp (dp x cp) ranks gives the global gradient (exact when every rank holds as many counted
    targets: true for LM batches without ignore_index)."""

    def __init__(self, model: GPT | TPGPT, group, *, variant: str = "ring", balanced: bool = True, hybrid=None):
        super().__init__()
        if variant not in VARIANTS or (variant == "hybrid") != (hybrid is not None):
            raise ValueError(f"CPGPT: variant={variant!r} must be one of {VARIANTS}, and hybrid=(a2a group, ring "
                             "group) given exactly for 'hybrid'")
        self.inner = type(model)  # GPT or TPGPT: its forward, generate, num_params run on these same modules
        self.config = model.config
        self.backend = model.backend
        self.cp_group = group
        self.balanced = balanced
        self.wte = model.wte  # the wrapped model's own modules: the same parameters, the same state_dict names
        self.drop = model.drop
        self.blocks = model.blocks
        self.norm_f = model.norm_f
        if isinstance(model, TPGPT):  # TP x CP: TPAttention keeps its heads, takes my positions and the ring
            self.group, self.sp = model.group, model.sp  # the tp group, as TPGPT's methods expect
            for b in self.blocks:
                b.attn.core = ring_core(group, variant, balanced, b.attn.backend, hybrid)
        else:
            for b in self.blocks:
                b.attn = CPAttention(b.attn, group, variant, balanced, hybrid)
        if variant in ("a2a", "hybrid"):  # my (tp rank's) heads split over the all-to-all: refused here, by name
            a, what = (comm.size(group), "cp") if variant == "a2a" else (comm.size(hybrid[0]), "cp_a2a")
            attn = self.blocks[0].attn
            tp = self.inner is TPGPT
            heads = (attn.H, attn.KVH) if tp else (attn.n_head, attn.n_kv_head)
            check_heads(*heads, a, what, " (each tp rank's heads)" if tp else "")

    @classmethod
    def from_dense(cls, model: GPT | TPGPT, group, **kw) -> "CPGPT":
        return cls(model, group, **kw)

    def num_params(self) -> int:
        return self.inner.num_params(self)

    moe_stats = GPT.moe_stats  # a MoE's routing at the last forward (the global load: counts summed over dp x cp)

    def generate(self, idx, max_new_tokens, **kw):  # every rank holds its (tp) weights: the prompt runs unsharded
        return self.inner.generate(self, idx, max_new_tokens, **kw)

    def head(self, x, targets=None, last: int = -1):  # TPGPT.forward ends in its vocab-parallel head: the same here
        return TPGPT.head(self, x, targets, last)

    def dense_state_dict(self) -> dict:
        """The dense GPT's state dict on every rank (with TP: gathered over the tp group, a collective)."""
        return TPGPT.dense_state_dict(self) if self.inner is TPGPT else {k: v.detach().clone()
                                                                         for k, v in self.state_dict().items()}

    def forward(self, idx, targets=None, **kw):
        if targets is None:  # sampling: the short prompt runs unsharded over cp
            return self.inner.forward(self, idx, **kw)
        B, T = idx.shape
        n, r = comm.size(self.cp_group), comm.rank(self.cp_group)
        check_length(T, n, self.balanced)
        if T > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {T}: block_size is {self.config.block_size}")
        if self.inner is TPGPT and self.sp and (T // n) % comm.size(self.group):
            raise ValueError(f"sequence parallelism under cp={n}: each cp rank's T/cp = {T}/{n} = {T // n} tokens "
                             f"must be divisible by tp={comm.size(self.group)}")
        pos = positions(T, n, r, self.balanced).to(idx.device)
        try:
            for b in self.blocks:
                b.attn.pos = pos
            logits, loss = self.inner.forward(self, idx[:, pos], targets[:, pos])  # (B, T/cp, V or V/tp), my mean
        finally:
            for b in self.blocks:
                b.attn.pos = None
        total = loss.detach().clone().reshape(1)
        comm.all_reduce(total, self.cp_group)
        return logits, loss + (total[0] / n - loss.detach())  # value: global loss; gradient: my tokens' loss
