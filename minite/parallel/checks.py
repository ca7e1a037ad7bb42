"""Distributed checks, one torchrun launch for many: ``torchrun --nproc-per-node N -m minite.parallel.checks
--out DIR dp tp sp ...``. Every rank runs every named check (they are collective) and writes DIR/rank<r>.json:
{check: {"ok": bool, "max_err": float, ...}}. The tests (tests/parallel/) and the notebooks launch this.

Each check compares a parallel run with the dense single-process one from the same seed, computed on every rank.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from minite.models.gpt import GPT, GPTConfig
from minite.parallel import comm
from minite.parallel.data import DataParallel, allreduce_grads
from minite.parallel.dims import ParallelDims, init_distributed
from minite.parallel.launch import report
from minite.parallel.zero import ShardedAdamW

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64,
            backend="torch")
LR, WD, STEPS, CLIP = 1e-2, 0.5, 5, 1.0
# After 5 AdamW steps parameters agree to ~lr/1000 (Adam turns reduction-order noise on near-zero gradients into
# up to lr-sized steps); a missing weight decay (lr*wd*|p| ~ 1e-4 per step) or a wrong lr is far above TOL. The
# gradients themselves are compared at 1e-6 (Adam is blind to a wrong gradient scale). 2e-4, not 1e-4: tp2 x sp
# at world 4 measured 1.008e-4 on an AVX-512 CPU (2026-11-25, the same on main before), where the reduction order
# of the CPU's kernels differs; a missing weight decay (~5e-4 after 5 steps) stays above it.
TOL = 2e-4


def tiny_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}))


def batches(n: int, B: int, T: int = 16, V: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(n)]


def adamw(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR)


def dense_run(model, data, steps=STEPS):
    opt = adamw(model)
    for x, y in data[:steps]:
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def maxerr(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def _result(err: float, tol: float, **kw) -> dict:
    return {"ok": bool(err <= tol), "max_err": err, "tol": tol, **kw}


# ----------------------------------------------------------------------------------- chapter 10
def check_dp(dims: ParallelDims, args) -> dict:
    """Naive DP, DDP (bucketed) and ZeRO-1/2/3 after 5 steps == single-process AdamW on the full batch."""
    W, r, group = dims.dp, dims.dp_rank, dims.group("dp")
    data = batches(STEPS, 4 * W)
    ref = dense_run(tiny_gpt(), data).state_dict()
    dense = tiny_gpt()
    dense(*data[0])[1].backward()
    ref_grads = {n: p.grad for n, p in dense.named_parameters()}
    out = {}
    for name in ("naive", "zero0", "zero1", "zero2", "zero3"):
        model = tiny_gpt()
        stage = None if name == "naive" else int(name[-1])
        dp = None if stage is None else DataParallel(model, group, stage=stage)
        opt = adamw(model) if not stage else ShardedAdamW(dp, lr=LR, weight_decay=WD)
        with comm.CommLog() as log:
            for i, (x, y) in enumerate(data):
                n = x.shape[0] // W
                model(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])[1].backward()
                if dp is None:
                    allreduce_grads(model, group)
                else:
                    dp.finish()
                if i == 0:  # the averaged gradient (Adam would hide a wrong scale) == the full-batch gradient
                    g_err = maxerr({n: p.grad for n, p in model.named_parameters()}, ref_grads) if not stage else \
                        float((dp.shard_grad - dp.shard_mask(lambda n, p: ref_grads[n])).abs().max())
                if stage:
                    opt.clip_grad_norm_(CLIP)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad(set_to_none=True)
        sd = dp.full_state_dict() if dp is not None else model.state_dict()
        out[name] = _result(maxerr(sd, ref), TOL, grad_err=g_err, bytes_sent=log.total() / STEPS)
        out[name]["ok"] &= g_err < 1e-6
    return out


def check_fsdp2(dims: ParallelDims, args) -> dict:
    """The production path: the same GPT under torch's FSDP2 (fully_shard) on this backend, 5 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    W, r = dims.dp, dims.dp_rank
    data = batches(STEPS, 4 * W)
    ref = dense_run(tiny_gpt(), data).state_dict()
    model = tiny_gpt()
    mesh = init_device_mesh("cpu", (W,))  # these checks run on CPU tensors over gloo
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model)
    for x, y in data:
        n = x.shape[0] // W
        model(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"fsdp2": _result(maxerr(sd, ref), TOL)}


def check_zero_ckpt(dims: ParallelDims, args) -> dict:
    """ZeRO-1: save sharded after 5 steps at this world size; a run at another world size loads it (ckpt_load)."""
    W, r, group = dims.dp, dims.dp_rank, dims.group("dp")
    data = batches(STEPS + 1, 8)
    model = tiny_gpt()
    dp = DataParallel(model, group, stage=1)
    opt = ShardedAdamW(dp, lr=LR, weight_decay=WD)

    def step(x, y):
        n = x.shape[0] // W
        model(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])[1].backward()
        dp.finish()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
    d = Path(args.ckpt)
    if args.ckpt_load:
        opt.load_sharded(d)
        saved = torch.load(d / "params5.pt", weights_only=True)
        err5 = maxerr(dp.full_state_dict(), saved)
        step(*data[STEPS])
        err6 = maxerr(dp.full_state_dict(), torch.load(d / "params6.pt", weights_only=True))
        res = _result(err6, TOL, loaded_err=err5, saved_world=len(list(d.glob("optim_rank*"))))
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


def check_die(dims: ParallelDims, args) -> dict:
    """Rank 1 raises (or is killed); the others wait in a collective: torchrun must end them, naming rank 1."""
    if dims.rank == 1:
        if args.die == "kill":
            os.kill(os.getpid(), 9)
        if args.die == "hang":  # alive but silent: rank 0's collective must time out
            time.sleep(3600)
        raise RuntimeError("planted failure on rank 1")
    t = torch.ones(1)
    comm.all_reduce(t, dims.group("dp") or dims.group("tp"))
    return {"die": {"ok": False}}


CHECKS = {"dp": check_dp, "fsdp2": check_fsdp2, "zero_ckpt": check_zero_ckpt, "die": check_die}


def main(argv=None, keep_group: bool = False) -> int:
    ap = argparse.ArgumentParser(prog="python -m minite.parallel.checks")
    from minite.parallel import checks_tp  # chapter 11's checks (they import this module's helpers)
    CHECKS.update(tp=checks_tp.check_tp, sp=checks_tp.check_sp, vce=checks_tp.check_vce)
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--out", default=tempfile.gettempdir())
    ap.add_argument("--dp", type=int, default=0, help="dp degree (default: the world size, tp checks use tp)")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--ckpt_load", action="store_true")
    ap.add_argument("--die", default="raise", choices=["raise", "kill", "hang"])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(args.timeout, backend="gloo")  # CPU tensors
    results = {}
    for name in args.checks:
        tp = name in ("tp", "sp", "vce")
        dims = ParallelDims(dp=1 if tp else world, tp=world if tp else 1).build(rank, world, args.timeout)
        t0 = time.perf_counter()
        res = CHECKS[name](dims, args)
        for v in res.values():
            v["rank"], v["seconds"] = rank, round(time.perf_counter() - t0, 2)
        results.update(res)
    return report(args.out, rank, results, keep_group)


if __name__ == "__main__":
    sys.exit(main())
