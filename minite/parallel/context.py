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
With a ``trace.Recorder`` active, each forward block call reports a "cp_block" event (the score entries it computed)
and each wait of the ring a "cp_wait" event: the lesson's work per rank and overlap.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from minite.backend import resolve_backend
from minite.kernels.attention import attention, attention_bwd
from minite.parallel import comm, trace

__all__ = ["lse_merge", "positions", "shard", "unshard", "check_length", "cp_attention", "ring_attention",
           "allgather_attention", "RingAttention", "AllGatherAttention"]
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------- the LSE merge
def lse_merge(o1, lse1, o2, lse2):
    """Merge two partial attentions over disjoint key sets. o (..., T, D), lse (..., T) -> fp32 (o, lse).
        lse = log(e^lse1 + e^lse2),   o = e^(lse1 - lse) o1 + e^(lse2 - lse) o2
    A row that saw no key in either part keeps lse = -inf and o = 0 (never NaN)."""
    m = torch.maximum(lse1.float(), lse2.float())
    # both -inf: shift by 0, not by -inf (NaN)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    a = torch.exp(lse1.float() - m)  # (..., T), in [0, 1]
    b = torch.exp(lse2.float() - m)
    s = a + b
    lse = torch.where(s > 0, m + torch.log(s), torch.full_like(s, NEG_INF))
    s = torch.where(s > 0, s, torch.ones_like(s))
    o = o1.float() * (a / s)[..., None] + o2.float() * (b / s)[..., None]
    return o, lse


# ----------------------------------------------------------------------------------- the layout
def check_length(T: int, cp: int, balanced: bool = True) -> None:
    n = 2 * cp if balanced else cp
    if T % n:
        what = "2*cp" if balanced else "cp"
        why = ", load-balanced chunks" if balanced else ""
        raise ValueError(f"context parallelism: sequence length T={T} must be divisible by {what}={n} "
                         f"(cp={cp}{why})")


def positions(T: int, cp: int, rank: int, balanced: bool = True) -> torch.Tensor:
    """Global positions of rank `rank`'s tokens: chunks r and 2cp-1-r of 2cp (balanced), else chunk r of cp."""
    check_length(T, cp, balanced)
    if not balanced:
        return torch.arange(rank * T // cp, (rank + 1) * T // cp)
    c = T // (2 * cp)  # chunk size
    j = 2 * cp - 1 - rank  # my second chunk
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange(j * c, (j + 1) * c)
    return torch.cat([first, second])


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """My tokens of x along `dim` (the sequence), in the order of ``positions``."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, balanced).to(x.device))


def unshard(parts: list[torch.Tensor], dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """Inverse of shard: every rank's part (in rank order) back into the global sequence order."""
    cp = len(parts)
    cat = torch.cat(parts, dim=dim)
    T = cat.shape[dim]
    perm = torch.cat([positions(T, cp, r, balanced) for r in range(cp)]).to(cat.device)
    return cat.index_select(dim, torch.argsort(perm))


# ----------------------------------------------------------------------------------- one block, fwd and bwd
def _block_fwd(q, k, v, causal, scale, backend):
    """The chapter-07 kernel (or its reference) on one block, no autograd: o, lse (B, H, Tq) fp32."""
    with torch.no_grad():
        return attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=backend)


def _block_bwd(do, q, k, v, o, lse, causal, scale, backend):
    """Gradients of one block given the FINAL o and lse. The Triton launcher, or the same math in PyTorch."""
    if backend == "triton":
        # the launcher assumes contiguous o and lse (it makes only do, q, k, v contiguous)
        return attention_bwd(do, q, k, v, o.contiguous(), lse.contiguous(), causal, scale)
    B, H, Tq, D = q.shape
    KVH, Tk = k.shape[1], k.shape[2]
    G = H // KVH  # query heads per kv head
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    kr = k.to(ct).repeat_interleave(G, 1)  # (B, H, Tk, D)
    vr = v.to(ct).repeat_interleave(G, 1)
    s = q.to(ct) @ kr.transpose(-1, -2) * scale  # (B, H, Tq, Tk)
    # the causal mask is bottom-right aligned (the chapter-07 kernel's convention)
    keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq if causal else Tk)
    keep = keep & torch.isfinite(lse)[..., None]  # a row that saw no key has no probabilities
    p = torch.where(keep, torch.exp(s - lse.to(ct)[..., None]), 0.0)
    do_ = do.to(ct)
    delta = (do_ * o.to(ct)).sum(-1, keepdim=True)  # Delta = rowsum(dO * O)
    ds = p * (do_ @ vr.transpose(-1, -2) - delta)  # dS = P * (dP - Delta)
    dq = ds @ kr * scale
    # GQA: dK and dV summed over the query heads of each kv head
    dk = (ds.transpose(-1, -2) @ q.to(ct) * scale).view(B, KVH, G, Tk, D).sum(2)
    dv = (p.transpose(-1, -2) @ do_).view(B, KVH, G, Tk, D).sum(2)
    return dq, dk, dv


def _plan(step, r, n, causal, balanced, Tl):
    """What rank r computes with the block that left rank (r - step) % n `step` hops ago:
    (query rows, key rows, causal) or None (the block is entirely in the future of my queries)."""
    src = (r - step) % n
    full = slice(0, Tl)
    if not causal:
        return full, full, False
    if step == 0:
        # my own block: local order follows global order, a plain causal mask is right
        return full, full, True
    if balanced:
        h = Tl // 2
        return (full, slice(0, h), False) if src < r else (slice(h, Tl), full, False)
    return (full, full, False) if src < r else None


def _scores(q, nq: int, nk: int, causal: bool) -> int:
    """Score entries one kernel call computes for nq queries over nk keys (the visible ones, bottom-right causal)."""
    seen = nq * (nk - nq) + nq * (nq + 1) // 2 if causal else nq * nk
    return q.shape[0] * q.shape[1] * seen


def _ring(buf, group):
    """Post the send of `buf` to the next cp rank and the receive of the previous rank's; (recv buffer, works).
    Ordered isend/irecv, never batch_isend_irecv (it hangs on gloo)."""
    n, r = comm.size(group), comm.rank(group)
    recv = torch.empty_like(buf)
    send = comm.send(buf, dist.get_global_rank(group, (r + 1) % n), group)
    receive = comm.recv(recv, dist.get_global_rank(group, (r - 1) % n), group)
    return recv, [send, receive]


def _wait(pending):
    buf, works = pending
    for work in works:
        work.wait()
    return buf


# ----------------------------------------------------------------------------------- ring attention
class RingAttention(torch.autograd.Function):
    """forward: cp ring steps of flash attention + LSE merge / backward: cp ring steps, dK/dV travelling home."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, balanced, backend):
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        # the running output (B, H, T/cp, D) and LSE (B, H, T/cp), fp32: no key seen yet
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], NEG_INF, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # (2, B, KVH, Tl, D): one message per step
        for step in range(n):
            # the block I hold goes on to the next rank (and the next arrives) while I compute
            pending = _ring(kv, group) if step < n - 1 else None
            plan = _plan(step, r, n, causal, balanced, Tl)
            if plan is not None:
                qs, ks, c = plan
                k_blk, v_blk = kv[0][:, :, ks], kv[1][:, :, ks]
                scores = _scores(q, len(range(Tl)[qs]), len(range(Tl)[ks]), c)
                with trace.span("cp_block", q.device, step=step, scores=scores):
                    ob, lb = _block_fwd(q[:, :, qs], k_blk, v_blk, c, scale, backend)
                    o[:, :, qs], lse[:, :, qs] = lse_merge(o[:, :, qs], lse[:, :, qs], ob, lb)
            if pending is not None:
                with trace.span("cp_wait", q.device, step=step):  # what the compute did not hide
                    kv = _wait(pending)
        out = o.to(q.dtype)
        # O(T/cp) per rank: no other rank's K/V is kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, balanced, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        group, causal, scale, balanced, backend = ctx.args
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv_pending = None
        for step in range(n):
            pending = _ring(kv, group) if step < n - 1 else None
            # my part of this block's dK, dV
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            plan = _plan(step, r, n, causal, balanced, Tl)
            if plan is not None:
                qs, ks, c = plan
                k_blk, v_blk = kv[0][:, :, ks], kv[1][:, :, ks]
                g = _block_bwd(do[:, :, qs], q[:, :, qs], k_blk, v_blk, o[:, :, qs], lse[:, :, qs], c, scale,
                               backend)
                dq[:, :, qs] += g[0].float()
                dkv[:, :, :, ks] += torch.stack(g[1:]).float()
            if dkv_pending is not None:  # what the ranks before me added to this block
                dkv += _wait(dkv_pending)
            # on to the next rank; the last hop brings each block home
            dkv_pending = _ring(dkv, group)
            kv = _wait(pending) if pending else kv
        dkv = _wait(dkv_pending)
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


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
    def forward(ctx, q, k, v, group, causal, scale, balanced, backend):
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        perm = torch.cat([positions(Tl * n, n, i, balanced) for i in range(n)]).to(q.device)
        kv = comm.all_gather(torch.stack([k, v]).contiguous(), group, dim=3)  # (2, B, KVH, T, D), ranks' order
        kv = kv.index_select(3, torch.argsort(perm))  # global order
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device)
        for qs, nk, c in _pieces(r, n, Tl, causal, balanced):
            k_pre, v_pre = kv[0][:, :, :nk], kv[1][:, :, :nk]  # the keys my rows see
            scores = _scores(q, len(range(Tl)[qs]), nk, c)
            with trace.span("cp_block", q.device, step=0, scores=scores):
                ob, lse[:, :, qs] = _block_fwd(q[:, :, qs], k_pre, v_pre, c, scale, backend)
            o[:, :, qs] = ob.to(q.dtype)
        # the gathered K/V stay until backward: cp x the K/V memory
        ctx.save_for_backward(q, kv, o, lse, perm)
        ctx.args = (group, causal, scale, balanced, backend)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kv, o, lse, perm = ctx.saved_tensors
        group, causal, scale, balanced, backend = ctx.args
        n, r, Tl = comm.size(group), comm.rank(group), q.shape[2]
        dq = torch.zeros_like(q)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for qs, nk, c in _pieces(r, n, Tl, causal, balanced):
            k_pre, v_pre = kv[0][:, :, :nk], kv[1][:, :, :nk]
            g = _block_bwd(do[:, :, qs].contiguous(), q[:, :, qs], k_pre, v_pre, o[:, :, qs], lse[:, :, qs], c,
                           scale, backend)
            dq[:, :, qs] = g[0].to(q.dtype)
            dkv[:, :, :, :nk] += torch.stack(g[1:]).float()
        # back in the ranks' order: each rank keeps its chunks of the sum
        dkv = comm.reduce_scatter(dkv.index_select(3, perm), group, dim=3)
        dk, dv = dkv[0].to(kv.dtype), dkv[1].to(kv.dtype)
        return dq, dk, dv, None, None, None, None, None


def cp_attention(q, k, v, group, *, variant: str = "ring", causal: bool = True, scale: float | None = None,
                 balanced: bool = True, backend: str | None = None, return_lse: bool = False):
    """Attention of my query shard q (B, H, T/cp, D) over the keys of every rank of `group`, k/v (B, KVH, T/cp, D)
    (GQA), by the "ring" or the "allgather" variant; the shards are ``shard(x, cp, rank, balanced=...)``.
    -> o (B, H, T/cp, D) [, lse (B, H, T/cp) fp32]."""
    fn = {"ring": RingAttention, "allgather": AllGatherAttention}[variant]
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] != k.shape[2]:
        raise ValueError(f"cp attention: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, heads, T/cp, D) "
                         "shards of the same tokens")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    n = comm.size(group)
    check_length(q.shape[2] * n, n, balanced and causal)
    be = resolve_backend(q, backend)
    if n == 1:  # one rank: the plain kernel
        out = attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=be)
    else:
        out = fn.apply(q, k, v, group, causal, scale, balanced and causal, be)
    return out if return_lse else out[0]


ring_attention = functools.partial(cp_attention, variant="ring")
allgather_attention = functools.partial(cp_attention, variant="allgather")
