"""Chapter 10's checks: data parallelism (naive, DDP, ZeRO-1/2/3, FSDP2) against one process, the sharded
checkpoint across world sizes, a dying or silent rank; the lesson's timeline and memory per rank; the exercise."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from minite.parallel import comm, trace
from minite.parallel.data import DataParallel, allreduce_grads
from minite.parallel.workers.common import (
    CLIP,
    LR,
    MID,
    STEPS,
    TOL,
    WD,
    adamw,
    batches,
    dense_run,
    maxerr,
    result,
    tiny_gpt,
)
from minite.parallel.workers.grade import graded
from minite.parallel.zero import ShardedAdamW


def _mine(t: torch.Tensor, dims) -> torch.Tensor:
    """My dp slice of a global batch."""
    n = t.shape[0] // dims.dp
    return t[dims.dp_rank * n:(dims.dp_rank + 1) * n]


def check_dp(dims, args) -> dict:
    """Naive DP, DDP (bucketed) and ZeRO-1/2/3 after 5 steps == single-process AdamW on the full batch."""
    group = dims.group("dp")
    data = batches(STEPS, 4 * dims.dp)
    ref = dense_run(tiny_gpt(), data).state_dict()
    dense = tiny_gpt()
    dense(*data[0])[1].backward()
    ref_grads = {n: p.grad for n, p in dense.named_parameters()}
    out = {}
    for name in ("naive", "zero0", "zero1", "zero2", "zero3"):
        model = tiny_gpt()
        stage = None if name == "naive" else int(name[-1])
        dp = None if stage is None else DataParallel(model, group, stage=stage)
        opt = ShardedAdamW(dp, lr=LR, weight_decay=WD) if stage else adamw(model)
        with comm.CommLog() as log:
            for i, (x, y) in enumerate(data):
                model(_mine(x, dims), _mine(y, dims))[1].backward()
                if dp is None:
                    allreduce_grads(model, group)
                else:
                    dp.finish()
                if i == 0 and stage:  # the averaged gradient (Adam would hide a wrong scale) == the full batch's
                    g_err = float((dp.shard_grad - dp.shard_mask(lambda n, p: ref_grads[n])).abs().max())
                elif i == 0:
                    g_err = maxerr({n: p.grad for n, p in model.named_parameters()}, ref_grads)
                if stage:
                    opt.clip_grad_norm_(CLIP)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad(set_to_none=True)
        sd = dp.full_state_dict() if dp is not None else model.state_dict()
        out[name] = result(maxerr(sd, ref), TOL, grad_err=g_err, bytes_sent=log.total() / STEPS)
        out[name]["ok"] &= g_err < 1e-6
    return out


def check_no_sync(dims, args) -> dict:
    """Gradient accumulation at ZeRO 0-3: my slice in two micro-batches, the first under ``no_sync()`` (no
    reduction), the second reducing the sum: the averaged gradient == the full batch's."""
    (x, y), = batches(1, 4 * dims.dp)
    dense = tiny_gpt()
    dense(x, y)[1].backward()
    ref_grads = {n: p.grad for n, p in dense.named_parameters()}
    x, y = _mine(x, dims), _mine(y, dims)
    out = {}
    for stage in range(4):
        model = tiny_gpt()
        dp = DataParallel(model, dims.group("dp"), stage=stage)
        with dp.no_sync():
            (model(x[:2], y[:2])[1] / 2).backward()
        (model(x[2:], y[2:])[1] / 2).backward()
        if stage:
            err = float((dp.shard_grad - dp.shard_mask(lambda n, p: ref_grads[n])).abs().max())
        else:
            err = maxerr({n: p.grad for n, p in model.named_parameters()}, ref_grads)
        out[f"no_sync_zero{stage}"] = result(err, 1e-6)
    return out


def check_fsdp2(dims, args) -> dict:
    """The production path: the same GPT under torch's FSDP2 (fully_shard) on this backend, 5 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    data = batches(STEPS, 4 * dims.dp)
    ref = dense_run(tiny_gpt(), data).state_dict()
    model = tiny_gpt()
    mesh = init_device_mesh("cpu", (dims.dp,))  # these checks run on CPU tensors over gloo
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model)
    for x, y in data:
        model(_mine(x, dims), _mine(y, dims))[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"fsdp2": result(maxerr(sd, ref), TOL)}


def check_zero_ckpt(dims, args) -> dict:
    """ZeRO-1: save sharded after 5 steps at this world size; a run at another world size loads it (--ckpt_load)."""
    data = batches(STEPS + 1, 8)
    model = tiny_gpt()
    dp = DataParallel(model, dims.group("dp"), stage=1)
    opt = ShardedAdamW(dp, lr=LR, weight_decay=WD)

    def step(x, y):
        model(_mine(x, dims), _mine(y, dims))[1].backward()
        dp.finish()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()

    d = Path(args.ckpt)
    if args.ckpt_load:
        opt.load_sharded(d)
        err5 = maxerr(dp.full_state_dict(), torch.load(d / "params5.pt", weights_only=True))
        step(*data[STEPS])
        err6 = maxerr(dp.full_state_dict(), torch.load(d / "params6.pt", weights_only=True))
        res = result(err6, TOL, loaded_err=err5, saved_world=len(list(d.glob("optim_rank*"))))
        res["ok"] &= err5 == 0.0  # the loaded parameters are the saved ones, bit for bit
        return {"ckpt_load": res}
    for x, y in data[:STEPS]:
        step(x, y)
    opt.save_sharded(d)
    if dims.is_main:
        torch.save(dp.full_state_dict(), d / "params5.pt")
    step(*data[STEPS])
    if dims.is_main:
        torch.save(dp.full_state_dict(), d / "params6.pt")
    return {"ckpt_save": {"ok": True}}


def check_die(dims, args) -> dict:
    """Rank 1 raises, is killed or hangs (--die); the others wait in a collective: the run must end naming it."""
    if dims.rank == 1:
        if args.die == "kill":
            os.kill(os.getpid(), 9)
        if args.die == "hang":  # alive but silent: rank 0's collective must time out
            time.sleep(3600)
        raise RuntimeError("planted failure on rank 1")
    comm.all_reduce(torch.ones(1), dims.group("dp"))
    return {"die": {"ok": False}}  # not reached


# ----------------------------------------------------------------------------------- the lesson's measurements
def dp_timeline(dims, args) -> dict:
    """Naive DP (backward, then one all-reduce per tensor) vs bucketed DDP (a unit's all-reduce launched from the
    gradient hook while backward goes on): rank's reductions, seconds since the step began, the last of 3 steps."""
    group = dims.group("dp")
    x, y = batches(1, 4, T=64, V=256)[0]
    out = {"ok": True}
    for name in ("naive", "bucketed"):
        model = tiny_gpt(**MID)
        dp = DataParallel(model, group, stage=0) if name == "bucketed" else None
        for _ in range(3):  # keep the last (warm) step
            with trace.Recorder() as rec:
                t0 = trace.now()
                model(x, y)[1].backward()  # DDP: the reductions run from the hooks, finish() at its end
                t1 = trace.now()
                if dp is None:
                    with trace.span("dp_comm", unit="all"):
                        allreduce_grads(model, group)
                t2 = trace.now()
            model.zero_grad(set_to_none=False)
        events = [{**e, "t0": e["t0"] - t0, "t1": e["t1"] - t0} for e in rec.rows("dp_comm")]
        out[name] = {"backward": [0.0, t1 - t0], "step_end": t2 - t0, "events": events}
    return {"dp_timeline": out}


def _nbytes(*ts) -> int:
    """Bytes of the storages of these tensors, each counted once."""
    seen = set()
    n = 0
    for t in ts:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            n += t.untyped_storage().nbytes()
    return n


def zero_memory(dims, args) -> dict:
    """Bytes each rank holds for parameters, gradients and optimizer state at ZeRO 0-3 (the tensors that exist
    after a step, counted by storage), the largest unit ZeRO-3 gathers, and the bytes sent (CommLog) by op."""
    group = dims.group("dp")
    x, y = batches(1, 4 * dims.dp, T=64, V=256)[0]
    out = {"ok": True}
    for stage in range(4):
        model = tiny_gpt(**MID)
        dp = DataParallel(model, group, stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if stage == 0 else ShardedAdamW(dp, lr=1e-3)
        peak = 0
        with comm.CommLog() as log:
            model(_mine(x, dims), _mine(y, dims))[1].backward()
            if stage == 3:  # the largest gathered unit is what ZeRO-3 adds on top of its shards
                peak = max(u.numel for u in dp.units) * 4
            opt.step()
        if stage == 0:
            moments = [s for v in opt.state.values() for s in (v["exp_avg"], v["exp_avg_sq"])]
            held = {"params": _nbytes(dp.flat_param), "grads": _nbytes(dp.flat_grad), "optimizer": _nbytes(*moments)}
        else:
            st = opt.inner.state[dp.shard_param]
            master = _nbytes(dp.shard_param)
            held = {"params": _nbytes(dp.flat_param) if stage < 3 else master,
                    "grads": _nbytes(dp.flat_grad) if stage == 1 else _nbytes(dp.shard_grad),
                    "optimizer": _nbytes(st["exp_avg"], st["exp_avg_sq"]) + (master if stage < 3 else 0)}
        out[f"zero{stage}"] = {**held, "total": sum(held.values()), "gathered_unit_peak": peak,
                               "sent_by_op": log.by_op(), "n_params": model.num_params()}
    return {"zero_memory": out}


# ----------------------------------------------------------------------------------- the exercise
@graded("sharded_sgd_step", tol=1e-5)
def grade_sharded_sgd_step(dims, student) -> float:
    """flat_param (the same on every rank), flat_grad (different per rank) -> flat_param - lr * mean of grads."""
    world, rank = dims.dp, dims.dp_rank
    worst = 0.0
    for n in (world * 5, world * 64):
        g = torch.Generator().manual_seed(n)
        param = torch.randn(n, generator=g)
        grads = torch.randn(world, n, generator=g)
        want = param - 0.1 * grads.mean(0)
        p = param.clone()
        student.sharded_sgd_step(p, grads[rank].clone(), dims.group("dp"), 0.1)
        worst = max(worst, float((p - want).abs().max()))
    return worst


CHECKS = {  # name: (check, the axis of ParallelDims that takes the world)
    "dp": (check_dp, "dp"),
    "no_sync": (check_no_sync, "dp"),
    "fsdp2": (check_fsdp2, "dp"),
    "zero_ckpt": (check_zero_ckpt, "dp"),
    "die": (check_die, "dp"),
    "dp_timeline": (dp_timeline, "dp"),
    "zero_memory": (zero_memory, "dp"),
    "sharded_sgd_step": (grade_sharded_sgd_step, "dp"),
}
