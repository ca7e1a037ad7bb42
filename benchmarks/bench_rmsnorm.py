"""Benchmark minite's fused RMSNorm / LayerNorm against torch eager, torch.compile and Liger-Kernel (GPU only).

    python benchmarks/bench_rmsnorm.py [--rows 16384] [--cols 1024 2048 4096 8192 16384] [--dtype bfloat16]

For each hidden size C it times the forward and the forward+backward of a norm over (N, C) rows (N = B*T tokens)
and prints milliseconds, the achieved bandwidth and its share of the HBM peak (3.35 TB/s on an H100 SXM).
Norms are memory bound, so bandwidth is the figure of merit. Bytes counted are the unavoidable ones:
    forward            read x, write y                2 * N * C * element size   (+ w, rstd: negligible)
    forward+backward   + read x and dy, write dx      5 * N * C * element size
Implementations: "minite" (the Triton kernels), "eager" (minite's reference: the upcast/pow/mean/rsqrt/mul
chain), "F" (torch.nn.functional.rms_norm / layer_norm), "torch.compile" (of the reference), "liger"
(Liger-Kernel's module, when it is importable). JSON goes to benchmarks/results/rmsnorm_<device-name-slug>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.039e12)]  # bytes/s by device-name substring
DEFAULT_PEAK = 3.35e12  # unknown device: report against the H100 number, and say so in the JSON


def peak_bandwidth(device_name: str) -> tuple[float, str]:
    for key, bw in PEAK_BW:
        if key in device_name:
            return bw, key
    return DEFAULT_PEAK, "H100 (default; device not in the table)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def implementations(op: str, C: int, dtype, device, compile_ok: bool) -> dict:
    """name -> fn(x, w, b) for one op; each returns y (N, C)."""
    from minite.kernels.rmsnorm import layernorm, layernorm_ref, rmsnorm, rmsnorm_ref

    if op == "rmsnorm":
        impls = {"minite": lambda x, w, b: rmsnorm(x, w, eps=1e-6, backend="triton"),
                 "eager": lambda x, w, b: rmsnorm_ref(x, w, 1e-6),
                 "F": lambda x, w, b: F.rms_norm(x, (C,), w, 1e-6)}
    else:
        impls = {"minite": lambda x, w, b: layernorm(x, w, b, eps=1e-5, backend="triton"),
                 "eager": lambda x, w, b: layernorm_ref(x, w, b, 1e-5),
                 "F": lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5)}
    if compile_ok:
        impls["torch.compile"] = torch.compile(impls["eager"], dynamic=False)
    try:  # optional: pip install liger-kernel
        if op == "rmsnorm":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm
            mod = LigerRMSNorm(C, eps=1e-6).to(device=device, dtype=dtype)
        else:
            from liger_kernel.transformers.layer_norm import LigerLayerNorm
            mod = LigerLayerNorm(C, eps=1e-5).to(device=device, dtype=dtype)
        impls["liger"] = lambda x, w, b, mod=mod: mod(x)  # its own weight/bias parameters (timing only)
    except Exception as e:  # ImportError, or an API change
        print(f"  (liger skipped for {op}: {type(e).__name__}: {e})")
    return impls


def run(op: str, rows: int, cols: list[int], dtype, device: str, do_bench, compile_ok: bool) -> list[dict]:
    from minite.kernels.rmsnorm import layernorm_ref, rmsnorm_ref

    results = []
    for C in cols:
        x = torch.randn(rows, C, device=device, dtype=dtype)  # (N, C)
        w = (1 + 0.1 * torch.randn(C, device=device)).to(dtype)
        b = (0.1 * torch.randn(C, device=device)).to(dtype)
        impls = implementations(op, C, dtype, device, compile_ok)
        ref = rmsnorm_ref(x, w, 1e-6) if op == "rmsnorm" else layernorm_ref(x, w, b, 1e-5)
        torch.testing.assert_close(impls["minite"](x, w, b), ref)  # never time a wrong kernel
        elem = x.element_size()
        dy = torch.randn_like(x)
        xg, wg, bg = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
        for name, fn in impls.items():
            ms_f = do_bench(lambda: fn(x, w, b))
            ms_fb = do_bench(lambda: fn(xg, wg, bg).backward(dy), grad_to_none=[xg, wg, bg])
            for mode, ms, nbytes in (("fwd", ms_f, 2 * rows * C * elem), ("fwd+bwd", ms_fb, 5 * rows * C * elem)):
                results.append({"op": op, "impl": name, "mode": mode, "N": rows, "C": C, "dtype": str(dtype)[6:],
                                "ms": ms, "bytes": nbytes, "GBps": nbytes / (ms * 1e-3) / 1e9})
    return results


def print_table(results: list[dict], peak: float) -> None:
    print(f"{'op':>9} {'C':>6} {'mode':>8} {'impl':>14} {'ms':>9} {'GB/s':>8} {'% peak':>7} {'vs eager':>9}")
    base = {(r["op"], r["C"], r["mode"]): r["ms"] for r in results if r["impl"] == "eager"}
    for r in results:
        r["pct_peak"] = 100 * r["GBps"] * 1e9 / peak
        r["speedup_vs_eager"] = base[(r["op"], r["C"], r["mode"])] / r["ms"]
        print(f"{r['op']:>9} {r['C']:>6} {r['mode']:>8} {r['impl']:>14} {r['ms']:>9.4f} {r['GBps']:>8.0f} "
              f"{r['pct_peak']:>6.1f}% {r['speedup_vs_eager']:>8.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16384, help="N = B*T tokens (default 8 x 2048)")
    p.add_argument("--cols", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--ops", nargs="+", default=["rmsnorm", "layernorm"], choices=["rmsnorm", "layernorm"])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/rmsnorm_<device>.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_rmsnorm: no CUDA device found; this benchmark needs a GPU (nothing to do on CPU).")
        return 0
    from minite._triton import triton  # GPU only: triton.testing.do_bench needs an active driver

    name = torch.cuda.get_device_name()
    peak, peak_from = peak_bandwidth(name)
    dtype = getattr(torch, args.dtype)
    print(f"norm benchmark on {name}: N={args.rows}, dtype={args.dtype}, peak {peak / 1e12:.2f} TB/s ({peak_from})")
    results = []
    for op in args.ops:
        results += run(op, args.rows, args.cols, dtype, "cuda", triton.testing.do_bench, not args.no_compile)
    print_table(results, peak)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"rmsnorm_{slug(name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "peak_bytes_per_s": peak, "peak_from": peak_from, "torch": torch.__version__,
            "triton": triton.__version__}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
