"""Chapter 11: Megatron tensor parallelism, every layer sharded from its dense twin (``from_dense``).

A linear y = x W^T splits two ways. Column-parallel: W's output rows are split, each rank computes its slice of y
from the whole x: the input must be on every rank (f: identity forward, all-reduce of dx backward). Row-parallel:
W's input columns are split, each rank holds a slice of x and produces a partial y; the partials are summed
(g: all-reduce forward, identity backward). Column then row (attention's qkv then proj, the MLP's gate/up then
down) needs one all-reduce forward and one backward per block half: heads and hidden units are independent.

Attention splits by heads, GQA-aware. Rank r owns query heads [r H/tp, (r+1) H/tp). Query head h reads kv head
h // (H/KVH). If KVH >= tp (tp | KVH), rank r's query heads read exactly kv heads [r KVH/tp, (r+1) KVH/tp): split
them. If KVH < tp (KVH | tp), all of rank r's query heads read the single kv head r // (tp/KVH): that head's
weights are replicated on tp/KVH ranks, each rank's copy gets the gradient of its own query heads only, so a hook
sums those copies' gradients over the tp group (the other ranks add zeros) before they are accumulated.

Sequence parallelism (``sequence.py``) changes only the collectives at the edges of each column/row pair: the
column-parallel linear all-gathers its sequence-sharded input, and a reduce-scatter replaces the row's all-reduce.

The vocabulary splits too: rank r owns token rows [r V/tp, (r+1) V/tp) of the (tied) embedding; it looks up the
tokens it owns, zeros the rest, and sums (g). The LM head gives each rank the logits of its vocabulary slice.

Every sharded parameter records its source, ``p.dense_name``, ``p.dense_index = (dim, index)``, and ``p.tp_replicas``
(how many tp ranks hold an identical copy: for the global gradient norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minite.backend import resolve_backend
from minite.kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from minite.layers.linear import Linear
from minite.ops import attention, rope, swiglu
from minite.parallel import comm

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "TPAttention", "TPMLP", "head_rows", "sp_column_linear", "tag"]


def tag(p: nn.Parameter, name: str, dim: int | None = None, index: torch.Tensor | None = None, replicas=1):
    """Record which slice of which dense parameter `p` is (for tests, checkpoints and the gradient norm)."""
    p.dense_name = name
    p.dense_index = (dim, index)
    p.tp_replicas = replicas
    return p


def _take(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:  # a copy of the slice
    return t.detach().index_select(dim, index.to(t.device)).clone()


# ----------------------------------------------------------------------------------- column and row
class _SPColumnLinear(torch.autograd.Function):
    """forward: all-gather x along T, then x W^T / backward: all-gather x again, reduce-scatter dx (Megatron SP)."""

    @staticmethod
    def forward(ctx, x_local, weight, bias, group):
        ctx.group = group
        ctx.has_bias = bias is not None
        # keep the sequence shard, not the gathered (B, T, C): 1/tp of the bytes
        ctx.save_for_backward(x_local, weight)
        x = comm.all_gather(x_local, group, 1)  # (B, T, C)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x_local, weight = ctx.saved_tensors
        # gathered again (on GPUs Megatron overlaps this with dx)
        x = comm.all_gather(x_local, ctx.group, 1)
        dx = comm.reduce_scatter(g @ weight, ctx.group, 1)
        g2 = g.reshape(-1, g.shape[-1])  # (B T, out)
        dw = g2.t() @ x.reshape(-1, x.shape[-1])
        db = g2.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def sp_column_linear(x_local, weight, bias, group):
    """x_local (B, T/tp, C), my sequence chunk -> (B, T, out/tp): all-gathered, then my output columns."""
    return _SPColumnLinear.apply(x_local, weight, bias, group)


class ColumnParallelLinear(Linear):
    """y_local = x W_local^T: my output rows. Input: whole x (f), or with SP a sequence shard (all-gather)."""

    def __init__(self, in_features: int, out_local: int, group, *, bias: bool = False, sequence_parallel=False):
        super().__init__(in_features, out_local, bias=bias)
        self.group = group
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_dense(cls, dense: nn.Linear, group, rows: torch.Tensor, *, name: str = "", sequence_parallel=False):
        m = cls(dense.in_features, len(rows), group, bias=dense.bias is not None,
                sequence_parallel=sequence_parallel)
        m.to(dense.weight.device)
        with torch.no_grad():
            m.weight.copy_(_take(dense.weight, 0, rows))
            tag(m.weight, name + ".weight", 0, rows)
            if dense.bias is not None:
                m.bias.copy_(_take(dense.bias, 0, rows))
                tag(m.bias, name + ".bias", 0, rows)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and comm.size(self.group) > 1:
            # all-gather (B, T/tp, C), keep only my chunk for backward
            return sp_column_linear(x, self.weight, self.bias, self.group)
        return super().forward(comm.copy_to_parallel(x, self.group))  # f


class RowParallelLinear(Linear):
    """y = sum over ranks of x_local W_local^T (g), or with SP its sequence shard (reduce-scatter); + bias once."""

    def __init__(self, in_local: int, out_features: int, group, *, bias: bool = False, sequence_parallel=False):
        super().__init__(in_local, out_features, bias=False)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.out_bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_dense(cls, dense: nn.Linear, group, cols: torch.Tensor, *, name: str = "", sequence_parallel=False):
        m = cls(len(cols), dense.out_features, group, bias=dense.bias is not None,
                sequence_parallel=sequence_parallel)
        m.to(dense.weight.device)
        with torch.no_grad():
            m.weight.copy_(_take(dense.weight, 1, cols))
            tag(m.weight, name + ".weight", 1, cols)
            if dense.bias is not None:
                m.out_bias.copy_(dense.bias)
                tag(m.out_bias, name + ".bias", replicas=comm.size(group))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # partial sum (B, T, C)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence(y, self.group, 1)  # (B, T/tp, C)
        else:
            y = comm.reduce_from_parallel(y, self.group)  # g
        return y if self.out_bias is None else y + self.out_bias


# ----------------------------------------------------------------------------------- the vocabulary
class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (V, C) table; other tokens give 0; summed over ranks (or reduce-scattered)."""

    def __init__(self, dense: nn.Embedding, group, *, name: str = "wte", sequence_parallel=False):
        super().__init__()
        n, r = comm.size(group), comm.rank(group)
        V = dense.num_embeddings
        if V % n:
            raise ValueError(f"vocabulary {V} is not divisible by tp={n}")
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.start = r * V // n
        self.end = (r + 1) * V // n
        rows = torch.arange(self.start, self.end)
        self.weight = nn.Parameter(_take(dense.weight, 0, rows))
        tag(self.weight, name + ".weight", 0, rows)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        x = F.embedding(torch.where(outside, 0, idx - self.start), self.weight)  # (B, T, C)
        x = x.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sequence(x, self.group, 1)  # (B, T/tp, C)
        return comm.reduce_from_parallel(x, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """forward: cross-entropy from vocab-sharded logits (3 all-reduces of N numbers) / backward: local softmax-onehot"""

    @staticmethod
    def forward(ctx, logits, target, start, group, ignore_index, use_kernel):
        N, Vl = logits.shape
        valid = target != ignore_index
        owner = valid & (target >= start) & (target < start + Vl)
        t_local = torch.where(owner, target - start, torch.where(valid, -1, ignore_index))
        if use_kernel:
            # minite's CE kernel on my shard: per-row local logsumexp and local target logit
            rows, lse_l = cross_entropy_fwd(logits, t_local, ignore_index, 0.0)
            x_t = torch.where(owner, lse_l - rows, 0.0)
            m = lse_l.clone()
            comm.all_reduce(m, group, torch.distributed.ReduceOp.MAX)  # max of the shards' lse
            s = torch.exp(lse_l - m)
        else:  # the recipe: local max -> all-reduce max -> local sum of exp -> all-reduce
            xf = logits.float()
            m = xf.max(dim=-1).values
            comm.all_reduce(m, group, torch.distributed.ReduceOp.MAX)
            s = torch.exp(xf - m[:, None]).sum(-1)
            mine = xf.gather(1, t_local.clamp(min=0)[:, None]).squeeze(1)
            x_t = torch.where(owner, mine, 0.0)
        comm.all_reduce(s, group)
        comm.all_reduce(x_t, group)  # the target logit, from the one rank that owns it
        lse = m + torch.log(s)
        n_valid = valid.sum()
        ctx.save_for_backward(logits, t_local, lse, n_valid)
        ctx.ignore_index = ignore_index
        ctx.use_kernel = use_kernel
        return torch.where(valid, lse - x_t, 0.0).sum() / n_valid.clamp(min=1)

    @staticmethod
    def backward(ctx, dloss):
        logits, t_local, lse, n_valid = ctx.saved_tensors
        g = (dloss / n_valid.clamp(min=1)).reshape(1)
        if ctx.use_kernel:
            dx = cross_entropy_bwd(g, logits, t_local, lse, ctx.ignore_index, 0.0)
            return dx, None, None, None, None, None
        # the softmax over the whole vocabulary, my columns of it
        p = torch.exp(logits.float() - lse[:, None])
        own = t_local >= 0
        p[own.nonzero().squeeze(1), t_local[own]] -= 1.0
        p = p.masked_fill((t_local == ctx.ignore_index)[:, None], 0.0)
        return (p * g).to(logits.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int, *,
                                 ignore_index: int = -100, backend: str | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits (N, V/tp), my vocabulary columns [vocab_start, vocab_start + V/tp), against
    global targets (N,); the (N, V) logits are never gathered. Uses minite's CE kernel per shard on Triton."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be (N, V/tp) and target "
                         f"{tuple(target.shape)} (N,)")
    use_kernel = resolve_backend(logits, backend) == "triton"
    logits = logits.contiguous() if use_kernel else logits
    target = target.long().contiguous()
    return _VocabParallelCE.apply(logits, target, vocab_start, group, ignore_index, use_kernel)


# ----------------------------------------------------------------------------------- attention and MLP
def head_rows(first: int, count: int, D: int) -> torch.Tensor:  # rows of heads [first, first + count), size D
    return torch.arange(first * D, (first + count) * D)


class TPAttention(nn.Module):
    """Causal GQA attention with my query heads (and my kv heads, split or replicated); qkv column, proj row."""

    def __init__(self, dense, group, *, name: str, sequence_parallel: bool = False):
        super().__init__()
        tp, r = comm.size(group), comm.rank(group)
        H, KVH, D = dense.n_head, dense.n_kv_head, dense.head_dim
        if H % tp or (KVH % tp and tp % KVH):
            raise ValueError(f"tp={tp} must divide n_head={H}, and divide or be a multiple of n_kv_head={KVH}")
        self.H = H // tp  # my query heads
        self.D = D
        self.backend = dense.backend
        self.group = group
        split = KVH >= tp
        self.KVH = KVH // tp if split else 1  # my kv heads
        kv0 = r * self.KVH if split else r // (tp // KVH)  # my first kv head
        q_rows = head_rows(r * self.H, self.H, D)
        k_rows = H * D + head_rows(kv0, self.KVH, D)
        v_rows = (H + KVH) * D + head_rows(kv0, self.KVH, D)
        rows = torch.cat([q_rows, k_rows, v_rows])
        self.qkv = ColumnParallelLinear.from_dense(dense.qkv, group, rows, name=name + ".qkv",
                                                   sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_dense(dense.proj, group, q_rows, name=name + ".proj",
                                                 sequence_parallel=sequence_parallel)
        self.resid_dropout = nn.Dropout(dense.resid_dropout.p)
        self.register_buffer("rope_cos", dense.rotary.cos.clone(), persistent=False)
        self.register_buffer("rope_sin", dense.rotary.sin.clone(), persistent=False)
        self.pos = None  # set by context_gpt.CPGPT: my tokens' global positions ...
        self.core = None  # ... and the attention over the cp ring
        if not split:
            # a replicated kv head: sum its copies' gradients over the ranks that share it
            nq, per = self.H * D, self.KVH * D
            reps = torch.ones(len(rows), 1)
            reps[nq:] = tp // KVH
            for p in (self.qkv.weight, self.qkv.bias):
                if p is not None:
                    p.tp_replicas = reps if p.dim() == 2 else reps[:, 0]
                    p.register_hook(lambda g, kv0=kv0: self._sum_kv(g, kv0, nq, per, KVH))

    def _sum_kv(self, g, kv0, nq, per, KVH):
        # one slot per kv head: my copy in mine, zeros elsewhere
        buf = g.new_zeros(KVH, 2, per, *g.shape[1:])
        buf[kv0] = g[nq:].reshape(2, per, *g.shape[1:])
        comm.all_reduce(buf, self.group)
        return torch.cat([g[:nq], buf[kv0].reshape(2 * per, *g.shape[1:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, (H + 2 KVH) D), local heads, whole sequence
        B, T, _ = qkv.shape
        H, KVH, D = self.H, self.KVH, self.D
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H_local, T, D)
        k = k.view(B, T, KVH, D).transpose(1, 2)  # (B, KVH_local, T, D)
        v = v.view(B, T, KVH, D).transpose(1, 2)
        # RoPE by global position (CP: my two chunks of the sequence)
        at = slice(0, T) if self.pos is None else self.pos
        cos, sin = self.rope_cos[at], self.rope_sin[at]
        q = rope(q, cos, sin, backend=self.backend)
        k = rope(k, cos, sin, backend=self.backend)
        if self.pos is None:
            y = attention(q, k, v, causal=True, backend=self.backend)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.resid_dropout(self.proj(y))  # (B, T, C), or (B, T/tp, C) with SP


class TPMLP(nn.Module):
    """SwiGLU split Megatron's way: gate and up column-parallel (my hidden units of each), down row-parallel."""

    def __init__(self, dense, group, *, name: str, sequence_parallel: bool = False):
        super().__init__()
        tp, r = comm.size(group), comm.rank(group)
        hid = dense.hidden
        if hid % tp:
            raise ValueError(f"mlp_hidden={hid} is not divisible by tp={tp}")
        self.hidden = hid // tp
        self.backend = dense.backend
        mine = torch.arange(r * self.hidden, (r + 1) * self.hidden)  # my hidden units
        gate_up_rows = torch.cat([mine, hid + mine])
        self.gate_up = ColumnParallelLinear.from_dense(dense.gate_up, group, gate_up_rows, name=name + ".gate_up",
                                                       sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear.from_dense(dense.down, group, mine, name=name + ".down",
                                                 sequence_parallel=sequence_parallel)
        self.dropout = nn.Dropout(dense.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)
        return self.dropout(self.down(swiglu(gate, up, backend=self.backend)))
