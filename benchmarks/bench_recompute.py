"""Activation recompute (minite/recompute.py): memory held for the backward, peak memory and step time per mode.

    python benchmarks/bench_recompute.py [--n_layer 4] [--n_embd 128] [--B 8] [--T 128] [--reps 5] [--device cpu]

For each mode (none | selective | full) on a GPT of the given shape (fp32, PyTorch reference ops): the bytes the
forward leaves alive for the backward and the peak bytes during forward + backward, counted op by op
(``minite.recompute.measure``: parameters and inputs not included), and the median wall time of forward + backward
over --reps runs (after one warm-up; the modes take turns). Saved to benchmarks/results/recompute_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

from minite.models.gpt import GPT, GPTConfig  # noqa: E402
from minite.recompute import MODES, apply_recompute, measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in dict(n_layer=4, n_embd=128, n_head=4, B=8, T=128, reps=5).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    cfg = GPTConfig(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, block_size=a.T, vocab_size=65,
                    backend="torch")
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (a.B, a.T), generator=g).to(a.device)
    models, times = {}, {m: [] for m in MODES}
    for mode in MODES:
        torch.manual_seed(0)
        models[mode] = GPT(cfg).to(a.device)
        apply_recompute(models[mode], mode)
    for rep in range(a.reps + 1):  # modes interleaved, so drift in a shared machine's speed hits them alike
        for mode, model in models.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(idx, idx)[1].backward()
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            if rep:  # the first round warms up
                times[mode].append(time.perf_counter() - t0)
    rows = []
    for mode, model in models.items():
        model.zero_grad(set_to_none=True)
        mem = measure(model, idx, idx)
        rows.append({"mode": mode, "held_bytes": mem["held"], "peak_bytes": mem["peak"],
                     "fwd_bwd_ms": 1e3 * statistics.median(times[mode]), "reps": a.reps})
    base = rows[0]
    print(f"GPT n_layer={a.n_layer} n_embd={a.n_embd} B={a.B} T={a.T} fp32 on {common.device_name(a.device)}")
    print(f"{'mode':10s} {'held MiB':>9s} {'peak MiB':>9s} {'fwd+bwd ms':>11s} {'time x':>7s}")
    for r in rows:
        print(f"{r['mode']:10s} {r['held_bytes'] / 2**20:9.2f} {r['peak_bytes'] / 2**20:9.2f} "
              f"{r['fwd_bwd_ms']:11.1f} {r['fwd_bwd_ms'] / base['fwd_bwd_ms']:7.2f}")
    out = Path(__file__).resolve().parent / "results" / f"recompute_{common.slug(common.device_name(a.device))}.json"
    out.write_text(json.dumps({"device": common.device_name(a.device), "torch": torch.__version__,
                               "config": vars(a), "rows": rows,
                               "loadavg_1min": os.getloadavg()[0]}, indent=1))
    print(f"1-minute load average {os.getloadavg()[0]:.1f} (times on a busy machine are inflated); saved {out}")


if __name__ == "__main__":
    main()
