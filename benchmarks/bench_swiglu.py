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
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def implementations() -> dict:
    from minite.kernels.swiglu import swiglu

    def eager(g, u):
        return F.silu(g) * u

    impls = {"minite triton": lambda g, u: swiglu(g, u, backend="triton"), "torch eager": eager,
             "torch.compile": common.strict_compile(eager)}
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
        with torch.no_grad():
            ref = swiglu_ref(g, u)
        for name, fn in implementations().items():
            with torch.no_grad():  # never time a wrong op (no graph: g, u must meet autograd first in the timer)
                torch.testing.assert_close(fn(g, u).float(), ref.float(), atol=2e-2, rtol=2e-2)
            gg, ug = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
            times = common.fwd_bwd_ms(lambda: fn(g, u), lambda: fn(gg, ug).backward(dh), [gg, ug], do_bench)
            for mode, passes in (("fwd", 3), ("fwd+bwd", 8)):
                ms = times[mode]
                out.append({"impl": name, "N": rows, "H": H, "dtype": str(dtype), "mode": mode, "ms": ms,
                            "GBs": passes * rows * H * elt / (ms * 1e-3) / 1e9})
    return out


def print_vs_peers(results: list[dict], peers=("torch.compile", "liger-kernel")) -> None:
    """minite's speed relative to each peer at the same H and mode (> 1: minite is faster); saved in the JSON as
    speedup_vs_<peer> on minite's rows."""
    ms = {(r["H"], r["mode"], r["impl"]): r["ms"] for r in results}
    for r in results:
        if r["impl"] == "minite triton":
            vs = {p: ms[(r["H"], r["mode"], p)] / r["ms"] for p in peers if (r["H"], r["mode"], p) in ms}
            r.update({f"speedup_vs_{p}": v for p, v in vs.items()})
            print(f"  minite H={r['H']:>6} {r['mode']:>8}: " + ", ".join(f"{v:.2f}x {p}" for p, v in vs.items()))


def sweep(rows: int, hiddens: list[int], dtype: torch.dtype) -> list[dict]:
    """minite's fwd and fwd+bwd under its columns per program (kernels/swiglu.py BLOCK_GPU)."""
    from minite.kernels import swiglu as K

    saved, out = K.BLOCK_GPU, []
    for H in hiddens:
        g, u = (torch.randn(rows, H, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        dh = torch.randn(rows, H, device="cuda", dtype=dtype)
        for block in (1024, 2048, 4096):
            K.BLOCK_GPU = block
            times = common.fwd_bwd_ms(lambda: K.swiglu(g, u), lambda: K.swiglu(g, u).backward(dh), [g, u])
            print(f"  sweep H={H} block={block}: {times['fwd']:.4f} ms fwd, {times['fwd+bwd']:.4f} ms fwd+bwd")
            out.append({"H": H, "block": block, **times, "table": "sweep"})
    K.BLOCK_GPU = saved
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_timer_args(p)
    p.add_argument("--rows", type=int, default=8192, help="N = B * T tokens")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 11008, 14336], help="MLP hidden widths H")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--sweep", action="store_true", help="only time minite under its columns per program")
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_swiglu"):
        return 0
    name = common.device_name()
    if args.sweep:
        rows = sweep(args.rows, args.hidden, DTYPES[args.dtype])
        common.write_json(common.results_path("swiglu_sweep", name), {"device": name, "results": rows})
        return 0
    bw, key = common.peak_bandwidth(name)
    results = run(args.rows, args.hidden, DTYPES[args.dtype], common.do_bench)
    print(f"device: {name} (peak HBM bandwidth from {key}: {bw / 1e12:.2f} TB/s)")
    common.print_bandwidth_table(results, [("N", 6), ("H", 6)], bw, rate="GBs", base_impl="torch eager",
                                 ms_fmt="8.3f", rate_width=7)
    print_vs_peers(results)
    common.save_results("swiglu", results, device=name, peak_bw=bw, peak_from=key)
    common.save_plot("swiglu", name, common.bandwidth_plot(results, "H", bw, rate="GBs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
