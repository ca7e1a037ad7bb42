"""Chapter 13's distributed checks and measurements, one torchrun launch for many:

    TRITON_INTERPRET=1 torchrun --nproc-per-node N -m minite.parallel.checks_cp --out DIR attn triton gpt measure

(without CUDA the Triton kernels need TRITON_INTERPRET=1 in the environment: minite imports triton first; on a GPU
machine launch.torchrun leaves it off and "triton" reports its checks skipped on CPU tensors).

Every rank runs every named check (they are collective) and writes DIR/rank<r>.json: {check: {"ok", ...}}.
    attn     ring and all-gather CP attention (reference path, fp32) vs one process: output, LSE, dq, dk, dv;
             causal (balanced and contiguous) and not, GQA, odd lengths per shard
    triton   the same through the chapter-07 Triton kernel (fp32, smaller), vs the single-process kernel
    gpt      the GPT under CP (ring and all-gather) vs dense: 5 AdamW steps, losses and parameters
    measure  work per rank with and without load balancing; bytes sent and peak memory, ring vs all-gather
    grade    a learner's function (``--file``, ``--task``), for the exercise of chapter 13
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minite.bytecount import PeakBytes
from minite.kernels.attention import attention
from minite.parallel import comm
from minite.parallel.context import allgather_attention, ring_attention, shard
from minite.parallel.dims import init_distributed
from minite.parallel.launch import report, triton_skipped

VARIANTS = {"ring": ring_attention, "allgather": allgather_attention}


def _qkv(B, H, KVH, T, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g, dtype=dtype).to(device) for h in (H, KVH, KVH)] + \
        [torch.randn(B, H, T, D, generator=g, dtype=dtype).to(device)]


def _compare(group, n, r, q, k, v, do, causal, balanced, variant, backend):
    """max error of (o, lse, dq, dk, dv) of CP attention on my shard vs the single-process kernel, my rows."""
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = attention(qd, kd, vd, causal=causal, return_lse=True, backend=backend)
    o.backward(do)
    ref = [o.detach(), lse, qd.grad, kd.grad, vd.grad]
    sh = [shard(t, n, r, dim=2, balanced=balanced).clone().requires_grad_() for t in (q, k, v)]
    mo, mlse = VARIANTS[variant](*sh, group, causal=causal, balanced=balanced, backend=backend, return_lse=True)
    mo.backward(shard(do, n, r, dim=2, balanced=balanced))
    mine = [mo.detach(), mlse, sh[0].grad, sh[1].grad, sh[2].grad]
    errs = [float((a.double() - shard(b, n, r, dim=-2 if i != 1 else -1, balanced=balanced).double()).abs().max())
            for i, (a, b) in enumerate(zip(mine, ref))]
    return dict(zip(("o", "lse", "dq", "dk", "dv"), errs))


def check_attn(group, n, r, args, backend="torch") -> dict:
    out = {}
    triton = backend == "triton"
    # fp32: the LSE of the chapter-07 reference is fp32 even for fp64 inputs, so fp64 would not be tighter. A wrong
    # mask or a missing block moves outputs by ~1e-1; reduction-order noise stays near 1e-7.
    dtype, tol = torch.float32, 1e-5
    cases = [(True, True), (True, False), (False, True)]  # (causal, balanced)
    for causal, balanced in cases[:1] if triton else cases:
        c = 5 if triton else 3  # odd tokens per chunk: T/cp = 10 or 3*2 (balanced) / 3 (contiguous), odd per shard
        T = c * (2 * n if balanced else n)
        q, k, v, do = _qkv(2 if not triton else 1, 4, 2, T, 16, dtype, seed=T + causal, device=args.device)
        for variant in VARIANTS:
            e = _compare(group, n, r, q, k, v, do, causal, balanced, variant, backend)
            name = f"{'triton' if triton else 'attn'}_{variant}_{'causal' if causal else 'full'}" + \
                ("_balanced" if balanced and causal else "")
            out[name] = {"ok": max(e.values()) <= tol, "max_err": max(e.values()), "errs": e, "tol": tol, "T": T}
    return out


def check_triton(group, n, r, args) -> dict:
    if skip := triton_skipped(torch.empty(0, device=args.device)):  # CPU tensors, no interpreter: a GPU machine
        return {f"triton_{variant}_causal_balanced": skip for variant in VARIANTS}
    return check_attn(group, n, r, args, backend="triton")


def check_gpt(group, n, r, args) -> dict:
    """The GPT under CP (every degree but cp 1) vs the dense GPT: per-step losses and parameters after 5 steps."""
    from minite.parallel.checks import CLIP, STEPS, TOL, adamw, batches, maxerr, tiny_gpt
    from minite.parallel.context_gpt import CPGPT
    from minite.parallel.data import DataParallel
    data = batches(STEPS, 4)
    dense, opt, ref_losses = tiny_gpt(), None, []
    opt = adamw(dense)
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
        opt, losses = adamw(model), []
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


def check_measure(group, n, r, args) -> dict:
    """Work per rank (score entries) with and without load balancing; bytes sent and peak bytes per variant."""
    B, H, KVH, D, T = 1, 4, 4, 64, args.T
    q, k, v, do = _qkv(B, H, KVH, T, D, torch.float32, seed=1)
    res = {}
    for variant in VARIANTS:
        for balanced in (False, True):
            stats = {}
            sh = [shard(t, n, r, dim=2, balanced=balanced).clone().requires_grad_() for t in (q, k, v)]
            dsh = shard(do, n, r, dim=2, balanced=balanced)
            inputs = sum(t.numel() * t.element_size() for t in (*sh, dsh))
            dist.barrier()
            t0 = time.perf_counter()
            with comm.CommLog() as log, PeakBytes() as pk:
                VARIANTS[variant](*sh, group, causal=True, balanced=balanced, backend=args.backend,
                                  stats=stats).backward(dsh)
            sec = time.perf_counter() - t0
            res[f"{variant}_{'balanced' if balanced else 'contiguous'}"] = {
                "ok": True, "scores": stats["scores"], "seconds": round(sec, 4), "steps": stats.get("steps", []),
                "bytes_sent": log.total(), "peak_bytes": pk.peak, "input_bytes": inputs,
                "kv_shard_bytes": 2 * sh[1].numel() * sh[1].element_size()}
    return {"measure": {"ok": True, "T": T, "cp": n, "B": B, "H": H, "D": D, **res}}


# ----------------------------------------------------------------------------------- grading (chapter 13 exercise)
def _grade_ring_merge(mod, group, n, r) -> float:
    """ring_step_merge(q, k, v, group) -> (o, lse): non-causal attention of my queries over both ranks' keys,
    by one K/V exchange and an LSE merge; compared with the full single-process attention (my rows)."""
    worst = 0.0
    for T, KVH in ((6, 2), (10, 1)):
        q, k, v, _ = _qkv(2, 2, KVH, T * n, 16, torch.float32, seed=T)
        o, lse = attention(q.double(), k.double(), v.double(), causal=False, return_lse=True, backend="torch")
        mine = [t.chunk(n, dim=2)[r].contiguous() for t in (q, k, v)]
        mo, mlse = mod.ring_step_merge(*mine, group)
        worst = max(worst, float((mo.double() - o.chunk(n, 2)[r]).abs().max()),
                    float((mlse.double() - lse.chunk(n, 2)[r]).abs().max()))
    return worst


GRADED = {"ring_step_merge": _grade_ring_merge}


def run_graded(source: str, task: str, world: int = 2, timeout: float = 120) -> tuple[bool, str]:
    """Write `source` to a file, torchrun the grader on `world` ranks; (ok, message)."""
    import textwrap

    from minite.parallel.launch import results, torchrun
    d = Path(tempfile.mkdtemp(prefix="minite_grade_"))
    (d / "student.py").write_text("import torch\nimport torch.distributed as dist\n" + textwrap.dedent(source))
    res = torchrun(world, ["-m", "minite.parallel.checks_cp", "grade", "--file", str(d / "student.py"),
                           "--task", task, "--out", str(d)], timeout=timeout)  # CPU tensors over gloo
    got = results(d)
    if len(got) != world:
        errs = [ln for ln in res.stdout.splitlines() if "Error" in ln or "Exception" in ln]
        return False, f"{task}: the torchrun run failed (exit {res.returncode}): " + (errs[-1] if errs else "")
    worst = max(v[task]["max_err"] for v in got.values())
    ok = all(v[task]["ok"] for v in got.values())
    return ok, f"{task} on {world} ranks: max error {worst:.1e} ({'ok' if ok else 'too large'})"


def check_grade(group, n, r, args) -> dict:
    from minite.parallel.grade import _load
    err = GRADED[args.task](_load(args.file), group, n, r)
    return {args.task: {"ok": err < 1e-5, "max_err": err}}  # fp32 inputs against an fp64 reference


CHECKS = {"attn": check_attn, "triton": check_triton, "gpt": check_gpt, "measure": check_measure,
          "grade": check_grade}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minite.parallel.checks_cp")
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--out", default=tempfile.gettempdir())
    ap.add_argument("--T", type=int, default=1024, help="sequence length of the measurements")
    ap.add_argument("--backend", default="torch", help="attention backend of the measurements")
    ap.add_argument("--file", default="")
    ap.add_argument("--task", default="ring_step_merge", choices=sorted(GRADED))
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--device", default="cpu", help="cpu (gloo; the tests) or cuda (NCCL, a GPU per rank)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(args.timeout, device=args.device)  # cuda with too few GPUs: fails fast
    group = dist.group.WORLD if world > 1 else None
    results = {}
    for name in args.checks:
        t0 = time.perf_counter()
        res = CHECKS[name](group, world, rank, args)
        for v in res.values():
            v["rank"], v["seconds_check"] = rank, round(time.perf_counter() - t0, 2)
        results.update(res)
    return report(args.out, rank, results)


if __name__ == "__main__":
    sys.exit(main())
