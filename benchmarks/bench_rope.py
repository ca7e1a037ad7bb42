"""Benchmark minite's fused RoPE against torch eager, torch.compile and Liger-Kernel (GPU only).

    python benchmarks/bench_rope.py [--batch 8] [--seq 2048] [--heads 32] [--head-dims 64 128 256] [--dtype bfloat16]

Times rotating q AND k (as every attention layer does; k has --kv-heads heads) in both layouts, (B, H, T, D) and
(B, T, H, D), forward and forward+backward, and prints milliseconds, achieved bandwidth and its share of the HBM
peak (3.35 TB/s on an H100 SXM). RoPE is memory bound. Bytes counted are the unavoidable ones:
    forward            read q, k; write their rotations        2 * (|q| + |k|) * element size  (+ cos/sin)
    forward+backward   + read dq', dk'; write dq, dk            4 * (|q| + |k|) * element size
Implementations: "minite" (the Triton kernel, one launch per tensor), "eager" (minite's reference: upcast, chunk,
four multiplies, add/sub, cat, downcast), "torch.compile" (of the reference), "liger" (Liger-Kernel's fused q+k
kernel, bhtd only, when importable). JSON goes to benchmarks/results/rope_<device-name-slug>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402


def implementations(layout: str, compile_ok: bool) -> dict:
    """name -> fn(q, k, cos, sin) -> (q', k')."""
    from minite.kernels.rope import rope, rope_ref

    def eager(q, k, cos, sin):
        return rope_ref(q, cos, sin, layout=layout), rope_ref(k, cos, sin, layout=layout)

    impls = {"minite": lambda q, k, cos, sin: (rope(q, cos, sin, layout=layout, backend="triton"),
                                               rope(k, cos, sin, layout=layout, backend="triton")),
             "eager": eager}
    if compile_ok:
        impls["torch.compile"] = common.strict_compile(eager)
    if layout == "bhtd":
        try:  # optional: pip install liger-kernel; HF convention: cos/sin (1, T, D) with the halves duplicated
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            def liger(q, k, cos, sin):
                cos_full = torch.cat([cos, cos], dim=-1)[None]  # (1, T, D)
                sin_full = torch.cat([sin, sin], dim=-1)[None]
                return liger_rotary_pos_emb(q, k, cos_full, sin_full)
            impls["liger"] = liger
        except Exception as e:  # ImportError, or an API change
            print(f"  (liger skipped: {type(e).__name__}: {e})")
    return impls


def run(B: int, T: int, H: int, KVH: int, head_dims: list[int], dtype, device: str, do_bench,
        compile_ok: bool) -> list[dict]:
    from minite.kernels.rope import rope_cos_sin, rope_ref

    results = []
    for layout in ("bhtd", "bthd"):
        impls = implementations(layout, compile_ok)
        for D in head_dims:
            shape_q = (B, H, T, D) if layout == "bhtd" else (B, T, H, D)
            shape_k = (B, KVH, T, D) if layout == "bhtd" else (B, T, KVH, D)
            q = torch.randn(shape_q, device=device, dtype=dtype)
            k = torch.randn(shape_k, device=device, dtype=dtype)
            cos, sin = rope_cos_sin(T, D, device=device)  # (T, D/2) fp32
            got = impls["minite"](q, k, cos, sin)
            torch.testing.assert_close(got[0], rope_ref(q, cos, sin, layout=layout))  # never time a wrong kernel
            torch.testing.assert_close(got[1], rope_ref(k, cos, sin, layout=layout))
            elem, n = q.element_size(), q.numel() + k.numel()
            dq, dk = torch.randn_like(q), torch.randn_like(k)
            qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)

            for name, fn in impls.items():
                def fwd_bwd(fn=fn):
                    torch.autograd.backward(fn(qg, kg, cos, sin), (dq, dk))
                times = common.fwd_bwd_ms(lambda fn=fn: fn(q, k, cos, sin), fwd_bwd, [qg, kg], do_bench)
                for mode, nbytes in (("fwd", 2 * n * elem), ("fwd+bwd", 4 * n * elem)):
                    ms = times[mode]
                    results.append({"layout": layout, "impl": name, "mode": mode, "B": B, "T": T, "H": H,
                                    "KVH": KVH, "D": D, "dtype": str(dtype)[6:], "ms": ms, "bytes": nbytes,
                                    "GBps": nbytes / (ms * 1e-3) / 1e9})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_timer_args(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="k's heads (GQA); = --heads for plain MHA")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/rope_<device>.json)")
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_rope"):
        return 0
    name = common.device_name()
    peak, peak_from = common.peak_bandwidth(name)
    dtype = getattr(torch, args.dtype)
    print(f"RoPE benchmark on {name}: B={args.batch} T={args.seq} H={args.heads} KVH={args.kv_heads}, "
          f"dtype={args.dtype}, peak {peak / 1e12:.2f} TB/s ({peak_from})")
    results = run(args.batch, args.seq, args.heads, args.kv_heads, args.head_dims, dtype, "cuda",
                  common.do_bench, not args.no_compile)
    common.print_bandwidth_table(results, [("layout", 6), ("D", 4)], peak)
    common.save_results("rope", results, device=name, out=args.out, peak_bw=peak, peak_from=peak_from)
    common.save_plot("rope", name, common.bandwidth_plot(results, "D", peak, group="layout"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
