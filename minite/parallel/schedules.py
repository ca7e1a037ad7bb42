"""Zero-bubble and interleaved pipeline schedules (chapter 12, issue 38), their checks, and their timelines.

An op is ``(kind, micro-batch)`` or ``(kind, micro-batch, chunk)``. Kinds: F (forward), B, W. A schedule that has W
ops splits each backward in two (Qi et al., "Zero Bubble Pipeline Parallelism", 2023):

    B  the input gradient: dL/dx of the stage, sent to the previous stage at once (on the critical path)
    W  the weight gradients: dL/dW = dy^T x of each linear layer, needed only by the optimizer step

A schedule without W runs the whole backward at B (AFAB, 1F1B, interleaved). ``DeferredWeights`` is the split on
a real stage. With p stages, m micro-batches and unit costs (F = B = W = 1; B = 2 when unsplit):

    zbh1         1F1B whose stage s runs its first s W ops late: their slots let the next micro-batch's B go
                 upstream sooner, the W ops fill the cool-down. bubble (p-1)(F+B-W) instead of (p-1)(F+B+W),
                 fraction (p-1)/(3m+p-1); at most p micro-batches between F and W (1F1B's peak, on every stage)
    interleaved  (Megatron) rank r holds v chunks, stages r, r+p, ..., r+(v-1)p of a pv-stage model; ops carry
                 the chunk; 1F1B over chunks of p micro-batches. bubble (p-1)/(vm+p-1), peak p + (p-1)/v stages'
                 worth of activations on rank 0 (m divisible by p)

``check_plan`` runs every rank's op list the way ``PipelineGPT`` does (a send after each op, a receive before,
messages between two ranks matched in the order they were sent) and raises ValueError on anything wrong;
``simulate_ops`` lays the plan out in time; ``schedule_table`` is the bubble and memory table against the formulas.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from minite.parallel.pipeline_schedule import afab, one_f_one_b

__all__ = ["zbh1", "interleaved", "SCHEDULES", "FORMULAS", "check_ops", "check_plan", "plan",
           "simulate_ops", "in_flight", "schedule_table", "DeferredWeights"]


def zbh1(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """ZB-H1: 1F1B's warm-up and order of F and B; stage s holds back its first s W ops (to the cool-down)."""
    warm = min(p - 1 - stage, m)
    ops, waiting = [("F", i) for i in range(warm)], deque()
    for k in range(m):  # k-th backward: after one more forward in the steady state, alone in the cool-down
        if warm + k < m:
            ops.append(("F", warm + k))
        ops.append(("B", k))
        waiting.append(k)
        if k >= stage:  # past the first `stage` backwards: one W per B, the oldest first
            ops.append(("W", waiting.popleft()))
    return ops + [("W", i) for i in waiting]


def interleaved(v: int = 2):
    """Megatron's interleaved 1F1B with v chunks per rank: a schedule ``(p, m, rank) -> [(kind, mb, chunk)]``.
    Virtual step k runs chunk (k // p) % v of micro-batch (k // pv) p + k % p; backwards take the chunks last first."""
    def schedule(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
        if m % p:
            raise ValueError(f"interleaved 1F1B needs micro-batches divisible by the stages: m={m}, p={p}")
        total = v * m
        mb = [(k // (p * v)) * p + k % p for k in range(total)]
        fwd = [("F", mb[k], (k // p) % v) for k in range(total)]
        bwd = [("B", mb[k], v - 1 - (k // p) % v) for k in range(total)]
        warm = min(2 * (p - rank - 1) + (v - 1) * p, total)
        ops = fwd[:warm]
        for k in range(total - warm):
            ops += [fwd[warm + k], bwd[k]]
        return ops + bwd[total - warm:]
    schedule.v = v
    return schedule


SCHEDULES = {"afab": afab, "1f1b": one_f_one_b, "zbh1": zbh1, "interleaved": interleaved(2)}
FORMULAS = {  # (bubble fraction, peak activations in stages' worth on the fullest rank) at unit F, B, W costs
    "afab": (lambda p, m, v: (p - 1) / (m + p - 1), lambda p, m, v: m),
    "1f1b": (lambda p, m, v: (p - 1) / (m + p - 1), lambda p, m, v: min(p, m)),
    "interleaved": (lambda p, m, v: (p - 1) / (v * m + p - 1), lambda p, m, v: p + (p - 1) / v),
    "zbh1": (lambda p, m, v: (p - 1) / (3 * m + p - 1), lambda p, m, v: min(p, m)),
}


def _norm(op) -> tuple[str, int, int]:
    return (op[0], op[1], op[2] if len(op) > 2 else 0)


def check_ops(ops, m: int, rank: int = 0, v: int = 1) -> bool:
    """One rank's ops: F and B of every (micro-batch, chunk) exactly once, each B after its F; W (if any) of every
    one exactly once, after its B. Returns whether the backward is split (W ops present); else ValueError."""
    seen = {"F": set(), "B": set(), "W": set()}
    want = {(i, c) for i in range(m) for c in range(v)}
    for op in ops:
        kind, i, c = _norm(op)
        if kind not in seen or (i, c) not in want or (i, c) in seen[kind]:
            raise ValueError(f"rank {rank}: bad or repeated op {op!r} (kinds F/B/W, micro-batches 0..{m - 1}, "
                             f"chunks 0..{v - 1})")
        before = {"F": None, "B": "F", "W": "B"}[kind]
        if before and (i, c) not in seen[before]:
            raise ValueError(f"rank {rank}: {op!r} before its {before}")
        seen[kind].add((i, c))
    split = bool(seen["W"])
    for kind in ("F", "B", "W") if split else ("F", "B"):
        if seen[kind] != want:
            raise ValueError(f"rank {rank}: {kind} ops missing for (micro-batch, chunk) {sorted(want - seen[kind])}")
    return split


def plan(schedule, p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """{rank: its ops, each (kind, mb, chunk)} of a schedule ``(p, m, rank) -> ops``."""
    return {r: [_norm(op) for op in schedule(p, m, r)] for r in range(p)}


def simulate_ops(plans: dict, p: int, v: int = 1, cost=(1.0, 1.0, 1.0)) -> dict[int, list[tuple]]:
    """{rank: [(kind, mb, chunk, start, end)]}: each op starts when its rank is free and its message has come
    (F of stage k after F of stage k-1; B of k after B of k+1), messages take no time. Stage k = chunk * p + rank
    runs on rank k % p. cost = (F, B, W) of a whole stage, a chunk's is 1/v of it; an unsplit B costs B + W.
    Messages between two ranks are matched in sending order, as gloo's untagged sends: ValueError when a receive
    meets another message first, or when no rank can go on (a deadlock)."""
    stages = p * v
    split = {r: any(op[0] == "W" for op in ops) for r, ops in plans.items()}
    chan = {}  # (src, dst) -> deque of (message, time sent)
    free, pos, out = [0.0] * p, [0] * p, {r: [] for r in range(p)}
    while any(pos[r] < len(plans[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if pos[r] == len(plans[r]):
                continue
            kind, i, c = plans[r][pos[r]]
            k = c * p + r
            src = {"F": k - 1, "B": k + 1}.get(kind, -1)
            ready = 0.0
            if 0 <= src < stages:
                q = chan.get((src % p, r))
                if not q:
                    continue
                msg, ready = q[0]
                if msg != (kind, i, k):
                    raise ValueError(f"rank {r} waits for {kind} of micro-batch {i} into stage {k} from rank "
                                     f"{src % p}, whose next message is {msg[0]} of micro-batch {msg[1]} into "
                                     f"stage {msg[2]}: sends and receives do not match")
                q.popleft()
            t = {"F": cost[0], "B": cost[1] if split[r] else cost[1] + cost[2], "W": cost[2]}[kind] / v
            start = max(free[r], ready)
            free[r] = start + t
            out[r].append((kind, i, c, start, start + t))
            dst = {"F": k + 1, "B": k - 1}.get(kind, -1)
            if 0 <= dst < stages:
                chan.setdefault((r, dst % p), deque()).append(((kind, i, dst), start + t))
            pos[r] += 1
            moved = True
        if not moved:
            stuck = {r: plans[r][pos[r]] for r in range(p) if pos[r] < len(plans[r])}
            raise ValueError(f"the schedule deadlocks: every rank waits, at ops {stuck}")
    return out


def check_plan(plans: dict, p: int, m: int, v: int = 1) -> None:
    """Every rank's ops valid (``check_ops``), all split or none, and the ranks' sends and receives matching
    without a deadlock (``simulate_ops``); else ValueError."""
    if sorted(plans) != list(range(p)):
        raise ValueError(f"ranks {sorted(plans)}: want one op list per rank 0..{p - 1}")
    splits = {check_ops(ops, m, r, v) for r, ops in plans.items()}
    if len(splits) > 1:
        raise ValueError("some ranks split the backward into B and W, others do not")
    simulate_ops(plans, p, v)


def in_flight(ops, v: int = 1) -> float:
    """Peak stages' worth of activations held on a rank: a chunk's micro-batch counts 1/v from its F until its
    W (or its B when the backward is not split)."""
    ops = [_norm(op) for op in ops]
    release = "W" if any(op[0] == "W" for op in ops) else "B"
    live = peak = 0
    for kind, _, _ in ops:
        live += 1 if kind == "F" else -1 if kind == release else 0
        peak = max(peak, live)
    return peak if v == 1 else peak / v


def schedule_table(p: int = 4, m: int = 8, v: int = 2) -> list[dict]:
    """Per schedule at unit costs: simulated bubble (idle fraction of the busiest-idle rank) and peak activations
    (the fullest rank, in stages' worth), beside each formula."""
    rows = []
    for name, sched in SCHEDULES.items():
        vv = getattr(sched, "v", 1)
        plans = plan(sched, p, m)
        check_plan(plans, p, m, vv)
        ev = simulate_ops(plans, p, vv)
        span = max(e[4] for r in ev.values() for e in r)
        bubble = max((span - sum(e[4] - e[3] for e in ev[r])) / span for r in ev)
        bub_f, mem_f = FORMULAS[name]
        rows.append({"schedule": name, "p": p, "m": m, "v": vv, "span": span, "bubble": round(bubble, 6),
                     "bubble_formula": round(bub_f(p, m, vv), 6), "peak_activations": max(
                         in_flight(plans[r], vv) for r in plans), "peak_formula": mem_f(p, m, vv)})
    return rows


class DeferredWeights:
    """The B/W split of one stage's backward, with no hidden autograd machinery:

    F  a forward hook on each plain linear layer (``nn.Linear`` / ``minite.nn.Linear``, weight trainable, not
       running FP8) keeps its input x (the storage autograd saves anyway) and its output's gradient edge (where
       dL/dy will arrive: ``torch.autograd.graph.get_gradient_edge``, no tensor held)
    B  ``backward_input``: torch.autograd.grad of the micro-batch's roots w.r.t. the stage input, every other
       parameter (norms, embedding, tied head, TP / LoRA / FP8 layers) and each kept edge. Autograd computes no
       GEMM for a weight it is not asked for, so B is the input-gradient chain; dL/dy is kept, the graph freed
    W  ``backward_weight``: each kept linear's weight grad dy^T x (and bias grad sum dy) added to its .grad

    Between B and W a micro-batch holds only (x, dy) of its linear layers."""

    def __init__(self, stage: nn.Module):
        from minite.layers.linear import Linear
        self.params = [q for q in stage.parameters() if q.requires_grad]
        self.mb, self.kept = None, {}  # micro-batch in forward; mb -> [(linear, x, edge of y, then dy)]
        self.hooks = [mod.register_forward_hook(self._keep) for mod in stage.modules()
                      if type(mod) in (nn.Linear, Linear) and mod.weight.requires_grad]

    def _keep(self, mod, args, y):
        from minite.formats.autocast import is_fp8_enabled
        if self.mb is not None and torch.is_grad_enabled() and not is_fp8_enabled():
            self.kept[self.mb].append((mod, args[0].detach(), get_gradient_edge(y)))

    @contextlib.contextmanager
    def forward(self, i: int):
        """``with split.forward(i): out = stage(...)``: keep micro-batch i's linear inputs and output edges."""
        self.mb, self.kept[i] = i, []
        try:
            yield
        finally:
            self.mb = None

    def backward_input(self, i: int, roots, grads, inp: torch.Tensor | None) -> torch.Tensor | None:
        """B of micro-batch i: returns dL/d(stage input) (None for ids); other parameters' grads are added."""
        kept = self.kept[i]
        late = {id(q) for mod, _, _ in kept for q in (mod.weight, mod.bias) if q is not None}
        now = [q for q in self.params if id(q) not in late]
        lead = [inp] if inp is not None and inp.requires_grad else []
        got = torch.autograd.grad(roots, lead + now + [edge for _, _, edge in kept], grads, allow_unused=True)
        for q, g in zip(now, got[len(lead):]):
            if g is not None:
                q.grad = g if q.grad is None else q.grad + g
        self.kept[i] = [(mod, x, dy) for (mod, x, _), dy in zip(kept, got[len(lead) + len(now):])]
        return got[0] if lead else None

    def backward_weight(self, i: int) -> None:
        """W of micro-batch i: dW = dy^T x, db = sum of dy over the tokens, for each kept linear layer."""
        for mod, x, dy in self.kept.pop(i):
            if dy is None:  # its output did not reach the loss
                continue
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            for q, g in ((mod.weight, dy2.t() @ x2), (mod.bias, dy2.sum(0) if mod.bias is not None else None)):
                if g is not None:
                    q.grad = g if q.grad is None else q.grad + g
