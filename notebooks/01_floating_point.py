# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: minite,tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (minite)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Floating point from the bits
#
# Every tensor in an LLM is a pile of bit patterns. How many bits, and how they are split, decides
# **memory traffic** (most kernels are bandwidth bound), **tensor-core speed** (each halving of the width doubles
# peak FLOP/s on an H100: ~67 TF/s FP32, ~990 FP16/BF16, ~1980 FP8) and **what can go wrong** (overflow, underflow,
# lost additions).
#
# Memory arithmetic for a 7B-parameter model:
#
# | format | bytes/param | weights | time to stream them once at 3.35 TB/s |
# |---|---|---|---|
# | FP32 | 4 | 28 GB | 8.4 ms |
# | BF16 / FP16 | 2 | 14 GB | 4.2 ms |
# | FP8 | 1 | 7 GB | 2.1 ms |
#
# Decoding one token reads every weight once, so the format *is* the speed. This chapter builds the formats from
# their bits (`minite/formats/specs.py`), writes the rounding in a Triton kernel with integer operations, and
# ends with FP16 mixed-precision training and dynamic loss scaling (`minite/formats/fp16.py`).

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # run Triton kernels on the CPU interpreter
torch.set_num_threads(1)                      # tiny shapes: threads only add overhead

# %%
import inspect, math
import numpy as np
import matplotlib.pyplot as plt
from minite.formats.specs import (FP32, FP16, BF16, E4M3, E5M2, FORMATS, encode, decode, round_to_format,
                                  bit_string, encode_bits_tl)
from minite.formats import DynamicLossScaler
from minite.testing import check_op

# %% [markdown]
# ## 1. Sign, exponent, mantissa
#
# A format with $E$ exponent bits, $M$ mantissa bits and bias $b = 2^{E-1}-1$ reads a pattern $s\,|\,e\,|\,m$ as
#
# $$
# v = \begin{cases}
# (-1)^s \; 2^{\,e-b} \left(1 + \frac{m}{2^M}\right) & 1 \le e \le e_{top} \quad\text{(normal: a hidden leading 1)}\\[2pt]
# (-1)^s \; 2^{\,1-b} \; \frac{m}{2^M} & e = 0 \quad\text{(subnormal, and } \pm 0\text{)}
# \end{cases}
# $$
#
# IEEE formats reserve $e = 2^E-1$ for $\pm\infty$ ($m=0$) and NaN. E4M3 ("fn" = finite) has no infinity and
# only `S.1111.111` is NaN, which buys one more binade: max $= 1.75 \cdot 2^8 = 448$ instead of 240.
# From $(E, M, b)$ everything follows: max, smallest normal $2^{1-b}$, smallest subnormal $2^{1-b-M}$ and the
# machine epsilon $2^{-M}$ (gap after 1). `FormatSpec` derives them; torch agrees:

# %% tags=["nbval-check-output"]
print(f"{'format':6} {'E':>2} {'M':>2} {'bias':>4} {'max':>12} {'min normal':>11} {'min subnorm':>11} {'eps':>9}")
for s in FORMATS:
    fi = torch.finfo(s.torch_dtype)
    assert (s.max, s.min_normal, s.eps) == (fi.max, fi.smallest_normal, fi.eps)
    print(f"{s.name:6} {s.exp_bits:2} {s.man_bits:2} {s.bias:4} {s.max:12.5g} {s.min_normal:11.3g} "
          f"{s.min_subnormal:11.3g} {s.eps:9.3g}")

# %% [markdown]
# Drawn to scale, one box per bit: BF16's exponent field is exactly FP32's (same range), FP16 trades 3 of those
# exponent bits for mantissa bits (more precision, less range), and the two FP8 formats split 7 bits either way.

# %%
from matplotlib.patches import Patch, Rectangle
FIELD_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}
LABELS = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16", "e4m3": "FP8 E4M3", "e5m2": "FP8 E5M2"}

def draw_bits(ax, y, spec, digits=None):
    """One row of boxes at height y, sign | exponent | mantissa; digits: optional '0'/'1' string, MSB first."""
    fields = ["sign"] + ["exponent"] * spec.exp_bits + ["mantissa"] * spec.man_bits
    for i, field in enumerate(fields):
        ax.add_patch(Rectangle((i, y), 1, 0.8, facecolor=FIELD_COLORS[field], edgecolor="white", lw=1.5))
        if digits is not None:
            ax.text(i + 0.5, y + 0.4, digits[i], ha="center", va="center", color="white", fontsize=11,
                    fontweight="bold")

fig, ax = plt.subplots(figsize=(11, 3.6))
for row, s in enumerate(FORMATS):
    y = -row
    draw_bits(ax, y, s)
    ax.text(-0.6, y + 0.4, f"{LABELS[s.name]}  (E={s.exp_bits}, M={s.man_bits})", ha="right", va="center",
            fontsize=10)
    ax.text(s.bits + 0.6, y + 0.4, f"bias {s.bias}, max {s.max:.5g}", ha="left", va="center", fontsize=9)
ax.set_xlim(-13, 41); ax.set_ylim(-len(FORMATS) + 0.6, 1.3); ax.axis("off")
ax.legend(handles=[Patch(color=c, label=f) for f, c in FIELD_COLORS.items()], loc="upper center", ncol=3,
          frameon=False, bbox_to_anchor=(0.5, 1.08))
ax.set_title("Bit layouts, one box per bit (to scale)", y=1.1)
plt.show()

# %% [markdown]
# A worked example: $-6.5 = -1.625 \cdot 2^2$ in FP16. Sign 1; stored exponent $2 + 15 = 17$ = `10001`;
# mantissa $0.625 \cdot 2^{10} = 640$ = `1010000000`. `encode` gives the same pattern:

# %%
v = -6.5
pattern = encode(torch.tensor([v]), FP16).item()                   # the 16-bit pattern as an int
digits = format(pattern, f"0{FP16.bits}b")                         # MSB (sign) first
e_field, m_field = int(digits[1:1 + FP16.exp_bits], 2), int(digits[1 + FP16.exp_bits:], 2)
fig, ax = plt.subplots(figsize=(8, 1.6))
draw_bits(ax, 0, FP16, digits)
ax.set_xlim(-0.2, FP16.bits + 0.2); ax.set_ylim(-0.1, 0.9); ax.axis("off")
ax.set_title(f"{v} in FP16: (-1)^{digits[0]} * 2^({e_field}-{FP16.bias}) * (1 + {m_field}/2^{FP16.man_bits})"
             f" = {decode(torch.tensor([pattern]), FP16).item()}")
ax.legend(handles=[Patch(color=c, label=f) for f, c in FIELD_COLORS.items()], loc="lower center", ncol=3,
          frameon=False, bbox_to_anchor=(0.5, -0.3))
plt.show()

# %% [markdown]
# The same numbers as bit strings (`sign exponent mantissa`); watch 0.1 being rounded differently by each:

# %% tags=["nbval-check-output"]
for v in [1.0, -2.5, 0.1, 448.0, 65504.0, 1e-7, 3e38]:
    x = torch.tensor([v])
    row = [f"{s.name}: {bit_string(encode(x, s).item(), s):<18} = {decode(encode(x, s), s).item():<11.6g}"
           for s in (FP16, BF16, E4M3)]
    print(f"{v:>8g} | " + " | ".join(row))

# %% [markdown]
# ## 2. Why BF16 keeps FP32's range
#
# BF16 is the top half of an FP32: the same sign and **8 exponent bits**, only 7 of the 23 mantissa bits. So it
# covers $10^{-38}\dots3\cdot10^{38}$ like FP32 (no overflow, no underflow in practice) with ~2-3 significant
# digits. FP16 spends its bits the other way: 10 mantissa bits (more precision) but 5 exponent bits, so it
# overflows above 65504 and flushes to zero below $6\cdot10^{-8}$. Large activations and tiny gradients are
# exactly what an LLM produces, which is why BF16 trains without the loss scaling of section 6.

# %% tags=["nbval-check-output"]
for v in [3e38, 70000.0, 1e-10, 1e-38]:
    x = torch.tensor([v])
    print(f"{v:>8g}  fp32 {bit_string(encode(x, FP32).item(), FP32)}  bf16 {bit_string(encode(x, BF16).item(), BF16)}"
          f" -> {decode(encode(x, BF16), BF16).item():<10.4g} fp16 -> {decode(encode(x, FP16), FP16).item():.4g}")

# %% [markdown]
# ## 3. Rounding: nearest, ties to even, with integer operations
#
# Rounding $x$ to a format keeps the value on the grid $q\,\mathbb{Z}$ where the quantum is
# $q = 2^{\max(e_x,\,e_{min}) - M}$ ($e_x = \lfloor\log_2|x|\rfloor$). In bits: take FP32's 24-bit significand,
# drop `shift` low bits, and round up when the dropped part is more than half a quantum, or exactly half and the
# kept part is odd (ties to even: no bias when many values are rounded). A carry out of the mantissa moves into
# the exponent field by itself, because patterns of positive floats are ordered like integers. Overflow has a rule
# per format: FP16/BF16/E5M2 go to $\pm\infty$, E4M3 saturates to $\pm448$ (`saturate=` switches).
#
# On a GPU, `x.to(tl.float8e4nv)` does this in hardware; the CPU interpreter gets it wrong on a few % of values
# (lost carries, no saturation), so minite writes it with integer operations. This Triton helper is what chapter 02's
# FP8 kernels call:

# %%
print(inspect.getsource(encode_bits_tl.fn if hasattr(encode_bits_tl, "fn") else encode_bits_tl))

# %% [markdown]
# Check it bit for bit against torch's casts, and the round-trip values with `check_op`:

# %% tags=["nbval-check-output"]
g = torch.Generator().manual_seed(0)
x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-20, 20, (100_000,), generator=g).float())
for s, view in [(FP16, torch.int16), (BF16, torch.int16), (E4M3, torch.uint8), (E5M2, torch.uint8)]:
    xs = x.clamp(-s.max, s.max)                       # in range: torch's overflow rule differs across versions
    want = xs.to(s.torch_dtype).view(view).to(torch.int32) & ((1 << s.bits) - 1)
    assert torch.equal(encode(xs, s, backend="triton"), want)
    assert check_op(f"round to {s.name}", lambda t: round_to_format(t, s, backend="triton"),
                    lambda t: t.to(s.torch_dtype).float(), xs, grad=False, atol=0, rtol=0)

# %% [markdown]
# Relative rounding error is at most $\varepsilon/2 = 2^{-M-1}$ across the normal range (a flat band), and grows in
# the subnormal range where the quantum stays fixed while $|x|$ shrinks, until everything flushes to 0
# (relative error 1). Each format's curve ends at its max:

# %%
x64 = torch.logspace(-50, 39, 6000, base=10, dtype=torch.float64)
fig, ax = plt.subplots(figsize=(9, 4))
for s in FORMATS:
    xs = x64[x64 <= s.max]
    err = ((round_to_format(xs.float(), s).double() - xs).abs() / xs).clamp(min=1e-12)
    line, = ax.loglog(xs, err, lw=0.7, label=s.name)
    ax.axhline(s.eps / 2, color=line.get_color(), ls=":", lw=0.8)
ax.set(xlabel="|x|", ylabel="relative error of rounding", ylim=(1e-9, 2),
       title="Rounding error vs magnitude (dotted: eps/2)")
ax.legend(); plt.show()

# %% [markdown]
# ## 4. All 256 FP8 values
#
# FP8 is small enough to list. Each binade $[2^k, 2^{k+1})$ holds $2^M$ values: 8 for E4M3, 4 for E5M2, so the
# numbers are dense near 0 and sparse near the max, evenly on a log scale. E4M3 has more precision, E5M2 more range
# (used for gradients in chapter 02).

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 4.5))
for ax, s in zip(axes, (E4M3, E5M2)):
    v = decode(torch.arange(256, dtype=torch.int32), s)
    fin = v[v.isfinite()]
    pos = fin[fin > 0]
    print(f"{s.name}: {v.isnan().sum().item()} NaN patterns, {v.isinf().sum().item()} inf, {(fin == 0).sum().item()} "
          f"zeros, {pos.numel()} positive finite from {pos.min().item():.3g} to {pos.max().item():g}")
    ax.hist(pos.log2().numpy(), bins=np.arange(-17, 17), color="C0" if s is E4M3 else "C1")
    ax.plot(pos.log2().numpy(), np.zeros(pos.numel()) - 0.5, "|k", ms=8)
    ax.set(title=f"{s.name}: positive values per binade (ticks: each value)", xlabel="log2(value)", xlim=(-17, 17))
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 5. Catastrophic cases, and why accumulation is in FP32
#
# Adding $a + b$ with $|b| < \tfrac12\,\mathrm{ulp}(a)$ returns $a$: the small number is rounded away. FP16's
# ulp at 2048 is 2, BF16's at 256 is 2. A running sum in low precision therefore **stalls**: summing 0.1 ten
# thousand times in FP16 stops growing at 256, where half an ulp (0.125) exceeds 0.1.

# %% tags=["nbval-check-output"]
print("fp16: 2048 + 1 =", (torch.tensor(2048.0, dtype=torch.float16) + 1).item())
print("bf16:  256 + 1 =", (torch.tensor(256.0, dtype=torch.bfloat16) + 1).item())
print("fp32: 2^24 + 1 =", int((torch.tensor(2.0 ** 24) + 1).item()), "(2^24 =", 2 ** 24, ")")
vals = np.full(10_000, 0.1, dtype=np.float16)
run16, acc = np.empty(10_000), np.float16(0)
for i, v in enumerate(vals):
    acc = np.float16(acc + v); run16[i] = acc            # fp16 accumulator
run32 = np.cumsum(vals.astype(np.float32))              # fp16 inputs, fp32 accumulator
print(f"sum of 10,000 x fp16(0.1): fp16 accumulator {run16[-1]:g}, fp32 accumulator {run32[-1]:.2f},"
      f" torch.sum on fp16 {torch.from_numpy(vals).sum().item():.2f}")
plt.figure(figsize=(7, 3))
plt.plot(run16, label="fp16 accumulator"); plt.plot(run32, label="fp32 accumulator")
plt.xlabel("terms added"); plt.ylabel("running sum"); plt.legend(); plt.title("Summing 0.1 in fp16"); plt.show()

# %% [markdown]
# So every serious kernel keeps **inputs** narrow (bandwidth) but **accumulates in FP32**: tensor cores multiply
# FP16/BF16/FP8 and add into FP32 (`tl.dot(a, b, acc)` with an FP32 `acc`), `torch.sum` of an FP16 tensor
# accumulates in FP32 and rounds once at the end (1000.00 above: the FP16 nearest to 999.76), and
# the minite kernels load then `.to(tl.float32)` at once. The same goes for weights: an update of $10^{-4}$ to
# a weight of 1.0 is below half an FP16 ulp ($2^{-11}$) and is lost, which is why optimizers keep **FP32 master weights**:

# %% tags=["nbval-check-output"]
w16, w32 = torch.tensor(1.0, dtype=torch.float16), torch.tensor(1.0)
for _ in range(100):
    w16 -= 1e-4; w32 -= 1e-4
print(f"100 updates of -1e-4: fp16 weight {w16.item():.4f}, fp32 master {w32.item():.4f}")

# %% [markdown]
# ## 6. Mixed precision: FP16 with master weights and dynamic loss scaling
#
# The recipe (Micikevicius et al., 2018): forward and backward in FP16, weights kept in FP32 and rounded to FP16
# for each step, the update applied to the FP32 master. The danger is in the backward: activation gradients are
# tiny (a loss averaged over many tokens, divided again by the number of micro-batches of gradient accumulation)
# and FP16 flushes everything below $2^{-24} \approx 6\cdot10^{-8}$ to zero.
#
# Our toy: a 3-layer MLP classifier, 512 tokens per micro-batch, loss divided by 4096 micro-batches. Histogram of
# the activation gradients (computed in FP32), against FP16's limits:

# %%
import copy
import torch.nn.functional as F
torch.manual_seed(0)
N, D, H, V, ACCUM = 512, 16, 64, 64, 4096
X = torch.randn(N, D)
Y = (X @ torch.randn(D, V)).argmax(-1)                  # labels of a random linear teacher: learnable

def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, H), torch.nn.Tanh(),
                               torch.nn.Linear(H, V))

def activation_grads(dtype, scale=1.0):
    model, h, acts = make_model().to(dtype), X.to(dtype), []
    for layer in model:
        h = layer(h); h.retain_grad(); acts.append(h)
    (F.cross_entropy(h.float(), Y) / ACCUM * scale).backward()
    return torch.cat([a.grad.float().flatten() for a in acts]) / scale

g32 = activation_grads(torch.float32)
print(f"activation grads below 2^-24: {(g32.abs() < 2 ** -24).float().mean().item():.0%} (fp32 run)")
print(f"exactly zero in an fp16 backward: {(activation_grads(torch.float16) == 0).float().mean().item():.0%}; "
      f"with the loss scaled by 2^16: {(activation_grads(torch.float16, 2.0 ** 16) == 0).float().mean().item():.1%}")
plt.figure(figsize=(7, 3))
plt.hist(g32.abs().clamp(min=2 ** -40).log2().numpy(), bins=60, color="C0", label="|grad| (fp32)")
plt.hist((g32.abs() * 2 ** 16).log2().numpy(), bins=60, color="C2", alpha=0.5, label="|grad| x 2^16")
for v, t in [(-24, "fp16 min subnormal"), (-14, "fp16 min normal"), (math.log2(65504), "fp16 max")]:
    plt.axvline(v, color="k", ls="--", lw=0.8); plt.text(v + 0.3, 10, t, rotation=90, fontsize=8)
plt.xlabel("log2 |activation gradient|"); plt.legend(); plt.title("Gradients underflow in fp16"); plt.show()

# %% [markdown]
# Scaling the loss by $S$ scales every gradient by $S$ (the backward is linear in the upstream gradient), shifting
# the histogram into FP16's range. Divide by $S$ (in FP32) before the optimizer step and nothing else changes.
# $S$ is picked **dynamically**: start high ($2^{16}$ by default; $2^{34}$ here, to watch it work); if any
# gradient is inf/NaN, skip the step and halve $S$; after `growth_interval` clean steps, double it.
# `DynamicLossScaler` follows Megatron-LM and `torch.amp.GradScaler`:

# %%
print(inspect.getsource(DynamicLossScaler.update))


# %% [markdown]
# Training for 40 steps (Adam) in FP32, FP16 without scaling, FP16 with the scaler, and BF16 without one:

# %%
def train(dtype, scaler=None, steps=40):
    master = make_model()                                    # fp32 master weights, owned by the optimizer
    model = copy.deepcopy(master).to(dtype)                  # the low-precision copy that runs fwd/bwd
    opt = torch.optim.Adam(master.parameters(), lr=1e-2)
    scaler = scaler or DynamicLossScaler(enabled=False)
    losses, scales = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(X.to(dtype)).float(), Y)   # loss in fp32
        model.zero_grad(set_to_none=True)
        scaler.scale(loss / ACCUM).backward()                    # low-precision backward
        for pm, p in zip(master.parameters(), model.parameters()):
            pm.grad = p.grad.float()                             # grads to the fp32 master
        scaler.step(opt)                                         # unscale, check inf, step (or skip)
        scaler.update()
        with torch.no_grad():
            for pm, p in zip(master.parameters(), model.parameters()):
                p.copy_(pm)                                      # round the master to the working dtype
        losses.append(loss.item()); scales.append(scaler.scale_value)
    return losses, scales

runs = {"fp32": train(torch.float32), "fp16, no scaling": train(torch.float16),
        "fp16 + loss scaler": train(torch.float16, DynamicLossScaler(init_scale=2.0 ** 34, growth_interval=10)),
        "bf16, no scaling": train(torch.bfloat16)}
for name, (losses, _) in runs.items():
    print(f"{name:20} loss {losses[0]:.2f} -> {losses[-1]:.2f}")
scales = runs["fp16 + loss scaler"][1]
print("loss scale, log2, every 4 steps:", [int(math.log2(s)) for s in scales[::4]])
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, (losses, _) in runs.items():
    a1.plot(losses, label=name, ls="--" if "bf16" in name else "-")
a1.set(xlabel="step", ylabel="loss", title="Training loss"); a1.legend()
a2.plot(np.log2(scales)); a2.set(xlabel="step", ylabel="log2 scale", title="Dynamic loss scale (fp16)")
plt.tight_layout(); plt.show()

# %% [markdown]
# FP16 without scaling learns slowly (most gradients are zero); with the scaler it follows FP32: the first steps
# overflow and are skipped while $S$ backs off from $2^{34}$, then $S$ doubles every 10 clean steps. BF16 needs none
# of this: its exponent range is FP32's. That is why BF16 is the default for LLM training, and FP16 + a loss
# scaler the fallback on GPUs without BF16.
#
# ## 7. Benchmark (GPU only)
#
# The encode kernel is a pure map (4 bytes in, 4 out per value): it should run near memory bandwidth.

# %%
if torch.cuda.is_available():
    import triton.testing
    x = torch.randn(1 << 26, device="cuda")
    for s in (BF16, E4M3):
        ms = triton.testing.do_bench(lambda: encode(x, s, backend="triton"))
        ms_t = triton.testing.do_bench(lambda: x.to(s.torch_dtype))
        print(f"{s.name}: minite encode {ms:.3f} ms ({8 * x.numel() / ms / 1e9:.0f} GB/s), torch cast {ms_t:.3f} ms")
else:
    print("no GPU here: benchmark skipped")

# %% [markdown]
# ## 8. Where this is used
#
# * `minite/formats/specs.py`: `FormatSpec`, `encode`/`decode`, and the Triton helpers `encode_bits_tl` /
#   `decode_bits_tl` that chapter 02's FP8 quantization kernels (`minite/formats/fp8.py`) call to round to
#   E4M3/E5M2 with saturation.
# * `minite/formats/fp16.py`: `DynamicLossScaler`, used by the training script (`python -m minite.train`) when
#   it trains in FP16; in BF16 it is disabled.
# * Every minite kernel loads its inputs in FP16/BF16 and accumulates in FP32 (section 5).
