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
# **memory traffic** (most kernels are bandwidth bound), **tensor-core speed** and **what can go wrong**
# (overflow, underflow, lost additions). On an H100 SXM the dense tensor-core peaks double with each halving of
# the operand width: **TF32 495 → BF16/FP16 989 → FP8 1979 TFLOP/s**. (TF32 is FP32's range with a 10-bit
# mantissa: what the tensor cores do with FP32 inputs. Plain FP32 arithmetic on the CUDA cores, the kind an
# elementwise kernel does, peaks at about 67 TFLOP/s.)
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
# ends with FP16 mixed-precision training and dynamic loss scaling (`minite/formats/fp16.py`). Exercise 01 then
# asks for what this lesson does not write: decoding FP16 by hand, *stochastic* rounding in a Triton kernel,
# a compensated FP16 sum, and the loss-scale update rule.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
import numpy as np
import matplotlib.pyplot as plt
from minite._triton import triton, tl
from minite.formats.specs import FP32, FP16, BF16, E4M3, E5M2, FORMATS, encode, decode, round_to_format, bit_string
from minite.formats import DynamicLossScaler
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)
torch.set_num_threads(1)                  # tiny shapes: threads only add overhead

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
# On a GPU, `x.to(tl.float16)` does this in hardware, but the CPU interpreter's fp8 casts are wrong on a few %
# of values (lost carries, no saturation), and chapter 02 needs an exact E4M3/E5M2 encoder on every machine. So
# we write the rounding with integer operations, in Triton, in three steps.
#
# **Step 1: take an FP32 apart.** `x.to(tl.int32, bitcast=True)` reinterprets the 32 bits without changing them.
# Then sign = bit 31, biased exponent = bits 23–30, fraction = bits 0–22. With the hidden 1 put back (for
# normals), $|x| = \text{sig} \cdot 2^{e_{32} - 150}$ with an integer $\text{sig} < 2^{24}$ (FP32 subnormals use
# $e_{32} = 1$ and no hidden bit). Note `>>` is an *arithmetic* shift on int32: mask after shifting.

# %% tags=["nbval-check-output"]
@triton.jit
def fp32_fields(x):
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    a = u & 0x7FFFFFFF                                   # |x| as bits
    e32 = a >> 23                                        # biased exponent, 0 for fp32 subnormals
    sig = tl.where(e32 > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)   # put the hidden 1 back for normals
    return sign, a, tl.maximum(e32, 1), sig              # |x| = sig * 2^(max(e32, 1) - 150)


@triton.jit
def fields_kernel(X_ptr, Out_ptr, N, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    sign, a, e32, sig = fp32_fields(tl.load(X_ptr + offs, mask=mask, other=0.0))
    tl.store(Out_ptr + 3 * offs, sign, mask=mask)
    tl.store(Out_ptr + 3 * offs + 1, e32, mask=mask)
    tl.store(Out_ptr + 3 * offs + 2, sig, mask=mask)


vals = torch.tensor([1.0, -6.5, 0.1, 1e-40]).to(DEVICE)
out = torch.zeros(len(vals), 3, dtype=torch.int32, device=DEVICE)
fields_kernel[(1,)](vals, out, len(vals), BLOCK_SIZE=4)
for v, (sg, e32, sig) in zip(vals.tolist(), out.tolist()):
    back = (-1) ** sg * sig * 2.0 ** (e32 - 150)
    print(f"{v:>10.4g}: sign {sg}, e32 {e32:3d}, sig {sig:8d} (0x{sig:06x}) -> sig * 2^(e32 - 150) = {back:.7g}")
    assert back == v, (v, back)  # the three fields give the value back exactly, the subnormal included

# %% [markdown]
# **Step 2: round to the target's quantum.** The target format (E exponent bits, M mantissa bits, bias $b$) keeps
# M bits after the leading 1, at exponent $e = \max(e_{32} - 127,\ e_{min})$ with $e_{min} = 1 - b$: below
# $e_{min}$ the quantum stops shrinking (subnormals). Its quantum is $2^{e - M}$, so `shift` $= (e - M) - (e_{32} - 150)$
# low bits of `sig` fall below it. Keep `r = sig >> shift` quanta and look at the dropped bits `rem`: round up if
# `rem` is more than half a quantum, or exactly half and `r` is odd (ties to even).
#
# **Step 3: assemble the pattern.** A normal result has `r` = $2^M$ + mantissa and exponent field $e - e_{min} + 1$,
# so the magnitude bits are `((e - e_min) << M) + r`; a subnormal has `r` < $2^M$ and exponent field 0, and the
# same expression gives it. A rounding carry (`r` = $2^{M+1}$) moves into the exponent field by itself. Then the
# special cases: magnitudes past the largest finite pattern, and $\pm\infty$, become $\pm\infty$ (IEEE formats)
# or saturate to $\pm$max (E4M3, whose all-ones pattern is NaN, the `fn` convention); NaN becomes a canonical NaN.

# %%
@triton.jit
def round_to_format_bits(x, E: tl.constexpr, M: tl.constexpr, FN: tl.constexpr):
    """fp32 block -> int32 bit patterns of the (1, E, M) format, round to nearest even."""
    BIAS: tl.constexpr = (1 << (E - 1)) - 1
    EMIN: tl.constexpr = 1 - BIAS
    ALL_ONES: tl.constexpr = (1 << E) - 1
    sign, a, e32, sig = fp32_fields(x)
    # step 2: quantum 2^(e - M), with e clamped at EMIN (subnormals keep the smallest quantum)
    e = tl.maximum(e32 - 127, EMIN)
    shift = tl.minimum(e - M - (e32 - 150), 26)          # >= 23 - M; past 25 every bit is dropped anyway
    r = sig >> shift
    rem = sig - (r << shift)
    half = (1 << shift) >> 1
    round_up = (rem > half) | ((rem == half) & (half > 0) & ((r & 1) == 1))
    r = r + round_up.to(tl.int32)
    # step 3: pattern, then overflow, inf and NaN
    mag = ((e - EMIN) << M) + r
    if FN:   # E4M3: max = S.1111.110 (448), NaN = S.1111.111, no inf: saturate
        max_bits: tl.constexpr = (ALL_ONES << M) | ((1 << M) - 2)
        mag = tl.where((mag > max_bits) | (a == 0x7F800000), max_bits, mag)
        nan_bits: tl.constexpr = (ALL_ONES << M) | ((1 << M) - 1)
    else:    # IEEE: max = S.1..10.1..1, inf = S.1..1.0..0
        max_bits: tl.constexpr = ((ALL_ONES - 1) << M) | ((1 << M) - 1)
        mag = tl.where((mag > max_bits) | (a == 0x7F800000), ALL_ONES << M, mag)
        nan_bits: tl.constexpr = (ALL_ONES << M) | (1 << (M - 1))
    mag = tl.where(a > 0x7F800000, nan_bits, mag)
    return (sign << (E + M)) | mag


@triton.jit
def round_kernel(X_ptr, Y_ptr, N, E: tl.constexpr, M: tl.constexpr, FN: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_ptr + offs, round_to_format_bits(x, E, M, FN), mask=mask)


def to_bits(x, spec, block=16384):
    """fp32 values -> int32 bit patterns of `spec`, on DEVICE; returned on the CPU."""
    x = x.float().contiguous().to(DEVICE)
    y = torch.empty(x.shape, dtype=torch.int32, device=DEVICE)
    round_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), E=spec.exp_bits, M=spec.man_bits, FN=spec.fn,
                                                   BLOCK_SIZE=block)
    return y.cpu()


# %% [markdown]
# Check it bit for bit against torch's own casts, and against minite's encoder (`encode(..., backend="triton")`,
# the `encode_bits_tl` helper that chapter 02's FP8 kernels call). The inputs span 40 binades, and include exact
# ties, zeros, infinities and NaN. torch's overflow rules differ between versions, so against torch the values are
# clamped into range first; against minite they are not.

# %% tags=["nbval-check-output"]
g = torch.Generator().manual_seed(0)
# the inputs and torch's casts stay on the CPU; to_bits and minite's encode run on DEVICE and return to the CPU
x = torch.randn(100_000, generator=g, device="cpu") * torch.exp2(
    torch.randint(-20, 20, (100_000,), generator=g, device="cpu").float())
specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e-30, 65520.0, 464.0],
                        device="cpu")
for s, view in [(FP16, torch.int16), (BF16, torch.int16), (E4M3, torch.uint8), (E5M2, torch.uint8)]:
    xs = x.clamp(-s.max, s.max)                       # in range: no overflow rule involved
    want = xs.to(s.torch_dtype).view(view).to(torch.int32) & ((1 << s.bits) - 1)
    ties = decode(torch.arange(1 << (s.bits - 1), dtype=torch.int32, device="cpu"), s)  # halfway between neighbours
    ties = ((ties[:-1] + ties[1:]) / 2)[torch.isfinite(ties[:-1] + ties[1:])].clamp(-s.max, s.max)
    want_t = ties.to(s.torch_dtype).view(view).to(torch.int32) & ((1 << s.bits) - 1)
    ok_torch = torch.equal(to_bits(xs, s), want) and torch.equal(to_bits(ties, s), want_t)
    allx = torch.cat([x, specials])
    ok_minite = torch.equal(to_bits(allx, s), encode(allx.to(DEVICE), s, backend="triton").cpu())
    assert ok_torch and ok_minite, (s.name, ok_torch, ok_minite)
    print(f"PASS: round to {s.name}: bit-exact vs torch ({xs.numel() + ties.numel()} values, ties included) "
          f"and vs minite's encoder (specials included)")

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
# **Reading the FP16 curve.** It is not a smooth drift but straight pieces with kinks at 16 and 64, and a flat
# line from 256 on. Inside one binade $[2^k, 2^{k+1})$ every FP16 number is a multiple of the same quantum
# $q = 2^{k-10}$, so *every* addition of $c = 	ext{fp16}(0.1) = 0.0999756$ lands on the multiple of $q$ nearest to
# $s + c$: the sum grows by the same rounded step, $q \cdot \operatorname{round}(c / q)$, each time, and the slope is
# that step over $c$. A new binade doubles $q$ and changes the step:

# %% tags=["nbval-check-output"]
c = float(np.float16(0.1))
print(f"{'binade':>12} {'quantum q':>10} {'c / q':>7} {'step':>9} {'slope':>6} {'terms in binade':>16}")
for k in range(3, 9):
    q = 2.0 ** (k - 10)
    step = q * round(c / q)
    crossing = f"{2 ** k / step:.0f}" if step else "never: stalls"
    print(f"[{2 ** k:4d}, {2 ** (k + 1):4d}) {q:10.6f} {c / q:7.3f} {step:9.6f} {step / c:6.3f} {crossing:>16}")
print(f"the fp16 run stalls at {run16[-1]:g} after term {int(np.argmax(run16 == run16[-1])) + 1}")

# %% [markdown]
# From 64 to 256 each step is 0.125 (the sum runs 25 % fast: $c/q$ = 1.6 and 0.8 both round up), and at 256 the
# quantum is 0.25: $c/q = 0.4$ rounds to 0 and the sum never moves again. The FP32 accumulator's quantum near 1000
# is $2^{-14}$, so its 10,000 roundings cost nothing visible. Round-to-nearest is *biased* when the same value is
# added over and over; two cures are compensated (Kahan) summation and **stochastic rounding**, which rounds up
# with a probability equal to the dropped fraction, so that each rounding is right on average. Both are in the
# exercise.

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
# gradient is inf/NaN, skip the step and lower $S$; after a run of clean steps, raise it again.
# `DynamicLossScaler` (`minite/formats/fp16.py`) follows Megatron-LM and `torch.amp.GradScaler`; writing its
# update rule, with Megatron's *hysteresis* (tolerate a few overflows before backing off), is exercise task 4.


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
