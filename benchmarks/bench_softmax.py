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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402


def run(rows: int, cols: list[int], dtype: torch.dtype, device: str, do_bench, compile_ok: bool = True) -> list[dict]:
    from minite.kernels.softmax import softmax  # imported here: the CPU check in main() comes first

    impls = {
        "minite": lambda t: softmax(t, dim=-1, backend="triton"),
        "torch": lambda t: torch.softmax(t, dim=-1),
    }
    if compile_ok:
        impls["torch.compile"] = common.strict_compile(lambda t: torch.softmax(t, dim=-1))
    results = []
    for C in cols:
        x = torch.randn(rows, C, device=device, dtype=dtype)
        ref = torch.softmax(x.float(), dim=-1).to(dtype)
        torch.testing.assert_close(impls["minite"](x), ref)  # never time a wrong kernel
        elem = x.element_size()
        xg = x.detach().clone().requires_grad_(True)
        dy = torch.randn_like(x)
        for name, fn in impls.items():
            times = common.fwd_bwd_ms(lambda: fn(x), lambda: fn(xg).backward(dy), [xg], do_bench)
            for mode, nbytes in (("fwd", 2 * rows * C * elem), ("fwd+bwd", 5 * rows * C * elem)):
                ms = times[mode]
                results.append({"impl": name, "mode": mode, "N": rows, "C": C, "dtype": str(dtype)[6:],
                                "ms": ms, "bytes": nbytes, "GBps": nbytes / (ms * 1e-3) / 1e9})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_timer_args(p)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/softmax_<device>.json)")
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_softmax"):
        return 0
    name = common.device_name()
    peak, peak_from = common.peak_bandwidth(name)
    dtype = getattr(torch, args.dtype)
    print(f"softmax benchmark on {name}: N={args.rows}, dtype={args.dtype}, peak {peak / 1e12:.2f} TB/s ({peak_from})")
    results = run(args.rows, args.cols, dtype, "cuda", common.do_bench, compile_ok=not args.no_compile)
    common.print_bandwidth_table(results, [("C", 6)], peak, base_impl="torch", base_label="torch")
    common.save_results("softmax", results, device=name, out=args.out, peak_bw=peak, peak_from=peak_from)
    common.save_plot("softmax", name, common.bandwidth_plot(results, "C", peak), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
