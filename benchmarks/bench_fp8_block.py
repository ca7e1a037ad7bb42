"""Block-scaled FP8 GEMM (chapter 15) against bf16 and cuBLAS's row-wise FP8, on a GPU.

    python benchmarks/bench_fp8_block.py [--sizes 4096 8192] [--timer graph|eager]

At M = N = K = S, times (ms, TFLOP/s):
* ``bf16``: ``torch.matmul`` on bf16 operands (cuBLAS);
* ``scaled_mm rowwise``: ``torch._scaled_mm`` with one fp32 scale per row of A and per column of B (cuBLAS FP8);
* ``minite blockwise``: ``block_scaled_gemm`` with A per 1 x 128 and B per 128 x 128 (DeepSeek-V3's layout);
* ``minite mx``: ``block_scaled_gemm`` with MX-32 (E8M0) scales along K;
* the quantize passes of the blockwise GEMM (A per 1 x 128, B per 128 x 128), timed alone: the overhead that
  decides when FP8 pays.

and the GEMMs' error against the fp64 product of the same fp8 operands, beside the same math in fp32 PyTorch
(dequantize, fp32 matmul), and beside ``torch._scaled_mm`` on the very same fp8 data (unit scales).
Writes benchmarks/results/fp8_block_<device-name-slug>.json naming the device.
It needs CUDA and fp8 tensor cores (sm_89+); on a CPU it says so and exits.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

PEAK = [("H200", 989e12, 1979e12), ("H100", 989e12, 1979e12), ("L40S", 362e12, 733e12)]   # (bf16, fp8) dense


def peaks(name: str) -> tuple[float, float, str]:
    for key, bf16, fp8 in PEAK:
        if key in name:
            return bf16, fp8, key
    return 989e12, 1979e12, "H100 (default; device not in the table)"


def run(S: int, do_bench) -> list[dict]:
    from minite.kernels.fp8_block import block_scaled_gemm, block_scaled_gemm_ref, quantize_blockwise, quantize_mx

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16, generator=g)             # (N, K): B = w.t()
    qa, qw = quantize_blockwise(a, (1, 128)), quantize_blockwise(w, (128, 128))
    ma, mw = quantize_mx(a), quantize_mx(w)
    # row-wise cuBLAS: one scale per row of A and per row of w (= column of B)
    sa = a.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    sw = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    a8 = (a.float() / sa).to(torch.float8_e4m3fn)
    w8 = (w.float() / sw).to(torch.float8_e4m3fn)
    fns = {
        "bf16": lambda: a @ w.t(),
        "scaled_mm rowwise": lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw.t(),
                                                      out_dtype=torch.bfloat16),
        "minite blockwise": lambda: block_scaled_gemm(qa, qw.t()),
        "minite mx": lambda: block_scaled_gemm(ma, mw.t()),
        "quantize 1x128 + 128x128": lambda: (quantize_blockwise(a, (1, 128)), quantize_blockwise(w, (128, 128))),
    }
    out = []
    for impl, fn in fns.items():
        ms = do_bench(fn)
        row = {"table": "gemm", "impl": impl, "S": S, "ms": ms}
        if not impl.startswith("quantize"):
            row["tflops"] = 2 * S**3 / ms / 1e9
        out.append(row)
    # error of the GEMM itself (quantization excluded): against fp64 of the same dequantized operands
    n = min(S, 2048)                                                                  # rows checked (fp64 cost)
    for impl, (x, y) in {"minite blockwise": (qa, qw), "minite mx": (ma, mw)}.items():
        xs = type(x)(x.data[:n], x.scale[:n], x.block, x.kind, x.orig_dtype)
        exact = block_scaled_gemm_ref(xs, y.t(), torch.float64)
        sd = exact.std().item()
        got = block_scaled_gemm(xs, y.t(), out_dtype=torch.float32)
        ref32 = block_scaled_gemm_ref(xs, y.t(), torch.float32)
        out.append({"table": "error", "impl": impl, "S": S, "rows": n,
                    "max_err_over_std": (got.double() - exact).abs().max().item() / sd,
                    "fp32_torch_max_err_over_std": (ref32.double() - exact).abs().max().item() / sd})
    # issue 32's bar: the block GEMMs' error at most torch._scaled_mm's on the same fp8 data (unit scales: all three
    # sum the very same products; cuBLAS and blockwise promote every 128, MX sums in fp32 on bf16 wgmma)
    from minite.formats import BlockScaledTensor
    x8, w8 = a8[:n], w8
    exact = x8.double() @ w8.double().t()
    one, K = torch.ones((), device="cuda"), S
    unit = {"scaled_mm tensorwise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.float32),
            "minite blockwise": lambda: block_scaled_gemm(
                BlockScaledTensor(x8, torch.ones(n, K // 128, device="cuda"), (1, 128), "blockwise"),
                BlockScaledTensor(w8, torch.ones(S // 128, K // 128, device="cuda"), (128, 128), "blockwise").t(),
                out_dtype=torch.float32),
            "minite mx": lambda: block_scaled_gemm(
                BlockScaledTensor(x8, torch.full((n, K // 32), 127, dtype=torch.uint8, device="cuda"), (1, 32), "mx"),
                BlockScaledTensor(w8, torch.full((S, K // 32), 127, dtype=torch.uint8, device="cuda"), (1, 32),
                                  "mx").t(), out_dtype=torch.float32)}
    for impl, fn in unit.items():
        out.append({"table": "error, same fp8 data", "impl": impl, "S": S, "rows": n,
                    "max_err_over_std": (fn().double() - exact).abs().max().item() / exact.std().item()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_timer_args(p)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192], help="M = N = K")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_fp8_block"):
        return 0
    if torch.cuda.get_device_capability() < (8, 9):
        print("bench_fp8_block: fp8 tensor cores need sm_89+ (Ada/Hopper); nothing to do on this GPU.")
        return 0
    name = common.device_name()
    peak_bf16, peak_fp8, key = peaks(name)
    results = [r for S in args.sizes for r in run(S, common.do_bench)]
    print(f"device: {name} (peaks from {key}: bf16 {peak_bf16 / 1e12:.0f}, fp8 {peak_fp8 / 1e12:.0f} TFLOP/s)")
    for r in results:
        if r["table"] == "gemm":
            extra = f"{r['tflops']:7.0f} TFLOP/s" if "tflops" in r else ""
            print(f"{r['S']:6d}^3 {r['impl']:26s} {r['ms']:8.3f} ms {extra}")
        elif r["table"] == "error":
            print(f"{r['S']:6d}^3 {r['impl']:26s} error {r['max_err_over_std']:.2e} "
                  f"(fp32 torch {r['fp32_torch_max_err_over_std']:.2e})")
        else:
            print(f"{r['S']:6d}^3 {r['impl']:26s} error {r['max_err_over_std']:.2e} (same fp8 data, unit scales)")
    common.save_results("fp8_block", results, device=name, out=args.out, peak_bf16=peak_bf16, peak_fp8=peak_fp8,
                        peak_from=key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
