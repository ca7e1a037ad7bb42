"""Benchmark minite's flash attention against PyTorch SDPA (flash and cuDNN backends), and decoding with and
without the KV cache.

    python benchmarks/bench_attention.py [--dims 64 128] [--seqlens 512 1024 ... 16384] [--dtype bf16]   # GPU only
    python benchmarks/bench_attention.py --decode [--lengths 64 128 256 512 1024] [--gemv-tuning]       # any device

Attention (GPU): B * T = 16k tokens, H = 2048 / D heads (FlashAttention's benchmark shape), causal and not.
FLOPs: forward 4 * B * H * T^2 * D (two matmuls), halved when causal; backward 2.5x the forward (five matmuls,
one of them recomputing S), so forward+backward is 3.5x. TFLOP/s = FLOPs / time. Saved to
benchmarks/results/attention_<device>.json and .png.

Decode: a GPT (--n_layer/--n_embd/--n_head/--n_kv_head; on a GPU by default issue 33's 12 x 768, 12 heads, 4 kv
heads) generates one token after a context of L tokens, either recomputing the whole context (no cache: O(L) work
per token) or with the KVCache (one token through the model, attention reads L cached keys). On a GPU also:
minite's decode step captured as a CUDA graph (minite.decoding.Decoder, "reduce-overhead"), and its peer, the same
model and weights written in plain PyTorch (F.rms_norm, RoPE in torch, a static KV cache written by index_copy_,
SDPA over the cache with a mask; gpt-fast's decode loop) under torch.compile(mode="reduce-overhead"). Each row:
tokens/s and its share of the HBM roofline (the bytes a cached step must read, every weight and the L cached keys
and values, over the device's peak bandwidth). Saved to benchmarks/results/decode_<device>.json and .png.
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
    else:
        print("decode: the CUDA-graph rows (minite's Decoder and the plain-PyTorch torch.compile peer) run on a GPU "
              "only; on the CPU: no cache and the eager KV cache")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    peak, peak_key = common.peak_bandwidth(common.device_name(device)) if device == "cuda" else (None, None)
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    peer = PlainPeer(m, Tmax) if device == "cuda" else None  # one compiled graph for every L
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
            times = [("minite no cache", no_cache), ("minite kv cache", cached)]
            if device == "cuda":  # the same step captured once and replayed: one CUDA graph a token
                from minite.decoding import Decoder
                dec = Decoder(m, compile="reduce-overhead")
                _refill(m, idx, cache)
                for _ in range(3):  # compile, record, replay
                    dec(tok, cache)
                graph = _best(lambda: dec(tok, cache), steps, sync, before=lambda: _refill(m, idx, cache))
                times.append(("minite kv cache + CUDA graph", graph))
                times.append(("plain torch, reduce-overhead", peer.seconds(m, idx, cache, steps, sync)))
        # what one cached step must read at least: every weight once, and the L cached keys and values of every
        # layer (issue 20 reports tokens/s as a share of the HBM roofline: bytes / bandwidth / seconds)
        kv = sum(t[:, :, :L].numel() * t.element_size() for t in cache.k + cache.v)
        for impl, s in times:
            r = {"impl": impl, "L": L, "ms_per_token": 1e3 * s, "tokens_per_s": 1 / s,
                 "bytes_per_token": weights + kv if impl != "minite no cache" else None}
            if peak and r["bytes_per_token"]:
                r["pct_hbm_roofline"] = 100 * r["bytes_per_token"] / s / peak
            out.append(r)
        graph, peer_s = dict(times).get("minite kv cache + CUDA graph"), dict(times).get("plain torch, reduce-overhead")
        if graph and peer_s:  # issue 33's bar: minite's graph at least as fast as the plain-PyTorch one
            out[-2]["speedup_vs_plain_torch"] = peer_s / graph
            print(f"L={L:6d}  minite's CUDA-graph step vs the plain-PyTorch peer: {peer_s / graph:.2f}x")
        print(f"L={L:6d}  " + "   ".join(
            f"{r['impl']} {r['tokens_per_s']:8.1f} tok/s" + (f" ({r['pct_hbm_roofline']:.1f}% of HBM)"
                                                           if "pct_hbm_roofline" in r else "")
            for r in out if r["L"] == L))
    if peak:
        print(f"HBM roofline: weights {weights / 1e6:.1f} MB + the cached K/V, at {peak / 1e12:.2f} TB/s "
              f"({peak_key}): {peak / weights:.0f} tok/s at most")
    return out


class PlainDecoder(torch.nn.Module):
    """The peer: a minite GPT's decode step in plain PyTorch, as gpt-fast writes it (F.rms_norm, RoPE in torch ops,
    a static KV cache written with index_copy_ at the position, SDPA over the whole cache with a position mask,
    enable_gqa), no minite op. Same weights (the GPT's own tensors); equal positions across the batch. step(tok,
    pos): tok (B, 1), pos (1,) int64 on the device -> logits (B, 1, V_pad); the caller moves pos on (gpt-fast's
    ``input_pos += 1``, outside the graph)."""

    def __init__(self, m, batch: int, T_max: int):
        super().__init__()
        c, p = m.config, next(m.parameters())
        self.H, self.KVH, self.D, self.eps, self.T_max = c.n_head, c.n_kv_head, c.n_embd // c.n_head, c.norm_eps, T_max
        self.wte, self.norm_f = m.wte.weight, m.norm_f.weight
        self.layers = [(b.norm1.weight, b.attn.qkv.weight, b.attn.proj.weight, b.norm2.weight, b.mlp.gate_up.weight,
                        b.mlp.down.weight) for b in m.blocks]
        rot = m.blocks[0].attn.rotary
        self.cos, self.sin = rot.cos, rot.sin  # (block_size, D/2)
        shape = (batch, self.KVH, T_max, self.D)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in self.layers]

    def _rope(self, x, cos, sin):  # x (B, 1, heads, D), cos/sin (1, D/2): rotate halves in fp32
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, H, KVH, D = tok.shape[0], self.H, self.KVH, self.D
        C = H * D
        x = F.embedding(tok, self.wte)  # (B, 1, C)
        cos, sin = self.cos[pos][:, None].float(), self.sin[pos][:, None].float()  # (1, 1, D/2)
        mask = (torch.arange(self.T_max, device=tok.device) <= pos).view(1, 1, 1, -1)  # keys 0 .. pos
        for (n1, wqkv, wo, n2, wgu, wd), kc, vc in zip(self.layers, self.k, self.v):
            q, k, v = F.linear(F.rms_norm(x, (C,), n1, self.eps), wqkv).split([H * D, KVH * D, KVH * D], dim=-1)
            q = self._rope(q.view(B, 1, H, D), cos, sin).transpose(1, 2)  # (B, H, 1, D)
            kc.index_copy_(2, pos, self._rope(k.view(B, 1, KVH, D), cos, sin).transpose(1, 2))
            vc.index_copy_(2, pos, v.view(B, 1, KVH, D).transpose(1, 2))
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)  # (B, H, 1, D)
            x = x + F.linear(y.transpose(1, 2).reshape(B, 1, C), wo)
            gate, up = F.linear(F.rms_norm(x, (C,), n2, self.eps), wgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, wd)
        return F.linear(F.rms_norm(x, (C,), self.norm_f, self.eps), self.wte)  # (B, 1, V_pad)


class PlainPeer:
    """PlainDecoder (batch 1) under torch.compile(mode="reduce-overhead"): its cache, weights and position marked
    static (gpt-fast keeps them as module buffers: the graph reads and writes them in place), compiled once."""

    def __init__(self, m, T_max: int):
        self.dec = PlainDecoder(m, 1, T_max)
        self.pos = torch.zeros(1, dtype=torch.int64, device=next(m.parameters()).device)
        d = self.dec
        for t in (d.wte, d.norm_f, d.cos, d.sin, self.pos, *d.k, *d.v, *(w for layer in d.layers for w in layer)):
            torch._dynamo.mark_static_address(t)
        self.step = torch.compile(d.step, mode="reduce-overhead", fullgraph=True)

    def seconds(self, m, idx, cache, steps, sync) -> float:
        """Seconds per token from the context of `idx`, which minite's prefill leaves in `cache` (copied into the
        peer's own cache); the peer's logits are checked against minite's cached forward first."""
        L, tok = idx.shape[1], idx[:, -1:]

        def refill():
            _refill(m, idx, cache)
            for a, b in zip(self.dec.k + self.dec.v, cache.k + cache.v):
                a.copy_(b)
            self.pos.fill_(L)

        def one():
            logits = self.step(tok, self.pos)
            self.pos.add_(1)  # gpt-fast's input_pos += 1, outside the graph
            return logits

        refill()
        want = m(tok, kv_cache=cache)[0].float()  # minite's cached forward at position L
        for _ in range(3):  # compile, record, replay
            refill()
            got = one().float()
        err = ((got - want).norm() / want.norm()).item()
        if not err < 3e-2:  # never time a wrong peer (bf16 through every layer: ~1e-2 expected)
            raise RuntimeError(f"plain-PyTorch peer: logits differ from minite's by {err:.3g} (relative L2) at L={L}")
        return _best(one, steps, sync, before=refill)


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
    for impl in ("minite no cache", "minite kv cache", "minite kv cache + CUDA graph", "plain torch, reduce-overhead"):
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
    p.add_argument("--n_layer", type=int, default=None, help="default: 12 on a GPU (issue 33's model), 4 on the CPU")
    p.add_argument("--n_embd", type=int, default=None, help="default: 768 on a GPU, 256 on the CPU")
    p.add_argument("--n_head", type=int, default=None, help="default: 12 on a GPU, 4 on the CPU")
    p.add_argument("--n_kv_head", type=int, default=4)
    p.add_argument("--gemv-tuning", action="store_true",
                   help="decode: Inductor's coordinate_descent_tuning for both compiled rows (minite's and the peer's; "
                        "gpt-fast's setting: batch-1 matmuls become generated GEMVs, fusable with norms and SwiGLU)")
    args = p.parse_args(argv)
    if args.decode:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for k, gpu, cpu in (("n_layer", 12, 4), ("n_embd", 768, 256), ("n_head", 12, 4)):
            if getattr(args, k) is None:
                setattr(args, k, gpu if dev == "cuda" else cpu)
        name = common.device_name(dev)
        model = f"GPT {args.n_layer}x{args.n_embd}, H={args.n_head}, KVH={args.n_kv_head}"
        if args.gemv_tuning:
            import torch._inductor.config as inductor_config
            inductor_config.coordinate_descent_tuning = True
        results = run_decode(args.lengths, dev, args.n_layer, args.n_embd, args.n_head, args.n_kv_head)
        path = common.save_results("decode", results, device=name, model=model, gemv_tuning=args.gemv_tuning)
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
