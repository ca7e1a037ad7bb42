"""Issue 38: the bubble and peak activation memory of AFAB, 1F1B, interleaved 1F1B and ZB-H1, against the formulas.

    python benchmarks/bench_pp_schedules.py [--p 4] [--m 8] [--measure 2 4] [--width 96] [--repeat 3]

Simulated (pure Python, ``minite.parallel.schedules.schedule_table``): every rank's op list laid out in time with
unit costs (F = B = W = 1; a whole backward 2; an interleaved chunk's ops half of that), messages free. The bubble
is the idle fraction of the most idle rank, the peak the most stages' worth of activations any rank holds (a
micro-batch from its F to its W, or its B when the backward is whole). Formulas (p stages, m micro-batches, v = 2
chunks): AFAB and 1F1B (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1); peaks m, p, p+(p-1)/v, p.

Measured (--measure P ...: torchrun P CPU ranks over gloo, one thread each, the worker ``pp_schedules_measure``):
the same schedules run by ``PipelineGPT`` on a 4p-layer GPT; per step, the span from the first op's start to the
last op's end on any rank, each rank's busy time (its ops' durations) and its peak saved activation bytes (from the
forwards' autograd-saved bytes, held to W or B); the least disturbed (shortest) of --repeat steps is kept. Real
costs are not unit costs (B is not W, W's GEMMs are run apart, the messages cost time), and on a machine with fewer
cores than ranks the idle time includes waiting for a core: read the measured bubble beside the simulated one, not
as a check of the formula. Also the cost of the split on one stage (``split_cost``: F, the whole backward, B and W
in ms, one process). Saved to benchmarks/results/pp_schedules_cpu.json (the CPU's name inside).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
import common  # noqa: E402

from minite.parallel.launch import results, torchrun  # noqa: E402
from minite.parallel.schedules import schedule_table  # noqa: E402


def measured(p: int, m: int, args) -> list[dict]:
    """One torchrun of p ranks: per schedule, the bubble and peak activations of its least disturbed step."""
    out = tempfile.mkdtemp(prefix="pp_schedules_")
    cmd = ["-m", "minite.parallel.workers", "pp_schedules_measure", "--micro", str(m), "--mb", str(args.mb),
           "--width", str(args.width), "--repeat", str(args.repeat), "--out", out]
    res = torchrun(p, cmd, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode:
        raise SystemExit(f"torchrun failed:\n{res.stdout[-3000:]}")
    reps = results(out)
    rows = []
    for key in reps[0]:
        if not key.startswith("measure_"):
            continue
        runs = [reps[r][key]["runs"] for r in range(p)]  # [rank][run][op]

        def span(k):
            ops = [op for r in range(p) for op in runs[r][k]]
            return max(op[4] for op in ops) - min(op[3] for op in ops)
        k = min(range(args.repeat), key=span)
        t = span(k)
        idle = [1 - sum(op[4] - op[3] for op in runs[r][k]) / t for r in range(p)]
        peaks = []
        for r in range(p):  # saved bytes held at once, in units of one micro-batch through all of the rank's stages
            ops = runs[r][k]
            release = "W" if any(op[0] == "W" for op in ops) else "B"
            held, live, peak = {}, 0, 0
            for kind, i, c, _, _, saved in ops:
                if kind == "F":
                    held[i, c] = saved
                    live += saved
                    peak = max(peak, live)
                elif kind == release:
                    live -= held.pop((i, c))
            one = sum(saved for kind, i, _, _, _, saved in ops if kind == "F" and i == 0)
            peaks.append(round(peak / one, 3))
        rows.append({"schedule": key.removeprefix("measure_"), "p": p, "m": m, "span_ms": round(1e3 * t, 2),
                     "bubble_max": round(max(idle), 4), "bubble_mean": round(sum(idle) / p, 4),
                     "bubble_per_rank": [round(x, 4) for x in idle], "peak_activations_per_rank": peaks})
    return rows


def split_cost(width: int = 256, T: int = 128, b: int = 8, n: int = 5) -> dict:
    """ms of one stage's F, whole backward, B and W (``DeferredWeights``) in this process, one thread: 2 blocks of a
    GPT `width` wide, b sequences of T tokens; the mean of n after one warm-up (B + W against the whole backward)."""
    import contextlib
    import time

    import torch

    from minite.models.gpt import GPT, GPTConfig
    from minite.parallel.pipeline_stage import Stage
    from minite.parallel.schedules import DeferredWeights
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=4, n_head=4, n_kv_head=2, n_embd=width,
                          mlp_hidden=4 * width, backend="torch"))
    stage, x = Stage(dense, range(1, 3), False, False), torch.randn(b, T, width)
    split = DeferredWeights(stage)
    ms = {"F": [], "backward": [], "B": [], "W": []}
    for k in range(n + 1):
        for whole in (True, False):
            inp = x.clone().requires_grad_()
            t0 = time.perf_counter()
            with contextlib.nullcontext() if whole else split.forward(0):
                out = stage(inp)
            t1 = time.perf_counter()
            if whole:
                out.backward(torch.ones_like(out))
            else:
                split.backward_input(0, [out], [torch.ones_like(out)], inp)
            t2 = time.perf_counter()
            if not whole:
                split.backward_weight(0)
            t3 = time.perf_counter()
            if k:
                ms["F"].append(t1 - t0)
                ms["backward" if whole else "B"].append(t2 - t1)
                if not whole:
                    ms["W"].append(t3 - t2)
    return {"shape": f"2 blocks, n_embd={width}, mlp 4x, b={b}, T={T}, fp32, 1 thread",
            **{k: round(1e3 * sum(v) / len(v), 2) for k, v in ms.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--measure", type=int, nargs="*", default=[], help="measure with these rank counts (gloo)")
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--mb", type=int, default=2, help="sequences per micro-batch (measured)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sim = [r for p in sorted({args.p, *args.measure}) for r in schedule_table(p, args.m, 2)]
    print(f"simulated, unit costs, m={args.m}:")
    print(f"{'p':>2} {'schedule':>12} {'bubble':>8} {'formula':>8} {'peak':>6} {'formula':>8}")
    for r in sim:
        print(f"{r['p']:>2} {r['schedule']:>12} {r['bubble']:8.4f} {r['bubble_formula']:8.4f} "
              f"{r['peak_activations']:6.2f} {r['peak_formula']:8.2f}")
    cost = split_cost()
    print("one stage, ms:", cost)
    meas = []
    for p in args.measure:
        meas += measured(p, args.m, args)
        for r in meas[-4:]:
            print(f"measured p={p} m={args.m} {r['schedule']:>12}: span {r['span_ms']:8.2f} ms, bubble max "
                  f"{r['bubble_max']:.3f} mean {r['bubble_mean']:.3f}, peak {r['peak_activations_per_rank']}")
    cpu = common.device_name("cpu").rsplit(" (", 1)[0]
    payload = {"device": f"CPU: {cpu}, {len(os.sched_getaffinity(0))} cores visible; measured rows: gloo, one "
                         "thread a rank",
               "what": "bubble fraction and peak activations (stages' worth of one micro-batch) per schedule: "
                       "simulated at unit F/B/W costs against each formula; measured by PipelineGPT on CPU ranks",
               "note": "measured: the least disturbed of the timed steps; with more ranks than free cores the idle "
                       "time includes waiting for a core, and on a tiny model messages and Python overhead weigh "
                       "as much as the GEMMs, so the measured bubble is no check of the unit-cost formula; the "
                       "measured peaks are (held micro-batches x the saved bytes of one)",
               "command": "python benchmarks/bench_pp_schedules.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "columns": "bubble_max / bubble_mean: 1 - busy / span of the most idle rank / averaged over ranks; "
                          "peak_activations_per_rank: the most held at once, in micro-batches through the rank's "
                          "stage(s)",
               "simulated": sim, "split_cost_ms": cost, "measured": meas,
               "measured_model": f"GPT n_layer=4p, n_embd={args.width}, 4 heads, vocab 64, T=16 (pp_timeline's), "
                                 f"{args.mb} sequences a micro-batch, fp32, one thread a rank"}
    path = common.write_json(common.results_path("pp_schedules", "cpu", args.out), payload)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
