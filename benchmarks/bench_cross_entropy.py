"""Benchmark minite's cross-entropy and fused linear-cross-entropy. GPU only.

    python benchmarks/bench_cross_entropy.py [--rows 8192] [--vocab 50304 50257] [--dim 768]

Two tables, saved as JSON to benchmarks/results/cross_entropy_<device-name-slug>.json with the device name:
    cross_entropy   logits (N, V) bf16 -> fp32 mean loss; minite vs torch eager F.cross_entropy(logits.float()),
                    torch.compile of it, Liger-Kernel when importable. Memory bound: GB/s of the ideal op's bytes
                    (forward: read the logits once = N*V*elt; forward+backward: + read them and write dlogits =
                    3*N*V*elt) and % of the HBM peak (H100 SXM 3.35 TB/s).
    linear_ce       x (N, C), W (V, C) bf16: naive (x @ W.T then cross-entropy) vs minite's chunked fused
                    linear-CE vs Liger's fused linear-CE: forward+backward ms and *peak memory* measured with
                    torch.cuda.max_memory_allocated (at N = B*T = 8192, V = 50304 by default).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402


def _liger(name: str):
    try:
        import liger_kernel.transformers as lt

        return getattr(lt, name)()
    except Exception as e:  # not installed, or an incompatible version
        print(f"(Liger-Kernel {name} not importable: {type(e).__name__}; column skipped)")
        return None


def run_ce(rows: int, vocabs: list[int], do_bench) -> list[dict]:
    from minite.kernels.cross_entropy import cross_entropy, cross_entropy_ref

    def eager(x, t):
        return F.cross_entropy(x.float(), t)

    impls = {"minite triton": lambda x, t: cross_entropy(x, t, backend="triton"), "torch eager": eager,
             "torch.compile": common.strict_compile(eager)}
    liger = _liger("LigerCrossEntropyLoss")
    if liger is not None:
        impls["liger-kernel"] = lambda x, t: liger(x, t)  # note: Liger writes dlogits into x in place
    out = []
    for V in vocabs:
        x = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, V, (rows,), device="cuda")
        ref = cross_entropy_ref(x, t)
        for name, fn in impls.items():
            xi = x.detach().clone().requires_grad_()
            with torch.no_grad():  # never time a wrong op; each at its own output dtype's tolerance (Liger: bf16)
                got = fn(x.detach().clone(), t)
            torch.testing.assert_close(got, ref.to(got.dtype))
            # Liger's CE syncs with the host (.item()), which a CUDA graph cannot capture: timed eagerly.
            bench = functools.partial(do_bench, eager=name.startswith("liger"))
            xd = x.detach()  # the forward alone is timed on a tensor without grad (xi meets autograd in one timer)
            times = common.fwd_bwd_ms(lambda: fn(xd, t), lambda: fn(xi, t).backward(), [xi], bench)
            for mode, passes in (("fwd", 1), ("fwd+bwd", 3)):
                ms = times[mode]
                out.append({"table": "cross_entropy", "impl": name, "N": rows, "V": V, "mode": mode, "ms": ms,
                        "timer": "eager" if name.startswith("liger") else common.TIMER,
                            "GBs": passes * rows * V * 2 / (ms * 1e-3) / 1e9})
    return out


def run_linear_ce(rows: int, dim: int, vocab: int, do_bench) -> list[dict]:
    from minite.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_ref

    impls = {"naive (x @ W.T, eager CE)": linear_cross_entropy_ref,
             "minite fused linear-CE": lambda x, w, t: linear_cross_entropy(x, w, t, backend="triton")}
    liger = _liger("LigerFusedLinearCrossEntropyLoss")
    if liger is not None:
        impls["liger fused linear-CE"] = lambda x, w, t: liger(w, x, t)
    out = []
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    for name, fn in impls.items():
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x, w, t).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ms = do_bench(lambda f=fn: f(x, w, t).backward(), grad_to_none=[x, w], eager=True)  # Python chunk loop
        out.append({"table": "linear_ce", "impl": name, "N": rows, "C": dim, "V": vocab, "mode": "fwd+bwd",
                    "ms": ms, "peak_GiB": peak / 2**30})
    return out


def print_tables(results: list[dict], bw: float) -> None:
    common.print_bandwidth_table([r for r in results if r["table"] == "cross_entropy"], [("N", 6), ("V", 6)], bw,
                                 rate="GBs", base_impl="torch eager", ms_fmt="8.3f", rate_width=7)
    lin = [r for r in results if r["table"] == "linear_ce"]
    if lin:
        naive = lin[0]["peak_GiB"]
        print(f"\nlinear + cross-entropy, N={lin[0]['N']}, C={lin[0]['C']}, V={lin[0]['V']}, bf16, fwd+bwd")
        print(f"{'impl':>28} {'ms':>8} {'peak GiB':>9} {'vs naive':>9}")
        for r in lin:
            r["memory_saving_vs_naive"] = naive / r["peak_GiB"]
            print(f"{r['impl']:>28} {r['ms']:>8.2f} {r['peak_GiB']:>9.2f} {r['memory_saving_vs_naive']:>8.1f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_timer_args(p)
    p.add_argument("--rows", type=int, default=8192, help="N = B * T tokens")
    p.add_argument("--vocab", type=int, nargs="+", default=[50304, 50257], help="V (padded and GPT-2's raw)")
    p.add_argument("--dim", type=int, default=768, help="C, the model width, for the linear-CE table")
    args = p.parse_args(argv)
    common.set_timer(args.timer)
    if not common.require_cuda("bench_cross_entropy"):
        return 0
    name = common.device_name()
    bw, key = common.peak_bandwidth(name)
    do_bench = common.do_bench
    results = run_ce(args.rows, args.vocab, do_bench) + run_linear_ce(args.rows, args.dim, args.vocab[0], do_bench)
    print(f"device: {name} (peak HBM bandwidth from {key}: {bw / 1e12:.2f} TB/s)")
    print_tables(results, bw)
    common.save_results("cross_entropy", results, device=name, peak_bw=bw, peak_from=key)
    ce = [r for r in results if r["table"] == "cross_entropy"]
    common.save_plot("cross_entropy", name, common.bandwidth_plot(ce, "V", bw, rate="GBs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
