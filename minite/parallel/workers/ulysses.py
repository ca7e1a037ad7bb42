"""Chapter 13, beyond the ring: Ulysses (all-to-all) context parallelism and its hybrid with the ring, against one
process: the attention of my shard (o, lse, dq, dk, dv; reference path and the Triton kernel) and the GPT under
it (loss, every weight gradient, 5 AdamW steps), at cp = world 2 and 4 (the hybrid: a2a in pairs, the ring across).
"""
from __future__ import annotations

import functools

import torch

from minite.parallel.context_gpt import CPGPT
from minite.parallel.data import DataParallel
from minite.parallel.dims import ParallelDims
from minite.parallel.launch import triton_skipped
from minite.parallel.ulysses import ulysses_attention
from minite.parallel.workers.common import CLIP, STEPS, TOL, adamw, batches, dense_run, maxerr, result, tiny_gpt
from minite.parallel.workers.context import _compare, _qkv


def _hybrid(dims):
    """cp = 2 x cp/2: a2a inside pairs of neighbouring cp ranks, the ring across them (groups built once)."""
    if "hybrid" not in dims.groups:  # (a2a group, ring group)
        h = ParallelDims(cp=dims.cp, cp_a2a=2).build(dims.rank, dims.world)
        dims.groups["hybrid"] = (h.group("cp_a2a"), h.group("cp_ring"))
    return dims.groups["hybrid"]


def check_ulysses(dims, args) -> dict:
    """a2a CP attention (o, lse, dq, dk, dv) and the GPT under it (loss, every weight gradient, 5 AdamW steps) vs
    one process, at cp = world; at cp = 4 also the hybrid (a2a in pairs, the ring across). H=4 heads: kv heads 2
    split (cp 2) or replicated (cp 4), 1 replicated; the Triton kernel on the whole sequence (causal balanced)."""
    out = {}
    hybrid = _hybrid(dims) if dims.cp >= 4 else None
    cases = [("a2a", True, True, 2), ("a2a", True, False, 2), ("a2a", False, True, 2), ("a2a", True, True, 1)]
    if hybrid:
        cases += [("hybrid", True, True, 2), ("hybrid", True, False, 2), ("hybrid", True, True, 1)]
    for variant, causal, balanced, KVH in cases:
        T = 3 * (2 * dims.cp if balanced else dims.cp)  # 3 tokens per chunk: odd shards
        q, k, v, do = _qkv(2, 4, KVH, T, 16, torch.float32, seed=T + causal + KVH, device=args.device)
        fn, d = ulysses_attention, dims
        if variant == "hybrid":  # _compare's group: the a2a pair; the ring's group bound
            fn, d = functools.partial(ulysses_attention, ring_group=hybrid[1]), _Dims(dims.cp, dims.cp_rank, hybrid[0])
        e = _compare(d, q, k, v, do, causal, balanced, fn, "torch")
        kind = ("causal_balanced" if balanced else "causal") if causal else "full"
        out[f"{variant}_{kind}_kv{KVH}"] = result(max(e.values()), 1e-5, errs=e, T=T)
    if skip := triton_skipped(torch.empty(0, device=args.device)):
        out["triton_a2a_causal_balanced"] = skip
    else:
        q, k, v, do = _qkv(1, 4, 2, 10 * dims.cp, 16, torch.float32, seed=5, device=args.device)
        e = _compare(dims, q, k, v, do, True, True, ulysses_attention, "triton")
        out["triton_a2a_causal_balanced"] = result(max(e.values()), 1e-5, errs=e)
    (x, y), = batches(1, 4)
    dense = tiny_gpt()
    d_loss = dense(x, y)[1]
    d_loss.backward()
    data = batches(STEPS, 4)
    ref = dense_run(tiny_gpt(), data).state_dict()
    for variant in ("a2a", "hybrid") if hybrid else ("a2a",):
        def make():
            model = CPGPT.from_dense(tiny_gpt(), dims.group("cp"), variant=variant,
                                     hybrid=hybrid if variant == "hybrid" else None)
            return model, DataParallel(model, dims.group("cp"), stage=0)
        model, dp = make()
        loss = model(x, y)[1]
        loss.backward()
        dp.finish()
        gerr = max(float((p.grad - dense.get_parameter(n).grad).abs().max()) for n, p in model.named_parameters())
        out[f"gpt_{variant}_grads"] = result(gerr, 1e-6, loss_err=abs(float(loss) - float(d_loss)))
        out[f"gpt_{variant}_grads"]["ok"] &= abs(float(loss) - float(d_loss)) <= 1e-5
        model, dp = make()
        opt = adamw(model)
        for xb, yb in data:
            model(xb, yb)[1].backward()
            dp.finish()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[f"gpt_{variant}_5_steps"] = result(maxerr(model.state_dict(), ref), TOL)
    return out


class _Dims:
    """What _compare reads of a ParallelDims: cp, cp_rank, group("cp") (here: the hybrid's a2a group)."""

    def __init__(self, cp, cp_rank, group):
        self.cp, self.cp_rank, self._group = cp, cp_rank, group

    def group(self, name):
        return self._group


CHECKS = {"cp_ulysses": (check_ulysses, "cp")}  # name: (check, the axis of ParallelDims that takes the world)
