"""Benchmark minite's fused row softmax against torch eager and torch.compile (GPU only).

    python benchmarks/bench_softmax.py [--rows 4096] [--cols 1024 2048 ... 32768] [--dtype bfloat16]

For each row length C it times the forward and the forward+backward of an (N, C) softmax along the last dim
and prints milliseconds, the achieved bandwidth and its share of the HBM peak. Softmax is memory bound, so
bandwidth is the figure of merit. Bytes counted are the unavoidable ones (the fused minimum):
    forward            read x, write y            2 * N * C * element size
    forward+backward   + read y and dy, write dx  5 * N * C * element size
(an implementation that moves more bytes than that still gets credited with only these). The table is saved as
JSON to benchmarks/results/softmax_<device-name-slug>.json with the device name.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

# HBM bandwidth peaks (bytes/s) by device-name substring; the first match wins. H100 SXM: 3.35 TB/s.
PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.039e12)]
DEFAULT_PEAK = 3.35e12  # unknown device: report against the H100 number, and say so in the JSON


def peak_bandwidth(device_name: str) -> tuple[float, str]:
    for key, bw in PEAK_BW:
        if key in device_name:
            return bw, key
    return DEFAULT_PEAK, "H100 (default; device not in the table)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def bench_one(fn, x: torch.Tensor, backward: bool, do_bench) -> float:
    """Median milliseconds of fn(x) (and its backward with a fixed upstream gradient when `backward`)."""
    if not backward:
        return do_bench(lambda: fn(x))
    xg = x.detach().clone().requires_grad_(True)
    dy = torch.randn_like(x)

    def step():
        fn(xg).backward(dy)

    return do_bench(step, grad_to_none=[xg])


def run(rows: int, cols: list[int], dtype: torch.dtype, device: str, do_bench, compile_ok: bool = True) -> list[dict]:
    from minite.kernels.softmax import softmax  # imported here: the CPU check in main() comes first

    impls = {
        "minite": lambda t: softmax(t, dim=-1, backend="triton"),
        "torch": lambda t: torch.softmax(t, dim=-1),
    }
    if compile_ok:
        impls["torch.compile"] = torch.compile(lambda t: torch.softmax(t, dim=-1), dynamic=False)
    results = []
    for C in cols:
        x = torch.randn(rows, C, device=device, dtype=dtype)
        ref = torch.softmax(x.float(), dim=-1).to(dtype)
        torch.testing.assert_close(impls["minite"](x), ref)  # never time a wrong kernel
        elem = x.element_size()
        for name, fn in impls.items():
            for mode, backward, nbytes in (("fwd", False, 2 * rows * C * elem), ("fwd+bwd", True, 5 * rows * C * elem)):
                ms = bench_one(fn, x, backward, do_bench)
                results.append({"impl": name, "mode": mode, "N": rows, "C": C, "dtype": str(dtype)[6:],
                                "ms": ms, "bytes": nbytes, "GBps": nbytes / (ms * 1e-3) / 1e9})
    return results


def print_table(results: list[dict], peak: float) -> None:
    print(f"{'C':>6} {'mode':>8} {'impl':>14} {'ms':>9} {'GB/s':>8} {'% peak':>7} {'vs torch':>9}")
    base = {(r["C"], r["mode"]): r["ms"] for r in results if r["impl"] == "torch"}
    for r in results:
        r["pct_peak"] = 100 * r["GBps"] * 1e9 / peak
        r["speedup_vs_torch"] = base[(r["C"], r["mode"])] / r["ms"]
        print(f"{r['C']:>6} {r['mode']:>8} {r['impl']:>14} {r['ms']:>9.4f} {r['GBps']:>8.0f} {r['pct_peak']:>6.1f}% "
              f"{r['speedup_vs_torch']:>8.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/softmax_<device>.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_softmax: no CUDA device found; this benchmark needs a GPU (nothing to do on CPU).")
        return 0
    from minite._triton import triton  # GPU only: triton.testing.do_bench needs an active driver

    name = torch.cuda.get_device_name()
    peak, peak_from = peak_bandwidth(name)
    dtype = getattr(torch, args.dtype)
    print(f"softmax benchmark on {name}: N={args.rows}, dtype={args.dtype}, peak {peak / 1e12:.2f} TB/s ({peak_from})")
    results = run(args.rows, args.cols, dtype, "cuda", triton.testing.do_bench, compile_ok=not args.no_compile)
    print_table(results, peak)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"softmax_{slug(name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "peak_bytes_per_s": peak, "peak_from": peak_from, "torch": torch.__version__,
            "triton": triton.__version__}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
