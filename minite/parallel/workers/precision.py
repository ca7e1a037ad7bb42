"""Chapter 01 x chapters 10-12: FP16's dynamic loss scaler on real ranks, the way minite.train drives it
(``scaler.scale(loss).backward(); scaler.unscale_(opt); clip; scaler.step(opt); scaler.update()``).

ZeRO: the gradient AdamW steps with lives in the shard buffer, not in a ``.grad``: the scaler must unscale that one
(the moments, the clip's norm and the weights == one process's step with the same scaler). An inf in ONE rank's
gradient (its ZeRO shard, its tp shards, its pipeline stage): the verdict is OR-ed over the world
(``Parallel.found_inf_anywhere``), so every rank skips the step and backs its scale off, the weights stay as they
were everywhere. The math is fp32 (the scale is what is checked, not fp16's rounding).
"""
from __future__ import annotations

import math

import torch

from minite.formats.fp16 import DynamicLossScaler
from minite.parallel import comm
from minite.parallel.data import DataParallel
from minite.parallel.pipeline import PipelineGPT
from minite.parallel.runtime import Parallel
from minite.parallel.sequence import TPGPT
from minite.parallel.workers.common import LR, TOL, WD, adamw, batches, tiny_gpt
from minite.parallel.zero import JointShardedAdamW, ShardedAdamW

S = 2.0 ** 16  # the scaler's initial scale, as minite.train's


def _scaler(dims, args) -> DynamicLossScaler:
    """minite.train's scaler, its verdict OR-ed over the world as minite.train sets it."""
    par = Parallel(dims)
    par.device(torch.device(args.device))  # the flag's device: NCCL reduces CUDA tensors only
    scaler = DynamicLossScaler(init_scale=S)
    scaler.found_inf_everywhere = par.found_inf_anywhere
    return scaler


def _mine(t: torch.Tensor, dims) -> torch.Tensor:
    n = t.shape[0] // dims.dp
    return t[dims.dp_rank * n:(dims.dp_rank + 1) * n]


def _step(scaler, opt, clip) -> tuple[bool, float]:
    """minite.train's order: unscale, clip (measure the norm: max_norm inf), step unless inf/NaN, update."""
    scaler.unscale_(opt)
    norm = float(clip())
    stepped = scaler.step(opt)
    scaler.update()
    return stepped, norm


def _skipped(stepped: bool, scaler, after: dict, before: dict) -> dict:
    """The verdict on a step whose gradient held an inf somewhere: skipped, scale halved, weights untouched."""
    unchanged = all(torch.equal(after[k], before[k]) for k in before)  # (a NaN weight is not equal either)
    err = max(float(torch.nan_to_num((after[k] - before[k]).abs(), nan=math.inf).max()) for k in before)
    ok = not stepped and scaler.scale_value == S / 2 and unchanged
    return {"ok": bool(ok), "stepped": stepped, "scale": scaler.scale_value, "weight_change": err}


def check_zero(dims, args) -> dict:
    """ZeRO-1/2/3 (and two shards stepped as one, JointShardedAdamW) at dp = world with the loss scaler."""
    group = dims.group("dp")
    (x, y), = batches(1, 4 * dims.dp)
    dense = tiny_gpt()
    opt_d, scaler_d = adamw(dense), DynamicLossScaler(init_scale=S)
    scaler_d.scale(dense(x, y)[1]).backward()
    _, ref_norm = _step(scaler_d, opt_d, lambda: torch.nn.utils.clip_grad_norm_(dense.parameters(), math.inf))
    ref = dense.state_dict()
    ref_m = {n: opt_d.state[p]["exp_avg"] for n, p in dense.named_parameters()}
    out = {}
    for stage in (1, 2, 3):
        model = tiny_gpt()
        dp = DataParallel(model, group, stage=stage)
        opt, scaler = ShardedAdamW(dp, lr=LR, weight_decay=WD), _scaler(dims, args)
        scaler.scale(model(_mine(x, dims), _mine(y, dims))[1]).backward()
        dp.finish()
        stepped, norm = _step(scaler, opt, lambda: opt.clip_grad_norm_(math.inf))
        m_err = float((opt.inner.state[dp.shard_param]["exp_avg"] - dp.shard_mask(lambda n, p: ref_m[n])).abs().max())
        w_err = max(float((v - ref[k]).abs().max()) for k, v in dp.full_state_dict().items())
        ok = stepped and abs(norm - ref_norm) <= 1e-5 * ref_norm and m_err < 1e-6 and w_err <= TOL
        out[f"fp16_zero{stage}"] = {"ok": bool(ok), "norm": norm, "ref_norm": ref_norm, "exp_avg_err": m_err,
                                    "weight_err": w_err, "scale": scaler.scale_value}
        model = tiny_gpt()  # an inf in rank 1's shard only
        dp = DataParallel(model, group, stage=stage)
        opt, scaler = ShardedAdamW(dp, lr=LR, weight_decay=WD), _scaler(dims, args)
        scaler.scale(model(_mine(x, dims), _mine(y, dims))[1]).backward()
        dp.finish()
        if dims.dp_rank == 1:
            dp.shard_grad[0] = math.inf
        stepped, _ = _step(scaler, opt, lambda: opt.clip_grad_norm_(1.0))
        out[f"fp16_zero{stage}_inf"] = _skipped(stepped, scaler, dp.full_state_dict(), tiny_gpt().state_dict())
    models = [tiny_gpt(), tiny_gpt(seed=1)]  # JointShardedAdamW: two shards, the inf in the second one's
    dps = [DataParallel(m, group, stage=2) for m in models]
    opt = JointShardedAdamW([ShardedAdamW(d, lr=LR, weight_decay=WD) for d in dps], [group])
    scaler = _scaler(dims, args)
    scaler.scale(sum(m(_mine(x, dims), _mine(y, dims))[1] for m in models)).backward()
    for d in dps:
        d.finish()
    if dims.dp_rank == 1:
        dps[1].shard_grad[-1] = math.nan
    stepped, _ = _step(scaler, opt, lambda: opt.clip_grad_norm_(1.0))
    before = {f"{i}.{k}": v for i, s in enumerate((0, 1)) for k, v in tiny_gpt(seed=s).state_dict().items()}
    after = {f"{i}.{k}": v for i, d in enumerate(dps) for k, v in d.full_state_dict().items()}
    out["fp16_joint_zero2_nan"] = _skipped(stepped, scaler, after, before)
    return out


def check_tp(dims, args) -> dict:
    """tp = world: an inf in rank 1's shards of the weights' gradients; every rank skips."""
    (x, y), = batches(1, 4)
    group = dims.group("tp")
    model = TPGPT.from_dense(tiny_gpt(), group)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt, scaler = adamw(model), _scaler(dims, args)
    scaler.scale(model(x, y)[1]).backward()
    if dims.tp_rank == 1:
        next(model.parameters()).grad.view(-1)[0] = math.inf
    stepped, _ = _step(scaler, opt, lambda: comm.clip_grad_norm_(model.parameters(), 1.0, [group]))
    return {"fp16_tp_inf": _skipped(stepped, scaler, model.state_dict(), before)}


def check_pp(dims, args) -> dict:
    """pp = world: an inf in the last stage's gradients; every stage skips."""
    (x, y), = batches(1, 4)
    pipe = PipelineGPT(tiny_gpt(), dims, 2, "1f1b")
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    opt, scaler = torch.optim.AdamW(pipe.parameters(), lr=LR), _scaler(dims, args)
    scaler.scale(pipe(x, y)[1]).backward()
    if dims.local_rank("pp") == dims.pp - 1:
        next(pipe.parameters()).grad.view(-1)[0] = math.inf
    stepped, _ = _step(scaler, opt, lambda: pipe.clip_grad_norm_(1.0))
    return {"fp16_pp_inf": _skipped(stepped, scaler, pipe.state_dict(), before)}


def check_pp_seed(dims, args) -> dict:
    """pp = world, minite.train's fp16 wiring (grad_scale = the scaler's S): the gradients that travel between the
    stages are S times one process's (the schedule's backward starts from the scaled loss, so fp16 activation
    gradients do not underflow), and the weights' gradients after ``scaler.scale(loss).backward()`` are S times the
    unscaled ones, as the scaler expects."""
    (x, y), = batches(1, 4)
    got = {}
    for scale in (1.0, S):
        pipe = PipelineGPT(tiny_gpt(), dims, 2, "1f1b")
        pipe.grad_scale = lambda: scale
        received, recv = [], pipe._recv
        pipe._recv = lambda ref, src: received.append(recv(ref, src)) or received[-1]  # stage 0: the gradients
        (pipe(x, y)[1] * scale).backward()
        got[scale] = received, {k: q.grad.clone() for k, q in pipe.named_parameters()}
    (r1, g1), (rs, gs) = got[1.0], got[S]
    # stage 0 receives only gradients (S times); the last stage only activations (unscaled: the same)
    k = S if dims.local_rank("pp") == 0 else 1.0
    travel = max(float((b - a * k).abs().max() / (a * k).abs().max()) for a, b in zip(r1, rs))
    weights = max(float((gs[n] - g1[n] * S).abs().max() / (g1[n] * S).abs().max().clamp_min(1e-30)) for n in g1)
    ok = travel <= 1e-6 and weights <= 1e-6 and len(rs) == len(r1) == 2
    return {"fp16_pp_seed": {"ok": bool(ok), "travel_rel_err": travel, "grad_rel_err": weights,
                             "received": len(rs)}}


CHECKS = {  # name: (check, the axis of ParallelDims that takes the world)
    "fp16_zero": (check_zero, "dp"),
    "fp16_tp": (check_tp, "tp"),
    "fp16_pp": (check_pp, "pp"),
    "fp16_pp_seed": (check_pp_seed, "pp"),
}
