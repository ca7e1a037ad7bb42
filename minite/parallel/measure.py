"""Measurements for the lessons of chapters 10-11: ``torchrun --nproc-per-node N -m minite.parallel.measure
--out DIR timeline memory sp``; rank 0 writes DIR/measure.json (and every rank its timeline).

    timeline  naive DP (backward, then one all-reduce per tensor) vs bucketed DDP (a unit's all-reduce launched
              from the gradient hook while backward goes on): per-rank events (seconds since the step began)
    memory    bytes each rank holds for parameters, gradients and optimizer state at ZeRO 0-3 (the tensors that
              exist after a step, counted by storage), plus the bytes each rank sent (CommLog) per collective
    sp        activation bytes saved for backward by one transformer block per rank, TP vs TP+SP
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minite.models.gpt import GPT, GPTConfig
from minite.parallel import comm
from minite.parallel.data import DataParallel, allreduce_grads
from minite.parallel.dims import ParallelDims, init_distributed
from minite.parallel.zero import ShardedAdamW

MID = dict(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384,
           backend="torch")


def _gpt(cfg=MID, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**cfg))


def _batch(B, T=64, V=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def timeline(dims: ParallelDims) -> dict:
    group, out = dims.group("dp"), {}
    x, y = _batch(4)
    for name in ("naive", "bucketed"):
        model = _gpt()
        dp = DataParallel(model, group, stage=0, timeline=True) if name == "bucketed" else None
        for rep in range(3):  # the last of 3 steps (warm)
            if dp is not None:
                dp.events = []
            t0 = time.perf_counter()
            model(x, y)[1].backward()
            t1 = time.perf_counter()
            if dp is None:
                allreduce_grads(model, group)
                ev = [{"kind": "comm", "unit": "all", "t0": t1, "t1": time.perf_counter()}]
            else:
                dp.finish()
                ev = list(dp.events)
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=False)
        out[name] = {"backward": [0.0, t1 - t0], "step_end": t2 - t0,
                     "events": [{**e, "t0": e["t0"] - t0, "t1": e["t1"] - t0} for e in ev]}
    return out


def _nbytes(*ts) -> int:
    seen, n = set(), 0
    for t in ts:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            n += t.untyped_storage().nbytes()
    return n


def memory(dims: ParallelDims) -> dict:
    group, W, r, out = dims.group("dp"), dims.dp, dims.dp_rank, {}
    x, y = _batch(4 * W)
    n = x.shape[0] // W
    for stage in range(4):
        model = _gpt()
        dp = DataParallel(model, group, stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if stage == 0 else ShardedAdamW(dp, lr=1e-3)
        peak = 0
        with comm.CommLog() as log:
            model(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])[1].backward()
            if stage == 3:  # the largest gathered unit is what ZeRO-3 adds on top of its shards
                peak = max(u.numel for u in dp.units) * 4
            opt.step()
        if stage == 0:
            st = [s for v in opt.state.values() for s in (v["exp_avg"], v["exp_avg_sq"])]
            held = {"params": _nbytes(dp.flat_param), "grads": _nbytes(dp.flat_grad), "optimizer": _nbytes(*st)}
        else:
            st = opt.inner.state[dp.shard_param]
            params = _nbytes(dp.flat_param) if stage < 3 else 0
            master = _nbytes(dp.shard_param)
            held = {"params": params + (master if stage == 3 else 0),
                    "grads": _nbytes(dp.flat_grad) if stage == 1 else _nbytes(dp.shard_grad),
                    "optimizer": _nbytes(st["exp_avg"], st["exp_avg_sq"]) + (master if stage < 3 else 0)}
        out[f"zero{stage}"] = {**held, "total": sum(held.values()), "gathered_unit_peak": peak,
                               "sent_by_op": log.by_op(), "n_params": model.num_params()}
    return out


def sp_memory(dims: ParallelDims) -> dict:
    """Bytes of activations one block saves for backward (parameters excluded), per rank."""
    from minite.parallel.sequence import TPGPT
    group, out = dims.group("tp"), {}
    x, y = _batch(2)
    for sp in (False, True):
        model = TPGPT.from_dense(_gpt(), group, sequence_parallel=sp)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        block = model.blocks[1]
        saved, seen = [0], set()

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in params and key not in seen:
                seen.add(key)
                saved[0] += t.untyped_storage().nbytes()
            return t

        def pre(m, a):
            m._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            m._ctx.__enter__()

        h1 = block.register_forward_pre_hook(pre)
        h2 = block.register_forward_hook(lambda m, a, o: m._ctx.__exit__(None, None, None))
        model(x, y)[1].backward()
        h1.remove(), h2.remove()
        out["sp" if sp else "tp"] = saved[0]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minite.parallel.measure")
    ap.add_argument("what", nargs="+", choices=["timeline", "memory", "sp"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(120)
    res = {"world": world}
    for w in args.what:
        dims = ParallelDims(dp=1 if w == "sp" else world, tp=world if w == "sp" else 1).build(rank, world)
        res[w] = {"timeline": timeline, "memory": memory, "sp": sp_memory}[w](dims)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"measure_rank{rank}.json").write_text(json.dumps(res))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
