"""Chapter 16: expert parallelism (EP). The E experts of every MoE layer are cut over an ``ep`` group of ranks.

ep divides dp: the dp ranks fall into dp/ep groups of ep consecutive ranks (``ep`` groups), and the ranks at the
same place of each group (``edp`` groups, dp/ep ranks each) hold the same experts. Each rank still sees its own
slice of the batch and holds the router, attention and embeddings whole; rank r of an ep group holds experts
[r * E/ep, (r + 1) * E/ep). One MoE layer's forward on a rank:

    route + permute (layers/moe.py)   rows sorted by expert id = grouped by destination rank (experts are contiguous)
    1. exchange counts                all_to_all_single of the (E,) counts: how many rows each source sends me, per
                                      local expert; split sizes go to the host (the one sync of the dispatch)
    2. dispatch                       all_to_all_single of the rows, with those split sizes
    3. local experts                  re-sort the received rows by local expert, grouped GEMM, sort back
    4. combine                        all_to_all_single back (the splits swapped), then unpermute as before

The layer knows none of this: steps 1-4 are ``ExpertExchange.experts``, the token exchange ``shard_experts``
installs into each MoE layer (its ``exchange``) after cutting its experts, as tensor.py builds its layers
``from_dense``. Both exchanges here also sum a layer's routed counts over the ranks holding other tokens of the
global batch (``batch_sum``, over dp, or dp x cp: ``stats_group``): the Switch loss's f_i and the "bias" step see
the global load, as one process does. ``install_batch_load`` gives that to a model whose experts stay whole
(ep = 1, dp x cp > 1). The bias itself moves at minite.layers.moe.step_expert_bias, once per optimizer step.

Autograd: the backward of an all-to-all is the all-to-all with the splits swapped (``comm.AllToAll``).
Gradients: a non-expert parameter is averaged over dp as in DDP. An expert's gradient on its owner already sums
the contributions of all ep ranks' tokens (the backward all-to-all brought them), so it is summed over the edp
replicas and divided by dp: the gradient of the global batch's mean loss. The checkpoint stays dense (the experts
all-gathered over ep), so it resumes under any layout. Under tp (sequence.py) every tp rank holds the same E/ep
experts and runs them on the same tokens: the ep and edp groups join the ranks of one tp index, the gradient norm
counts each element once. Under cp (context_gpt.py) each cp rank runs its T/cp tokens through the experts of its
ep group (ep and edp lie inside dp at one cp index): dense gradients are averaged over dp x cp, an expert's summed
over its replicas at every cp index (``edp_cp``), both divided by dp * cp. Under pp (pipeline.py) each stage's MoE
layers are sharded the same way and the pipeline reduces their gradients itself (``average_grads``,
``grad_squares``); with cp as well, over dp x cp and edp x cp, as under cp alone. With ZeRO (``ExpertZero``)
the dense parameters and the experts are sharded by two ``DataParallel``, over dp and over edp (x cp).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from minite.layers.moe import LocalExchange, MoE
from minite.parallel import comm
from minite.parallel.sequence import gather_dense

__all__ = ["exchange_counts", "BatchLoad", "ExpertExchange", "shard_experts", "install_batch_load",
           "ExpertDataParallel", "ExpertZero", "moe_layers", "stats_group", "is_expert", "average_grads",
           "grad_squares"]


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts (E,): rows I send to each expert -> (ep, E/ep): rows each source rank sends to each of my experts."""
    return comm.all_to_all_counts(counts, group)


class BatchLoad(LocalExchange):
    """A MoE's token exchange when its experts are all here but the global batch is cut over `group` (dp, or
    dp x cp): the rows stay local, the routed counts are summed over the group (in place)."""

    def __init__(self, group):
        self.group = group

    def batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.group)
        return t


class ExpertExchange(BatchLoad):
    """A MoE's token exchange under expert parallelism: its experts cut over `ep_group` (E/ep each, contiguous),
    the routed counts summed over `group` (dp, or dp x cp; ep divides it)."""

    def __init__(self, ep_group, group):
        super().__init__(group)
        self.ep_group = ep_group

    @torch.compiler.disable  # Python split sizes and collectives: eager, behind a graph break under torch.compile
    def experts(self, ffn, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """xs (M, C) rows sorted by global expert id, offsets (E + 1,), ffn the local experts -> (M, C) rows in the
        same order (dropped rows, past offsets[E], are 0)."""
        group, ep = self.ep_group, comm.size(self.ep_group)
        El = (offsets.numel() - 1) // ep  # my experts
        counts = offsets[1:] - offsets[:-1]  # (E,) rows for each expert, kept ones only
        recv = exchange_counts(counts, group)  # (ep, El)
        send_splits = counts.view(ep, El).sum(1).tolist()  # host sync: all_to_all_single takes Python split sizes
        recv_splits = recv.sum(1).tolist()
        kept = sum(send_splits)
        xr = comm.AllToAll.apply(xs[:kept], send_splits, recv_splits, group)  # (R, C): by source, then local expert
        local = torch.repeat_interleave(torch.arange(El, device=xs.device).repeat(ep), recv.reshape(-1))  # (R,)
        order = torch.argsort(local, stable=True)  # by local expert (sources in rank order within each)
        loffsets = torch.cat([recv.new_zeros(1), torch.cumsum(recv.sum(0), 0)])  # (El + 1,)
        # (R, C). Even with R = 0 its result is in the graph of xr and the weights (grouped GEMM, both backends):
        # every rank must run both backward all-to-alls, or the ranks' collectives fall out of step.
        yl = ffn(xr[order], loffsets)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        ys = comm.AllToAll.apply(yl[inverse], recv_splits, send_splits, group)  # (kept, C): back to their sources
        return torch.cat([ys, ys.new_zeros((xs.shape[0] - kept, ys.shape[1]))])


def stats_group(dims):
    """The group whose routed counts make the global load: every rank holding other tokens of the global batch."""
    return dims.group("dp_cp" if dims.cp > 1 else "dp")


def moe_layers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, MoE)]


def is_expert(q) -> bool:
    """An expert parameter sharded over ep (shard_experts tags it)."""
    return getattr(q, "expert_parallel", False)


def average_grads(params, dp_group, edp_group, n: int) -> None:
    """Gradients summed over their replicas and divided by n (dp, or dp * cp): the experts' (sharded over ep: theirs
    already sum my ep group's tokens, the all-to-all's backward) over edp_group (edp, or edp x cp), the others over
    dp_group (dp, or dp x cp). One flat all-reduce each."""
    experts = [q for q in params if is_expert(q)]
    for qs, group in (([q for q in params if not is_expert(q)], dp_group), (experts, edp_group)):
        if qs:
            flat = torch.cat([q.grad.reshape(-1) for q in qs])
            comm.all_reduce(flat, group)
            for q, g in zip(qs, (flat / n).split([q.numel() for q in qs])):
                q.grad = g.view_as(q).clone()


def grad_squares(qs, ep_group, groups, grads: bool = True) -> torch.Tensor:
    """Sum over qs of (grad ** 2, or 1 to count elements) / tp_replicas, fp64 (1,): the experts' part summed over
    the ep group (each rank holds E/ep of them), then the whole over each of `groups` (pp, tp)."""
    parts = [torch.zeros(1, dtype=torch.float64, device=qs[0].device if qs else None) for _ in range(2)]
    for q in qs:
        if grads and q.grad is None:
            continue
        v = q.grad.double() ** 2 if grads else torch.ones_like(q, dtype=torch.float64)
        replicas = torch.as_tensor(getattr(q, "tp_replicas", 1), dtype=torch.float64, device=v.device)
        parts[is_expert(q)] += (v / replicas).sum()
    comm.all_reduce(parts[1], ep_group)
    total = parts[0] + parts[1]
    for group in groups:
        comm.all_reduce(total, group)
    return total


def shard_experts(model: nn.Module, dims) -> nn.Module:
    """Keep my E/ep experts of every MoE layer (in place) and install the all-to-all exchange; the router and the
    rest stay whole. Each expert parameter is tagged ``dense_index = (0, my expert ids)`` (reshard.py slices the
    dense optimizer state by it)."""
    ep, r = dims.ep, dims.ep_rank
    for moe in moe_layers(model):
        El = moe.num_experts // ep
        lo = r * El
        for name in ("w_gate_up", "w_down"):
            old = getattr(moe, name)
            p = nn.Parameter(old.detach()[lo:lo + El].clone())
            p.dense_index = (0, torch.arange(lo, lo + El))
            p.expert_parallel = True
            for attr in ("dense_name", "tp_replicas"):  # under tp (sequence.py): the same shard on every tp rank
                if hasattr(old, attr):
                    setattr(p, attr, getattr(old, attr))
            setattr(moe, name, p)
        moe.exchange = ExpertExchange(dims.group("ep"), stats_group(dims))  # rows to their experts' ranks
    return model


def install_batch_load(model: nn.Module, dims) -> nn.Module:
    """Every MoE layer of `model` (experts whole) sums its routed counts over dp (x cp): the global load."""
    for moe in moe_layers(model):
        moe.exchange = BatchLoad(stats_group(dims))
    return model


class ExpertDataParallel:
    """Gradient averaging for a model whose experts are sharded: dense parameters over dp, experts over edp
    (both divided by dp), once per backward (one flat all-reduce each); ``no_sync()`` for gradient accumulation.
    Under cp: dense over dp x cp, experts over edp x cp (``edp_cp``), both divided by dp * cp."""

    def __init__(self, model: nn.Module, dims):
        self.model, self.dims = model, dims
        self.experts = [p for p in model.parameters() if getattr(p, "expert_parallel", False)]
        self.dense = [p for p in model.parameters() if not getattr(p, "expert_parallel", False)]
        self._sync, self._queued = True, False
        cp = dims.cp > 1  # every cp rank of my dp rank holds my experts and saw other tokens
        self.groups = (dims.group("dp_cp" if cp else "dp"), dims.group("edp_cp" if cp else "edp"))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p) -> None:
        if self._sync and not self._queued:  # the first gradient of this backward: reduce when it ends
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        self._queued = False
        for params, group in zip((self.dense, self.experts), self.groups):
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group)
            flat /= self.dims.dp * self.dims.cp
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]),
                                                                            grads)])

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient: the dense part (the same on every rank) plus every expert's,
        summed over the ep group; every gradient scaled by min(max_norm / (norm + 1e-6), 1). Under tp, each
        element counted once (divided by its ``tp_replicas``) and the sum taken over the tp group."""
        def sq(params):
            return sum((p.grad.double() ** 2 / getattr(p, "tp_replicas", 1)).sum() for p in params
                       if p.grad is not None) + torch.zeros(1, dtype=torch.float64,
                                                            device=next(self.model.parameters()).device)
        experts = sq(self.experts)
        comm.all_reduce(experts, self.dims.group("ep"))
        total = sq(self.dense) + experts
        if self.dims.tp > 1:
            comm.all_reduce(total, self.dims.group("tp"))
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    def _dense(self, name: str, t: torch.Tensor, p) -> torch.Tensor:
        if getattr(p, "expert_parallel", False):
            return gather_dense(t, p, self.dims.group("ep"))
        return gather_dense(t, p, self.dims.group("tp"))  # a TP shard gathered; a whole tensor copied

    def dense_state_dict(self) -> dict:
        """The dense model's state dict (a collective over ep, and tp: every rank calls it), by dense names."""
        params = dict(self.model.named_parameters())
        return {getattr(params[k], "dense_name", k) if k in params else k: self._dense(k, v, params[k])
                if k in params else v for k, v in self.model.state_dict().items()}

    def dense_optim_state(self, opt) -> dict:
        """The layout-free AdamW state (reshard.py's format), the expert moments gathered over ep."""
        from minite.parallel.reshard import FORMAT, MOMENTS, _local_moments
        moments, step = _local_moments(opt)
        state = {k: {} for k in MOMENTS}
        for name, p in self.model.named_parameters():
            if p in moments:
                for k, t in zip(MOMENTS, moments[p]):
                    state[k][getattr(p, "dense_name", name)] = self._dense(name, t, p).cpu()
        return {"format": FORMAT, "step": step, **state}


class ExpertZero(ExpertDataParallel):
    """ZeRO stage 1-3 with sharded experts: two ``DataParallel`` at that stage, one owning the dense parameters
    (over dp, averaged), one the experts (over edp, the sum divided by dp, as ``finish`` above); under cp, dp x cp
    and edp x cp (``edp_cp``), divided by dp * cp. ``optimizer()`` pairs their ``ShardedAdamW``: one global norm,
    the squares of both shards summed over dp (x cp: its ranks' shards are disjoint and cover the model, edp x ep
    spans dp) and tp. The checkpoint is ExpertDataParallel's."""

    def __init__(self, model: nn.Module, dims, stage: int):
        from minite.parallel.data import DataParallel
        self.model, self.dims, self.opt = model, dims, None
        experts = [p for p in model.parameters() if getattr(p, "expert_parallel", False)]
        dense = [p for p in model.parameters() if not getattr(p, "expert_parallel", False)]
        cp = dims.cp > 1  # under cp: the replicas of each cp index too, as ExpertDataParallel
        self.norm_group = dims.group("dp_cp" if cp else "dp")
        self.parts = [DataParallel(model, self.norm_group, stage, params=dense),
                      DataParallel(model, dims.group("edp_cp" if cp else "edp"), stage, params=experts,
                                   divisor=dims.dp * dims.cp)]

    def finish(self) -> None:
        for dp in self.parts:
            dp.finish()

    @contextlib.contextmanager
    def no_sync(self):
        with self.parts[0].no_sync(), self.parts[1].no_sync():
            yield

    def optimizer(self, **kw):
        """One optimizer over both shards (kw: ShardedAdamW's lr, betas, weight_decay)."""
        from minite.parallel.zero import JointShardedAdamW, ShardedAdamW
        tp = self.dims.group("tp")
        self.opt = JointShardedAdamW([ShardedAdamW(dp, tp_group=tp, **kw) for dp in self.parts],
                                     [self.norm_group, tp])
        return self.opt

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.opt.clip_grad_norm_(max_norm)

    def dense_state_dict(self) -> dict:
        with self.parts[0].gathered(), self.parts[1].gathered():  # stage 3: every unit whole meanwhile
            return super().dense_state_dict()
