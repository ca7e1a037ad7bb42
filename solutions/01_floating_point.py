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
# # 01 · Floating point from the bits — exercises
#
# Four graded tasks. Fill in each region between `### BEGIN SOLUTION` and `### END SOLUTION`, run the check cell
# below it. Grade with `python -m minite.grading grade exercises/01_floating_point.ipynb`.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # run Triton kernels on the CPU interpreter
torch.set_num_threads(1)                      # tiny shapes: threads only add overhead

# %%
import torch
from minite._triton import triton, tl
from minite.formats.specs import BF16, encode
from minite.formats import DynamicLossScaler

def torch_bf16_bits(x):
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF

def bf16_is_nan(b):
    return ((b >> 7) & 0xFF == 0xFF) & (b & 0x7F != 0)

g = torch.Generator().manual_seed(0)
# fp32 test values: random magnitudes, exact bf16 ties and their neighbours, specials
X = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-130, 128, (100_000,), generator=g).float())
ties = (torch.randint(0, 1 << 16, (20_000,), generator=g, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
X = torch.cat([X, ties, torch.nextafter(ties, 2 * ties), torch.nextafter(ties, 0 * ties),
               torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028235e38, 1e-45])])


# %% [markdown]
# ## Task 1 — decode an FP16 bit pattern by hand
#
# FP16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. Return the Python float of a 16-bit pattern
# `bits` (0 ≤ bits < 65536): normal numbers $(-1)^s 2^{e-15}(1 + m/1024)$, subnormals $(-1)^s 2^{-14} m/1024$,
# $\pm 0$, $\pm\infty$ ($e = 31, m = 0$), NaN ($e = 31, m \ne 0$). Use only integer operations and `2.0 ** k`.

# %% minite={"task": "decode_fp16"}
def decode_fp16(bits: int) -> float:
    ### BEGIN SOLUTION
    s, e, m = bits >> 15, (bits >> 10) & 0x1F, bits & 0x3FF
    if e == 0x1F:
        v = float("inf") if m == 0 else float("nan")
    elif e == 0:
        v = 2.0 ** -14 * (m / 1024)
    else:
        v = 2.0 ** (e - 15) * (1 + m / 1024)
    return -v if s else v
    ### END SOLUTION


# %% minite={"check": "decode_fp16"} tags=["nbval-check-output"]
# CHECK: decode_fp16
import math
patterns = torch.arange(1 << 16, dtype=torch.int32)
want = patterns.to(torch.int16).view(torch.float16).float().tolist()
bad = [p for p, w in zip(range(1 << 16), want)
       if not ((math.isnan(w) and math.isnan(decode_fp16(p))) or (decode_fp16(p) == w
               and math.copysign(1, decode_fp16(p)) == math.copysign(1, w)))]
assert not bad, f"{len(bad)} patterns wrong, e.g. {hex(bad[0])}: got {decode_fp16(bad[0])}"
print("PASS: decode_fp16 on all 65536 patterns")


# %% [markdown]
# ## Task 2 — round FP32 to BF16 with integer operations
#
# BF16 is the top 16 bits of an FP32. Truncating would always round toward zero; round-to-nearest-even instead:
# add `0x7FFF` plus the lowest kept bit (bit 16) to the FP32 bits, then shift right by 16. Ties (low half exactly
# `0x8000`) then round up only when the kept part is odd. The carry ripples into the exponent by itself, and the
# largest FP32 values correctly round to inf. NaN must stay NaN (return `0x7FC0` with the sign bit). Return the
# int32 tensor of 16-bit patterns (0 ≤ b < 65536).

# %% minite={"task": "fp32_to_bf16_bits"}
def fp32_to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    u = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF     # the fp32 bits, as a non-negative int64
    ### BEGIN SOLUTION
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = torch.where(nan, (u >> 16) & 0x8000 | 0x7FC0, rounded)
    ### END SOLUTION
    return out.to(torch.int32)


# %% minite={"check": "fp32_to_bf16_bits"} tags=["nbval-check-output"]
# CHECK: fp32_to_bf16_bits
got, want = fp32_to_bf16_bits(X), torch_bf16_bits(X)
assert got.dtype == torch.int32 and got.shape == X.shape
nan = bf16_is_nan(want)
assert torch.equal(bf16_is_nan(got), nan), "NaN must stay NaN (and nothing else may become NaN)"
assert torch.equal(got[~nan], want[~nan]), f"{int((got != want)[~nan].sum())} of {X.numel()} values rounded wrong"
print(f"PASS: fp32_to_bf16_bits bit-exact on {X.numel()} values incl. ties")


# %% [markdown]
# ## Task 3 — the same rounding as a Triton kernel body
#
# Write the body of a kernel that rounds a block of `BLOCK_SIZE` FP32 values to BF16 bit patterns (int32) with the
# same trick. In Triton: `x.to(tl.int32, bitcast=True)` reinterprets the bits; `>>` on int32 is an arithmetic
# shift, so mask after shifting (`(u >> 16) & 0xFFFF`). Here you may ignore NaN inputs (the check leaves them out).

# %% minite={"task": "round_bf16_kernel"}
@triton.jit
def round_bf16_kernel(X_ptr, Y_ptr, N, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    ### BEGIN SOLUTION
    u = x.to(tl.int32, bitcast=True)
    y = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    tl.store(Y_ptr + offs, y, mask=mask)
    ### END SOLUTION

def round_bf16_triton(x):
    y = torch.zeros(x.shape, dtype=torch.int32)
    round_bf16_kernel[(triton.cdiv(x.numel(), 16384),)](x, y, x.numel(), BLOCK_SIZE=16384)
    return y


# %% minite={"check": "round_bf16_kernel"} tags=["nbval-check-output"]
# CHECK: round_bf16_kernel
xs = X[~X.isnan()].contiguous()
got, want = round_bf16_triton(xs), torch_bf16_bits(xs)
assert torch.equal(got, want), f"{int((got != want).sum())} of {xs.numel()} values rounded wrong"
assert torch.equal(got, encode(xs, BF16, backend="torch"))
print(f"PASS: round_bf16_kernel bit-exact on {xs.numel()} values")


# %% [markdown]
# ## Task 4 — the dynamic loss-scale update rule
#
# Given this step's verdict `found_inf`, return the new `(scale, growth_tracker, hysteresis_tracker)`:
#
# * overflow: `growth_tracker = 0`, `hysteresis_tracker -= 1`, and once it is ≤ 0 the scale backs off:
#   `scale = max(scale * backoff_factor, min_scale)`;
# * clean step: `growth_tracker += 1`; when it reaches `growth_interval`: `scale *= growth_factor`, reset
#   `growth_tracker = 0` and `hysteresis_tracker = hysteresis`.

# %% minite={"task": "update_scale"}
def update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, *, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=1, min_scale=1.0):
    ### BEGIN SOLUTION
    if found_inf:
        growth_tracker = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0:
            scale = max(scale * backoff_factor, min_scale)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            scale, growth_tracker, hysteresis_tracker = scale * growth_factor, 0, hysteresis
    return scale, growth_tracker, hysteresis_tracker
    ### END SOLUTION


# %% minite={"check": "update_scale"} tags=["nbval-check-output"]
# CHECK: update_scale
import random
rng = random.Random(0)
for cfg in [dict(growth_interval=3), dict(growth_interval=5, hysteresis=2, min_scale=4.0),
            dict(growth_interval=2, growth_factor=4.0, backoff_factor=0.25, hysteresis=3)]:
    ref = DynamicLossScaler(init_scale=256.0, **cfg)
    state = (256.0, 0, cfg.get("hysteresis", 1))
    for step in range(200):
        bad = rng.random() < 0.3
        p = torch.nn.Parameter(torch.zeros(1)); p.grad = torch.tensor([float("inf") if bad else 1.0])
        ref.step(torch.optim.SGD([p], lr=0.1)); ref.update()
        state = update_scale(*state, bad, **cfg)
        sd = ref.state_dict()
        assert state == (sd["scale"], sd["growth_tracker"], sd["hysteresis_tracker"]), (cfg, step, state, sd)
print("PASS: update_scale matches DynamicLossScaler on 600 random steps")
