"""Benchmark minite's fused SwiGLU (silu(gate) * up) against torch eager, torch.compile and Liger-Kernel. GPU only.

    python benchmarks/bench_swiglu.py [--rows 8192] [--hidden 4096 11008 14336] [--dtype bf16]

The op is elementwise, so it is memory bound: the figure of merit is GB/s = bytes that *must* move / time, and
its share of the HBM peak (H100 SXM 3.35 TB/s). Bytes counted for the ideal (fused) op, the same for every
implementation, so a slower implementation shows a lower GB/s:
    forward        read gate, up; write h                         3 * N * H * elt
    forward+bwd    + read dh, gate, up; write dgate, dup          8 * N * H * elt
The table is saved as JSON to benchmarks/results/swiglu_<device-name-slug>.json with the device name.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# HBM bandwidth (bytes/s) by device-name substring.
PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L40S", 0.864e12)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def peak_bw(name: str) -> tuple[float, str]:
    for key, bw in PEAK_BW:
        if key in name:
            return bw, key
    return 3.35e12, "H100 (default; device not in the table)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def implementations() -> dict:
    from minite.kernels.swiglu import swiglu

    def eager(g, u):
        return F.silu(g) * u

    impls = {"minite triton": lambda g, u: swiglu(g, u, backend="triton"), "torch eager": eager,
             "torch.compile": torch.compile(eager, dynamic=False)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        impls["liger-kernel"] = LigerSiLUMulFunction.apply
    except Exception as e:  # not installed, or an incompatible version
        print(f"(Liger-Kernel not importable: {type(e).__name__}; column skipped)")
    return impls


def run(rows: int, hiddens: list[int], dtype: torch.dtype, do_bench) -> list[dict]:
    from minite.kernels.swiglu import swiglu_ref

    out, elt = [], torch.finfo(dtype).bits // 8
    for H in hiddens:
        g = torch.randn(rows, H, device="cuda", dtype=dtype, requires_grad=True)
        u = torch.randn(rows, H, device="cuda", dtype=dtype, requires_grad=True)
        dh = torch.randn(rows, H, device="cuda", dtype=dtype)
        ref = swiglu_ref(g, u)
        for name, fn in implementations().items():
            torch.testing.assert_close(fn(g, u).float(), ref.float(), atol=2e-2, rtol=2e-2)  # never time a wrong op
            for mode, passes in (("fwd", 3), ("fwd+bwd", 8)):
                step = (lambda f=fn: f(g, u)) if mode == "fwd" else (lambda f=fn: f(g, u).backward(dh))
                ms = do_bench(step, grad_to_none=[g, u])
                out.append({"impl": name, "N": rows, "H": H, "dtype": str(dtype), "mode": mode, "ms": ms,
                            "GBs": passes * rows * H * elt / (ms * 1e-3) / 1e9})
    return out


def print_table(results: list[dict], bw: float) -> None:
    print(f"{'N':>6} {'H':>6} {'mode':>8} {'impl':>14} {'ms':>8} {'GB/s':>7} {'% peak':>7} {'vs eager':>9}")
    eager = {(r["H"], r["mode"]): r["ms"] for r in results if r["impl"] == "torch eager"}
    for r in results:
        r["pct_peak"] = 100 * r["GBs"] * 1e9 / bw
        r["speedup_vs_eager"] = eager[(r["H"], r["mode"])] / r["ms"]
        print(f"{r['N']:>6} {r['H']:>6} {r['mode']:>8} {r['impl']:>14} {r['ms']:>8.3f} {r['GBs']:>7.0f} "
              f"{r['pct_peak']:>6.1f}% {r['speedup_vs_eager']:>8.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192, help="N = B * T tokens")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 11008, 14336], help="MLP hidden widths H")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_swiglu: no CUDA device here; this benchmark runs on a GPU only (nothing to do).")
        return 0
    from triton.testing import do_bench  # GPU only: do_bench needs an active driver

    name = torch.cuda.get_device_name()
    bw, key = peak_bw(name)
    results = run(args.rows, args.hidden, DTYPES[args.dtype], do_bench)
    print(f"device: {name} (peak HBM bandwidth from {key}: {bw / 1e12:.2f} TB/s)")
    print_table(results, bw)
    path = Path(__file__).resolve().parent / "results" / f"swiglu_{slug(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": name, "torch": torch.__version__, "peak_bw": bw, "peak_key": key,
                                "results": results}, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
