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
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402


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
        impls["torch.compile"] = common.strict_compile(impls["eager"])
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
            times = common.fwd_bwd_ms(lambda: fn(x, w, b), lambda: fn(xg, wg, bg).backward(dy), [xg, wg, bg], do_bench)
            for mode, nbytes in (("fwd", 2 * rows * C * elem), ("fwd+bwd", 5 * rows * C * elem)):
                ms = times[mode]
                results.append({"op": op, "impl": name, "mode": mode, "N": rows, "C": C, "dtype": str(dtype)[6:],
                                "ms": ms, "bytes": nbytes, "GBps": nbytes / (ms * 1e-3) / 1e9})
    return results


def run_sweep(op: str, rows: int, cols: list[int], dtype, device: str) -> list[dict]:
    """Time minite's fwd+bwd under the launch knobs of kernels/rmsnorm.py (elements per program step, backward
    programs per SM, backward warp cap); the defaults there come from this table."""
    from minite.kernels import rmsnorm as K

    saved, out = (K.ROW_ELEMS, K.BWD_PROGRAMS_PER_SM, K.BWD_MAX_WARPS), []
    for C in cols:
        x = torch.randn(rows, C, device=device, dtype=dtype)
        w, b, dy = torch.ones(C, device=device, dtype=dtype), torch.zeros(C, device=device, dtype=dtype), \
            torch.randn_like(x)
        xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
        fn = (lambda: K.rmsnorm(xg, wg).backward(dy)) if op == "rmsnorm" else \
            (lambda: K.layernorm(xg, wg, bg).backward(dy))
        for elems in (2048, 4096, 8192):
            for per_sm in (1, 2, 4):
                for warps in ((8, 16, 32) if C >= 8192 else (32,)):
                    K.ROW_ELEMS, K.BWD_PROGRAMS_PER_SM, K.BWD_MAX_WARPS = elems, per_sm, {op: warps}
                    ms = common.do_bench(fn, grad_to_none=[xg, wg, bg])
                    print(f"  sweep {op} C={C} row_elems={elems} programs/SM={per_sm} bwd warps<={warps}: "
                          f"{ms:.4f} ms fwd+bwd")
                    out.append({"op": op, "C": C, "row_elems": elems, "programs_per_sm": per_sm, "max_warps": warps,
                                "ms": ms, "table": "sweep"})
    K.ROW_ELEMS, K.BWD_PROGRAMS_PER_SM, K.BWD_MAX_WARPS = saved
    # the forward's warp cap, and (LayerNorm) db in the kernel beside dw or from the host past DB_IN_KERNEL_MAX
    saved = K.FWD_MAX_WARPS, K.DB_IN_KERNEL_MAX
    for C in cols:
        x = torch.randn(rows, C, device=device, dtype=dtype)
        w, b, dy = torch.ones(C, device=device, dtype=dtype), torch.zeros(C, device=device, dtype=dtype), \
            torch.randn_like(x)
        xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
        norm = (lambda x, w, b: K.rmsnorm(x, w)) if op == "rmsnorm" else K.layernorm
        for warps in (8, 16, 32):
            K.FWD_MAX_WARPS = warps
            ms = common.do_bench(lambda: norm(x, w, b))
            print(f"  sweep {op} C={C} fwd warps<={warps}: {ms:.4f} ms fwd")
            out.append({"op": op, "C": C, "fwd_max_warps": warps, "ms": ms, "mode": "fwd", "table": "sweep"})
        K.FWD_MAX_WARPS = saved[0]
        for db_max in ((C - 1, C) if op == "layernorm" else ()):
            K.DB_IN_KERNEL_MAX = db_max
            ms = common.do_bench(lambda: norm(xg, wg, bg).backward(dy), grad_to_none=[xg, wg, bg])
            print(f"  sweep {op} C={C} db {'in the kernel' if db_max >= C else 'on the host'}: {ms:.4f} ms fwd+bwd")
            out.append({"op": op, "C": C, "db_in_kernel": db_max >= C, "ms": ms, "mode": "fwd+bwd", "table": "sweep"})
    K.FWD_MAX_WARPS, K.DB_IN_KERNEL_MAX = saved
    return out


def print_vs_peers(results: list[dict], peers=("liger", "torch.compile")) -> None:
    """minite's speed relative to each peer at the same op, C and mode (> 1: minite is faster); saved in the JSON
    as speedup_vs_<peer> on minite's rows."""
    ms = {(r["op"], r["C"], r["mode"], r["impl"]): r["ms"] for r in results}
    for r in results:
        if r["impl"] != "minite":
            continue
        vs = {p: ms[(r["op"], r["C"], r["mode"], p)] / r["ms"] for p in peers if (r["op"], r["C"], r["mode"], p) in ms}
        r.update({f"speedup_vs_{p}": v for p, v in vs.items()})
        print(f"  minite {r['op']:>9} C={r['C']:>6} {r['mode']:>8}: "
              + ", ".join(f"{v:.2f}x {p}" for p, v in vs.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_timer_args(p)
    p.add_argument("--rows", type=int, default=16384, help="N = B*T tokens (default 8 x 2048)")
    p.add_argument("--cols", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--ops", nargs="+", default=["rmsnorm", "layernorm"], choices=["rmsnorm", "layernorm"])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--sweep", action="store_true", help="only time minite under its launch knobs (no peers): "
                   "rows per step, backward programs per SM and warps, forward warps, LayerNorm's db placement")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/rmsnorm_<device>.json)")
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_rmsnorm"):
        return 0
    name = common.device_name()
    peak, peak_from = common.peak_bandwidth(name)
    dtype = getattr(torch, args.dtype)
    print(f"norm benchmark on {name}: N={args.rows}, dtype={args.dtype}, peak {peak / 1e12:.2f} TB/s ({peak_from})")
    if args.sweep:
        rows = [r for op in args.ops for r in run_sweep(op, args.rows, args.cols, dtype, "cuda")]
        common.write_json(common.results_path("rmsnorm_sweep", name), {"device": name, "results": rows})
        return 0
    results = []
    for op in args.ops:
        results += run(op, args.rows, args.cols, dtype, "cuda", common.do_bench, not args.no_compile)
    common.print_bandwidth_table(results, [("op", 9), ("C", 6)], peak)
    print_vs_peers(results)
    common.save_results("rmsnorm", results, device=name, out=args.out, peak_bw=peak, peak_from=peak_from)
    common.save_plot("rmsnorm", name, common.bandwidth_plot(results, "C", peak, group="op"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
