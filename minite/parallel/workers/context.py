"""Chapter 13's checks: ring and all-gather CP attention against one process (reference path and the Triton
kernel), the GPT under CP, CP x TP (+SP); the lesson's work, bytes and memory per rank; the exercise's ring.

Attention checks compare the output, the LSE and dq, dk, dv of my shard with the single-process kernel's: causal
(balanced and contiguous) and not, GQA, odd lengths per shard. The CP x TP cases build ``CPGPT(TPGPT(dense))`` on a
tp x cp grid, average the gradients over the cp ranks with ``DataParallel`` (as ``minite.train`` does) and compare
the loss, every local gradient with the dense gradient's slice that the parameter's tags name, the dense state
dict, ``num_params()``, greedy ``generate`` and 5 AdamW steps with clipping (cp_sp_triton: SP on the Triton
kernels, loss and gradients only: the interpreter is slow).
"""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from minite.bytecount import PeakBytes
from minite.kernels.attention import attention
from minite.parallel import comm, trace
from minite.parallel.context import allgather_attention, ring_attention, shard
from minite.parallel.context_gpt import CPGPT
from minite.parallel.data import DataParallel
from minite.parallel.launch import triton_skipped
from minite.parallel.sequence import TPGPT
from minite.parallel.workers.common import CLIP, STEPS, TOL, adamw, batches, dense_run, maxerr, result, tiny_gpt
from minite.parallel.workers.grade import graded

VARIANTS = {"ring": ring_attention, "allgather": allgather_attention}


def _qkv(B, H, KVH, T, D, dtype, seed=0, device="cpu"):
    """q, k, v and the output gradient do, from `seed`: q and do (B, H, T, D), k and v (B, KVH, T, D)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=dtype).to(device) for h in (H, KVH, KVH))
    do = torch.randn(B, H, T, D, generator=g, dtype=dtype).to(device)
    return q, k, v, do


def _compare(dims, q, k, v, do, causal, balanced, variant, backend):
    """max error of (o, lse, dq, dk, dv) of CP attention on my shard vs the single-process kernel, my rows.
    variant: a name of VARIANTS, or the attention function itself, called as they are."""
    n, r = dims.cp, dims.cp_rank
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = attention(qd, kd, vd, causal=causal, return_lse=True, backend=backend)
    o.backward(do)
    ref = [o.detach(), lse, qd.grad, kd.grad, vd.grad]
    sh = [shard(t, n, r, dim=2, balanced=balanced).clone().requires_grad_() for t in (q, k, v)]
    fn = VARIANTS.get(variant, variant)
    mo, mlse = fn(*sh, dims.group("cp"), causal=causal, balanced=balanced, backend=backend, return_lse=True)
    mo.backward(shard(do, n, r, dim=2, balanced=balanced))
    mine = [mo.detach(), mlse, sh[0].grad, sh[1].grad, sh[2].grad]
    errs = {}
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), mine, ref):
        b = shard(b, n, r, dim=-1 if name == "lse" else -2, balanced=balanced)
        errs[name] = float((a.double() - b.double()).abs().max())
    return errs


def check_attn(dims, args, backend: str = "torch") -> dict:
    """Both variants vs one process: causal balanced, causal contiguous, non-causal (Triton: the first only)."""
    out = {}
    triton = backend == "triton"
    # fp32: the LSE of the chapter-07 reference is fp32 even for fp64 inputs, so fp64 would not be tighter. A wrong
    # mask or a missing block moves outputs by ~1e-1; reduction-order noise stays near 1e-7.
    dtype, tol = torch.float32, 1e-5
    cases = [(True, True), (True, False), (False, True)]  # (causal, balanced)
    for causal, balanced in cases[:1] if triton else cases:
        c = 5 if triton else 3  # odd tokens per chunk: T/cp = 10 or 3*2 (balanced) / 3 (contiguous), odd per shard
        T = c * (2 * dims.cp if balanced else dims.cp)
        q, k, v, do = _qkv(1 if triton else 2, 4, 2, T, 16, dtype, seed=T + causal, device=args.device)
        for variant in VARIANTS:
            e = _compare(dims, q, k, v, do, causal, balanced, variant, backend)
            kind = "causal" if causal else "full"
            name = f"{'triton' if triton else 'attn'}_{variant}_{kind}" + ("_balanced" if balanced and causal else "")
            out[name] = {"ok": max(e.values()) <= tol, "max_err": max(e.values()), "errs": e, "tol": tol, "T": T}
    return out


def check_triton(dims, args) -> dict:
    if skip := triton_skipped(torch.empty(0, device=args.device)):  # CPU tensors, no interpreter: a GPU machine
        return {f"triton_{variant}_causal_balanced": skip for variant in VARIANTS}
    return check_attn(dims, args, backend="triton")


def check_gpt(dims, args) -> dict:
    """The GPT under CP (ring and all-gather) vs the dense GPT: per-step losses and parameters after 5 steps."""
    group = dims.group("cp")
    data = batches(STEPS, 4)
    dense = tiny_gpt()
    opt = adamw(dense)
    ref_losses = []
    for x, y in data:
        loss = dense(x, y)[1]
        loss.backward()
        ref_losses.append(float(loss))
        torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = {}
    for variant in VARIANTS:
        model = CPGPT.from_dense(tiny_gpt(), group, variant=variant)
        dp = DataParallel(model, group, stage=0)  # averages the gradients over the cp ranks
        opt = adamw(model)
        losses = []
        for x, y in data:
            loss = model(x, y)[1]
            loss.backward()
            dp.finish()
            losses.append(float(loss))
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        lerr = max(abs(a - b) for a, b in zip(losses, ref_losses))
        perr = maxerr(model.state_dict(), dense.state_dict())
        out[f"gpt_{variant}_5_steps"] = {"ok": perr <= TOL and lerr <= 1e-5, "max_err": perr, "loss_err": lerr,
                                         "losses": losses}
    return out


# ----------------------------------------------------------------------------------- CP x TP (+SP)
# name: (sequence parallel, GPT shape, also generate and 5 steps). T = 12: chunks of 3 tokens (2*cp = 4 of them),
# T/cp = 6, T/(cp tp) = 3. n_kv_head=2 splits the kv heads over tp=2; n_kv_head=1 replicates the one kv head (its
# gradient-summing hook). cp_sp_triton: head_dim 16 (the Triton kernels' tl.dot dims), one forward/backward only.
CPTP = {"cp_tp": (False, dict(n_head=6, n_kv_head=2, n_embd=48), True),
        "cp_sp": (True, dict(n_head=6, n_kv_head=2, n_embd=48), True),
        "cp_sp_kv1": (True, dict(n_head=4, n_kv_head=1, n_embd=32), True),
        "cp_sp_triton": (True, dict(n_head=4, n_kv_head=2, n_embd=64, backend="triton"), False)}
T_CPTP = 12
B_CPTP = 3


def _composed(dims, sp: bool, kw: dict):
    tp = TPGPT.from_dense(tiny_gpt(**kw), dims.group("tp"), sequence_parallel=sp)
    model = CPGPT.from_dense(tp, dims.group("cp"))
    return model, DataParallel(model, dims.group("dp_cp"))  # averages the gradients over dp x cp


def check_cptp(dims, args, name: str) -> dict:
    """One fwd/bwd (loss, gradients, state, num_params); unless cp_sp_triton also greedy generate and 5 steps."""
    sp, kw, steps = CPTP[name]
    kw = {**kw, "block_size": T_CPTP}
    if kw.get("backend") == "triton" and (skip := triton_skipped(torch.empty(0))):  # a GPU machine: no interpreter
        return {f"{name}_{k}": skip for k in ("state", "num_params", "loss", "grads")}
    (x, y), = batches(1, B_CPTP, T=T_CPTP, seed=7)
    dense = tiny_gpt(**kw)
    d_loss = dense(x, y)[1]
    d_loss.backward()
    d_grads = {n: p.grad for n, p in dense.named_parameters()}
    model, dp = _composed(dims, sp, kw)
    out = {f"{name}_state": result(maxerr(model.dense_state_dict(), dense.state_dict()), 0.0),
           f"{name}_num_params": result(abs(model.num_params() - dense.num_params()), 0)}
    loss = model(x, y)[1]
    loss.backward()
    dp.finish()
    out[f"{name}_loss"] = result(abs(float(loss.detach()) - float(d_loss)), 1e-5)
    errs = {}
    for n, p in model.named_parameters():  # my slice of each dense gradient, named by the parameter's tags
        dim, index = p.dense_index
        ref = d_grads[p.dense_name] if dim is None else d_grads[p.dense_name].index_select(dim, index)
        errs[n] = float((p.grad - ref).abs().max())
    out[f"{name}_grads"] = result(max(errs.values()), 1e-5, n_params=len(errs), worst=max(errs, key=errs.get))
    if not steps:
        return out
    prompt = x[:, :5]
    same = torch.equal(model.generate(prompt, 4, temperature=0), dense.generate(prompt, 4, temperature=0))
    out[f"{name}_generate"] = result(0.0 if same else 1.0, 0.0)
    model, dp = _composed(dims, sp, kw)
    data = batches(STEPS, B_CPTP, T=T_CPTP, seed=3)
    ref = dense_run(tiny_gpt(**kw), data).state_dict()
    opt = adamw(model)
    for xb, yb in data:
        model(xb, yb)[1].backward()
        dp.finish()
        comm.clip_grad_norm_(model.parameters(), CLIP, [dims.group("tp")])
        opt.step()
        opt.zero_grad(set_to_none=True)
    out[f"{name}_5_steps"] = result(maxerr(model.dense_state_dict(), ref), TOL)
    return out


# ----------------------------------------------------------------------------------- the lesson's measurements
def cp_measure(dims, args) -> dict:
    """One causal forward + backward at T = --T per variant, with and without load balancing: the score entries
    computed, the ring's per-step compute and wait, bytes sent, peak bytes (inputs excluded), seconds."""
    group = dims.group("cp")
    B, T = 1, args.T
    H = KVH = 4
    D = 64
    q, k, v, do = _qkv(B, H, KVH, T, D, torch.float32, seed=1)
    res = {}
    for variant in VARIANTS:
        for balanced in (False, True):
            sh = [shard(t, dims.cp, dims.cp_rank, dim=2, balanced=balanced).clone().requires_grad_()
                  for t in (q, k, v)]
            dsh = shard(do, dims.cp, dims.cp_rank, dim=2, balanced=balanced)
            inputs = sum(t.numel() * t.element_size() for t in (*sh, dsh))
            dist.barrier()
            t0 = time.perf_counter()
            with comm.CommLog() as log, PeakBytes() as pk, trace.Recorder() as rec:
                VARIANTS[variant](*sh, group, causal=True, balanced=balanced, backend=args.backend).backward(dsh)
            sec = time.perf_counter() - t0
            blocks = rec.rows("cp_block")
            waits = {w["step"]: w["t1"] - w["t0"] for w in rec.rows("cp_wait")}
            steps = []  # the ring's forward: (seconds computing, seconds then blocked on the transfer) per step
            if variant == "ring":
                compute = {b["step"]: b["t1"] - b["t0"] for b in blocks}
                steps = [(compute.get(s, 0.0), waits.get(s, 0.0)) for s in range(dims.cp)]
            res[f"{variant}_{'balanced' if balanced else 'contiguous'}"] = {
                "ok": True, "scores": sum(b["scores"] for b in blocks), "seconds": round(sec, 4), "steps": steps,
                "bytes_sent": log.total(), "peak_bytes": pk.peak, "input_bytes": inputs,
                "kv_shard_bytes": 2 * sh[1].numel() * sh[1].element_size()}
    return {"cp_measure": {"ok": True, "T": T, "cp": dims.cp, "B": B, "H": H, "D": D, **res}}


# ----------------------------------------------------------------------------------- the exercise
@graded("ring_step_merge", tol=1e-5)  # fp32 inputs against an fp64 reference
def grade_ring_step_merge(dims, student) -> float:
    """ring_step_merge(q, k, v, group) -> (o, lse): non-causal attention of my queries over every rank's keys, by
    K/V exchanges and LSE merges; compared with the full single-process attention (my rows)."""
    n, r = dims.cp, dims.cp_rank
    worst = 0.0
    for T, KVH in ((6, 2), (10, 1)):
        q, k, v, _ = _qkv(2, 2, KVH, T * n, 16, torch.float32, seed=T)
        o, lse = attention(q.double(), k.double(), v.double(), causal=False, return_lse=True, backend="torch")
        mine = [t.chunk(n, dim=2)[r].contiguous() for t in (q, k, v)]
        mo, mlse = student.ring_step_merge(*mine, dims.group("cp"))
        worst = max(worst, float((mo.double() - o.chunk(n, 2)[r]).abs().max()),
                    float((mlse.double() - lse.chunk(n, 2)[r]).abs().max()))
    return worst


CHECKS = {  # name: (check, the axis of ParallelDims that takes the world; tp_cp: tp = --tp, cp = the rest)
    "cp_attn": (check_attn, "cp"),
    "cp_triton": (check_triton, "cp"),
    "cp_gpt": (check_gpt, "cp"),
    "cp_measure": (cp_measure, "cp"),
    **{name: (functools.partial(check_cptp, name=name), "tp_cp") for name in CPTP},
    "ring_step_merge": (grade_ring_step_merge, "cp"),
}
