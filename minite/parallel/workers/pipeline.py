"""Chapter 12's checks: every stage's loss and gradients against the dense GPT (AFAB, 1F1B and ZB-H1, several
micro-batch counts), minite.train's path, the rejections, a dying stage; the lesson's activation memory and timeline per
stage; the exercise's 1F1B order, run in a real pipeline step."""
from __future__ import annotations

import torch
import torch.distributed as dist

from minite.parallel import trace
from minite.parallel.dims import ParallelError
from minite.parallel.pipeline import PipelineGPT
from minite.parallel.pipeline_schedule import SCHEDULES, bubble_fraction
from minite.parallel.schedules import SCHEDULES as ALL
from minite.parallel.schedules import in_flight
from minite.parallel.workers.common import batches, tiny_gpt

B = 12  # sequences: 1, 2, 3, 4, 6 or 12 micro-batches
TOL = 1e-5


def dense_and_batch(batch: int = B, **kw):
    """The dense 4-layer GPT (kw: other shapes) and one global batch (x, y) of `batch` sequences."""
    model = tiny_gpt(**{"n_layer": 4, **kw})
    (x, y), = batches(1, batch, V=model.config.vocab_size)
    return model, x, y


def activation_peak(rows: list[dict]) -> int:
    """The most bytes of saved activations held at once, from the "pp" events of one schedule (trace): a micro-batch
    holds its forward's from its F to its W (ZB-H1: the B/W split), or to its B (the whole backward)."""
    release = "W" if any(row["step"] == "W" for row in rows) else "B"
    held, live, peak = {}, 0, 0
    for row in rows:
        at = (row["mb"], row.get("chunk", 0))
        if row["step"] == "F":
            held[at] = row["saved_bytes"]
            live += row["saved_bytes"]
            peak = max(peak, live)
        elif row["step"] == release:
            live -= held.pop(at)
    return peak


def micro_counts(sched: str) -> tuple[int, ...]:
    """The micro-batch counts each schedule's gradients are checked at (interleaved: divisible by pp = 2 and 4)."""
    return (4, 12) if sched == "interleaved" else (1, 2, 3, 4, 6)


def compare(dims, schedule, m, model=None, x=None, y=None) -> dict:
    """Loss and every gradient of my stage vs the dense model's, after one pipeline step with m micro-batches."""
    if model is None:  # interleaved: 2 chunks of at least one layer per rank
        model, x, y = dense_and_batch(n_layer=max(4, 2 * dims.pp) if schedule == "interleaved" else 4)
    pipe = PipelineGPT(model, dims, m, schedule)
    with trace.Recorder() as rec:
        loss = pipe.step(x, y)
    dense_loss = model(x, y)[1]
    dense_loss.backward()
    grads = dict(model.named_parameters())
    errs = {q.dense_name: float((q.grad - grads[q.dense_name].grad).abs().max()) for q in pipe.stage.parameters()}
    return {"loss_err": abs(loss - float(dense_loss.detach())), "grad_err": max(errs.values()), "n_grads": len(errs),
            "layers": [list(r) for r in pipe.layers], "steps": rec.rows("pp"),
            "deferred": sum(len(d.hooks) for d in pipe._split or [])}  # linears whose W ran apart (ZB-H1)


def check_grads(dims, args) -> dict:
    out = {}
    for sched in ALL:
        for m in micro_counts(sched):
            r = compare(dims, sched, m)
            ok = r["loss_err"] < TOL and r["grad_err"] < TOL and r["n_grads"] > 0 and (r["deferred"] > 0) == (
                sched == "zbh1")
            out[f"grads_{sched}_m{m}"] = {"ok": ok, **{k: r[k] for k in ("loss_err", "grad_err", "n_grads",
                                                                          "deferred")}}
    got = {}  # a MoE GPT with the Switch loss (a second root of each B): ZB-H1 against 1F1B (test_moe_pp's, vs dense)
    for sched in ("1f1b", "zbh1"):
        model, x, y = dense_and_batch(moe_num_experts=4, moe_top_k=2, moe_balance="aux", moe_aux_weight=0.1)
        pipe = PipelineGPT(model, dims, 4, sched)
        got[sched] = (pipe.step(x, y), {q.dense_name: q.grad for q in pipe.stage.parameters()}, pipe._split)
    (l1, g1, _), (l2, g2, split) = got["1f1b"], got["zbh1"]
    err = max(float((g1[n] - g2[n]).abs().max()) for n in g1)
    out["grads_zbh1_moe"] = {"ok": abs(l1 - l2) < TOL and err < TOL and len(g1) > 0 and len(split[0].hooks) > 0,
                             "loss_err": abs(l1 - l2), "grad_err": err}
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


def check_train(dims, args, steps: int = 3) -> dict:
    """minite.train's path: loss = model(x, y)[1]; (loss / 2).backward() twice (grad_accum 2), global clip, AdamW;
    1F1B, and interleaved (2 chunks a rank: 2 pp layers, 16 sequences, 4 micro-batches of each half)."""
    out = {}
    for name, sched, m, batch in (("train_3_steps", "1f1b", 3, B), ("train_interleaved", "interleaved", 4, 16)):
        model, x, y = dense_and_batch(batch, n_layer=max(4, 2 * dims.pp) if sched == "interleaved" else 4)
        pipe = PipelineGPT(model, dims, m, sched)
        opt_d = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        opt_p = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        for _ in range(steps):
            for half in (slice(0, batch // 2), slice(batch // 2, batch)):
                (model(x[half], y[half])[1] / 2).backward()
                (pipe(x[half], y[half])[1] / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            pipe.clip_grad_norm_(0.05)
            for opt in (opt_d, opt_p):
                opt.step()
                opt.zero_grad()
        full = pipe.dense_state_dict()
        err = max(float((full[n] - v).abs().max()) for n, v in model.state_dict().items())
        with torch.no_grad():
            loss_err = abs(float(pipe(x, y)[1]) - float(model(x, y)[1]))
        out[name] = {"ok": err < 1e-4 and loss_err < 1e-4 and set(full) == set(model.state_dict()),
                     "param_err": err, "eval_loss_err": loss_err}
    return out


def check_die(dims, args) -> dict:
    """The last stage raises before its first forward while the others wait on receives: the run must end with an
    error naming that rank (torchrun tears the others down; the collective timeout bounds it otherwise)."""
    model, x, y = dense_and_batch()
    pipe = PipelineGPT(model, dims, 4)
    if dims.pp_rank == dims.pp - 1:
        raise RuntimeError(f"rank {dims.rank} (stage {dims.pp_rank}) dies on purpose")
    pipe.step(x, y)
    return {"pp_die": {"ok": False}}  # not reached


# ----------------------------------------------------------------------------------- the lesson's measurements
def pp_memory(dims, args) -> dict:
    """Peak activation bytes per stage: AFAB holds all m micro-batches, 1F1B at most p - stage of them, ZB-H1 at
    most p (from F to W), as its op list says; the events come in the schedule's order (F, B, W)."""
    out = {}
    p, s = dims.pp, dims.pp_rank
    for sched in ALL:
        m = 4 if sched == "interleaved" else 6
        rows = compare(dims, sched, m)["steps"]
        ops = [(*op, 0)[:3] for op in ALL[sched](p, m, s)]
        order = [(r["step"], r["mb"], r.get("chunk", 0)) for r in rows] == ops
        units = in_flight(ops)  # micro-batches (interleaved: chunks) between F and W (or B)
        held = units / getattr(ALL[sched], "v", 1)  # stages' worth (interleaved: half a stage a chunk)
        want = {"afab": m, "1f1b": min(p - s, m), "zbh1": min(p, m), "interleaved": min(
            2 * (p - s - 1) + p + 1, 2 * m) / 2}[sched]
        per_mb = [r["saved_bytes"] for r in rows if r["step"] == "F"]
        peak = activation_peak(rows)
        same = min(per_mb) == max(per_mb)  # one stage (or like chunks): every F saves the same bytes
        out[f"memory_{sched}"] = {"ok": (peak == units * per_mb[0] > 0 if same else peak > 0) and held == want and
                                  order and (same or sched == "interleaved"), "peak_act_bytes": peak,
                                  "per_microbatch": per_mb[0], "held": held, "order": order}
    return out


def pp_timeline(dims, args) -> dict:
    """Per-rank (F or B, micro-batch, start, end) of timed steps per (schedule, m) after a warm-up step, the global
    batch fixed at max(m) * mb sequences; a wider model than the checks' so that compute, not messages, dominates."""
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
                with trace.Recorder() as rec:
                    pipe.step(x, y)
                runs.append([(r["step"], r["mb"], r["t0"], r["t1"]) for r in rec.rows("pp")])
            out[f"timeline_{sched}_m{m}"] = {"ok": True, "runs": runs, "bubble_formula": bubble_fraction(dims.pp, m)}
            model.zero_grad(set_to_none=True)
    return out


def pp_schedules_measure(dims, args) -> dict:
    """Issue 38's table, measured: every schedule (AFAB, 1F1B, ZB-H1, interleaved) at m = the last --micro, each
    rank's ops as (kind, mb, chunk, t0, t1, saved bytes) in --repeat timed steps after a warm-up step; the model of
    pp_timeline (4 layers a stage: 2 a chunk interleaved). benchmarks/bench_pp_schedules.py reads them."""
    m = args.micro[-1]
    model, x, y = dense_and_batch(n_layer=4 * dims.pp, n_embd=args.width, n_head=4, mlp_hidden=4 * args.width,
                                  batch=m * args.mb, vocab_size=64)
    out = {}
    for sched in ALL:
        pipe = PipelineGPT(model, dims, m, sched)
        pipe.step(x, y)  # warm-up
        runs = []
        for _ in range(args.repeat):
            dist.barrier()
            with trace.Recorder() as rec:
                pipe.step(x, y)
            runs.append([(r["step"], r["mb"], r.get("chunk", 0), r["t0"], r["t1"], r.get("saved_bytes", 0))
                         for r in rec.rows("pp")])
        out[f"measure_{sched}"] = {"ok": True, "runs": runs}
        model.zero_grad(set_to_none=True)
    return out


CHECKS = {  # name: (check, the axis of ParallelDims that takes the world)
    "pp_grads": (check_grads, "pp"),
    "pp_reject": (check_reject, "pp"),
    "pp_train": (check_train, "pp"),
    "pp_die": (check_die, "pp"),
    "pp_memory": (pp_memory, "pp"),
    "pp_timeline": (pp_timeline, "pp"),
    "pp_schedules_measure": (pp_schedules_measure, "pp"),
}
