"""Chapter 10: data parallelism, from "all-reduce every gradient" to ZeRO-3 (FSDP).

Every rank holds the model, sees 1/dp of the global batch, and the gradients are averaged over the dp group, so
every rank takes the step single-process AdamW would take on the whole batch. What differs is what a rank keeps:

    stage   params   grads    AdamW state (+ fp32 shard)   communication per step (N params, ring)
    0 DDP   N        N        2N                           all-reduce grads               2N(W-1)/W
    1       N        N        3N/W                         reduce-scatter grads + all-gather params  2N(W-1)/W
    2       N        N/W      3N/W                         the same (a unit's full grads freed once scattered)
    3 FSDP  N/W      N/W      2N/W                         all-gather params twice + reduce-scatter  3N(W-1)/W

``allreduce_grads`` is the naive baseline (after backward). ``DataParallel`` is the real one: parameters live in
flat buffers cut into *units* (one per transformer block, plus a root unit for the rest), a gradient hook counts
each unit's gradients and launches the complete unit's collective asynchronously while backward goes on with
earlier layers (overlap). Stage >= 1 pairs it with ``zero.ShardedAdamW``. Under ``no_sync()`` a backward only
accumulates (gradient accumulation's early micro-batches); each reduction reports to ``trace`` (the lesson's
timeline) when a recorder is active.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
from torch import nn

from minite.parallel import comm, trace

__all__ = ["allreduce_grads", "DataParallel", "Unit"]


def allreduce_grads(model: nn.Module, group) -> None:
    """Naive DP: after backward, all-reduce every gradient (one collective per tensor) and divide by W."""
    n = comm.size(group)
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, group)
            p.grad /= n


class Unit:
    """A group of parameters reduced (and, at stage 3, gathered) together: a flat buffer padded to W pieces."""

    def __init__(self, name: str, module: nn.Module | None, params: list[tuple[str, nn.Parameter]], world: int):
        self.name, self.module, self.params = name, module, params
        self.offsets, o = [], 0
        for _, p in params:
            self.offsets.append(o)
            o += p.numel()
        self.numel = o + (-o) % world  # padded so that every rank owns numel / W elements
        self.shard_numel = self.numel // world
        self.ready, self.full = 0, None

    def pieces(self, r: int):
        """(param name, lo, hi within the flat param, lo, hi within my shard of this unit) for rank r's shard."""
        a, b = r * self.shard_numel, (r + 1) * self.shard_numel
        for (name, p), o in zip(self.params, self.offsets):
            lo, hi = max(a, o), min(b, o + p.numel())
            if lo < hi:
                yield name, lo - o, hi - o, lo - a, hi - a


class DataParallel:
    """Data parallelism over `group` at ZeRO `stage` 0-3 (0: bucketed DDP). Call ``finish()`` after backward.

    units: the modules that form a unit each (default: ``model.blocks``); every other parameter joins the root.
    params: the parameters it owns (default: all; expert parallelism gives the experts to a second one, over edp);
    divisor: what the summed gradients are divided by (default W: the mean over the group).
    """

    def __init__(self, model: nn.Module, group, stage: int = 0, units: list[nn.Module] | None = None,
                 params: list[nn.Parameter] | None = None, divisor: int | None = None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        self.model = model
        self.group = group
        self.stage = stage
        self.W = comm.size(group)
        self.r = comm.rank(group)
        self.divisor = divisor or self.W
        self.pending = []  # (work, buffer, trace row) of each reduction in flight
        self.done = True  # no backward in progress: finish() has nothing to do
        self._sync = True  # False under no_sync(): backward accumulates, nothing is reduced
        self.units = self._cut(model, units, params)
        # where each unit starts in the flat full buffers, and in my shard (the last entry: the total)
        self._unit_off = list(itertools.accumulate((u.numel for u in self.units), initial=0))
        self.shard_off = list(itertools.accumulate((u.shard_numel for u in self.units), initial=0))
        self._make_buffers(next(model.parameters()).device)
        if stage == 3:
            self._gather_around_forward()
        for u in self.units:
            for _, p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._grad_ready(u))

    def _cut(self, model: nn.Module, units: list[nn.Module] | None, params) -> list[Unit]:
        """A unit per module of `units` (default: the transformer blocks), then the root: every other parameter."""
        mods = list(model.blocks) if units is None else list(units)
        owner = {id(p): i for i, m in enumerate(mods) for p in m.parameters()}
        mine = None if params is None else {id(p) for p in params}
        groups = [[] for _ in mods] + [[]]
        for name, p in model.named_parameters():
            if mine is None or id(p) in mine:
                groups[owner.get(id(p), len(mods))].append((name, p))
        out = [Unit(f"unit{i}", m, g, self.W) for i, (m, g) in enumerate(zip(mods, groups))]
        return out + [Unit("root", model, groups[-1], self.W)]

    def _make_buffers(self, dev: torch.device) -> None:
        """The flat buffers the parameters and gradients live in, at this stage."""
        total, mine = self._unit_off[-1], self.shard_off[-1]
        # stage < 3: every parameter is a view into one flat full buffer (as in DDP/Megatron)
        self.flat_param = torch.zeros(total, device=dev) if self.stage < 3 else None
        if self.stage < 3:
            for u, uo in zip(self.units, self._unit_off):
                self._bind(u, self.flat_param[uo:uo + u.numel], copy=True)
        # stage <= 1: one flat full gradient buffer, .grad are views into it (accumulated in place by autograd)
        self.flat_grad = torch.zeros(total, device=dev) if self.stage <= 1 else None
        if self.stage <= 1:
            for u, uo in zip(self.units, self._unit_off):
                for (_, p), o in zip(u.params, u.offsets):
                    p.grad = self.flat_grad[uo + o:uo + o + p.numel()].view_as(p)
        # stage >= 1: my shard of every unit, contiguous: the master parameters and their reduced gradients
        self.shard_param = self.shard_grad = None
        if self.stage >= 1:
            self.shard_param = nn.Parameter(torch.zeros(mine, device=dev))
            self.shard_grad = torch.zeros(mine, device=dev)
            for u, so in zip(self.units, self.shard_off):
                params = dict(u.params)
                for name, lo, hi, slo, shi in u.pieces(self.r):
                    self.shard_param.data[so + slo:so + shi] = params[name].detach().reshape(-1)[lo:hi]

    def _gather_around_forward(self) -> None:
        """Stage 3: the parameters become views of a per-unit buffer that exists only while gathered: before the
        unit's forward and again before its backward."""
        for u in self.units:
            u.full = torch.zeros(u.numel, device=self.shard_param.device)
            self._bind(u, u.full, copy=False)
            self._free(u)
        for u in self.units[:-1]:
            u.module.register_forward_pre_hook(lambda m, a, u=u: self._gather(u))
            u.module.register_forward_hook(lambda m, a, out, u=u: self._after_forward(u, out))
        root = self.units[-1]
        self.model.register_forward_pre_hook(lambda m, a: self._gather(root))
        self.model.register_forward_hook(lambda m, a, out: None if torch.is_grad_enabled() else self._free(root))

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _bind(u: Unit, buf: torch.Tensor, copy: bool) -> None:
        for (_, p), o in zip(u.params, u.offsets):
            view = buf[o:o + p.numel()].view_as(p)
            if copy:
                view.copy_(p.detach())
            p.data = view

    def _gather(self, u: Unit) -> None:
        if u.full.untyped_storage().size() == 0:  # stage 3: bring the unit back, all-gathered from the shards
            u.full.untyped_storage().resize_(u.numel * u.full.element_size())
            so = self.shard_off[self.units.index(u)]
            comm.all_gather_into(u.full, self.shard_param.detach()[so:so + u.shard_numel], self.group)

    @staticmethod
    def _free(u: Unit) -> None:  # stage 3: the parameters' storage goes, the views stay (FSDP's trick)
        u.full.untyped_storage().resize_(0)

    def _after_forward(self, u: Unit, out):
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:

            def gather_again(g):  # just before the unit's backward
                self._gather(u)
                return g

            out.register_hook(gather_again)
        self._free(u)

    # ------------------------------------------------------------------ gradient reduction
    @contextlib.contextmanager
    def no_sync(self):
        """``with dp.no_sync():`` the backwards run inside only accumulate their gradients (the early
        micro-batches of gradient accumulation); the first backward outside reduces the sum (torch DDP's)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _grad_ready(self, u: Unit) -> None:
        if not self._sync:
            return
        if self.done:  # first gradient of this backward: finish() runs when the backward ends (DDP)
            self.done = False
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        u.ready += 1
        if u.ready < len(u.params):
            return
        self._poll()
        self._launch(u)

    def _launch(self, u: Unit) -> None:
        i = self.units.index(u)
        row = trace.begin("dp_comm", unit=u.name)
        if self.stage <= 1:
            full = self.flat_grad[self._unit_off[i]:self._unit_off[i] + u.numel]
            for (_, p), o in zip(u.params, u.offsets):  # .grad may have been replaced (zero_grad(set_to_none))
                view = full[o:o + p.numel()].view_as(p)
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
        else:  # stage 2/3: a temporary flat copy of the unit's grads; the full .grad tensors are dropped now
            full = torch.zeros(u.numel, device=self.shard_grad.device)
            for (_, p), o in zip(u.params, u.offsets):
                full[o:o + p.numel()] = p.grad.reshape(-1)
                p.grad = None
            if self.stage == 3 and u is not self.units[-1]:
                self._free(u)
        if self.stage == 0:
            work = comm.all_reduce(full, self.group, async_op=True)
        else:
            so = self.shard_off[i]
            work = comm.reduce_scatter_into(self.shard_grad[so:so + u.shard_numel], full, self.group, async_op=True)
        self.pending.append((work, full, row))

    def _poll(self) -> None:  # the lesson's timeline: when each reduction in flight is seen complete
        for work, _, row in self.pending:
            if row is not None and (work is None or work.is_completed()):
                trace.end(row)

    def finish(self) -> None:
        """Wait for every reduction (launching units whose hooks did not fire), then average over W. Runs by
        itself at the end of each backward; calling it again before the next backward does nothing."""
        if self.done:
            return
        self.done = True
        for u in self.units:
            if u.ready < len(u.params) and any(p.grad is not None for _, p in u.params):
                self._launch(u)
        for work, _, row in self.pending:
            if work is not None:
                work.wait()
            trace.end(row)
        self.pending = []
        for u in self.units:
            u.ready = 0
        if self.stage == 0:
            self.flat_grad /= self.divisor
        else:
            self.shard_grad /= self.divisor
        if self.stage == 3:
            self._free(self.units[-1])

    def zero_grad(self) -> None:
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        if self.shard_grad is not None:
            self.shard_grad.zero_()
        if self.stage >= 2:
            for p in (p for u in self.units for _, p in u.params):
                p.grad = None

    def gather_params(self) -> None:
        """Stage 1/2, after the optimizer stepped my shard: all-gather every unit's parameters."""
        for u, uo, so in zip(self.units, self._unit_off, self.shard_off):
            comm.all_gather_into(self.flat_param[uo:uo + u.numel], self.shard_param.detach()[so:so + u.shard_numel],
                                 self.group)

    def shard_mask(self, fn, padding: float = 0.0) -> torch.Tensor:
        """A per-element vector over my shard: fn(name, param) for the elements of each parameter (a number, or a
        tensor that broadcasts to the parameter's shape), `padding` on the padding."""
        out = torch.full_like(self.shard_grad, padding)
        for u, so in zip(self.units, self.shard_off):
            params = dict(u.params)
            for name, lo, hi, slo, shi in u.pieces(self.r):
                v = fn(name, params[name])
                out[so + slo:so + shi] = v if not torch.is_tensor(v) else v.expand_as(params[name]).reshape(-1)[lo:hi]
        return out

    @contextlib.contextmanager
    def gathered(self):
        """Inside, every parameter is whole (stage 3 gathers each unit, and frees them after; a collective)."""
        for u in self.units if self.stage == 3 else []:
            self._gather(u)
        try:
            yield
        finally:
            for u in self.units if self.stage == 3 else []:
                self._free(u)

    def full_state_dict(self) -> dict:
        """The model's state dict with every parameter whole (stage 3 gathers each unit; a collective)."""
        with self.gathered():
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
