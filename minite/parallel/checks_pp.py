"""Chapter 12's distributed checks and measurements, many per torchrun launch (each launch costs ~6 s):

    torchrun --nproc-per-node N -m minite.parallel.checks_pp --out DIR grads reject train memory
    torchrun --nproc-per-node N -m minite.parallel.checks_pp --out DIR timeline --micro 1 4 8
    torchrun --nproc-per-node 2 -m minite.parallel.checks_pp --out DIR grade --file student.py

Every rank builds the dense GPT from the same seed, computes the dense loss and gradients of the whole batch, and
compares its stage with them. Each rank writes DIR/rank<r>.json: {check: {"ok": bool, ...}}.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minite.models.gpt import GPT, GPTConfig
from minite.parallel.dims import ParallelDims, ParallelError, init_distributed
from minite.parallel.launch import report
from minite.parallel.pipeline import PipelineGPT
from minite.parallel.pipeline_schedule import SCHEDULES, bubble_fraction

TINY = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64,
            backend="torch")
B, T, TOL = 12, 16, 1e-5  # 12 sequences split into 1, 2, 3, 4, 6 or 12 micro-batches


def dense_and_batch(seed=0, batch=B, **kw):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **kw}))
    g = torch.Generator().manual_seed(seed + 1)
    x, y = (torch.randint(0, model.config.vocab_size, (batch, T), generator=g) for _ in range(2))
    return model, x, y


def compare(dims, schedule, m, model=None, x=None, y=None) -> dict:
    """Loss and every gradient of my stage vs the dense model's, after one pipeline step with m micro-batches."""
    if model is None:
        model, x, y = dense_and_batch()
    pipe = PipelineGPT(model, dims, m, schedule)
    loss = pipe.step(x, y)
    dense_loss = model(x, y)[1]
    dense_loss.backward()
    grads = dict(model.named_parameters())
    errs = {n: float((q.grad - grads[n].grad).abs().max()) for n, q in pipe.stage.named_parameters()}
    return {"loss_err": abs(loss - float(dense_loss.detach())), "grad_err": max(errs.values()), "n_grads": len(errs),
            "layers": [list(r) for r in pipe.layers], "peak_act_bytes": pipe.peak_act_bytes, "events": pipe.events,
            "mb_bytes": pipe.mb_bytes}


def check_grads(dims, args) -> dict:
    out = {}
    for sched in SCHEDULES:
        for m in (1, 2, 3, 4, 6):
            r = compare(dims, sched, m)
            ok = r["loss_err"] < TOL and r["grad_err"] < TOL and r["n_grads"] > 0
            out[f"grads_{sched}_m{m}"] = {"ok": ok, **{k: r[k] for k in ("loss_err", "grad_err", "n_grads")}}
    return out


def check_reject(dims, args) -> dict:
    """pp > n_layer, and a batch that does not split into the micro-batch count, both name their numbers."""
    msgs = []
    for make in (lambda: PipelineGPT(dense_and_batch(n_layer=dims.pp - 1)[0], dims),
                 lambda: PipelineGPT(dense_and_batch()[0], dims, 5).step(*dense_and_batch()[1:])):
        try:
            make()
            msgs.append("no error")
        except ParallelError as e:
            msgs.append(str(e))
    want = [(f"pp={dims.pp}", f"n_layer={dims.pp - 1}"), (f"{B} sequences", "5 equal micro-batches")]
    return {"reject": {"ok": all(all(w in msg for w in ws) for msg, ws in zip(msgs, want)), "messages": msgs}}


def check_train(dims, args, steps=3) -> dict:
    """minite.train's path: loss = model(x, y)[1]; (loss / 2).backward() twice (grad_accum 2), global clip, AdamW."""
    model, x, y = dense_and_batch()
    pipe = PipelineGPT(model, dims, 3, "1f1b")
    opt_d, opt_p = (torch.optim.AdamW(mod.parameters(), lr=1e-2, weight_decay=0.1) for mod in (model, pipe))
    for _ in range(steps):
        for half in (slice(0, B // 2), slice(B // 2, B)):
            (model(x[half], y[half])[1] / 2).backward()
            (pipe(x[half], y[half])[1] / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        pipe.clip_grad_norm_(0.05)
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    full = pipe.dense_state_dict()
    err = max(float((full[n] - v).abs().max()) for n, v in model.state_dict().items())
    with torch.no_grad():
        loss_err = abs(float(pipe(x, y)[1]) - float(model(x, y)[1]))
    return {"train_3_steps": {"ok": err < 1e-4 and loss_err < 1e-4 and set(full) == set(model.state_dict()),
                              "param_err": err, "eval_loss_err": loss_err}}


def check_memory(dims, args) -> dict:
    """Peak activation bytes per stage: AFAB holds all m micro-batches, 1F1B at most p - stage of them."""
    m, out = 6, {}
    for sched in SCHEDULES:
        r = compare(dims, sched, m)
        per_mb = max(r["mb_bytes"])
        assert min(r["mb_bytes"]) == per_mb
        held = m if sched == "afab" else min(dims.pp - dims.pp_rank, m)
        out[f"memory_{sched}"] = {"ok": r["peak_act_bytes"] == held * per_mb > 0, "peak_act_bytes":
                                  r["peak_act_bytes"], "per_microbatch": per_mb, "held": held}
    return out


def measure_timeline(dims, args) -> dict:
    """Per-rank events of timed steps per (schedule, m) after a warm-up step, the global batch fixed at
    max(m) * mb sequences; a wider model than the checks' so that compute, not messages, dominates."""
    model, x, y = dense_and_batch(n_layer=4 * dims.pp, n_embd=args.width, n_head=4, mlp_hidden=4 * args.width,
                                  batch=max(args.micro) * args.mb, vocab_size=64)
    out = {}
    for sched in SCHEDULES:
        for m in args.micro:
            pipe = PipelineGPT(model, dims, m, sched)
            pipe.step(x, y)  # warm-up
            runs = []
            for _ in range(args.repeat):  # the notebook keeps the run with the shortest span (the least disturbed)
                dist.barrier()
                pipe.step(x, y)
                runs.append(pipe.events)
            out[f"{sched}_m{m}"] = {"ok": True, "runs": runs, "peak_act_bytes": pipe.peak_act_bytes,
                                    "bubble_formula": bubble_fraction(dims.pp, m)}
            model.zero_grad(set_to_none=True)
    return out


def die(dims, args) -> dict:
    """The last stage raises before its first forward while the others wait on receives: the run must end with an
    error naming that rank (torchrun tears the others down; the collective timeout bounds it otherwise)."""
    model, x, y = dense_and_batch()
    pipe = PipelineGPT(model, dims, 4)
    if dims.pp_rank == dims.pp - 1:
        raise RuntimeError(f"rank {dims.rank} (stage {dims.pp_rank}) dies on purpose")
    pipe.step(x, y)
    return {"die": {"ok": False}}  # not reached


def grade(dims, args) -> dict:
    """A learner's 1F1B: its step order for several (p, m, stage), then a real pipeline step run with it."""
    spec = importlib.util.spec_from_file_location("student", args.file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    want = SCHEDULES["1f1b"]
    wrong = [(p, m, s) for p in (2, 3, 4) for m in (1, 2, 3, 5, 8) for s in range(p)
             if [tuple(a) for a in mod.one_f_one_b(p, m, s)] != want(p, m, s)]
    if wrong:  # the same on every rank: skip the real step (a wrong order could wait forever on a receive)
        return {"grade": {"ok": False, "err": float("inf"), "wrong_orders": wrong[:3]}}
    r = compare(dims, lambda p, m, s: [tuple(a) for a in mod.one_f_one_b(p, m, s)], 6)
    err = max(r["loss_err"], r["grad_err"])
    return {"grade": {"ok": not wrong and err < TOL, "err": err, "wrong_orders": wrong[:3]}}


def run_graded(source: str, world: int = 2, timeout: float = 120) -> tuple[bool, str]:
    """The exercise's check: write the learner's ``one_f_one_b`` to a file, torchrun ``grade``; (ok, message)."""
    import textwrap

    from minite.parallel.launch import results, torchrun
    d = Path(tempfile.mkdtemp(prefix="minite_grade_pp_"))
    (d / "student.py").write_text(textwrap.dedent(source))
    res = torchrun(world, ["-m", "minite.parallel.checks_pp", "grade", "--file", str(d / "student.py"),
                           "--out", str(d)], timeout=timeout)
    got = {r: rep["grade"] for r, rep in results(d).items()}
    if len(got) != world:
        return False, f"one_f_one_b: the torchrun run failed (exit {res.returncode}): {res.stdout[-500:]}"
    r = got[0]
    if r.get("error"):
        return False, f"one_f_one_b raised {r['error']}"
    if r.get("wrong_orders"):
        return False, f"one_f_one_b: wrong step order for (p, m, stage) = {r['wrong_orders']}"
    ok = all(v["ok"] for v in got.values())
    worst = max(v["err"] for v in got.values())
    return ok, f"one_f_one_b on {world} ranks: order right, m=6 step: max |loss or grad - dense| {worst:.0e}"


CHECKS = {"grads": check_grads, "reject": check_reject, "train": check_train, "memory": check_memory,
          "timeline": measure_timeline, "grade": grade, "die": die}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minite.parallel.checks_pp")
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--out", default=tempfile.gettempdir())
    ap.add_argument("--file", default="")
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--mb", type=int, default=2, help="sequences per micro-batch (timeline)")
    ap.add_argument("--repeat", type=int, default=3, help="timed steps per configuration (timeline)")
    ap.add_argument("--width", type=int, default=96, help="model width (timeline)")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(args.timeout, device="cpu")  # CPU tensors over gloo, on any machine
    dims = ParallelDims(pp=world).build(rank, world)
    results = {}
    for name in args.checks:
        t0 = time.perf_counter()
        try:
            res = CHECKS[name](dims, args)
        except Exception as e:  # a wrong learner function must fail its grade, not hang the other ranks
            if name != "grade":
                raise
            res = {"grade": {"ok": False, "err": float("inf"), "error": f"{type(e).__name__}: {e}"}}
        for v in res.values():
            v["rank"], v["seconds"] = rank, round(time.perf_counter() - t0, 2)
        results.update(res)
    return report(args.out, rank, results)


if __name__ == "__main__":
    sys.exit(main())
