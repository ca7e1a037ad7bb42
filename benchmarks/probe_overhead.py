"""Where an eager minite call spends its CPU time (GPU only): wall microseconds per call and a cProfile top list.

    python benchmarks/probe_overhead.py

A small op is launch-bound when the CPU side of a call (Python checks, autograd, Triton's launcher) takes longer
than the kernel. This prints the per-call wall time of minite vs torch for a few ops and the functions that
dominate minite's.
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, n=300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_overhead: GPU only")
        return 0
    import minite

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)  # tiny: the CPU side dominates
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    cases = {"rmsnorm fwd": (lambda: minite.ops.rmsnorm(x, w), lambda: F.rms_norm(x, (1024,), w, 1e-6)),
             "rmsnorm fwd+bwd": (lambda: minite.ops.rmsnorm(xg, wg).sum().backward(),
                                 lambda: F.rms_norm(xg, (1024,), wg, 1e-6).sum().backward()),
             "softmax fwd": (lambda: minite.ops.softmax(x), lambda: torch.softmax(x, -1))}
    for name, (mine, ref) in cases.items():
        print(f"{name:>16}: minite {per_call_us(mine):7.1f} us/call, torch {per_call_us(ref):7.1f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        minite.ops.rmsnorm(xg, wg).sum().backward()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
