"""One training step of minite's GPT against a nanoGPT-shaped model written here in plain PyTorch, same shapes.

    python benchmarks/bench_gpt_step.py                         # 6x384 (the gpu preset), then GPT-2 124M
    python benchmarks/bench_gpt_step.py --shapes 124M --variants nanoGPT minite
    python benchmarks/bench_gpt_step.py --device cpu --shapes tiny --steps 2     # the script's own check, on a CPU

The peer (``NanoGPT`` below) is nanoGPT's ``model.py`` in shape and in what it asks of PyTorch: LayerNorm (no
bias), a 4x GELU MLP, causal attention through ``F.scaled_dot_product_attention``, a learned position table, the
LM head tied to the token embedding, the whole model under one ``torch.compile``. Both sides: fused AdamW, bf16
autocast, the same batch of random tokens, the same compile mode (``default`` at 124M as nanoGPT trains it;
``reduce-overhead`` at 6x384 as minite's main job runs it).

Variants: ``nanoGPT``; ``minite`` compiled as the main job compiles it (one graph per transformer block, shared
by every block: ``minite.compile.compile_regions``); ``minite-whole`` the whole minite model under one
``torch.compile`` (how the main job compiled before; it says what regional compilation costs per step, if anything).

Reported per variant: ms per step (median of 3 runs of --steps steps, after 5 warm-up steps), tokens/s, seconds to
the end of the first step (compile included) and of the warm-up, peak memory, and

    MFU = tokens/s * (6 N + 12 L C T) / 989e12

N: the model's parameters less its position table (the tied embedding once), L layers, C width, T context;
989 TFLOP/s is the dense bf16 peak of an H100/H200 SXM (the same number for both: the H200 has the H100's tensor
cores). ``ratio_time`` = minite's step time / nanoGPT's (issue 33's target: at most 0.9). Results:
benchmarks/results/gpt_step_<device>.json and .png; the JSON is rewritten after every variant, so a run stopped
by a time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402

PEAK_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100/H200 SXM (no sparsity)
# L layers, H heads, KV key/value heads (minite), C width, T context, B batch, V vocabulary, mode of torch.compile
SHAPES = {
    "6x384": dict(L=6, H=6, KV=2, C=384, T=256, B=64, V=128, dropout=0.1, mode="reduce-overhead"),  # gpu preset
    "124M": dict(L=12, H=12, KV=12, C=768, T=1024, B=16, V=50304, dropout=0.0, mode="default"),  # GPT-2 small
    "tiny": dict(L=2, H=2, KV=2, C=32, T=16, B=2, V=64, dropout=0.0, mode="off"),  # the script's check on a CPU
}
# minite: backend="auto" (on a GPU, per op the recorded winner: minite/choices.py); minite-triton: minite's kernels
# forced everywhere (--model.backend=triton), what a kernel change is measured by
VARIANTS = ("nanoGPT", "minite", "minite-whole", "minite-triton")
# The default order: what matters first, so that a run cut short by a time limit keeps it (the JSON is rewritten
# after every variant): the gpu preset and GPT-2 against the peer, then the whole-model compile of the preset, then
# GPT-2 on minite's kernels only.
PLAN = (("6x384", "nanoGPT"), ("6x384", "minite"), ("124M", "nanoGPT"), ("124M", "minite"), ("6x384", "minite-whole"),
        ("124M", "minite-triton"))


# ------------------------------------------------------------------------------------ the peer, in plain PyTorch
class NanoBlock(nn.Module):
    def __init__(self, C: int, H: int, dropout: float):
        super().__init__()
        self.H, self.dropout = H, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(C, bias=False), nn.LayerNorm(C, bias=False)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        p = self.dropout if self.training else 0.0
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + F.dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)), p, self.training)
        return x + F.dropout(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))), p, self.training)


class NanoGPT(nn.Module):
    """nanoGPT's GPT at bias=False: token + position embeddings, blocks, final LayerNorm, tied head."""

    def __init__(self, L: int, H: int, C: int, T: int, V: int, dropout: float = 0.0):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(V, C), nn.Embedding(T, C), nn.Dropout(dropout)
        self.h = nn.ModuleList([NanoBlock(C, H, dropout) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C, bias=False)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.wte.weight = self.lm_head.weight  # tied
        for name, p in self.named_parameters():  # GPT-2's init: the residual projections scaled by depth
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * L) if name.endswith(("c_proj.weight", "mlp_proj.weight"))
                                else 0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ------------------------------------------------------------------------------------------------- one variant
def build(variant: str, s: dict, dev: str, compile_mode: str | None):
    """The model of `variant` on `dev`, compiled with `compile_mode` (None: eager)."""
    torch.manual_seed(0)
    if variant == "nanoGPT":
        model = NanoGPT(s["L"], s["H"], s["C"], s["T"], s["V"], s["dropout"]).to(dev)
    else:
        from minite.models.gpt import GPT, GPTConfig
        model = GPT(GPTConfig(vocab_size=s["V"], block_size=s["T"], n_layer=s["L"], n_head=s["H"], n_kv_head=s["KV"],
                              n_embd=s["C"], dropout=s["dropout"],
                              backend="triton" if variant == "minite-triton" else "auto")).to(dev)
    if compile_mode is not None:
        if variant in ("minite", "minite-triton"):
            from minite.compile import compile_regions
            compile_regions(model, compile_mode)
        else:
            model.compile(mode=None if compile_mode == "default" else compile_mode)
    return model


def n_params(model: nn.Module) -> int:
    """Parameters less the position table (nanoGPT's own count), the tied embedding once."""
    n = sum(p.numel() for p in model.parameters())
    return n - (model.wpe.weight.numel() if isinstance(model, NanoGPT) else 0)


def measure(variant: str, shape: str, s: dict, dev: str, steps: int, compile_mode: str | None) -> dict:
    import torch._dynamo
    torch._dynamo.reset()
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_build = time.perf_counter()
    model = build(variant, s, dev, compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    g = torch.Generator(device=dev).manual_seed(0)
    x, y = (torch.randint(0, s["V"], (s["B"], s["T"]), device=dev, generator=g) for _ in range(2))

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    step()
    sync()
    first = time.perf_counter() - t_build
    for _ in range(4):
        loss = step()
    sync()
    warm = time.perf_counter() - t_build
    runs = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        sync()
        runs.append((time.perf_counter() - t0) / steps)
    dt = sorted(runs)[1]
    n = n_params(model)
    tok_s = s["B"] * s["T"] / dt
    flops_per_token = 6 * n + 12 * s["L"] * s["C"] * s["T"]
    r = {"shape": shape, "impl": variant, "compile": compile_mode or "off", "ms": dt * 1e3, "tokens_per_s": tok_s,
         "mfu": tok_s * flops_per_token / PEAK_FLOPS, "params": n, "flops_per_token": flops_per_token,
         "first_step_s": first, "warmup_s": warm, "loss": float(loss.detach()),
         "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
         **{k: s[k] for k in ("L", "H", "KV", "C", "T", "B", "V", "dropout")}}
    print(f"  {shape:6s} {variant:13s} {r['compile']:16s} {r['ms']:8.2f} ms/step {tok_s / 1e3:9.0f}k tok/s  "
          f"MFU {100 * r['mfu']:5.1f}%  params {n / 1e6:6.1f}M  first step {first:5.1f} s  warm {warm:5.1f} s  "
          f"loss {r['loss']:.3f}", flush=True)
    model = opt = None  # free the memory before the next variant (step() holds them too)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return r


def ratios(results: list[dict]) -> None:
    """ratio_time (step time / nanoGPT's at the same shape) on every minite row; printed."""
    for r in results:
        peer = next((p for p in results if p["impl"] == "nanoGPT" and p["shape"] == r["shape"]), None)
        if peer is not None and r["impl"] != "nanoGPT":
            r["ratio_time"] = r["ms"] / peer["ms"]
            r["peer_ms"], r["peer_mfu"] = peer["ms"], peer["mfu"]


def draw(results: list[dict]):
    def fill(fig):
        shapes = list(dict.fromkeys(r["shape"] for r in results))
        for i, shape in enumerate(shapes):
            ax = fig.add_subplot(1, len(shapes), i + 1)
            rows = [r for r in results if r["shape"] == shape]
            bars = ax.bar([r["impl"] for r in rows], [r["ms"] for r in rows],
                          color=["tab:gray" if r["impl"] == "nanoGPT" else "tab:blue" for r in rows])
            for b, r in zip(bars, rows):
                ax.annotate(f"MFU {100 * r['mfu']:.1f}%" + (f"\n{r['ratio_time']:.2f}x time" if "ratio_time" in r
                                                             else ""), (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{shape}: B={rows[0]['B']} T={rows[0]['T']} ({rows[0]['compile']})", fontsize=9)
            ax.set_ylabel("ms per training step (lower is better)")
            ax.grid(alpha=0.3, axis="y")
    return fill


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: PLAN's (6x384, 124M)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: PLAN's (minite-whole at 6x384 only)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed run (3 runs, the median kept)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--compile", default=None, help="override every shape's compile mode (off: eager)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpt_step_<device>.json)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not common.require_cuda("bench_gpt_step.py"):
        return 0
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    device = common.device_name(args.device)
    print(f"{device}, torch {torch.__version__}; MFU = tokens/s * (6N + 12 L C T) / {PEAK_FLOPS / 1e12:.0f} TFLOP/s "
          "(dense bf16, H100/H200 SXM)", flush=True)
    plan = PLAN if not (args.shapes or args.variants) else \
        [(s, v) for s in args.shapes or ("6x384", "124M") for v in args.variants or VARIANTS]
    results, failed = [], []
    for shape, variant in plan:
        s = SHAPES[shape]
        mode = args.compile or s["mode"]
        try:
            results.append(measure(variant, shape, s, args.device, args.steps, None if mode == "off" else mode))
        except Exception as e:  # a variant that fails is recorded and the others still run
            msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            print(f"  {shape:6s} {variant:13s} FAILED {msg}", flush=True)
            failed.append({"shape": shape, "impl": variant, "error": msg})
        ratios(results)
        common.save_results("gpt_step", results, device=device, out=args.out, peak_flops=PEAK_FLOPS,
                            mfu_formula="tokens/s * (6N + 12 L C T) / peak_flops; N without the position table",
                            failed=failed)
    for r in results:
        if "ratio_time" in r:
            print(f"  {r['shape']}: {r['impl']} / nanoGPT step time = {r['ratio_time']:.3f} "
                  f"(MFU {100 * r['mfu']:.1f}% vs {100 * r['peer_mfu']:.1f}%)", flush=True)
    if results:
        common.save_plot("gpt_step", device, draw(results), out=args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
