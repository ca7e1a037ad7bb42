"""Benchmark minite's grouped GEMM (all experts in one launch) against a loop of cuBLAS GEMMs and, where the installed
torch has it, ``torch._grouped_mm``. GPU only: on a CPU it prints why and exits.

    python benchmarks/bench_grouped_gemm.py [--experts 8] [--tokens 16384] [--k 4096] [--n 14336] [--dtype bf16]

The problem is one MoE projection: tokens sorted by expert, x (M, K) times w[e] (K, N) for each expert's rows. The
routing is uneven on purpose (expert e gets a share proportional to 1 / (e + 1), and one expert gets nothing): what
a real router produces, and where a padded batched GEMM would waste work. The figure of merit is TFLOP/s =
2 * M * K * N / time (forward), 3x that for forward + backward (dx and dw). The loop gets its split sizes as Python
ints before the timer starts (its host sync is not timed, which flatters it). Every implementation is checked
against the fp32 reference before it is timed. Results: benchmarks/results/grouped_gemm_<device>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def uneven_counts(tokens: int, experts: int) -> list[int]:
    """Rows per expert: shares ~ 1 / (e + 1), the last expert empty, multiples of 16 (torch._grouped_mm wants them)."""
    w = torch.tensor([1.0 / (e + 1) for e in range(experts - 1)] + [0.0])
    counts = (w / w.sum() * tokens / 16).floor().long() * 16
    counts[0] += tokens - int(counts.sum())
    return counts.tolist()


def implementations(counts: list[int]) -> dict:
    from minite.kernels.grouped_gemm import grouped_gemm

    ends = torch.tensor(counts, device="cuda").cumsum(0)

    def loop(x, w, offsets):  # one cuBLAS GEMM per expert, slices known on the host
        outs, o = [], 0
        for e, c in enumerate(counts):
            outs.append(x[o:o + c] @ w[e])
            o += c
        return torch.cat(outs)

    impls = {"torch loop": loop, "minite triton": lambda x, w, offsets: grouped_gemm(x, w, offsets, backend="triton")}
    if hasattr(torch, "_grouped_mm"):
        offs32 = ends.to(torch.int32)
        impls["torch._grouped_mm"] = lambda x, w, offsets: torch._grouped_mm(x, w, offs=offs32)
    else:
        print("(torch._grouped_mm is not in this torch; column skipped)")
    return impls


def run(counts: list[int], K: int, N: int, dtype: torch.dtype, do_bench) -> list[dict]:
    from minite.kernels.grouped_gemm import grouped_gemm_ref

    E, M = len(counts), sum(counts)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(E, K, N, device="cuda", dtype=dtype, generator=g) / K ** 0.5
    dy = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    offsets = torch.tensor([0] + counts, device="cuda").cumsum(0)
    with torch.no_grad():
        ref = grouped_gemm_ref(x, w, offsets).float()
    out = []
    for name, fn in implementations(counts).items():
        try:
            with torch.no_grad():  # never time a wrong op
                torch.testing.assert_close(fn(x, w, offsets).float(), ref, atol=5e-2, rtol=5e-2)
        except Exception as e:  # e.g. torch._grouped_mm on a GPU or dtype it does not support
            print(f"({name}: {type(e).__name__}: {str(e)[:200]}; column skipped)")
            continue
        xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        times = common.fwd_bwd_ms(lambda: fn(x, w, offsets), lambda: fn(xg, wg, offsets).backward(dy), [xg, wg],
                                  do_bench)
        for mode, flops in (("fwd", 2 * M * K * N), ("fwd+bwd", 6 * M * K * N)):
            ms = times[mode]
            out.append({"impl": name, "E": E, "M": M, "K": K, "N": N, "dtype": str(dtype), "mode": mode, "ms": ms,
                        "TFLOPs": flops / (ms * 1e-3) / 1e12, "counts": counts})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_timer_args(p)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="M: routed rows in total (tokens x top_k)")
    p.add_argument("--k", type=int, default=4096, help="K: model width")
    p.add_argument("--n", type=int, default=14336, help="N: expert hidden width")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_grouped_gemm"):
        return 0
    name = common.device_name()
    counts = uneven_counts(args.tokens, args.experts)
    results = run(counts, args.k, args.n, DTYPES[args.dtype], common.do_bench)
    print(f"device: {name}; rows per expert {counts}")
    for mode in ("fwd", "fwd+bwd"):
        rows = {r["impl"]: r for r in results if r["mode"] == mode}
        base = rows.get("torch loop")
        for impl, r in rows.items():
            vs = f"  {base['ms'] / r['ms']:.2f}x the loop" if base else ""
            print(f"{mode:8s} {impl:18s} {r['ms']:9.3f} ms {r['TFLOPs']:8.1f} TFLOP/s{vs}")
    common.save_results("grouped_gemm", results, device=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
