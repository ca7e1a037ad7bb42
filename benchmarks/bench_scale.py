"""Chapter 14: what each technique buys, measured per rank on the CPU (gloo): memory, bytes sent, step time, curve.

    python benchmarks/bench_scale.py [--steps 20] [--only NAME,...] [--plot-only]   (make scale ARGS="--steps 30")

One small GPT (the `cpu` preset: n_layer=4, n_embd=128, 4 heads / 2 kv heads, block 128, global batch 16; fp32,
the PyTorch reference ops: the Triton interpreter is for correctness, not speed) is trained for --steps steps by
``minite.train.train`` under every configuration below, each from the same seed on the same batches
(``benchmarks/scale_worker.py``; torchrun for world > 1, one thread per rank). Per rank it records the tensor
memory at the peak (resident: parameters, optimizer state, flat buffers; plus the transient peak of steps 3-4:
activations, gradients, recompute buffers, temporaries), the bytes sent per step (CommLog's ring model) and the
median step time of steps 6..N, measured with the counters off. Rank 0's loss curve is kept: every configuration
trains the same global batch, so the curves lie on one another (max |loss - one process| is in the table; the MoE
configurations, chapter 16, are compared with the MoE model in one process).

Each technique is compared with its baseline: recompute none vs selective vs full (one process); ZeRO-1 vs plain
DP (dp2); SP vs none (tp2); 1F1B vs AFAB (pp2, 4 micro-batches); and the composed layouts (world 4). A layout that
``check_layout`` rejects is skipped with its message; one that fails at run time is recorded as failed.
On 2 cores, world-4 runs share the cores (2 ranks per core): their step times measure oversubscription, not
parallel speed. Saved to benchmarks/results/scale_<device>.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
import common  # noqa: E402

from minite.config import make_config  # noqa: E402
from minite.parallel.dims import ParallelError, check_layout  # noqa: E402
from minite.parallel.launch import torchrun  # noqa: E402
from minite.train import parse_cli  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "scale_worker.py")
BASE = ["--preset", "cpu", "--data", "pydoc-topics", "--model.backend=torch", "--train.device=cpu",
        "--train.precision=fp32", "--train.compile=off", "--train.threads=1", "--train.log_interval=1",
        "--train.eval_iters=2", "--train.sample_tokens=0", "--train.progress=False", "--train.warmup_iters=5",
        "--parallel.timeout_s=300"]
# name: (world, flags, baseline name, what it shows)
CONFIGS = {
    "single": (1, [], None, "one process, everything kept"),
    "recompute_selective": (1, ["--train.recompute=selective"], "single", "selective recompute"),
    "recompute_full": (1, ["--train.recompute=full"], "single", "full recompute"),
    "dp2": (2, ["--parallel.dp=2"], None, "plain data parallel (DDP-style all-reduce)"),
    "dp2_zero1": (2, ["--parallel.dp=2", "--parallel.zero=1"], "dp2", "ZeRO-1: AdamW state sharded over dp"),
    "tp2": (2, ["--parallel.tp=2"], None, "tensor parallel"),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=True"], "tp2", "sequence parallel on top of tp"),
    "pp2_afab": (2, ["--parallel.pp=2", "--parallel.microbatches=4", "--parallel.pp_schedule=afab"], None,
                 "pipeline, all-forward-all-backward (GPipe)"),
    "pp2_1f1b": (2, ["--parallel.pp=2", "--parallel.microbatches=4", "--parallel.pp_schedule=1f1b"], "pp2_afab",
                 "pipeline, one-forward-one-backward"),
    "tp2_pp2": (4, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.microbatches=4"], None, "composed"),
    "dp2_tp2_zero1": (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=1"], None, "composed"),
    "dp2_cp2": (4, ["--parallel.dp=2", "--parallel.cp=2"], None, "composed"),
    "tp2_cp2_sp": (4, ["--parallel.tp=2", "--parallel.cp=2", "--parallel.sp=True"], None, "composed"),
    "pp2_cp2": (4, ["--parallel.pp=2", "--parallel.cp=2", "--parallel.microbatches=4"], None, "composed"),
    # chapter 16: 8 experts (top 2) per block: 8x the MLP weights, 2x its FLOPs; replicated vs cut over ep
    "moe8": (1, ["--model.moe.num_experts=8"], None, "mixture of experts, one process"),
    "moe8_dp4": (4, ["--model.moe.num_experts=8", "--parallel.dp=4"], None, "MoE, every expert on every rank"),
    "moe8_dp4_ep4": (4, ["--model.moe.num_experts=8", "--parallel.dp=4", "--parallel.ep=4"], "moe8_dp4",
                     "expert parallel: 2 experts per rank, tokens by all-to-all"),
    "moe8_dp4_ep4_zero1": (4, ["--model.moe.num_experts=8", "--parallel.dp=4", "--parallel.ep=4",
                               "--parallel.zero=1"], "moe8_dp4_ep4", "ep + ZeRO-1: the dense AdamW state sharded"),
    "moe8_dp2_ep2_cp2": (4, ["--model.moe.num_experts=8", "--parallel.dp=2", "--parallel.ep=2", "--parallel.cp=2"],
                         None, "experts under context parallelism"),
}


def run_config(name: str, world: int, flags: list[str], steps: int, tmp: Path, timeout: float) -> dict:
    res_dir, out_dir = tmp / f"res_{name}", tmp / f"out_{name}"
    args = [*BASE, f"--data.data_dir={tmp / 'data'}", f"--out_dir={out_dir}", f"--train.max_iters={steps}",
            f"--train.eval_interval={steps}", *flags]
    preset, overrides, _ = parse_cli(args)
    cfg = make_config(preset, overrides)
    try:  # the layout check minite.train runs first, here before any process starts
        check_layout(cfg.parallel, cfg.model, world=world, seq_len=cfg.data.block_size or cfg.model.block_size,
                     batch_size=cfg.train.batch_size, lora_r=cfg.lora.r)
    except ParallelError as e:
        print(f"  skipped {name}: {e}", flush=True)
        return {"status": "rejected", "message": str(e)}
    t0 = time.perf_counter()
    cmd = [WORKER, "--result", str(res_dir), "--", *args]
    env = {"TRITON_INTERPRET": "0"}
    try:
        if world == 1:
            e = {**os.environ, "OMP_NUM_THREADS": "1", **env}
            e["PYTHONPATH"] = os.pathsep.join([str(Path(WORKER).parents[1]), e.get("PYTHONPATH", "")])
            p = subprocess.run([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout, env=e)
        else:
            p = torchrun(world, cmd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"  {name}: timed out after {timeout:.0f} s", flush=True)
        return {"status": "failed", "message": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    ranks = [json.loads(f.read_text()) for f in sorted(res_dir.glob("rank*.json"))]
    if p.returncode != 0 or len(ranks) != world:
        lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
        errs = [ln for ln in lines if re.search(r"\w+Error: ", ln) and "ChildFailedError" not in ln]
        msg = errs[0] if errs else lines[-1] if lines else ""
        print(f"  {name}: FAILED (exit {p.returncode}): {msg.strip()[:300]}", flush=True)
        return {"status": "failed", "message": msg.strip()[:1000], "exit": p.returncode}
    return {"status": "ok", "wall_s": wall, "ranks": ranks,
            "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
            "resident_bytes_per_rank": [r["resident_bytes"] for r in ranks],
            "transient_peak_bytes_per_rank": [r["transient_peak_bytes"] for r in ranks],
            "sent_per_step_per_rank": [r["sent_per_step"] for r in ranks],
            "sent_by_op_per_step_rank0": ranks[0]["sent_by_op_per_step"],
            # every rank waits for the slowest at each step: the step time is the slowest rank's median
            "step_ms": max(1e3 * statistics.median(r["step_s"]) for r in ranks),
            "losses": {int(k): v for k, v in ranks[0]["losses"].items()}}


def table(results: dict) -> None:
    refs = {m: results.get(m, {}).get("losses", {}) for m in ("single", "moe8")}  # a MoE run vs the MoE one process
    print(f"\n{'config':20s} {'world':>5s} {'peak MiB/rank':>13s} {'resident':>8s} {'transient':>9s} "
          f"{'sent MiB/step':>13s} {'step ms':>8s} {'final loss':>10s} {'max|dloss|':>10s}  vs baseline")
    for name, r in results.items():
        if r["status"] != "ok":
            print(f"{name:20s} {r['world']:5d}  {r['status']}: {r['message'][:90]}")
            continue
        mib = 2.0**20
        ref = refs["moe8" if name.startswith("moe") else "single"]
        dl = max((abs(v - ref[s]) for s, v in r["losses"].items() if s in ref), default=float("nan"))
        b = results.get(r["baseline"] or "", {})
        vs = ""
        if b.get("status") == "ok":
            vs = (f"{r['baseline']}: memory x{max(r['peak_bytes_per_rank']) / max(b['peak_bytes_per_rank']):.2f}, "
                  f"time x{r['step_ms'] / b['step_ms']:.2f}, sent x"
                  + (f"{max(r['sent_per_step_per_rank']) / max(b['sent_per_step_per_rank']):.2f}"
                     if max(b["sent_per_step_per_rank"]) else "-"))
        print(f"{name:20s} {r['world']:5d} {max(r['peak_bytes_per_rank']) / mib:13.1f} "
              f"{max(r['resident_bytes_per_rank']) / mib:8.1f} {max(r['transient_peak_bytes_per_rank']) / mib:9.1f} "
              f"{max(r['sent_per_step_per_rank']) / mib:13.2f} {r['step_ms']:8.0f} "
              f"{r['losses'][max(r['losses'])]:10.4f} {dl:10.2e}  {vs}")


def plot(results: dict, device: str) -> None:
    ok = {n: r for n, r in results.items() if r["status"] == "ok"}

    def draw(fig):
        ax = fig.add_subplot(1, 3, 1)
        for n, r in ok.items():
            pts = sorted((int(k), v) for k, v in r["losses"].items())  # JSON keys are strings
            ax.plot(*zip(*pts), label=n, lw=1, alpha=0.8)
        ax.set(xlabel="step", ylabel="train loss (global batch)", title="loss curves (they overlap)")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        names = list(ok)
        ax = fig.add_subplot(1, 3, 2)
        res = [max(ok[n]["resident_bytes_per_rank"]) / 2**20 for n in names]
        tr = [max(ok[n]["transient_peak_bytes_per_rank"]) / 2**20 for n in names]
        ax.barh(names, res, label="resident (params, AdamW state, buffers)")
        ax.barh(names, tr, left=res, label="transient (activations, grads, temporaries)")
        ax.set(xlabel="MiB per rank (max over ranks)", title="peak tensor memory per rank")
        ax.invert_yaxis()
        ax.legend(fontsize=6, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
        ax = fig.add_subplot(1, 3, 3)
        ax.barh(names, [ok[n]["step_ms"] for n in names], color=["C0" if ok[n]["world"] < 4 else "C3" for n in names])
        ax.set(xlabel="median step ms (red: 4 ranks on 2 cores)", title="step time (wall clock)")
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    common.save_plot("scale", device, draw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated config names (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON")
    a = ap.parse_args()
    common.TIMER = "wall clock, median"  # named in the plot's title
    if a.plot_only:
        saved = json.loads(sorted(common.RESULTS.glob("scale_*.json"))[0].read_text())
        return plot(saved["results"], saved["device"])
    names = [n for n in CONFIGS if not a.only or n in a.only.split(",")]
    device = f"{common.device_name('cpu').split(' (')[0]} ({os.cpu_count()} cores, 1 thread per rank)"
    tmp = Path(tempfile.mkdtemp(prefix="minite_scale_"))
    results, t0, load0 = {}, time.perf_counter(), os.getloadavg()[0]
    try:
        for n in names:
            world, flags, base, what = CONFIGS[n]
            print(f"[{time.perf_counter() - t0:5.0f} s] {n}: world {world} {' '.join(flags)}", flush=True)
            results[n] = {"world": world, "flags": flags, "baseline": base, "what": what,
                          **run_config(n, world, flags, a.steps, tmp, a.timeout)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table(results)
    for r in results.values():
        r.pop("ranks", None)
    path = common.results_path("scale", device)
    common.write_json(path, {
        "device": device, "date": time.strftime("%Y-%m-%d"), "torch": __import__("torch").__version__,
        "model": "cpu preset: n_layer=4 n_head=4 n_kv_head=2 n_embd=128 mlp_hidden=256 block=128, global batch 16, "
                 "fp32, backend torch, data pydoc-topics (char)", "steps": a.steps, "base_flags": BASE,
        "memory": "per rank: resident = tensor storages alive at the start of the window (gc walk); transient = "
                  "minite.bytecount.PeakBytes peak of storages created during steps 3-4; peak = resident + transient",
        "sent": "bytes sent per step per rank, minite.parallel.comm.CommLog ring model (all_reduce 2(n-1)/n x bytes)",
        "step_ms": "median wall time of steps 6..N without counters; the slowest rank",
        "loadavg_1min_start": load0, "loadavg_1min_end": os.getloadavg()[0],
        "bench_wall_s": time.perf_counter() - t0, "results": results})
    print(f"saved {path}  ({time.perf_counter() - t0:.0f} s; 1-minute load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end: other processes on the cores inflate the times)")
    plot(results, device)


if __name__ == "__main__":
    main()
