"""Benchmark minite's flash attention against PyTorch SDPA (flash and cuDNN backends), and decoding with and
without the KV cache.

    python benchmarks/bench_attention.py [--dims 64 128] [--seqlens 512 1024 ... 16384] [--dtype bf16]   # GPU only
    python benchmarks/bench_attention.py --decode [--lengths 64 128 256 512 1024]                       # any device

Attention (GPU): B * T = 16k tokens, H = 2048 / D heads (FlashAttention's benchmark shape), causal and not.
FLOPs: forward 4 * B * H * T^2 * D (two matmuls), halved when causal; backward 2.5x the forward (five matmuls,
one of them recomputing S), so forward+backward is 3.5x. TFLOP/s = FLOPs / time. Saved to
benchmarks/results/attention_<device>.json and .png.

Decode: a GPT (--n_layer/--n_embd/--n_head/--n_kv_head) generates one token after a context of L tokens, either
recomputing the whole context (no cache: O(L) work per token) or with the KVCache (one token through the model,
attention reads L cached keys). Tokens/s against L, saved to benchmarks/results/decode_<device>.json and .png.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sdpa_impls() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minite.kernels.attention import attention

    def backend(b):
        def fn(q, k, v, causal):
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fn
    return {"minite triton": lambda q, k, v, causal: attention(q, k, v, causal=causal, backend="triton"),
            "sdpa flash": backend(SDPBackend.FLASH_ATTENTION), "sdpa cudnn": backend(SDPBackend.CUDNN_ATTENTION)}


def run_attention(dims, seqlens, dtype, do_bench, tokens=16384, width=2048) -> list[dict]:
    out = []
    for D in dims:
        H = width // D
        for T in seqlens:
            B = max(1, tokens // T)
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            for causal in (False, True):
                ref = None
                flops = 4 * B * H * T * T * D / (2 if causal else 1)
                for name, fn in sdpa_impls().items():
                    try:
                        o = fn(q, k, v, causal)
                        ref = o if ref is None else ref
                        torch.testing.assert_close(o.float(), ref.float(), atol=3e-2, rtol=3e-2)  # never time wrong
                        t = common.fwd_bwd_ms(lambda: fn(q, k, v, causal), lambda: fn(q, k, v, causal).backward(do),
                                              [q, k, v], do_bench)
                    except Exception as e:  # a backend this GPU / build does not offer (e.g. cuDNN): say so
                        print(f"  {name} D={D} T={T} causal={causal}: skipped ({type(e).__name__}: {e})"[:200])
                        continue
                    for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                        r = {"impl": name, "D": D, "T": T, "B": B, "H": H, "causal": causal, "mode": mode,
                             "ms": t[mode], "TFLOPs": mult * flops / (t[mode] * 1e-3) / 1e12}
                        out.append(r)
                        print(f"D={D:4d} T={T:6d} causal={causal!s:5} {mode:8} {name:14} {r['ms']:8.3f} ms "
                              f"{r['TFLOPs']:6.1f} TFLOP/s")
    return out


def plot_attention(results, device, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dims = sorted({r["D"] for r in results})
    fig, axes = plt.subplots(len(dims), 4, figsize=(16, 3.6 * len(dims)), squeeze=False)
    for i, D in enumerate(dims):
        for j, (causal, mode) in enumerate([(False, "fwd"), (True, "fwd"), (False, "fwd+bwd"), (True, "fwd+bwd")]):
            ax = axes[i][j]
            for impl in sorted({r["impl"] for r in results}):
                rs = [r for r in results if (r["impl"], r["D"], r["causal"], r["mode"]) == (impl, D, causal, mode)]
                ax.plot([r["T"] for r in rs], [r["TFLOPs"] for r in rs], "o-", label=impl)
            ax.set_xscale("log", base=2)
            ax.set(title=f"D={D} {'causal' if causal else 'full'} {mode}", xlabel="T", ylabel="TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"attention, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"saved {path}")


def run_decode(lengths, device, n_layer, n_embd, n_head, n_kv_head, steps=8) -> list[dict]:
    from minite.layers.kv_cache import KVCache
    from minite.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    Tmax = max(lengths) + steps + 1
    cfg = GPTConfig(vocab_size=256, block_size=Tmax, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                    n_kv_head=n_kv_head)
    m = GPT(cfg).to(device).eval()
    if device == "cuda":
        m = m.to(torch.bfloat16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for L in lengths:
        idx = torch.randint(0, 256, (1, L), device=device)
        with torch.no_grad():
            m(idx)  # warm-up
            no_cache = _best(lambda: m(idx), steps, sync)  # the whole context of L tokens again for one token
            cache = KVCache.for_model(m, 1, Tmax)
            tok = idx[:, -1:]
            _refill(m, idx, cache)
            m(tok, kv_cache=cache)  # warm-up step
            cached = _best(lambda: m(tok, kv_cache=cache), steps, sync, before=lambda: _refill(m, idx, cache))
            times = [("no cache", no_cache), ("kv cache", cached)]
            if device == "cuda":  # the same step captured once and replayed: one CUDA graph a token
                from minite.decoding import Decoder
                dec = Decoder(m, compile="reduce-overhead")
                _refill(m, idx, cache)
                for _ in range(3):  # compile, record, replay
                    dec(tok, cache)
                times.append(("kv cache + CUDA graph", _best(lambda: dec(tok, cache), steps, sync,
                                                             before=lambda: _refill(m, idx, cache))))
        # what one cached step must read at least: every weight once, and the L cached keys and values of every
        # layer (issue 20 reports tokens/s as a share of the HBM roofline: bytes / bandwidth / seconds)
        weights = sum(p.numel() * p.element_size() for p in m.parameters())
        kv = sum(t[:, :, :L].numel() * t.element_size() for t in cache.k + cache.v)
        for impl, s in times:
            out.append({"impl": impl, "L": L, "ms_per_token": 1e3 * s, "tokens_per_s": 1 / s,
                        "bytes_per_token": weights + kv if impl != "no cache" else None})
        print(f"L={L:6d}  " + "   ".join(f"{impl} {1 / s:9.1f} tok/s" for impl, s in times))
    return out


def _refill(m, idx, cache):
    cache.reset()
    m(idx, kv_cache=cache)  # the cache holds the L context tokens again


def _best(fn, steps, sync, before=None, repeats=5) -> float:
    """Seconds per call: the best of `repeats` runs of `steps` calls (shared CPUs are noisy; the minimum is the
    run least disturbed by other processes). `before` runs untimed before each repeat."""
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def plot_decode(results, device, model, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in ("no cache", "kv cache", "kv cache + CUDA graph"):
        rs = [r for r in results if r["impl"] == impl]
        if not rs:
            continue
        ax.plot([r["L"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=impl)
    ax.set(xscale="log", yscale="log", xlabel="context length L", ylabel="tokens/s (batch 1)",
           title=f"decode, {model}\n{device}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"saved {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--decode", action="store_true", help="measure decode tokens/s with and without the KV cache")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_kv_head", type=int, default=4)
    args = p.parse_args(argv)
    if args.decode:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        name = common.device_name(dev)
        model = f"GPT {args.n_layer}x{args.n_embd}, H={args.n_head}, KVH={args.n_kv_head}"
        results = run_decode(args.lengths, dev, args.n_layer, args.n_embd, args.n_head, args.n_kv_head)
        path = common.save_results("decode", results, device=name, model=model)
        plot_decode(results, name, model, path.with_suffix(".png"))
        return 0
    if not common.require_cuda("bench_attention"):
        return 0
    name = common.device_name()
    results = run_attention(args.dims, args.seqlens, DTYPES[args.dtype], common.do_bench)
    path = common.save_results("attention", results, device=name, dtype=args.dtype,
                               shape="B*T=16384 tokens, H=2048/D")
    plot_attention(results, name, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
