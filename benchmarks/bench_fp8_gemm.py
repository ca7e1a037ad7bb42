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


def run_gemm(sizes: list[int], do_bench) -> list[dict]:
    from minite.formats import quantize
    from minite.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref

    out = []
    for S in sizes:
        a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)            # (N, K) like a Linear weight
        qa, qw = quantize(a), quantize(w)                                       # E4M3, current scaling
        got = fp8_gemm(qa, qw.t(), out_dtype=torch.bfloat16, backend="triton")
        ref = fp8_gemm_ref(qa, qw.t(), torch.bfloat16)
        torch.testing.assert_close(got.float(), ref.float(), atol=0.5, rtol=2e-2)  # never time a wrong kernel
        impls = {"minite fp8": (lambda: fp8_gemm(qa, qw.t(), out_dtype=torch.bfloat16, backend="triton"), "fp8"),
                 "torch bf16": (lambda: torch.matmul(a, w.t()), "bf16")}
        if hasattr(torch, "_scaled_mm"):
            impls["torch _scaled_mm fp8"] = (lambda: torch._scaled_mm(qa.data, qw.data.t(), scale_a=qa.scale_inv,
                                                                      scale_b=qw.scale_inv,
                                                                      out_dtype=torch.bfloat16), "fp8")
        for name, (fn, prec) in impls.items():
            try:
                ms = do_bench(fn)
            except Exception as e:  # e.g. _scaled_mm layout rules differ between torch versions
                print(f"  skipped {name} at {S}: {type(e).__name__}: {e}")
                continue
            out.append({"table": "gemm", "impl": name, "prec": prec, "M": S, "N": S, "K": S, "mode": "fwd",
                        "ms": ms, "TFLOPs": 2 * S ** 3 / (ms * 1e-3) / 1e12})
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
        compiled = torch.compile(lambda t: lin(t), dynamic=False)

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
    print(f"{'table':>6} {'size':>6} {'mode':>8} {'impl':>22} {'ms':>9} {'TFLOP/s':>8} {'% peak':>7} {'vs bf16':>8}")
    base = {(r["table"], r["M"], r["mode"]): r["ms"] for r in results if r["impl"] == "torch bf16"}
    for r in results:
        r["pct_peak"] = 100 * r["TFLOPs"] * 1e12 / (peak_fp8 if r["prec"] == "fp8" else peak_bf16)
        r["speedup_vs_bf16"] = base[(r["table"], r["M"], r["mode"])] / r["ms"]
        print(f"{r['table']:>6} {r['M']:>6} {r['mode']:>8} {r['impl']:>22} {r['ms']:>9.3f} {r['TFLOPs']:>8.1f} "
              f"{r['pct_peak']:>6.1f}% {r['speedup_vs_bf16']:>7.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192], help="M = N = K")
    p.add_argument("--no-linear", action="store_true", help="only the GEMM table")
    args = p.parse_args(argv)
    if not common.require_cuda("bench_fp8_gemm"):
        return 0
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        print(f"bench_fp8_gemm: fp8 tensor cores need sm_89+ (Ada/Hopper); this GPU is sm_{major}{minor}.")
        return 0
    do_bench = common.do_bench
    name = common.device_name()
    peak_bf16, peak_fp8, peak_key = peaks(name)
    results = run_gemm(args.sizes, do_bench)
    if not args.no_linear:
        results += run_linear(args.sizes, do_bench)
    print(f"device: {name} (peaks from {peak_key}: bf16 {peak_bf16 / 1e12:.0f}, fp8 {peak_fp8 / 1e12:.0f} TFLOP/s)")
    print_table(results, peak_bf16, peak_fp8)
    common.save_results("fp8_gemm", results, device=name, peak_bf16=peak_bf16, peak_fp8=peak_fp8, peak_from=peak_key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
