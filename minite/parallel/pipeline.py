"""Pipeline parallelism (chapter 12): the GPT cut into stages by layers, one stage per rank of the pp group.

    stage 0: embedding + blocks[0:a]  ->  stage 1: blocks[a:b]  -> ... ->  stage p-1: blocks[..] + norm + head + loss

``partition`` balances the stages by parameter count (the embedding counts on the first stage, the tied head on
the last). ``PipelineGPT.step(x, y)`` cuts the batch into m micro-batches and runs a schedule from
``pipeline_schedule`` (AFAB or 1F1B) or ``schedules`` (ZB-H1: each backward split into B, the input gradient
sent upstream at once, and W, the weight gradients, run later by ``schedules.DeferredWeights``): activations go
forward and their gradients come back with ordered ``isend``/``irecv`` (never ``batch_isend_irecv``: it hangs on
gloo). Sends are non-blocking and receives wait; ``schedules.check_plan`` runs every rank's op list first (each
receive meets the message sent for it, in order, and no rank waits forever), so a bad schedule fails before sending.
Interleaved 1F1B (``schedules.interleaved``): each rank holds v model chunks, stages s, s + p, ... of p * v
(``Chunks``), and an op names its chunk. The tied embedding lives on both end stages; their two gradients are
summed after the backward (Megatron's embedding group), so both copies take the same AdamW step.
With a ``trace.Recorder`` active, each step reports a "pp" event (F, B or W, micro-batch, start, end; a forward also
the bytes of activations autograd saved for its backward): the lesson's timeline and memory per stage.

A mixture of experts (chapter 16): the m micro-batches are gradient accumulation, so each stage adds its blocks'
Switch loss per micro-batch ("aux"; the reported loss sums every stage's) and the "bias" moves once per optimizer
step, after the schedule (the micro-batches' loads add up in the layers; minite.layers.moe.step_expert_bias).
With ep > 1 (``runtime.Parallel.wrap`` shards the stage's experts) expert gradients are summed over the edp
replicas, the rest over dp, both divided by dp, as ExpertDataParallel does. Under cp too: each cp rank runs its
T/cp tokens of every micro-batch through its stage, the routed counts are summed over dp x cp (by the MoE's
exchange), the Switch loss (global f_i, my tokens' P_i) is averaged over cp with the rest of the loss, dense
gradients over dp x cp, expert gradients over edp x cp (``edp_cp``), both divided by dp * cp.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch import nn

from minite.models.gpt import GPT
from minite.parallel import comm, trace
from minite.parallel.dims import ParallelError
from minite.parallel.expert import average_grads, grad_squares, is_expert
from minite.parallel.pipeline_stage import Stage, StageMoE, _PendingGrads, my_tokens, partition
from minite.parallel.schedules import SCHEDULES, DeferredWeights, check_plan, plan
from minite.parallel.sequence import gather_dense

__all__ = ["partition", "Stage", "PipelineGPT"]


class Chunks(nn.ModuleList):
    """Interleaved 1F1B: my v stages (model chunks s, s + p, ...) seen as one stage by the rest of PipelineGPT:
    first / last when it holds the model's first / last stage, wte that stage's embedding (the tied pair)."""

    def __init__(self, chunks: list[Stage]):
        super().__init__(chunks)
        self.first, self.last, self.sp = chunks[0].first, chunks[-1].last, chunks[0].sp

    @property
    def wte(self):
        return (self[0] if self.first else self[-1]).wte


class PipelineGPT(nn.Module):
    """My stage (interleaved: my chunks) of a GPT under pipeline parallelism (dims.pp ranks). ``step(x, y)`` runs
    one schedule over the global batch (the same x, y on every rank) and accumulates this stage's gradients;
    ``forward(x, y)`` does the same behind minite.train's ``loss.backward()``. Under ``no_sync()`` the gradients
    are not averaged over dp."""

    def __init__(self, dense: GPT, dims, microbatches: int = 0, schedule="1f1b"):
        """dense: the dense GPT, or the TPGPT / CPGPT built from it (each stage keeps its layers' shards)."""
        super().__init__()
        p, s = dims.pp, dims.pp_rank  # stages, and mine
        self.config = dense.config
        self.dims = dims
        self.p = p
        self.s = s
        if isinstance(schedule, str) and schedule not in SCHEDULES or microbatches < 0:
            raise ParallelError(f"pipeline schedule {schedule!r} (one of {sorted(SCHEDULES)}), microbatches="
                                f"{microbatches} (>= 1, or 0 for pp={p})")
        self.microbatches = microbatches or p
        self.schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
        self._split = None  # the B/W split of my stages' backward (DeferredWeights), made by a first ZB schedule
        self.v = v = getattr(self.schedule, "v", 1)  # model chunks per rank (interleaved: stages s, s + p, ...)
        moe, n = getattr(self.config, "moe_num_experts", 0), self.config.n_layer  # chunk c: stage c * p + s
        if v > 1 and (dims.tp * dims.cp > 1 or moe or self.microbatches % p or n < p * v):
            raise ParallelError(f"interleaved pipeline schedule (pp={p} x {v} chunks = {p * v} stages) needs n_layer "
                                f">= {p * v} (got {n}), micro-batches divisible by pp (got {self.microbatches}), "
                                f"tp=cp=1, no MoE (tp={dims.tp}, cp={dims.cp}, moe_num_experts={moe}): use 1f1b/zbh1")
        self.layers = partition(dense, p * v)
        self.chunks = [Stage(dense, self.layers[k], k == 0, k == p * v - 1) for k in range(s, p * v, p)]
        self.stage = self.chunks[0] if v == 1 else Chunks(self.chunks)
        for ch in self.chunks:  # the dense name of every parameter (TP shards have theirs)
            for name, q in ch.named_parameters():
                if not hasattr(q, "dense_name"):
                    q.dense_name, q.dense_index, q.tp_replicas = name, (None, None), 1
        self.group = dims.group("pp")
        self.tp_group = dims.group("tp")
        self.cp_group = dims.group("cp")
        self.dp_group = dims.group("dp_cp" if dims.cp > 1 else "dp")  # the replicas of my stage's weights
        self.edp_group = dims.group("edp_cp" if dims.cp > 1 else "edp")  # (ep) those of my experts
        self.ends = (dims.ranks.get("pp", [0])[0], dims.ranks.get("pp", [0])[-1])  # global ranks, first and last
        self.act_dtype = next(dense.parameters()).dtype
        self._pending = None  # the schedule's gradients, until the returned loss's backward adds them
        # fp16: minite.train sets grad_scale to the loss scaler's S; the schedule's backward starts from S / m, so the
        # activation gradients in and between the stages are scaled as one process's; _seed: the S they carry
        self.grad_scale, self._seed = (lambda: 1.0), 1.0
        self._anchor = torch.zeros((), requires_grad=True)
        self._sync = True  # False under no_sync(): gradients accumulate, not averaged over dp
        self._moe = None  # the last training schedule's StageMoE (its routing: moe_stats)

    # ------------------------------------------------------------------ the schedule
    def _chunks(self, x, y, m):
        if x.shape[0] % m:
            raise ParallelError(f"batch of {x.shape[0]} sequences does not split into {m} equal micro-batches "
                                f"(--parallel.microbatches={m}); choose m dividing the global batch")
        return x.chunk(m), (y.chunk(m) if y is not None else [None] * m)

    def _recv(self, ref: torch.Tensor, src: int) -> torch.Tensor:
        b, T = ref.shape  # ids (b, T): the activation is (b, T, C), or (b, T/tp, C) with sequence parallelism
        T = T // comm.size(self.tp_group) if self.stage.sp else T
        buf = torch.empty(b, T, self.config.n_embd, dtype=self.act_dtype, device=ref.device)
        comm.recv(buf, src, self.group).wait()
        return buf

    def _run(self, x, y, m: int):
        """One schedule: (global loss, this stage's fresh gradients). Under cp: my tokens only, loss averaged."""
        with my_tokens(self.stage, self.cp_group, x) as pos:
            loss, grads = self._schedule(x if pos is None else x[:, pos], y if pos is None else y[:, pos], m)
        comm.all_reduce(loss, self.cp_group)
        return loss / comm.size(self.cp_group), grads

    def _schedule(self, x, y, m: int):
        """One schedule: (global loss, my fresh gradients); .grad is left as it was. Op (kind, i, c): chunk c."""
        params = list(self.stage.parameters())
        kept = [q.grad for q in params]
        for q in params:
            q.grad = None
        xs, ys = self._chunks(x, y, m)
        plans = plan(self.schedule, self.p, m)  # every rank's ops (kind, i, chunk), checked before any message:
        check_plan(plans, self.p, m, self.v)  # F < B < W, each receive meets the message sent for it, no deadlock
        steps = plans[self.s]
        split = any(op[0] == "W" for op in steps)  # the backward is split into B and W
        if split and self._split is None:
            self._split = [DeferredWeights(ch) for ch in self.chunks]
        prev, nxt = self.dims.neighbour("pp", -1), self.dims.neighbour("pp", 1)
        ins, outs, sends = {}, {}, []
        loss = torch.zeros((), dtype=torch.float64, device=x.device)
        moes = [StageMoE(ch, self.config, self.training, m, x.device) for ch in self.chunks]
        self._moe = moes[0]  # (interleaved: a dense GPT only)
        for kind, i, c in steps:
            st, moe, at = self.chunks[c], moes[c], (i, c)
            if kind == "F":
                inp = xs[i] if st.first else self._recv(xs[i], prev).requires_grad_()
                weights = itertools.chain(st.parameters(), st.buffers())  # not activations
                keep = self._split[c].forward(i) if split else contextlib.nullcontext()  # ZB: linears' x, dy edge
                with trace.span("pp", x.device, step="F", mb=i, chunk=c) as row, trace.saved_bytes(row, weights), keep:
                    out = st(inp, ys[i] if st.last else None)
                out, share = moe.after_forward(i, out, st.last)  # MoE: + the balance loss ("aux"), stats
                loss += share
                if st.last:
                    loss += out.detach().double() / m
                else:
                    sends.append((comm.send(out.detach(), nxt, self.group), out))
                ins[at] = inp
                outs[at] = out
            elif kind == "B":
                grad = torch.full_like(outs[at], self._seed / m) if st.last else self._recv(xs[i], nxt)
                inp = ins.pop(at)
                with trace.span("pp", x.device, step="B", mb=i, chunk=c):
                    if split:
                        dx = self._split[c].backward_input(i, *moe.roots(i, outs.pop(at), grad, self._seed / m), inp)
                    else:  # the whole backward
                        moe.backward(i, outs.pop(at), grad, self._seed / m)
                        dx = inp.grad
                if not st.first:
                    sends.append((comm.send(dx, prev, self.group), dx))
            else:  # W: my weight gradients of micro-batch i (its B ran earlier)
                with trace.span("pp", x.device, step="W", mb=i, chunk=c):
                    self._split[c].backward_weight(i)
        for work, _ in sends:
            work.wait()
        self._sum_tied_grads()
        fresh = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        for q, g in zip(params, kept):
            q.grad = g
        comm.all_reduce(loss, self.group)  # the last stage's loss plus the other stages' balance losses
        return loss, fresh

    def moe_stats(self) -> dict | None:
        """The last training schedule's routing over every stage (StageMoE.gather_stats: a collective over pp;
        minite.train's log calls it on every rank). None for a dense GPT."""
        return self._moe.gather_stats(self.group) if self._moe is not None else None

    def _sum_tied_grads(self):
        """Sum the embedding's gradient (stage 0) and the tied head's (stage p-1): both copies get the dense grad."""
        if self.p == 1 or not (self.stage.first or self.stage.last):
            return
        w = self.stage.wte.weight
        mine = w.grad if w.grad is not None else torch.zeros_like(w)
        other = torch.empty_like(mine)
        peer = self.ends[1] if self.stage.first else self.ends[0]
        work = comm.send(mine, peer, self.group)
        comm.recv(other, peer, self.group).wait()
        work.wait()
        w.grad = mine + other

    @contextlib.contextmanager
    def no_sync(self):
        """``with pipe.no_sync():`` the backwards run inside accumulate this stage's gradients without averaging
        them over the dp replicas (gradient accumulation's early micro-batches); the next backward outside does."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _accumulate(self, grads, scale: float = 1.0):
        params = list(self.stage.parameters())
        for q, g in zip(params, grads):
            g = g if scale == 1.0 else g * scale
            q.grad = g.clone() if q.grad is None else q.grad + g
        n = comm.size(self.dp_group)
        if self._sync and n > 1:  # pp x dp (x cp): average the (accumulated) gradients over my stage's replicas
            average_grads(params, self.dp_group, self.edp_group, n)  # (ep: experts over edp (x cp))

    def step(self, x, y, microbatches: int | None = None) -> float:
        """Forward and backward of the global batch (x, y) through the pipeline; returns the global loss."""
        self._seed = 1.0
        loss, grads = self._run(x, y, microbatches or self.microbatches)
        self._accumulate(grads)
        return float(loss)

    @torch.no_grad()
    def _forward_only(self, x, y):
        """Loss (or last-position logits when y is None) of (x, y), micro-batch by micro-batch, on every rank."""
        st, m, last = self.stage, min(self.microbatches, x.shape[0]), x.shape[1] - 1
        pad = (-x.shape[1]) % comm.size(self.tp_group) if st.sp else 0
        if pad:  # sampling under sequence parallelism: pad on the right (causal: real positions never see it)
            x = torch.nn.functional.pad(x, (0, pad))
        m = max(d for d in range(1, m + 1) if x.shape[0] % d == 0)
        xs, ys = self._chunks(x, y, m)
        prev = self.dims.neighbour("pp", -1)
        nxt = self.dims.neighbour("pp", 1)
        outs, sends = [], []
        for ch, i in itertools.product(self.chunks, range(m)):  # interleaved: chunk by chunk (stage k before k + p)
            out = ch(xs[i] if ch.first else self._recv(xs[i], prev), ys[i] if ch.last else None, last)
            if ch.last:
                outs.append(out)
            else:
                sends.append((comm.send(out, nxt, self.group), out))
        for work, _ in sends:
            work.wait()
        if y is not None:
            res = torch.stack(outs).double().mean() if st.last else torch.zeros((), dtype=torch.float64,
                                                                                  device=x.device)
        else:
            V = self.config.padded_vocab_size
            res = torch.cat(outs) if st.last else torch.empty(x.shape[0], 1, V, dtype=self.act_dtype,
                                                              device=x.device)
        comm.broadcast(res, self.ends[1], self.group)
        return res

    def forward(self, idx, targets=None):
        """minite.train's interface: (None, loss). With gradients on, the whole schedule (forwards and backwards)
        runs here; the returned loss's backward adds upstream * those gradients (1/grad_accum, loss scale)."""
        if targets is None:
            return self._forward_only(idx, None), None
        if not torch.is_grad_enabled():
            return None, self._forward_only(idx, targets)
        self._seed = float(self.grad_scale())
        loss, self._pending = self._run(idx, targets, self.microbatches)
        return None, _PendingGrads.apply(loss, self._anchor, self)

    def generate(self, idx, max_new_tokens, **kw):
        kw["use_cache"] = False  # no KV cache across stages here: the whole context each token
        return GPT.generate(self, idx, max_new_tokens, **kw)

    # ------------------------------------------------------------------ what minite.train asks of a model
    def _shared(self, q) -> bool:  # the last stage's copy of the tied embedding (counted once, on stage 0)
        return self.p > 1 and self.stage.last and q is self.stage.wte.weight

    def _squares(self, grads: bool) -> torch.Tensor:  # over every stage, tp and (experts) ep rank; dp, cp: replicas
        counted = [q for q in self.stage.parameters() if not self._shared(q)]
        return grad_squares(counted, self.dims.group("ep"), [self.group, self.tp_group], grads)

    def num_params(self) -> int:
        """Parameters of the whole model: summed over the stages, tp and ep ranks, each element counted once."""
        return round(float(self._squares(grads=False)))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient, over every stage, tp rank and (experts) ep rank (the tied
        embedding's copy on the last stage is clipped, not counted: stage 0 counts it)."""
        norm = self._squares(grads=True).sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for q in self.stage.parameters():
            if q.grad is not None:
                q.grad.mul_(coef.to(q.grad.dtype))
        return norm

    def dense_state_dict(self) -> dict:
        """The dense GPT's state dict (the MoE's bias buffers too), every stage's tensors gathered on every rank
        (collective): tp shards over tp, experts over ep."""
        ep = self.dims.group("ep")
        mine = {q.dense_name: gather_dense(q.detach(), q, ep if is_expert(q) else self.tp_group).cpu()
                for q in self.stage.parameters()}
        for ch in self.chunks:  # buffers and extra state, under their dense names
            names = {n for n, _ in ch.named_parameters()}
            mine.update({k: v.detach().cpu().clone() for k, v in ch.state_dict().items() if k not in names})
        if self.p == 1:
            return mine
        parts = [None] * self.p
        dist.all_gather_object(parts, mine, group=self.group)
        return {k: v for part in parts for k, v in part.items()}
