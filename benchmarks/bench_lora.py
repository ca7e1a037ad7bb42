"""Benchmark minite's fused LoRA linear against the unfused three-GEMM version, over the rank r. GPU only.

    python benchmarks/bench_lora.py [--rows 8192] [--dims 4096 4096] [--ranks 1 4 8 16 32 64 128] [--dtype bf16]

y = x W^T + s (x A^T) B^T with W (O, K) frozen. Implementations, each timed forward and forward+backward
(gradients of x, A and B; none of W):
    base only      x W^T alone (cuBLAS): the floor a LoRA layer cannot beat
    unfused        torch: F.linear(x, W) + s * F.linear(F.linear(x, A), B) (three cuBLAS GEMMs and an add)
    merged         x (W + s B A)^T: inference after merge_lora (the merge itself is not timed)
    minite fused   g = x A^T once (a skinny Triton GEMM), then ONE Triton GEMM (128x256x64, grouped order) whose
                   last K-step adds (s g) B^T: y is written once; the backward is the same pair plus a row-split
                   dA / dB reduction (kernels/lora.py)
Fusing saves the unfused path's extra (N, O) write, read and add; it pays only if minite's Triton GEMM keeps up
with cuBLAS: the table says at which r it does on this device (the first version, which recomputed x A^T in every
column tile on 64x128 tiles, ran at 0.52-0.62x the unfused path on an H200). Results (and a PNG of time vs r)
are saved to benchmarks/results/lora_<device-name-slug>.json / .png with the device named.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def implementations(s: float) -> dict:
    from minite.kernels.lora import lora_linear

    return {
        "base only": lambda x, W, A, B: F.linear(x, W),
        "unfused": lambda x, W, A, B: F.linear(x, W) + s * F.linear(F.linear(x, A), B),
        "minite fused": lambda x, W, A, B: lora_linear(x, W, A, B, scaling=s, backend="triton"),
    }


def run(rows: int, K: int, O: int, ranks: list[int], dtype: torch.dtype, do_bench) -> list[dict]:
    from minite.kernels.lora import lora_linear_ref

    out, gen = [], torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, K, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
    W = (0.02 * torch.randn(O, K, device="cuda", generator=gen)).to(dtype)  # frozen
    dy = torch.randn(rows, O, device="cuda", dtype=dtype, generator=gen)
    for r in ranks:
        s = 16.0 / r
        A = (0.02 * torch.randn(r, K, device="cuda", generator=gen)).to(dtype).requires_grad_(True)
        B = (0.02 * torch.randn(O, r, device="cuda", generator=gen)).to(dtype).requires_grad_(True)
        ref = lora_linear_ref(x, W, A, B, s).float()
        impls = implementations(s)
        for name, fn in impls.items():
            if name != "base only":  # never time a wrong op
                torch.testing.assert_close(fn(x, W, A, B).float(), ref, atol=3e-2, rtol=3e-2)
            times = common.fwd_bwd_ms(lambda: fn(x, W, A, B), lambda: fn(x, W, A, B).backward(dy), [x, A, B],
                                      do_bench)
            for mode, ms in times.items():
                flops = 2 * rows * K * O * (1 if mode == "fwd" else 2)  # base GEMMs only (dgrad in bwd, no wgrad)
                out.append({"impl": name, "N": rows, "K": K, "O": O, "r": r, "dtype": str(dtype), "mode": mode,
                            "ms": ms, "TFLOPs_base": flops / (ms * 1e-3) / 1e12})
        with torch.no_grad():
            Wm = (W.float() + s * B.float() @ A.float()).to(dtype)
        out.append({"impl": "merged", "N": rows, "K": K, "O": O, "r": r, "dtype": str(dtype), "mode": "fwd",
                    "ms": do_bench(lambda: F.linear(x, Wm)), "TFLOPs_base": None})
    return out


def table(results: list[dict]) -> None:
    unf = {(r["r"], r["mode"]): r["ms"] for r in results if r["impl"] == "unfused"}
    print(f"{'r':>4} {'mode':>8} {'impl':>13} {'ms':>8} {'vs unfused':>10}")
    for r in results:
        r["speedup_vs_unfused"] = unf[(r["r"], r["mode"])] / r["ms"]
        print(f"{r['r']:>4} {r['mode']:>8} {r['impl']:>13} {r['ms']:>8.3f} {r['speedup_vs_unfused']:>9.2f}x")
    pays = sorted({r["r"] for r in results if r["impl"] == "minite fused" and r["speedup_vs_unfused"] > 1.0})
    print(f"fusing pays (fused faster than unfused, fwd or fwd+bwd) at r = {pays or 'none of the ranks tried'}")


def plot(results: list[dict], device: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), layout="tight")
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for impl in ("base only", "unfused", "merged", "minite fused"):
            pts = sorted((r["r"], r["ms"]) for r in results if r["impl"] == impl and r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), "o-", label=impl)
        ax.set(xscale="log", xlabel="LoRA rank r", ylabel="ms", title=f"{mode}")
        ax.grid(alpha=0.3), ax.legend()
    r0 = results[0]
    fig.suptitle(f"LoRA linear N={r0['N']} K={r0['K']} O={r0['O']} {r0['dtype']} on {device}", fontsize=9)
    fig.savefig(path, dpi=100)
    print(f"saved {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192, help="N = B * T tokens")
    p.add_argument("--dims", type=int, nargs=2, default=[4096, 4096], metavar=("K", "O"), help="in, out features")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    args = p.parse_args(argv)
    if not common.require_cuda("bench_lora"):
        return 0
    name = common.device_name()
    results = run(args.rows, *args.dims, args.ranks, DTYPES[args.dtype], common.do_bench)
    print(f"device: {name}")
    table(results)
    path = common.save_results("lora", results, device=name)
    plot(results, name, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
