"""Benchmark minite's FP8 GEMM against torch.matmul in bf16 (and torch._scaled_mm in fp8 when present). GPU only.

    python benchmarks/bench_fp8_gemm.py [--sizes 4096 8192]

GEMMs are compute bound, so the figure of merit is TFLOP/s = 2*M*N*K / time, and its share of the dense tensor
core peak of the operand precision (H100 SXM: 989 TFLOP/s bf16, 1979 TFLOP/s fp8). Two tables:
    gemm         (M, K) @ (K, N) with M = N = K: fp8 operands already quantized (minite, _scaled_mm) vs bf16
    linear       minite.nn.Linear(K, N) on (M, K) bf16 input, forward and forward+backward, under fp8_autocast
                 (quantize x, W, dy on the fly + 3 FP8 GEMMs) vs the same layer in bf16 (cuBLAS) and
                 torch.compile of it
On the GPU the quantize kernel uses the hardware fp8 cast (sm_89+). The table is saved as JSON to
benchmarks/results/fp8_gemm_<device-name-slug>.json with the device name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

# Dense tensor-core peaks (FLOP/s) by device-name substring: (bf16, fp8). H100 SXM / H200: 989 / 1979 TFLOP/s.
PEAK = [("H200", 989e12, 1979e12), ("H100", 989e12, 1979e12), ("L40S", 362e12, 733e12)]


def peaks(device_name: str) -> tuple[float, float, str]:
    for key, bf16, fp8 in PEAK:
        if key in device_name:
            return bf16, fp8, key
    return 989e12, 1979e12, "H100 (default; device not in the table)"


def _scaled_mm(qa, qb, fast: bool, out_dtype=torch.bfloat16):
    """cuBLAS FP8 GEMM: qa (M, K) row-major, qb (K, N) column-major (what _scaled_mm requires)."""
    return torch._scaled_mm(qa.data, qb.data, scale_a=qa.scale_inv.reshape(()), scale_b=qb.scale_inv.reshape(()),
                            out_dtype=out_dtype, use_fast_accum=fast)


def rel_err(got: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(max |got - exact| / std(exact), mean |got - exact| / std(exact)): the error of the GEMM itself, against
    the fp64 product of the same fp8 operands (quantization error excluded)."""
    d = (got.double() - exact).abs()
    sd = exact.std().item()
    return d.max().item() / sd, d.mean().item() / sd


def run_error(M: int, Ks: list[int]) -> list[dict]:
    """Error against K for both accumulation modes, beside cuBLAS with and without fast accumulation."""
    from minite.formats import quantize
    from minite.kernels.fp8_gemm import fp8_gemm

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for K in Ks:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        qa, qw = quantize(a), quantize(w)
        exact = (qa.dequantize(torch.float64) @ qw.dequantize(torch.float64).t())  # (M, M) fp64
        impls = {"minite fp8 split": lambda: fp8_gemm(qa, qw.t(), out_dtype=torch.float32, accumulate="split"),
                 "minite fp8 fast": lambda: fp8_gemm(qa, qw.t(), out_dtype=torch.float32, accumulate="fast"),
                 "torch _scaled_mm": lambda: _scaled_mm(qa, qw.t(), False, torch.float32),
                 "torch _scaled_mm fast_accum": lambda: _scaled_mm(qa, qw.t(), True, torch.float32)}
        for name, fn in impls.items():
            try:
                mx, mean = rel_err(fn(), exact)
            except Exception as e:
                print(f"  error table: skipped {name} at K={K}: {type(e).__name__}: {e}")
                continue
            out.append({"table": "error", "impl": name, "M": M, "N": M, "K": K, "max_err_over_std": mx,
                        "mean_err_over_std": mean})
    return out


def run_gemm(sizes: list[int], do_bench) -> list[dict]:
    from minite.formats import quantize
    from minite.kernels.fp8_gemm import fp8_gemm

    out = []
    for S in sizes:
        a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)            # (N, K) like a Linear weight
        qa, qw = quantize(a), quantize(w)                                       # E4M3, current scaling
        exact = qa.dequantize(torch.float64) @ qw.dequantize(torch.float64).t()
        impls = {"minite fp8 fast": (lambda: fp8_gemm(qa, qw.t(), accumulate="fast", backend="triton"), "fp8"),
                 "minite fp8 split": (lambda: fp8_gemm(qa, qw.t(), accumulate="split", backend="triton"), "fp8"),
                 "torch bf16": (lambda: torch.matmul(a, w.t()), "bf16"),
                 "torch _scaled_mm fp8": (lambda: _scaled_mm(qa, qw.t(), False), "fp8"),
                 "torch _scaled_mm fast_accum": (lambda: _scaled_mm(qa, qw.t(), True), "fp8")}
        for name, (fn, prec) in impls.items():
            try:
                got = fn()
                # Never time a wrong kernel: the bf16 output's own rounding (2^-8 relative) bounds the error of a
                # correct GEMM at ~0.4% of the largest |value| ~ 2e-2 std; fast accumulation adds ~4e-2 at 8192.
                err = rel_err(got, exact)[0] if prec == "fp8" else None
                if err is not None and err > (0.1 if "fast" in name else 3e-2):
                    raise AssertionError(f"{name} at {S}: max error {err:.3g} std of the exact product")
                ms = do_bench(fn)
            except AssertionError:
                raise
            except Exception as e:  # e.g. _scaled_mm layout rules differ between torch versions
                print(f"  skipped {name} at {S}: {type(e).__name__}: {e}")
                continue
            out.append({"table": "gemm", "impl": name, "prec": prec, "M": S, "N": S, "K": S, "mode": "fwd",
                        "ms": ms, "TFLOPs": 2 * S ** 3 / (ms * 1e-3) / 1e12, "max_err_over_std": err})
    return out


def run_sweep(sizes: list[int], do_bench) -> list[dict]:
    """Time tile configurations of each accumulation mode (the constants in kernels/fp8_gemm.py come from here)."""
    from minite.formats import quantize
    from minite.kernels import fp8_gemm as G

    configs = [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 64, 8, 3),
               (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 256, 128, 8, 4), (64, 256, 128, 4, 4),
               (256, 128, 128, 8, 4), (256, 64, 128, 8, 3), (256, 128, 64, 8, 4)]
    configs = configs[int(os.environ.get("SWEEP_FROM", "0")):]
    saved, out = dict(G.GPU_TILES), []
    for S in sizes:
        a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
        qa, qw = quantize(a), quantize(w)
        for mode in ("fast", "split"):
            for cfg in configs:
                G.GPU_TILES[mode] = cfg
                try:
                    ms = do_bench(lambda: G.fp8_gemm(qa, qw.t(), accumulate=mode))
                except Exception as e:  # out of shared memory / registers
                    print(f"  sweep {mode} {cfg}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                tf = 2 * S ** 3 / (ms * 1e-3) / 1e12
                print(f"  sweep S={S} {mode:5} {cfg}: {ms:.3f} ms {tf:7.1f} TFLOP/s")
                out.append({"table": "sweep", "impl": f"minite fp8 {mode}", "tiles": list(cfg), "M": S, "N": S,
                            "K": S, "ms": ms, "TFLOPs": tf})
        G.GPU_TILES.update(saved)
    return out


def run_linear(sizes: list[int], do_bench) -> list[dict]:
    from minite.formats import DelayedScaling, fp8_autocast
    from minite.nn import Linear

    out = []
    for S in sizes:
        lin = Linear(S, S, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(S, S, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
        recipe = DelayedScaling()
        compiled = common.strict_compile(lambda t: lin(t))

        def fp8_fwd():
            with fp8_autocast(recipe=recipe):
                return lin(x)

        impls = {"minite fp8": fp8_fwd, "torch bf16": lambda: lin(x), "torch.compile bf16": lambda: compiled(x)}
        for name, fwd in impls.items():
            for mode, n_gemm in (("fwd", 1), ("fwd+bwd", 3)):
                step = fwd if mode == "fwd" else (lambda f=fwd: f().backward(dy))
                ms = do_bench(step, grad_to_none=[x, lin.weight])
                out.append({"table": "linear", "impl": name, "prec": "fp8" if "fp8" in name else "bf16",
                            "M": S, "N": S, "K": S, "mode": mode, "ms": ms,
                            "TFLOPs": n_gemm * 2 * S ** 3 / (ms * 1e-3) / 1e12})
    return out


def print_table(results: list[dict], peak_bf16: float, peak_fp8: float) -> None:
    err = [r for r in results if r["table"] == "error"]
    if err:
        print(f"{'K':>6} {'impl':>28} {'max|err|/std':>13} {'mean|err|/std':>14}")
        for r in err:
            print(f"{r['K']:>6} {r['impl']:>28} {r['max_err_over_std']:>13.3e} {r['mean_err_over_std']:>14.3e}")
    rows = [r for r in results if r["table"] in ("gemm", "linear")]
    print(f"{'table':>6} {'size':>6} {'mode':>8} {'impl':>28} {'ms':>9} {'TFLOP/s':>8} {'% peak':>7} {'vs bf16':>8}")
    base = {(r["table"], r["M"], r["mode"]): r["ms"] for r in rows if r["impl"] == "torch bf16"}
    for r in rows:
        r["pct_peak"] = 100 * r["TFLOPs"] * 1e12 / (peak_fp8 if r["prec"] == "fp8" else peak_bf16)
        r["speedup_vs_bf16"] = base[(r["table"], r["M"], r["mode"])] / r["ms"]
        print(f"{r['table']:>6} {r['M']:>6} {r['mode']:>8} {r['impl']:>28} {r['ms']:>9.3f} {r['TFLOPs']:>8.1f} "
              f"{r['pct_peak']:>6.1f}% {r['speedup_vs_bf16']:>7.2f}x")


def draw(results: list[dict]):
    def fill(fig):
        ax = fig.add_subplot(1, 2, 1)
        err = [r for r in results if r["table"] == "error"]
        for impl in dict.fromkeys(r["impl"] for r in err):
            pts = sorted((r["K"], r["max_err_over_std"]) for r in err if r["impl"] == impl)
            ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, base=2)
        ax.set_xlabel("K")
        ax.set_ylabel("max |err| / std (vs fp64 of the same fp8 operands)")
        ax.set_title("FP8 GEMM accumulation error", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax = fig.add_subplot(1, 2, 2)
        rows = [r for r in results if r["table"] in ("gemm", "linear")]
        labels = [f"{r['table']} {r['M']} {r['mode']}\n{r['impl']}" for r in rows]
        ax.barh(range(len(rows)), [r["TFLOPs"] for r in rows])
        ax.set_yticks(range(len(rows)), labels, fontsize=5)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOP/s")
        ax.grid(alpha=0.3, axis="x")
    return fill


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_timer_args(p)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192], help="M = N = K")
    p.add_argument("--error-ks", type=int, nargs="+", default=[256, 1024, 4096, 8192, 16384, 32768],
                   help="K values of the error table (M = N = --error-m)")
    p.add_argument("--error-m", type=int, default=1024)
    p.add_argument("--no-linear", action="store_true", help="only the GEMM tables")
    p.add_argument("--sweep", action="store_true", help="also time tile configurations of both modes")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_fp8_gemm"):
        return 0
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        print(f"bench_fp8_gemm: fp8 tensor cores need sm_89+ (Ada/Hopper); this GPU is sm_{major}{minor}.")
        return 0
    do_bench = common.do_bench
    name = common.device_name()
    peak_bf16, peak_fp8, peak_key = peaks(name)
    results = run_error(args.error_m, args.error_ks) + run_gemm(args.sizes, do_bench)
    if args.sweep:
        results += run_sweep(args.sizes, do_bench)
    if not args.no_linear:
        results += run_linear(args.sizes, do_bench)
    print(f"device: {name} (peaks from {peak_key}: bf16 {peak_bf16 / 1e12:.0f}, fp8 {peak_fp8 / 1e12:.0f} TFLOP/s)")
    print_table(results, peak_bf16, peak_fp8)
    common.save_results("fp8_gemm", results, device=name, out=args.out, peak_bf16=peak_bf16, peak_fp8=peak_fp8,
                        peak_from=peak_key)
    common.save_plot("fp8_gemm", name, draw(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
