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
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L40S", 0.864e12)]


def peak_bw(name: str) -> tuple[float, str]:
    for key, bw in PEAK_BW:
        if key in name:
            return bw, key
    return 3.35e12, "H100 (default; device not in the table)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


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
             "torch.compile": torch.compile(eager, dynamic=False)}
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
            torch.testing.assert_close(fn(xi, t).float(), ref, atol=1e-2, rtol=1e-3)  # never time a wrong op
            for mode, passes in (("fwd", 1), ("fwd+bwd", 3)):
                step = (lambda f=fn: f(xi, t)) if mode == "fwd" else (lambda f=fn: f(xi, t).backward())
                ms = do_bench(step, grad_to_none=[xi])
                out.append({"table": "cross_entropy", "impl": name, "N": rows, "V": V, "mode": mode, "ms": ms,
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
        ms = do_bench(lambda f=fn: f(x, w, t).backward(), grad_to_none=[x, w])
        out.append({"table": "linear_ce", "impl": name, "N": rows, "C": dim, "V": vocab, "mode": "fwd+bwd",
                    "ms": ms, "peak_GiB": peak / 2**30})
    return out


def print_tables(results: list[dict], bw: float) -> None:
    print(f"{'N':>6} {'V':>6} {'mode':>8} {'impl':>14} {'ms':>8} {'GB/s':>7} {'% peak':>7} {'vs eager':>9}")
    eager = {(r["V"], r["mode"]): r["ms"] for r in results if r["impl"] == "torch eager"}
    for r in (r for r in results if r["table"] == "cross_entropy"):
        r["pct_peak"] = 100 * r["GBs"] * 1e9 / bw
        r["speedup_vs_eager"] = eager[(r["V"], r["mode"])] / r["ms"]
        print(f"{r['N']:>6} {r['V']:>6} {r['mode']:>8} {r['impl']:>14} {r['ms']:>8.3f} {r['GBs']:>7.0f} "
              f"{r['pct_peak']:>6.1f}% {r['speedup_vs_eager']:>8.2f}x")
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
    p.add_argument("--rows", type=int, default=8192, help="N = B * T tokens")
    p.add_argument("--vocab", type=int, nargs="+", default=[50304, 50257], help="V (padded and GPT-2's raw)")
    p.add_argument("--dim", type=int, default=768, help="C, the model width, for the linear-CE table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cross_entropy: no CUDA device here; this benchmark runs on a GPU only (nothing to do).")
        return 0
    from triton.testing import do_bench  # GPU only: do_bench needs an active driver

    name = torch.cuda.get_device_name()
    bw, key = peak_bw(name)
    results = run_ce(args.rows, args.vocab, do_bench) + run_linear_ce(args.rows, args.dim, args.vocab[0], do_bench)
    print(f"device: {name} (peak HBM bandwidth from {key}: {bw / 1e12:.2f} TB/s)")
    print_tables(results, bw)
    path = Path(__file__).resolve().parent / "results" / f"cross_entropy_{slug(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": name, "torch": torch.__version__, "peak_bw": bw, "peak_key": key,
                                "results": results}, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
