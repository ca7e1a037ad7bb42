"""Chapter 13, beyond the ring: Ulysses context parallelism (DeepSpeed-Ulysses; Transformer Engine's "a2a"), and
its hybrid with the ring (USP, "2D" CP).

Each cp rank holds T/cp tokens of every head. One all-to-all per tensor trades that for every token of H/cp heads
(``comm.SeqToHeads``); the rank runs the ordinary causal kernel on whole sequences of its heads, and one all-to-all
trades the output back (``comm.HeadsToSeq``). Backward: the same all-to-alls, inverted. Per rank and layer, q, k, v
and o each send (cp-1)/cp of the shard once (the ring sends its K/V shard cp-1 times), but the degree is limited
by the heads: H % cp == 0.
GQA: kv heads split like the query heads when cp divides n_kv_head; fewer kv heads than cp (cp % n_kv_head == 0)
are replicated up to cp first (as DeepSpeed-Ulysses and TE do): rank j then holds the one kv head its query heads
read, and the copies' gradients are summed (repeat_interleave's backward). Any other n_kv_head is refused.
Layout: the all-to-all gathers the sequence in the order the ranks hold it (the load-balanced chunks r and
2cp-1-r of each rank, ``context.positions``); it is sorted into position order before the causal kernel and
unsorted after.
Hybrid, cp = a * R: cp rank c = i * a + j is rank j of a2a group i (a neighbouring ranks) and rank i of ring j.
The all-to-all inside the group gathers its a shards; sorted by position they are exactly the ring's balanced shard
of a sequence in 2R chunks (group i holds chunks i*a .. (i+1)*a - 1 of the 2cp and their mirror image), so the
ring of chapter 13 runs unchanged across the R groups on T*a/cp tokens of H/a heads.
"""
from __future__ import annotations

import math

import torch

from minite.backend import resolve_backend
from minite.errors import ParallelError
from minite.kernels.attention import attention
from minite.parallel import comm
from minite.parallel.context import check_length, cp_attention, positions

__all__ = ["check_heads", "ulysses_attention"]


def check_heads(n_head: int, n_kv_head: int, a: int, what: str = "cp", note: str = "") -> None:
    """Refuse head counts the all-to-all over `a` ranks cannot split, naming the numbers (`note`: whose heads)."""
    if n_head % a:
        raise ParallelError(f"Ulysses (a2a) context parallelism: n_head={n_head} is not divisible by {what}={a}{note}")
    if n_kv_head % a and a % n_kv_head:
        raise ParallelError(f"Ulysses (a2a) context parallelism: n_kv_head={n_kv_head} and {what}={a}{note}: one "
                            "must divide the other (kv heads split, or replicated up to the a2a degree)")


def _order(Tl: int, a: int, i: int, R: int, balanced: bool) -> torch.Tensor:
    """The sort of the tokens gathered from a2a group i (cp ranks i*a .. i*a+a-1, rank order) into position order."""
    n = a * R
    pos = torch.cat([positions(Tl * n, n, i * a + j, balanced) for j in range(a)])
    return torch.argsort(pos)


def ulysses_attention(q, k, v, group, *, ring_group=None, causal: bool = True, scale: float | None = None,
                      balanced: bool = True, backend: str | None = None, return_lse: bool = False):
    """Attention of my shard q (B, H, T/cp, D), k/v (B, KVH, T/cp, D) (``context.shard``) by the all-to-all over
    `group`; with `ring_group` the hybrid: a2a inside `group`, the ring across `ring_group` (cp rank =
    ring rank * a + a2a rank). -> o (B, H, T/cp, D) [, lse (B, H, T/cp) fp32]."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] != k.shape[2]:
        raise ValueError(f"Ulysses attention: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, heads, T/cp, D) "
                         "shards of the same tokens")
    a, R = comm.size(group), comm.size(ring_group)
    H, KVH, Tl = q.shape[1], k.shape[1], q.shape[2]
    check_heads(H, KVH, a, "the a2a degree" if R > 1 else "cp")
    balanced = balanced and causal
    check_length(Tl * a * R, a * R, balanced)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    be = resolve_backend(q, backend)
    if KVH < a:  # GQA with fewer kv heads than ranks: a copy per rank, rank j's the one its query heads read
        k, v = k.repeat_interleave(a // KVH, dim=1), v.repeat_interleave(a // KVH, dim=1)
    order = _order(Tl, a, comm.rank(ring_group), R, balanced).to(q.device)
    # seq -> heads, then position order: (B, H/a, a*Tl, D)
    q, k, v = (comm.SeqToHeads.apply(t.contiguous(), group).index_select(2, order) for t in (q, k, v))
    if R == 1:
        o, lse = attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=be)
    else:  # the group's tokens are the ring's balanced shard: chapter 13's ring across the groups
        o, lse = cp_attention(q, k, v, ring_group, variant="ring", causal=causal, scale=scale, balanced=balanced,
                              backend=be, return_lse=True)
    back = torch.argsort(order)
    o = comm.HeadsToSeq.apply(o.index_select(2, back).contiguous(), group)  # rank order, heads -> seq
    if not return_lse:
        return o
    with torch.no_grad():
        lse = comm.heads_to_seq(lse.float().index_select(2, back)[..., None].contiguous(), group)[..., 0]
    return o, lse
