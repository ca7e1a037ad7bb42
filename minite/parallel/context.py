"""Chapter 13: context parallelism (CP): the sequence sharded over ranks, attention computed by a ring of K/V blocks.

Every layer but attention is per-token and runs unchanged on a rank's T/cp tokens. Attention needs every key:
  ring (Megatron CP)  K/V blocks pass around the cp ranks; at each of the cp steps a rank runs the chapter-07 flash
                      kernel (return_lse=True) on its queries and the block it holds while the next block is already
                      on the wire (isend/irecv posted before the compute); partial outputs merge in fp32 by the LSE.
  all-gather          all-gather K/V forward, reduce-scatter dK/dV backward: the same bytes, cp x the K/V memory.
Causal load balancing: contiguous shards leave rank 0 one block of work and rank cp-1 all of them. Cut the sequence
into 2*cp chunks, rank r holding chunks r and 2*cp-1-r: the diagonal step is a plain causal call on my tokens, a
block from a lower rank is seen (non-causally) through its first half, one from a higher rank by my second half.
Backward: the block gradients use the FINAL O and LSE (Delta = rowsum(dO * O), P = exp(S - LSE)), so dQ adds up
locally and the dK/dV partials travel with the ring, home after cp hops.
"""
from __future__ import annotations

import functools
import math
import time

import torch
import torch.distributed as dist

from minite.backend import resolve_backend
from minite.kernels.attention import attention, attention_bwd
from minite.parallel import comm

__all__ = ["lse_merge", "positions", "shard", "unshard", "check_length", "cp_attention", "ring_attention",
           "allgather_attention", "RingAttention", "AllGatherAttention"]
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------- the LSE merge
def lse_merge(o1, lse1, o2, lse2):
    """Merge two partial attentions over disjoint key sets. o (..., T, D), lse (..., T) -> fp32 (o, lse).
        lse = log(e^lse1 + e^lse2),   o = e^(lse1 - lse) o1 + e^(lse2 - lse) o2
    A row that saw no key in either part keeps lse = -inf and o = 0 (never NaN)."""
    m = torch.maximum(lse1.float(), lse2.float())
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: shift by 0, not by -inf (NaN)
    a, b = torch.exp(lse1.float() - m), torch.exp(lse2.float() - m)  # (..., T), each in [0, 1]
    s = a + b
    lse = torch.where(s > 0, m + torch.log(s), torch.full_like(s, NEG_INF))
    s = torch.where(s > 0, s, torch.ones_like(s))
    return o1.float() * (a / s)[..., None] + o2.float() * (b / s)[..., None], lse


# ----------------------------------------------------------------------------------- the layout
def check_length(T: int, cp: int, balanced: bool = True) -> None:
    n = 2 * cp if balanced else cp
    if T % n:
        raise ValueError(f"context parallelism: sequence length T={T} must be divisible by "
                         f"{'2*cp' if balanced else 'cp'}={n} (cp={cp}{', load-balanced chunks' if balanced else ''})")


def positions(T: int, cp: int, rank: int, balanced: bool = True) -> torch.Tensor:
    """Global positions of rank `rank`'s tokens: chunks r and 2cp-1-r of 2cp (balanced), else chunk r of cp."""
    check_length(T, cp, balanced)
    if not balanced:
        return torch.arange(rank * T // cp, (rank + 1) * T // cp)
    c, j = T // (2 * cp), 2 * cp - 1 - rank  # chunk size, my second chunk
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(j * c, (j + 1) * c)])


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """My tokens of x along `dim` (the sequence), in the order of ``positions``."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, balanced).to(x.device))


def unshard(parts: list[torch.Tensor], dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """Inverse of shard: every rank's part (in rank order) back into the global sequence order."""
    cp, cat = len(parts), torch.cat(parts, dim=dim)
    perm = torch.cat([positions(cat.shape[dim], cp, r, balanced) for r in range(cp)]).to(cat.device)
    return cat.index_select(dim, torch.argsort(perm))


# ----------------------------------------------------------------------------------- one block, fwd and bwd
def _block_fwd(q, k, v, causal, scale, backend):
    """The chapter-07 kernel (or its reference) on one block, no autograd: o, lse (B, H, Tq) fp32."""
    with torch.no_grad():
        return attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=backend)


def _block_bwd(do, q, k, v, o, lse, causal, scale, backend):
    """Gradients of one block given the FINAL o and lse. The Triton launcher, or the same math in PyTorch."""
    if backend == "triton":  # the launcher assumes contiguous o and lse (it makes only do, q, k, v contiguous)
        return attention_bwd(do, q, k, v, o.contiguous(), lse.contiguous(), causal, scale)
    B, H, Tq, D = q.shape
    KVH, Tk, G = k.shape[1], k.shape[2], H // k.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    kr, vr = k.to(ct).repeat_interleave(G, 1), v.to(ct).repeat_interleave(G, 1)  # (B, H, Tk, D)
    s = q.to(ct) @ kr.transpose(-1, -2) * scale  # (B, H, Tq, Tk)
    keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq if causal else Tk)  # bottom-right
    p = torch.where(keep & torch.isfinite(lse)[..., None], torch.exp(s - lse.to(ct)[..., None]), 0.0)
    do_, delta = do.to(ct), (do.to(ct) * o.to(ct)).sum(-1, keepdim=True)  # Delta = rowsum(dO * O)
    ds = p * (do_ @ vr.transpose(-1, -2) - delta)  # dS = P * (dP - Delta)
    dq, dk = ds @ kr * scale, (ds.transpose(-1, -2) @ q.to(ct) * scale).view(B, KVH, G, Tk, D).sum(2)
    dv = (p.transpose(-1, -2) @ do_).view(B, KVH, G, Tk, D).sum(2)  # GQA: dK, dV summed over the group
    return dq, dk, dv


def _plan(step, r, n, causal, balanced, Tl):
    """What rank r computes with the block that left rank (r - step) % n `step` hops ago:
    (query rows, key rows, causal) or None (the block is entirely in the future of my queries)."""
    src, full = (r - step) % n, slice(0, Tl)
    if not causal:
        return full, full, False
    if step == 0:
        return full, full, True  # my own block: local order follows global order, a plain causal mask is right
    if balanced:
        h = Tl // 2
        return (full, slice(0, h), False) if src < r else (slice(h, Tl), full, False)
    return (full, full, False) if src < r else None


def _ring(buf, group):
    """Post the send of `buf` to the next cp rank and the receive of the previous rank's; (recv buffer, works).
    Ordered isend/irecv, never batch_isend_irecv (it hangs on gloo)."""
    n, r = comm.size(group), comm.rank(group)
    recv = torch.empty_like(buf)
    return recv, [comm.send(buf, dist.get_global_rank(group, (r + 1) % n), group),
                  comm.recv(recv, dist.get_global_rank(group, (r - 1) % n), group)]


def _wait(pending):
    [w.wait() for w in pending[1]]
    return pending[0]


def _tally(stats, q, nq, nk, causal):
    # Score entries this rank's kernel calls compute: nq x nk, or under a bottom-right causal mask the visible ones
    if stats is not None:
        seen = nq * (nk - nq) + nq * (nq + 1) // 2 if causal else nq * nk
        stats["scores"] = stats.get("scores", 0) + q.shape[0] * q.shape[1] * seen


# ----------------------------------------------------------------------------------- ring attention
class RingAttention(torch.autograd.Function):
    """forward: cp ring steps of flash attention + LSE merge / backward: cp ring steps, dK/dV travelling home."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, balanced, backend, stats):
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # running output (B, H, T/cp, D), fp32
        lse = torch.full(q.shape[:3], NEG_INF, device=q.device)  # running LSE: no key seen yet
        kv = torch.stack([k, v]).contiguous()  # (2, B, KVH, Tl, D): one message per step
        for step in range(n):
            pending, t0 = _ring(kv, group) if step < n - 1 else None, time.perf_counter()  # next block on the wire
            plan = _plan(step, r, n, causal, balanced, Tl)
            if plan is not None:
                qs, ks, c = plan
                _tally(stats, q, len(range(Tl)[qs]), len(range(Tl)[ks]), c)
                ob, lb = _block_fwd(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], c, scale, backend)
                o[:, :, qs], lse[:, :, qs] = lse_merge(o[:, :, qs], lse[:, :, qs], ob, lb)
            t1, kv = time.perf_counter(), _wait(pending) if pending else kv
            if stats is not None:  # seconds computing, then seconds still blocked on the transfer (not hidden)
                stats.setdefault("steps", []).append((t1 - t0, time.perf_counter() - t1))
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # O(T/cp) per rank: no other rank's K/V is kept
        ctx.args = (group, causal, scale, balanced, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        group, causal, scale, balanced, backend = ctx.args
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        do, dq = do.contiguous(), torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dkv_pending = torch.stack([k, v]).contiguous(), None
        for step in range(n):
            pending = _ring(kv, group) if step < n - 1 else None
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # my part for this block
            plan = _plan(step, r, n, causal, balanced, Tl)
            if plan is not None:
                qs, ks, c = plan
                g = _block_bwd(do[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], o[:, :, qs],
                               lse[:, :, qs], c, scale, backend)
                dq[:, :, qs] += g[0].float()
                dkv[:, :, :, ks] += torch.stack(g[1:]).float()
            if dkv_pending is not None:  # what the ranks before me added to this block
                dkv += _wait(dkv_pending)
            dkv_pending = _ring(dkv, group)  # on to the next rank; the last hop brings each block home
            kv = _wait(pending) if pending else kv
        dkv = _wait(dkv_pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


# ----------------------------------------------------------------------------------- all-gather K/V
def _pieces(r, n, Tl, causal, balanced):
    """(my query rows, number of global keys they attend to, causal) for each of my chunks."""
    if not (causal and balanced):  # every key, or (bottom-right causal) the prefix up to my chunk
        return [(slice(0, Tl), (r + 1) * Tl if causal else Tl * n, causal)]
    c = Tl // 2
    return [(slice(0, c), (r + 1) * c, True), (slice(c, Tl), (2 * n - r) * c, True)]


class AllGatherAttention(torch.autograd.Function):
    """forward: all-gather K/V, attend to the causal prefix / backward: dK/dV reduce-scattered to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, balanced, backend, stats):
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        perm = torch.cat([positions(Tl * n, n, i, balanced) for i in range(n)]).to(q.device)
        kv = comm.all_gather(torch.stack([k, v]).contiguous(), group, dim=3)  # (2, B, KVH, T, D), ranks' order
        kv = kv.index_select(3, torch.argsort(perm))  # global order
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)
        for qs, nk, c in _pieces(r, n, Tl, causal, balanced):
            _tally(stats, q, len(range(Tl)[qs]), nk, c)
            ob, lse[:, :, qs] = _block_fwd(q[:, :, qs], kv[0][:, :, :nk], kv[1][:, :, :nk], c, scale, backend)
            o[:, :, qs] = ob.to(q.dtype)
        ctx.save_for_backward(q, kv, o, lse, perm)  # the gathered K/V stay until backward: cp x the K/V memory
        ctx.args = (group, causal, scale, balanced, backend)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kv, o, lse, perm = ctx.saved_tensors
        group, causal, scale, balanced, backend = ctx.args
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        dq, dkv = torch.zeros_like(q), torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for qs, nk, c in _pieces(r, n, Tl, causal, balanced):
            g = _block_bwd(do[:, :, qs].contiguous(), q[:, :, qs], kv[0][:, :, :nk], kv[1][:, :, :nk], o[:, :, qs],
                           lse[:, :, qs], c, scale, backend)
            dq[:, :, qs] = g[0].to(q.dtype)
            dkv[:, :, :, :nk] += torch.stack(g[1:]).float()
        dkv = comm.reduce_scatter(dkv.index_select(3, perm), group, dim=3)  # ranks' order: my chunks of the sum
        return dq, dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None, None, None, None


def cp_attention(q, k, v, group, *, variant: str = "ring", causal: bool = True, scale: float | None = None,
                 balanced: bool = True, backend: str | None = None, return_lse: bool = False, stats=None):
    """Attention of my query shard q (B, H, T/cp, D) over the keys of every rank of `group`, k/v (B, KVH, T/cp, D)
    (GQA), by the "ring" or the "allgather" variant; the shards are ``shard(x, cp, rank, balanced=...)``.
    -> o (B, H, T/cp, D) [, lse (B, H, T/cp) fp32]. stats: a dict that collects the score entries computed."""
    fn = {"ring": RingAttention, "allgather": AllGatherAttention}[variant]
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] != k.shape[2]:
        raise ValueError(f"cp attention: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, heads, T/cp, D) "
                         "shards of the same tokens")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    check_length(q.shape[2] * comm.size(group), comm.size(group), balanced and causal)
    be = resolve_backend(q, backend)
    if comm.size(group) == 1:  # one rank: the plain kernel
        out = attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=be)
    else:
        out = fn.apply(q, k, v, group, causal, scale, balanced and causal, be, stats)
    return out if return_lse else out[0]


ring_attention = functools.partial(cp_attention, variant="ring")
allgather_attention = functools.partial(cp_attention, variant="allgather")
