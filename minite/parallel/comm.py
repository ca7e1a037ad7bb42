"""Every collective of chapters 10-13, and a byte counter for them.

Two layers. Plain functions (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``send``/``recv``...) call
torch.distributed and log what they move. Autograd Functions pair a forward collective with its adjoint backward,
which is all tensor and sequence parallelism need (Megatron's f and g, the SP gather and scatter):

    f  CopyToParallel          forward: identity          / backward: all-reduce
    g  ReduceFromParallel      forward: all-reduce        / backward: identity
       ScatterToSequence       forward: keep my chunk     / backward: all-gather
       GatherFromSequence      forward: all-gather        / backward: reduce-scatter      (SP, before a column linear)
       ReduceScatterToSequence forward: reduce-scatter    / backward: all-gather          (SP, after a row linear)
       GatherSplit             forward: all-gather        / backward: keep my chunk       (gather outputs to print)
       AllToAll                forward: all-to-all (send, recv) / backward: all-to-all (recv, send)  (EP dispatch)
       SeqToHeads              forward: all-to-all seq->heads / backward: all-to-all heads->seq  (Ulysses CP)
       HeadsToSeq              forward: all-to-all heads->seq / backward: all-to-all seq->heads  (Ulysses CP)

A group of size 1 (or None: no process group) makes all of them the identity, so the parallel layers with tp=1 are
the dense ones. Groups are passed in (``ParallelDims``); nothing here is global but the optional byte log.

``clip_grad_norm_`` clips sharded gradients by the norm of the whole model's (one all-reduce of one number).

Bytes: ``with CommLog() as log:`` records (op, payload bytes, group size, ring bytes sent per rank) for every call.
A ring all-reduce sends 2(n-1)/n of the payload per rank, an all-gather or reduce-scatter (n-1)/n of the full
tensor. gloo implements reduce_scatter as an all-reduce (twice the traffic): the log counts what the algorithm
needs, which is what NCCL sends, so do not time gloo's.
"""
from __future__ import annotations

import contextvars

import torch
import torch.distributed as dist

__all__ = ["size", "rank", "all_reduce", "all_gather", "reduce_scatter", "all_gather_into", "reduce_scatter_into",
           "send", "recv", "broadcast",
           "all_to_all", "all_to_all_counts", "CommLog", "clip_grad_norm_", "copy_to_parallel", "reduce_from_parallel",
           "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence", "gather_split",
           "CopyToParallel", "ReduceFromParallel", "ScatterToSequence", "GatherFromSequence",
           "ReduceScatterToSequence", "GatherSplit", "AllToAll",
           "seq_to_heads", "heads_to_seq", "SeqToHeads", "HeadsToSeq"]

_LOG: contextvars.ContextVar = contextvars.ContextVar("minite_comm_log", default=None)


class CommLog:
    """``with CommLog() as log:`` collects one row per collective: dict(op, bytes, n, sent)."""

    def __init__(self):
        self.rows: list[dict] = []

    def __enter__(self):
        self._token = _LOG.set(self)
        return self

    def __exit__(self, *exc):
        _LOG.reset(self._token)

    def total(self, key: str = "sent", op: str | None = None) -> int:
        return sum(r[key] for r in self.rows if op is None or r["op"] == op)

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r["op"]] = out.get(r["op"], 0) + r["sent"]
        return out


_RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0, "broadcast": lambda n: 1.0}


def _record(op: str, t: torch.Tensor, n: int) -> None:
    log = _LOG.get()
    if log is not None:
        b = t.numel() * t.element_size()
        log.rows.append({"op": op, "bytes": b, "n": n, "sent": round(b * _RING[op](n))})


def size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ----------------------------------------------------------------------------------- plain collectives
def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In place; returns the work handle when async_op (None when there is nothing to do)."""
    if size(group) == 1:
        return None
    _record("all_reduce", t, size(group))
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """out (n * shard.numel(),) flat <- every rank's shard, in rank order."""
    if size(group) == 1:
        out.copy_(shard.reshape(out.shape))
        return None
    _record("all_gather", out, size(group))
    return dist.all_gather_into_tensor(out, shard, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
    """out <- my chunk of sum over ranks of `full` (flat, n * out.numel())."""
    if size(group) == 1:
        out.copy_(full.reshape(out.shape))
        return None
    _record("reduce_scatter", full, size(group))
    return dist.reduce_scatter_tensor(out, full, group=group, async_op=async_op)


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's x along `dim` (new tensor)."""
    n = size(group)
    if n == 1:
        return x
    x = x.contiguous().reshape(1, *x.shape)
    out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group)  # gloo wants out = n stacked copies of the input's shape along dim 0
    return torch.cat(out.unbind(0), dim=dim)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """My chunk along `dim` of the sum over ranks of x (x.shape[dim] divisible by the group size)."""
    n = size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not divisible by {n} ranks")
    full = torch.stack(x.chunk(n, dim=dim)).contiguous()  # (n, ..., x.shape[dim] / n, ...)
    out = torch.empty((1, *full.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, full, group)
    return out[0]


def broadcast(t: torch.Tensor, src: int, group) -> None:
    if size(group) > 1:
        _record("broadcast", t, size(group))
        dist.broadcast(t, src=src, group=group)


def send(t: torch.Tensor, dst: int, group=None):
    """Ordered point-to-point (isend; wait on the handle). Never batch_isend_irecv: it hangs on gloo."""
    _record("send", t, 2)
    return dist.isend(t.contiguous(), dst=dst, group=group)


def recv(t: torch.Tensor, src: int, group=None):
    return dist.irecv(t, src=src, group=group)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows x[sum(send[:j]) : sum(send[:j+1])] go to rank j of `group`; returns the rows received, by source rank.
    Logged as the rows that leave this rank (a rank's rows to itself never touch the network)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    log = _LOG.get()
    if log is not None:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        sent = (sum(send) - send[rank(group)]) * row
        log.rows.append({"op": "all_to_all", "bytes": sum(send) * row, "n": size(group), "sent": sent})
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """Equal all-to-all: x (n, ...), row j goes to rank j; returns (n, ...), row j from rank j."""
    n = size(group)
    return all_to_all(x.reshape(n, -1), [1] * n, [1] * n, group).view(x.shape)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, T/n, D) my tokens of every head -> (B, H/n, T, D) every rank's tokens (in rank order) of my heads."""
    n = size(group)
    if n == 1:
        return x
    B, H, Tl, D = x.shape
    if H % n:
        raise ValueError(f"all-to-all seq->heads: {H} heads are not divisible by the group's {n} ranks")
    y = x.reshape(B, n, H // n, Tl, D).transpose(0, 1).contiguous()  # row j: head group j, for rank j
    return _exchange(y, group).permute(1, 2, 0, 3, 4).reshape(B, H // n, n * Tl, D)  # row j: rank j's tokens


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H/n, T, D) every token (rank order) of my heads -> (B, H, T/n, D) my tokens of every head."""
    n = size(group)
    if n == 1:
        return x
    B, Hl, T, D = x.shape
    if T % n:
        raise ValueError(f"all-to-all heads->seq: {T} tokens are not divisible by the group's {n} ranks")
    y = x.reshape(B, Hl, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()  # row j: rank j's tokens
    return _exchange(y, group).transpose(0, 1).reshape(B, n * Hl, T // n, D)  # row j: head group j


def all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Equal splits: counts (n * c,) -> (n, c), row j the c numbers rank j of `group` sent me (split sizes)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(size(group), -1)


def clip_grad_norm_(params, max_norm: float, groups=(), *, norm_params=None) -> torch.Tensor:
    """Clip the gradients of `params` in place to a global norm of max_norm, the norm of the whole model's
    gradient when each rank holds a shard of it; returns that norm before clipping (fp64, shape (1,)).

    Each rank sums the squares of its gradients in fp64; a parameter carrying ``tp_replicas`` (how many tp ranks
    hold the same elements: a number, or a tensor of per-row counts) is divided by it, so every element counts
    once. The sum is all-reduced over each group of `groups` (tp, pp, dp... None: nothing to add), then
    coef = min(max_norm / (norm + 1e-6), 1) scales every gradient.
    norm_params: the parameters whose gradients make up the norm, when not all of `params` (a pipeline's last
    stage leaves out its copy of the tied embedding and clips it with the rest, as Megatron does)."""
    params = [p for p in params if p.grad is not None]
    counted = params if norm_params is None else [p for p in norm_params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for p in counted:
        replicas = torch.as_tensor(getattr(p, "tp_replicas", 1), dtype=torch.float64, device=p.grad.device)
        sq += (p.grad.double() ** 2 / replicas).sum()
    for group in groups:
        all_reduce(sq, group)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of shape {tuple(x.shape)} over {n} ranks")
    return x.chunk(n, dim=dim)[rank(group)].contiguous()


# ----------------------------------------------------------------------------------- autograd pairs
class CopyToParallel(torch.autograd.Function):
    """forward: identity / backward: all-reduce (Megatron's f, before a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        all_reduce(g, ctx.group)
        return g, None


class ReduceFromParallel(torch.autograd.Function):
    """forward: all-reduce / backward: identity (Megatron's g, after a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class ScatterToSequence(torch.autograd.Function):
    """forward: keep my chunk along dim / backward: all-gather along dim."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


class GatherFromSequence(torch.autograd.Function):
    """forward: all-gather along dim / backward: reduce-scatter along dim (SP, before a column linear)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.group, ctx.dim), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter along dim / backward: all-gather along dim (SP, after a row linear)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


class GatherSplit(torch.autograd.Function):
    """forward: all-gather along dim / backward: keep my chunk (gather a sharded output, e.g. logits)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, ctx.dim), None, None


class AllToAll(torch.autograd.Function):
    """forward: all_to_all with (send, recv) split sizes / backward: all_to_all with (recv, send)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, dy):
        return all_to_all(dy, ctx.recv, ctx.send, ctx.group), None, None, None


class SeqToHeads(torch.autograd.Function):
    """forward: all-to-all seq->heads (my T/n tokens of H heads -> T tokens of H/n) / backward: heads->seq."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """forward: all-to-all heads->seq (T tokens of H/n heads -> my T/n tokens of H) / backward: seq->heads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g, ctx.group), None


def _wrap(fn, identity_if_single=True):
    def apply(x, group, *args):
        return x if identity_if_single and size(group) == 1 else fn.apply(x, group, *args)
    apply.__doc__ = fn.__doc__
    return apply


copy_to_parallel = _wrap(CopyToParallel)
reduce_from_parallel = _wrap(ReduceFromParallel)
scatter_to_sequence = _wrap(ScatterToSequence)
gather_from_sequence = _wrap(GatherFromSequence)
reduce_scatter_to_sequence = _wrap(ReduceScatterToSequence)
gather_split = _wrap(GatherSplit)
