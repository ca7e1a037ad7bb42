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
# # 02 — FP8: E4M3 and E5M2, scaling recipes, an FP8 GEMM, FP8 training
#
# Chapter 01 built floating-point formats from their bits. This chapter trains with the smallest ones the
# hardware multiplies: the two 8-bit formats of *FP8 Formats for Deep Learning* (Micikevicius et al., 2022,
# [arXiv:2209.05433](https://arxiv.org/abs/2209.05433)), used the way NVIDIA's
# [TransformerEngine](https://github.com/NVIDIA/TransformerEngine) uses them.
#
# **Why bother — the arithmetic.** Take one linear layer of a large model, $Y = XW^\top$ with
# $M = N = K = 8192$. It costs $2MNK = 1.1\cdot10^{12}$ FLOP. An H100 SXM does 989 TFLOP/s dense in bf16 and
# **1979 TFLOP/s in fp8**: 1.11 ms becomes 0.56 ms. The operands shrink from 2 bytes to 1, and so does the input
# saved for the backward pass (activation memory). The price: 3 or 2 mantissa bits and a tiny range, so every
# tensor needs its own **scale**, and producing the fp8 copy is one more pass over memory:
# reading $X$ in bf16 and writing it in fp8 moves $8192^2 \times 3$ B = 201 MB, 0.06 ms at 3.35 TB/s, about 10 %
# of the fp8 GEMM. A recipe that needs a *second* pass (to find the tensor's max first) doubles that. Keeping this
# overhead to one fused pass is what **delayed scaling** is about.
#
# Plan: the two formats and why each tensor gets the one it gets → scaling math and the backward → quantize in
# PyTorch, then in Triton (one pass, amax included) → the recipes, and what delayed scaling risks → the FP8 GEMM
# kernel, built in cells, and Hopper's 14-bit accumulator with the promotion fix (measured on an H100) →
# `minite.nn.Linear` under `fp8_autocast` → training a GPT in FP32 vs BF16 vs FP8, and the histograms of its real
# activations and gradients against the two FP8 ranges.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import json, math
import matplotlib.pyplot as plt
import minite
from minite._triton import triton, tl
from minite.formats import (E4M3, E5M2, BF16, Format, DelayedScaling, CurrentScaling, fp8_autocast,
                            Float8Tensor, quantize, dequantize)
from minite.testing import check_op, assert_close
from minite.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %% [markdown]
# ## 1. Two formats, two jobs
#
# Both are $(-1)^s\,2^{e-\text{bias}}(1.m)$ with the fields from chapter 01. **E4M3** (`torch.float8_e4m3fn`) has
# one more mantissa bit; it gives up infinities (only `S.1111.111` is NaN) to reach 448. **E5M2**
# (`torch.float8_e5m2`) is IEEE-like: a truncated fp16, with fp16's range.

# %% tags=["nbval-check-output"]
def binades(spec):                       # dynamic range: how many powers of two from the smallest subnormal to max
    return math.log2(spec.max / spec.min_subnormal)
print(f"{'format':>6} {'max':>9} {'min normal':>11} {'min subnormal':>14} {'eps':>7} {'binades':>8}")
for s in (E4M3, E5M2, BF16):
    print(f"{s.name:>6} {s.max:>9.4g} {s.min_normal:>11.3g} {s.min_subnormal:>14.3g} {s.eps:>7.3g} {binades(s):>8.1f}")


# %% [markdown]
# E4M3 resolves $2^{-3}$ steps (relative error $\le 2^{-4}$ after rounding) over ~18 binades; E5M2 only
# $2^{-2}$ steps but over ~32 binades. Which matters depends on the tensor:
#
# * **activations and weights** live in a narrow band (a normalized activation is ~N(0, 1), a weight ~N(0, 0.02)),
#   so once a per-tensor scale puts the band under the maximum, precision is what counts: **E4M3**.
# * **gradients** span many orders of magnitude within one tensor (a few tokens carry most of the loss), so
#   range is what counts: with E4M3 the small ones underflow to zero. **E5M2**.
#
# That is TransformerEngine's `Format.HYBRID`. Measured on one "activation-like" and one "gradient-like" tensor,
# each scaled so that its max lands on the format's max:

# %% tags=["nbval-check-output"]
def fp8_error(t, fp8_dtype):
    q = quantize(t, fp8_dtype=fp8_dtype, backend="torch")        # scale=None: current scaling, amax -> max
    back = q.dequantize()
    nz = t != 0
    rel = ((back - t)[nz].norm() / t[nz].norm()).item()            # relative RMS error
    flushed = ((back == 0) & nz).float().mean().item()              # nonzeros that underflowed to 0
    return rel, flushed

g = torch.Generator().manual_seed(0)
act = torch.randn(1 << 16, generator=g)                                            # ~N(0, 1)
grad = torch.randn(1 << 16, generator=g) * 10 ** (-7 * torch.rand(1 << 16, generator=g))   # 7 decades
print(f"{'tensor':>10} {'format':>6} {'rel. error':>10} {'flushed to 0':>13}")
for name, t in (("activation", act), ("gradient", grad)):
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        rel, fl = fp8_error(t, f8)
        print(f"{name:>10} {('e4m3' if f8 == torch.float8_e4m3fn else 'e5m2'):>6} {rel:>10.4f} {100 * fl:>12.1f}%")

# %% [markdown]
# The activation is twice as accurate in E4M3. The gradient's relative error looks fine in both (it is dominated
# by the large entries), but E4M3 silently zeroes a large share of its entries — those are the gradients of the
# tokens the model already predicts well, and losing them biases the update. E5M2 keeps them.
#
# ## 2. The math: per-tensor scaling, the GEMM, the backward
#
# A tensor $x$ is stored as fp8 bits $q$ and one fp32 number $s^{-1}$:
#
# $$q = \operatorname{rne}_{8}\big(\operatorname{clamp}(s\,x,\,-m,\,m)\big), \qquad \hat x = q\,s^{-1},
# \qquad s = \frac{m}{\operatorname{amax}(x)\;2^{\text{margin}}}$$
#
# with $m$ = 448 (E4M3) or 57344 (E5M2) and $\operatorname{rne}_8$ the round-to-nearest-even encoding of chapter 01.
# The clamp comes first because torch's E5M2 cast (like fp16's) overflows to inf instead of saturating.
#
# **Forward.** $Y = \hat X \hat W^\top$, and since $s_x, s_w$ are constants of the whole tensors they leave the sum:
#
# $$y_{nj} = \sum_k \frac{q^x_{nk}}{s_x}\frac{q^w_{jk}}{s_w} = \frac{1}{s_x s_w}\sum_k q^x_{nk}\,q^w_{jk}.$$
#
# The kernel multiplies raw fp8 values with an fp32 accumulator and applies $1/(s_x s_w)$ once, in the epilogue.
#
# **Backward, step by step.** Quantization is a step function (zero derivative almost everywhere), so like
# TransformerEngine we differentiate the layer as if $\hat X = X$, $\hat W = W$ (straight-through) and quantize the
# incoming gradient $G = \partial L/\partial Y$ too:
#
# 1. $\dfrac{\partial L}{\partial x_{nk}}
#    = \sum_j \dfrac{\partial L}{\partial y_{nj}}\dfrac{\partial y_{nj}}{\partial x_{nk}} = \sum_j g_{nj}\,\hat w_{jk}$,
#    i.e. **dgrad** $dX = \hat G\,\hat W$ — an $(N, O)\times(O, K)$ FP8 GEMM;
# 2. $\dfrac{\partial L}{\partial w_{jk}} = \sum_n g_{nj}\,\hat x_{nk}$, i.e. **wgrad** $dW = \hat G^\top \hat X$ —
#    $(O, N)\times(N, K)$;
# 3. $\dfrac{\partial L}{\partial b_j} = \sum_n g_{nj}$ (full precision, it is a cheap reduction);
#
# with $\hat G = Q_{E5M2}(s_g G)/s_g$. The backward multiplies the **same fp8 copies** $\hat X, \hat W$ that the
# forward multiplied, saved at 1 byte per element. Three GEMMs per layer, all in FP8.
#
# ## 3. Quantize in PyTorch, and count the passes

# %%
def quantize_torch(x, scale, fp8_dtype=torch.float8_e4m3fn):
    """Per-tensor scaled FP8: returns (fp8 data, amax of x). The spec every FP8 kernel below is checked against."""
    fp8_max = torch.finfo(fp8_dtype).max                      # 448 (E4M3) or 57344 (E5M2)
    xs = x.float() * scale                                    # pass 1: read x, write xs (fp32)
    data = xs.clamp(-fp8_max, fp8_max).to(fp8_dtype)          # clamp first: torch's E5M2 cast overflows to inf
    amax = x.abs().amax().float()                             # another pass over x: the statistic for next time
    return data, amax


g = torch.Generator().manual_seed(1)
x = torch.randn(37, 129, generator=g) * torch.logspace(-5, 3, 129)
x[0, :3] = torch.tensor([float("inf"), -1e9, 0.0])
for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
    data, amax = quantize_torch(x, torch.tensor(7.5), f8)
    ref = quantize(x, 7.5, fp8_dtype=f8, backend="torch")
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(amax, ref.amax), f8
    print(f"PASS: quantize_torch == minite's quantize reference, bit for bit [{str(f8)[6:]}]")

# %% [markdown]
# With the scale known in advance this is one read of $x$ (2 B/element in bf16) and one 1-byte write, if fused.
# Eagerly it is several passes (multiply, clamp, cast, abs, amax each read and write a full tensor). And with
# *current* scaling the scale depends on $\operatorname{amax}(x)$ itself, so the amax must be a separate, earlier
# pass: at least 2 reads + 1 write. minite's Triton kernel (`minite/formats/fp8.py`) does **1 read + 1 write and
# produces the amax in the same pass**, as a per-program partial max reduced by the launcher; writing that kernel
# is exercise task 2. It encodes with chapter 01's integer `encode_bits_tl` (round to nearest even, saturate,
# subnormals), because the interpreter's own fp32→fp8 cast is wrong on a few percent of values; on a GPU with fp8
# units (sm_89+) it uses the hardware cast after the same clamp. Bit for bit, it agrees with the reference:

# %% tags=["nbval-check-output"]
g = torch.Generator().manual_seed(1)
for dtype in (torch.float32, torch.bfloat16):
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = (torch.randn(37, 129, generator=g) * torch.logspace(-5, 3, 129)).to(DEVICE, dtype)
        x[0, :3] = torch.tensor([float("inf"), -1e9, 0.0]).to(DEVICE, dtype)     # saturation and zero
        a = quantize(x, 7.5, fp8_dtype=f8, backend="triton")
        b = quantize(x, 7.5, fp8_dtype=f8, backend="torch")
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.amax, b.amax)
        print(f"PASS: quantize triton == torch, bit for bit [{str(dtype)[6:]} -> {str(f8)[6:]}]")

# %% [markdown]
# ## 4. Recipes: current vs delayed scaling
#
# `CurrentScaling` computes $s$ from this tensor's amax: always right, two passes. `DelayedScaling`
# (TransformerEngine's default) quantizes with the scale computed from the **amax history** of previous steps and
# records this step's amax from the same pass:
#
# ```python
# recipe = DelayedScaling(margin=0, amax_history_len=1024, amax_compute_algo="max", fp8_format=Format.HYBRID)
# # per tensor, every step:  q = Q(x * scale);  history = roll(history); history[0] = amax(x)
# #                          scale = 448 / max(history) / 2**margin   (keep the old scale if that amax is 0 or inf)
# ```
#
# What it buys: one pass. What it risks: the scale lags. If a tensor's amax **spikes**, the spike step is quantized
# with yesterday's scale and everything above $448/s$ is clamped; with `"max"` the spike then stays in the history
# for `amax_history_len` steps and the scale stays small (precision lost at the bottom) until it rolls out.
# Simulated below: a tensor whose amax is ~1 except for a 30x spike at step 40 and a 4x level shift at step 60.

# %%
from minite.formats.recipe import ScalingState
g = torch.Generator().manual_seed(2)
steps = 80
level = torch.ones(steps); level[40] = 30.0; level[60:] = 4.0
xs = [torch.randn(4096, generator=g) * lv / 4 for lv in level]          # amax ~ level
recipes = {"current": CurrentScaling(), "delayed, max (16)": DelayedScaling(amax_history_len=16),
           "delayed, most_recent": DelayedScaling(amax_history_len=16, amax_compute_algo="most_recent")}
curves = {}
for name, r in recipes.items():
    st = r.new_state(torch.float8_e4m3fn)
    err, clipped, used = [], [], []
    for x in xs:
        s = r.scale_for(st, x)                                               # the scale this step uses
        q = quantize(x, s, backend="torch")
        r.update(st, q.amax)                                                 # record amax, next scale
        clipped.append((x.abs() * s > 448).float().mean().item() * 100)
        err.append(((q.dequantize() - x).norm() / x.norm()).item())
        used.append(min(1.0, (q.amax * s / 448).item()))                    # share of the fp8 range used
    curves[name] = (err, clipped, used)
fig, ax = plt.subplots(1, 4, figsize=(17, 3.4))
ax[0].plot([x.abs().max().item() for x in xs], "k"); ax[0].set_title("amax of the tensor"); ax[0].set_yscale("log")
for (name, (err, clipped, used)), style in zip(curves.items(), ("-", "--", ":")):
    ax[1].plot(err, style, label=name); ax[2].plot(clipped, style, label=name); ax[3].plot(used, style, label=name)
ax[1].set_yscale("log"); ax[1].set_title("relative quantization error"); ax[1].legend()
ax[2].set_title("% of elements clamped (overflow)"); ax[3].set_title("amax * scale / 448 (range used)")
ax[3].set_yscale("log")
for a in ax:
    a.set_xlabel("step")
plt.tight_layout(); plt.show()
for name, (err, clipped, used) in curves.items():
    print(f"{name:>22}: step 40 error {err[40]:.3f}, clamped {clipped[40]:.1f}%; "
          f"steps 41-56 mean error {sum(err[41:57]) / 16:.4f}")

# %% [markdown]
# Current scaling never clamps. Both delayed variants clamp most of the spike step (its error jumps by more than
# an order of magnitude) and a third of the step where the level shifts. Afterwards `"max"` keeps the spike's small
# scale for 16 steps: the tensor then uses only the bottom 1/30 of the fp8 range. Here that costs little, because
# E4M3's precision is *relative* and flat over its normal range — it only hurts the values pushed into the
# subnormals, which is what a larger spike (or an E4M3 gradient) would do. `"most_recent"` recovers at once but
# overflows again on every upward wiggle of the amax. (Step 0 of both delayed runs: no history yet, so the scale
# is 1, as in TransformerEngine, and the tensor uses 1/448 of the range.) In training,
# amaxes move slowly from step to step (weights change by a learning rate, activations are normalized), which is
# why the one-pass delayed recipe works in practice — and why `margin` exists as headroom for the spikes.

# %% [markdown]
# ## 5. The FP8 GEMM, and Hopper's 14-bit accumulator
#
# The GEMM is chapter 00's tiled matmul with fp8 tiles: the operands stay fp8 in registers, `tl.dot` multiplies
# them on the tensor cores, the two per-tensor scales are applied once in the epilogue, and the output is rounded
# once to bf16 / fp16 / fp32. On paper the accumulator is fp32. On an H100 it is not quite.
#
# **What was measured.** On an H100 (2026-11-23), minite's FP8 GEMM as first written (`acc = tl.dot(a, b, acc)`
# over the whole K loop) had a max error of $3.97 \cdot 10^{-2}$ of the output's standard deviation at
# $M = N = K = 8192$, where cuBLAS (`torch._scaled_mm`) had $8.6 \cdot 10^{-4}$ on the same fp8 inputs: **46× the
# error**, growing with K. The cause is documented by DeepSeek-V3 (arXiv:2412.19437, §3.3.2): Hopper's FP8 tensor
# cores add products into an accumulator that keeps only about **14 significant bits**, not fp32's 24. Chaining
# `tl.dot(a, b, acc)` keeps the running sum inside the tensor core for the whole K loop, so every one of the
# $K/32$ additions loses bits to that narrow accumulator, and the loss adds up.
#
# **The fix: promotion.** Accumulate only $N_C$ elements of K in the tensor core (the "fast" partial sum), then add
# the partial sum into a real fp32 accumulator with an ordinary CUDA-core addition, and start a fresh partial sum.
# cuBLAS does this; DeepSeek-V3 promotes every $N_C = 128$. Triton exposes it as
# `tl.dot(..., max_num_imprecise_acc=N_C)` on fp8 inputs; written out by hand it is two nested loops:
#
# ```
# acc = 0 (fp32, CUDA cores)
# for each chunk of N_C along K:          # promotion interval
#     part = 0 (tensor-core accumulator)
#     for each BLOCK_K inside the chunk:
#         part = tl.dot(a_tile, b_tile, part)    # fast: stays in the tensor core
#     acc += part                          # promote: one exact fp32 add per N_C of K
# ```
#
# The price is speed: the tensor core has to hand its partial sum over and wait. Here is the kernel, runnable on
# the CPU (where `tl.dot` is exact, so both paths agree to the last bit) and GPU-legal (every dot dim ≥ 16, K ≥ 32).

# %%
@triton.jit
def fp8_matmul_kernel(A_ptr, B_ptr, C_ptr, A_scale_inv_ptr, B_scale_inv_ptr, M, N, K,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PROMOTE_EVERY: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_pid_n, pid % num_pid_n
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak     # (BLOCK_M, BLOCK_K) fp8
    b_ptrs = B_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn     # (BLOCK_K, BLOCK_N) fp8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)              # the true fp32 accumulator
    for chunk in range(0, K, PROMOTE_EVERY):                           # one promotion per PROMOTE_EVERY of K
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)         # the tensor core's running sum
        for kk in range(0, PROMOTE_EVERY, BLOCK_K):
            k = chunk + kk + offs_k
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
            b = tl.load(b_ptrs, mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
            part = tl.dot(a, b, part, input_precision="ieee")  # fast accumulation, fp8 x fp8 (precision: fp32 tiles)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        acc += part                                                   # promotion: an exact fp32 add
    acc = acc * (tl.load(A_scale_inv_ptr) * tl.load(B_scale_inv_ptr))  # epilogue: both per-tensor scales
    c_ptrs = C_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fp8_matmul(qa, qb, out_dtype=torch.float32, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, promote_every=64):
    """(M, K) @ (K, N) of two Float8Tensors; promote_every must be a multiple of BLOCK_K."""
    (M, K), (_, N) = qa.shape, qb.shape
    c = torch.empty(M, N, device=qa.device, dtype=out_dtype)
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
    fp8_matmul_kernel[grid](qa.data, qb.data, c, qa.scale_inv.reshape(1), qb.scale_inv.reshape(1), M, N, K,
                            qa.data.stride(0), qa.data.stride(1), qb.data.stride(0), qb.data.stride(1),
                            c.stride(0), c.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                            PROMOTE_EVERY=promote_every)
    return c


# %% [markdown]
# Check it against the reference (dequantize both operands, matmul in fp32) and against minite's `fp8_gemm`, on
# ragged shapes, mixed E4M3 × E5M2 operands, a transposed weight (`w.t()`, as `Linear` uses it), and K that is not
# a multiple of the promotion interval.

# %% tags=["nbval-check-output"]
from minite.testing import fp8_dot_tolerance
g = torch.Generator().manual_seed(3)
for (M, K, N), promote in (((33, 65, 17), 32), ((64, 128, 48), 64), ((20, 200, 40), 128)):
    for out_dtype in (torch.float32, torch.bfloat16):
        a = quantize(torch.randn(M, K, generator=g).to(DEVICE), backend="torch")                     # E4M3
        w = quantize(torch.randn(N, K, generator=g).to(DEVICE), fp8_dtype=torch.float8_e5m2, backend="torch")
        out = fp8_matmul(a, w.t(), out_dtype, promote_every=promote)                               # (M, N)
        atol = 1e-4 if out_dtype == torch.float32 else 0.1       # bf16 output: one rounding of values ~10
        # + on a GPU, the fp8 tensor cores' ~14-bit accumulator (see below): <= 2^-13 * sum_k |a_k b_k| per MMA step
        # of 32 products between promotions (0 on the CPU, where tl.dot is exact); minite's GEMM promotes every 128
        ours, mine = (fp8_dot_tolerance(a, w.t(), device=DEVICE, atol=0.0, rtol=0.0, promote_every=pe)["atol"]
                      for pe in (promote, 128))
        assert_close(out, fp8_gemm_ref(a, w.t(), out_dtype), name="fp8_matmul vs reference", atol=atol + ours)
        assert_close(out, fp8_gemm(a, w.t(), out_dtype=out_dtype, backend="triton"), name="vs minite",
                     atol=atol + ours + mine)
        print(f"PASS: fp8_matmul (promote every {promote}) vs dequantize+fp32 matmul and vs minite "
              f"[{M}x{K}x{N} -> {str(out_dtype)[6:]}]")

# %% [markdown]
# **Seeing the 14-bit accumulator on a CPU.** The interpreter's `tl.dot` is exact, so the error cannot show up
# there. We can model it: a PyTorch GEMM that adds each 32-wide slice of K (one Hopper FP8 MMA instruction) into
# an accumulator that is truncated to 14 significant bits after every addition, with and without promotion every
# 128. This is an emulation under a stated assumption (14 bits, truncation), not the hardware; it reproduces
# the *shape* of what the H100 measured: an error that grows about linearly with K without promotion, and stays
# flat with it.

# %%
def truncate_to_bits(x, bits):
    """Keep `bits` significant bits of fp32 values (the hidden 1 included), rounding toward zero."""
    return (x.view(torch.int32) & ~((1 << (24 - bits)) - 1)).view(torch.float32)


def emulated_fp8_gemm(a, b, acc_bits=14, promote_every=None, mma_k=32):
    """a (M, K), b (K, N): exact fp8 values in fp32. The tensor-core sum keeps `acc_bits` bits."""
    acc = torch.zeros(a.shape[0], b.shape[1])
    part = torch.zeros_like(acc)
    for k0 in range(0, a.shape[1], mma_k):
        part = truncate_to_bits(part + a[:, k0:k0 + mma_k] @ b[k0:k0 + mma_k], acc_bits)
        if promote_every and (k0 + mma_k) % promote_every == 0:
            acc, part = acc + part, torch.zeros_like(part)
    return acc + part


torch.set_num_threads(1)
g = torch.Generator().manual_seed(4)
Ks, emu = [256, 512, 1024, 2048, 4096, 8192], {"fast (14-bit, no promotion)": [], "promoted every 128": []}
for K in Ks:
    a8 = quantize(torch.randn(64, K, generator=g), backend="torch").data.float()      # exact E4M3 values
    b8 = quantize(torch.randn(K, 64, generator=g), backend="torch").data.float()
    ref = a8.double() @ b8.double()
    for name, pe in (("fast (14-bit, no promotion)", None), ("promoted every 128", 128)):
        err = (emulated_fp8_gemm(a8, b8, promote_every=pe).double() - ref).abs().max() / ref.std()
        emu[name].append(err.item())
for name, errs in emu.items():
    print(f"emulated, {name:28s}: max|err|/std " + " ".join(f"{e:.1e}" for e in errs) + f"  (K = {Ks})")

# %% [markdown]
# **Measured on the H100.** `benchmarks/results/h100-2026-11-23_fp8_gemm.json` holds three measurements of that
# day: the error of minite's FP8 GEMM against `torch._scaled_mm` at $S = M = N = K$ = 1024, 4096 and 8192
# (`fp8_gemm_error.log`), a stand-alone copy of the kernel in six accumulation variants at 4096³ and 8192³
# (`fp8_accumulation_variants.log`: 128 × 128 tiles, 8 warps, 3 stages), and the speed benchmark.

# %% tags=["nbval-check-output"]
with open("../benchmarks/results/h100-2026-11-23_fp8_gemm.json") as f:
    h100 = json.load(f)
err = {}
for r in h100["error_vs_scaled_mm"]:
    err.setdefault(r["impl"], []).append((r["K"], r["max_err_over_std"]))
var = {(r["S"], r["variant"]): r for r in h100["accumulation_variants"]}
fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.2))
(k1, e1), (k2, e2) = zip(*sorted(err["minite fp8_gemm"])), zip(*sorted(err["torch._scaled_mm"]))
a1.loglog(k1, e1, "o-", color="C3", label="H100: minite, tl.dot(a, b, acc) (fast)")
a1.loglog(k2, e2, "s-", color="k", label="H100: cuBLAS torch._scaled_mm")
promo = [(S, var[(S, "BK=128, max_num_imprecise_acc=128")]["max_err_over_std"]) for S in (4096, 8192)]
a1.loglog(*zip(*promo), "D", ms=9, color="C2", label="H100: promoted every 128 (BK=128)")
for (name, errs), st in zip(emu.items(), (":", "--")):
    a1.loglog(Ks, errs, st, color="gray", label=f"CPU emulation: {name}")
a1.set(xlabel="K (= M = N on the H100)", ylabel="max |error| / std(output)",
       title=f"FP8 GEMM error vs K ({h100['device']}, {h100['date']})")
a1.legend(fontsize=7)
names = ["tl.dot(a,b,acc) [minite today]", "BK=128 tl.dot(a,b,acc)", "BK=128, max_num_imprecise_acc=128",
         "max_num_imprecise_acc=64 (=BK)", "max_num_imprecise_acc=32", "acc += tl.dot(a,b)",
         "torch._scaled_mm (cuBLAS)"]
for S, c in ((4096, "C0"), (8192, "C1")):
    a2.scatter([var[(S, n)]["max_err_over_std"] for n in names], [var[(S, n)]["tflops"] for n in names], color=c,
               label=f"{S}³")
for n in names:
    a2.annotate(n.replace(" [minite today]", ""), (var[(8192, n)]["max_err_over_std"], var[(8192, n)]["tflops"]),
                fontsize=7, xytext=(4, 4), textcoords="offset points")
a2.set_xscale("log")
a2.set(xlabel="max |error| / std(output)", ylabel="TFLOP/s", title="speed vs error of 7 ways to accumulate (H100)")
a2.legend(fontsize=8)
plt.tight_layout()
plt.show()
ratio = dict(err["minite fp8_gemm"])[8192] / dict(err["torch._scaled_mm"])[8192]
print(f"K = 8192: fast accumulation {dict(err['minite fp8_gemm'])[8192]:.2e} vs cuBLAS "
      f"{dict(err['torch._scaled_mm'])[8192]:.2e}: {ratio:.0f}x the error")
for n in names:
    r = var[(8192, n)]
    print(f"8192^3 {n:36s} error {r['max_err_over_std']:.2e}  {r['tflops']:6.0f} TFLOP/s")

# %% [markdown]
# Reading the measurements:
#
# * **Fast accumulation is fast and inaccurate**: 970 TFLOP/s at 8192³ with BLOCK_K = 128, at 46× cuBLAS's error.
# * **Promotion every 32 or 64** (one fp32 add per K step, `acc += tl.dot(a, b)` or `max_num_imprecise_acc=BLOCK_K`)
#   is the most accurate (2.7–4.8e-4, below cuBLAS), but costs almost half the speed (520–550 TFLOP/s).
# * **Promotion every 128 with BLOCK_K = 128** matches cuBLAS's error exactly (8.6e-4 at 8192³, 8.5e-4 at 4096³)
#   at 817 TFLOP/s, 16 % slower than fast accumulation at the same tiles. Even the fast variant is only
#   **0.78× cuBLAS's speed** (970 vs 1237 TFLOP/s): that gap (cuBLAS's pipelining, tile shapes and warp
#   specialization) is not closed here.
#
# Where to pay for promotion is a recipe choice. TransformerEngine's default, which minite's fix follows, keeps
# fast accumulation in the forward GEMM and promotes (its "split accumulator") in the two backward GEMMs: wgrad
# sums over every token of the batch, the longest K of the three, and both feed the weight update, where
# accumulated error does the most harm.
#
# The speed benchmark of the same day says more that is poor: the full FP8 `Linear` was **0.19× (4096) and 0.26×
# (8192) of bf16 for forward+backward**, because the time outside the GEMM (three quantization passes per
# layer, the transposed operands of dgrad and wgrad, scale bookkeeping) was larger than what the fp8 GEMM saved;
# at 8192 the forward alone reached 1.2× bf16. Those numbers predate the accumulation fix and are not profiled
# further in this chapter.

# %% [markdown]
# ## 6. `minite.nn.Linear` under `fp8_autocast`
#
# `minite.nn.Linear` is an `nn.Linear` (same constructor and `state_dict`). Outside `fp8_autocast` it is a plain
# linear; inside, it quantizes its input and weight to E4M3 with its own per-tensor scaling states, runs the FP8 GEMM,
# saves the fp8 copies, and in the backward quantizes the gradient to E5M2 (under `HYBRID`) for the dgrad and wgrad
# GEMMs. `fp8_autocast` is a class-based context manager: it restores the previous state on exit even when the body
# raises, and regions nest. The backward pass may run outside the region: each layer remembers its recipe.

# %% tags=["nbval-check-output"]
from minite.layers.linear import fp8_linear
g = torch.Generator().manual_seed(4)
# On a GPU the Triton path's three GEMMs (y, dx, dW) run on the fp8 tensor cores, whose ~14-bit accumulator errs by
# up to 2^-13 * sum_k |a_k b_k| per 32 products (section 5): at most 3.6e-3 for these inputs and gradients (K <= 64).
# On the CPU tl.dot is exact and the default fp32 tolerance holds.
tol = {} if DEVICE == "cpu" else dict(atol=5e-3, rtol=1e-5)
for shape in ((3, 7, 33), (16, 64)):
    x = torch.randn(*shape, generator=g).to(DEVICE)
    w = (torch.randn(24, shape[-1], generator=g) * 0.1).to(DEVICE)
    assert check_op("fp8_linear triton vs torch (same quantization math)",
                    lambda x, w: fp8_linear(x, w, recipe=CurrentScaling(), backend="triton"),
                    lambda x, w: fp8_linear(x, w, recipe=CurrentScaling(), backend="torch"), x, w, **tol)

# %%
lin = minite.nn.Linear(64, 32)
x = torch.randn(16, 64)
with fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
    for _ in range(3):
        y8 = lin(x)
y32 = lin(x)                                        # outside the region: a plain fp32 linear again
print("relative error of the FP8 layer:", round(((y8 - y32).norm() / y32.norm()).item(), 3))
print(lin.fp8_states)

# %% [markdown]
# ## 7. Training a GPT in FP32, BF16 and FP8
#
# The course's GPT (`minite.models.gpt`, 2 layers, width 64) on a synthetic character corpus of additions
# (`"17+45=62;"`), 120 AdamW steps from the same seed and batches, three ways:
#
# * **FP32**;
# * **BF16**: `torch.autocast` (matmuls in bf16, fp32 master weights);
# * **FP8**: `fp8_autocast(recipe=DelayedScaling(...))` — every projection of the model runs its three GEMMs on
#   HYBRID fp8 operands; the tied LM head stays in higher precision (it feeds the softmax over the vocabulary).
#
# On this CPU the FP8 run uses the **torch reference GEMM path** (`minite.use_backend("torch")`): exactly the same
# quantization math (the same fp8 bits, same scales, same history updates), but the product is computed by
# torch on the dequantized operands instead of by the interpreted Triton kernel, which would take minutes for a
# few hundred steps. On a GPU the same cell runs the Triton kernels.

# %%
import contextlib, random
from minite.models.gpt import GPT, GPTConfig
rng = random.Random(0)
text = "".join(f"{a}+{b}={a + b};" for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(6000)))
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text])
train_ids, val_ids = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
T, B, STEPS = 32, 16, 120

def batch(src, g):
    ix = torch.randint(len(src) - T - 1, (B,), generator=g)
    return torch.stack([src[i:i + T] for i in ix]), torch.stack([src[i + 1:i + T + 1] for i in ix])   # (B, T)

MODELS = {}


def train(precision):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=len(chars), block_size=T, n_layer=2, n_head=4, n_embd=64, vocab_multiple=16)
    model = GPT(cfg).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    recipe = DelayedScaling(amax_history_len=16)
    ctx = {"FP32": contextlib.nullcontext, "BF16": lambda: torch.autocast(DEVICE, dtype=torch.bfloat16),
           "FP8": lambda: fp8_autocast(recipe=recipe)}[precision]
    g, losses = torch.Generator().manual_seed(1), []
    with minite.use_backend("torch" if DEVICE == "cpu" else "auto"):
        for _ in range(STEPS):
            x, y = batch(train_ids, g)
            with ctx():
                _, loss = model(x.to(DEVICE), y.to(DEVICE))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        gv = torch.Generator().manual_seed(2)
        with torch.no_grad(), ctx():
            val = sum(model(*(t.to(DEVICE) for t in batch(val_ids, gv)))[1].item() for _ in range(8)) / 8
    MODELS[precision] = model
    return losses, val

if DEVICE == "cpu":
    torch.set_num_threads(1)     # tiny matmuls: on a busy 2-core machine extra threads cost far more than they save
runs = {p: train(p) for p in ("FP32", "BF16", "FP8")}


# %%
def smooth(v, k=10):
    return [sum(v[max(0, i - k + 1):i + 1]) / len(v[max(0, i - k + 1):i + 1]) for i in range(len(v))]
plt.figure(figsize=(7, 4))
for p, (losses, val) in runs.items():
    plt.plot(smooth(losses), label=f"{p} (val {val:.3f})")
plt.xlabel("step"); plt.ylabel("train loss (10-step mean)"); plt.title("tiny GPT: FP32 vs BF16 vs FP8"); plt.legend()
plt.show()
for p, (losses, val) in runs.items():
    print(f"{p}: final train loss {sum(losses[-10:]) / 10:.4f}, val loss {val:.4f}")
val = {p: v for p, (_, v) in runs.items()}
lo, hi = min(val["FP32"], val["BF16"]), max(val["FP32"], val["BF16"])
print(f"BF16 - FP32 val-loss gap: {val['BF16'] - val['FP32']:+.3f} (rounding alone); "
      f"FP8 - BF16: {val['FP8'] - val['BF16']:+.3f}, FP8 - FP32: {val['FP8'] - val['FP32']:+.3f} (margin 0.05)")
assert lo - 0.05 < val["FP8"] < hi + 0.05, f"FP8 val loss {val['FP8']:.3f} is outside [{lo:.3f}, {hi:.3f}] +- 0.05"
print("PASS: FP8 trains like FP32 and BF16 (val loss within 0.05 of theirs)")

# %% [markdown]
# **Real tensors against the two FP8 ranges.** Section 1 argued from synthetic tensors. Here are real ones: after
# the FP32 run above, one more batch through the trained model, recording the input of the second block's MLP
# down-projection (an activation: what `fp8_autocast` quantizes to E4M3) and the gradient flowing back into it
# (what the backward quantizes to E5M2). Each tensor is scaled the way current scaling would (its amax onto the
# format's max), and its magnitudes are histogrammed against each format's representable band: normal numbers
# (solid), subnormals (hatched); below the smallest subnormal a value becomes 0.

# %%
captured = {}
down = MODELS["FP32"].blocks[1].mlp.down
h1 = down.register_forward_hook(lambda m, inp, out: captured.__setitem__("activation", inp[0].detach()))
h2 = down.register_full_backward_hook(lambda m, gin, gout: captured.__setitem__("gradient", gin[0].detach()))
try:
    with minite.use_backend("torch"):
        x, y = batch(train_ids, torch.Generator().manual_seed(5))
        _, loss = MODELS["FP32"](x.to(DEVICE), y.to(DEVICE))
        loss.backward()
finally:
    h1.remove(), h2.remove()
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
for ax, (name, t) in zip(axes, captured.items()):
    v = t.float().abs().flatten().cpu()
    v = v[v > 0]
    for spec, color in ((E4M3, "C0"), (E5M2, "C1")):
        scaled = v * (spec.max / v.max())                        # current scaling: amax -> the format's max
        ax.axvspan(math.log2(spec.min_normal), math.log2(spec.max), color=color, alpha=0.12)
        ax.axvspan(math.log2(spec.min_subnormal), math.log2(spec.min_normal), color=color, alpha=0.06, hatch="//")
        flushed = (scaled < spec.min_subnormal / 2).float().mean().item()
        sub = ((scaled >= spec.min_subnormal / 2) & (scaled < spec.min_normal)).float().mean().item()
        ax.hist(scaled.log2().numpy(), bins=80, histtype="step", color=color, lw=1.5,
                label=f"scaled for {spec.name}: {sub:.1%} subnormal, {flushed:.2%} flushed to 0")
        bulk = math.log2(v.max() / v.quantile(0.001))
        print(f"{name:10s} ({v.numel()} nonzeros) scaled for {spec.name}: {sub:6.2%} subnormal, "
              f"{flushed:6.2%} flushed to 0; 99.9 % of it within {bulk:.1f} binades below the max")
    ax.set(xlabel="log2 |value| after scaling", title=f"{name} (block 1, MLP down-projection input)")
    ax.legend(fontsize=8, loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# What this small model shows: E5M2's 32-binade band holds every value of both tensors. In E4M3 (normal band
# 15 binades wide below 448), both tensors leave a tail in the subnormals, where the relative precision drops,
# and a sliver is flushed to 0; the gradient loses about twice the share the activation does. The effect is modest
# here (a 2-layer, width-64 model whose gradients are not yet very skewed); the FP8 paper (Micikevicius et al.,
# 2022) reports gradient distributions of large models spreading much wider, which is where E4M3 gradients stop
# training. Activations in E4M3 and gradients in E5M2 (`Format.HYBRID`) is the safe default.

# %% [markdown]
# The three curves lie close together: at this scale FP8 with delayed scaling trains like FP32 and BF16. The assert
# states what "like" means: FP8's val loss within **0.05** (about 3 % of the loss) of the band the FP32 and BF16
# runs span. Those two differ only by rounding, yet end 0.02–0.06 apart, and which one ends lower depends on the
# CPU's matmul kernels (an AVX-512 Xeon and an AMD EPYC round differently: 120 steps amplify last-bit differences),
# so a gap to BF16 alone would test the machine; a broken FP8
# path (a wrong scale, a lost gradient, clamped activations) lands far outside it — an untrained model is at
# $\ln(\text{vocab}) \approx 2.6$, a diverging one higher. (At scale the
# known failure modes are the ones of section 4: amax spikes, and outlier features in a few channels, which is why
# newer recipes scale per block of 32 or 128 values instead of per tensor.)
#
# **The Triton path, on this CPU too.** The comparison above used the torch GEMM for speed. Below, a smaller
# GPT (1 layer, width 32) trains 3 SGD steps under `fp8_autocast` twice from the same seed: once with every
# `minite.nn.Linear` on `backend="triton"` (the Triton quantize kernel and the Triton FP8 GEMM, run by the
# interpreter here), once with `backend="torch"`. The other ops (RMSNorm, attention, loss) use the torch reference in
# both runs, so the only difference is the kernels. Both quantize the same way; the GEMMs differ only in the order of
# the fp32 accumulation (last-bit differences), which can tip an occasional value across an fp8 rounding boundary in
# the next quantization. So the losses agree to ~1e-3, not bit for bit: the tolerance is **2e-3** (0.07 % of the
# loss), far below the effect of any real bug in the kernels. A counting wrapper proves the Triton GEMM ran.

# %%
from minite.formats import fp8 as fp8_mod
from minite.kernels import fp8_gemm as gemm_mod

def train_fp8_tiny(linear_backend, steps=3):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=32, vocab_multiple=16)).to(DEVICE)
    for m in model.modules():
        if isinstance(m, minite.nn.Linear):
            m.backend = linear_backend                    # module attribute beats the use_backend() context
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe, g, losses = DelayedScaling(amax_history_len=4), torch.Generator().manual_seed(1), []
    with minite.use_backend("torch"):                     # everything but the FP8 linears: reference ops
        for _ in range(steps):
            x = torch.randint(16, (4, 16), generator=g).to(DEVICE)                   # (B, T)
            with fp8_autocast(recipe=recipe):
                _, loss = model(x, torch.roll(x, -1, dims=1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses

launches = {"fp8_gemm": 0, "quantize": 0}
def counting(name, fn):
    def wrapper(*args, **kwargs):
        launches[name] += 1
        return fn(*args, **kwargs)
    return wrapper
orig_gemm, orig_quant = gemm_mod.fp8_gemm_fwd, fp8_mod.fp8_quantize_fwd
gemm_mod.fp8_gemm_fwd = counting("fp8_gemm", orig_gemm)             # the launchers that run the Triton kernels
fp8_mod.fp8_quantize_fwd = counting("quantize", orig_quant)
try:
    loss_triton = train_fp8_tiny("triton")
finally:
    gemm_mod.fp8_gemm_fwd, fp8_mod.fp8_quantize_fwd = orig_gemm, orig_quant
loss_torch = train_fp8_tiny("torch")
print("triton:", [round(v, 3) for v in loss_triton])
print("torch: ", [round(v, 3) for v in loss_torch])
# 4 FP8 linears (qkv, attention out, gate_up, down) x 3 GEMMs and 3 quantizations each x 3 steps
print("Triton launches:", launches)
assert launches == {"fp8_gemm": 36, "quantize": 36}, launches
gap = max(abs(a - b) for a, b in zip(loss_triton, loss_torch))
print(f"largest loss gap: {gap:.1e} (tolerance 2e-3)")
assert gap < 2e-3, f"Triton and torch FP8 losses differ by {gap:.2e}"
print("PASS: 3 FP8 training steps, Triton kernels == torch reference within 2e-3")

# %% [markdown]
# ## 8. Benchmark (GPU only)
#
# `benchmarks/bench_fp8_gemm.py` compares the FP8 GEMM with `torch.matmul` in bf16 at $4096^3$ and $8192^3$
# (TFLOP/s and % of the fp8 / bf16 peaks), plus the whole FP8 `Linear` forward and forward+backward. The H100
# numbers of 2026-11-23 are plotted in section 5; on a GPU this cell times the library kernel against bf16 now.

# %%
if torch.cuda.is_available():
    from triton.testing import do_bench
    S = 4096
    a16 = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
    qa, qw = quantize(a16), quantize(w16)
    for name, fn in (("fp8 triton", lambda: fp8_gemm(qa, qw.t())), ("bf16 torch", lambda: a16 @ w16.t())):
        ms = do_bench(fn)
        print(f"{name}: {ms:.3f} ms, {2 * S**3 / ms / 1e9:.0f} TFLOP/s")
else:
    print("no GPU: run `python benchmarks/bench_fp8_gemm.py` on one")

# %% [markdown]
# ## 9. Where it is used
#
# * `minite/models/gpt.py`: every projection (qkv, attention output, SwiGLU gate/up, down) is a
#   `minite.nn.Linear`, so wrapping the forward in `fp8_autocast` runs all of them in FP8; the tied LM head uses
#   `F.linear` on purpose and stays in higher precision.
# * `minite/train.py`: `--train.precision=fp8` wraps each forward in `fp8_autocast(recipe=DelayedScaling())`.
# * Library: `minite.formats` (`Format`, `DelayedScaling`, `CurrentScaling`, `fp8_autocast`, `Float8Tensor`,
#   `quantize`, `dequantize`), `minite.ops.fp8_gemm`, `minite.ops.fp8_linear`, `minite.nn.Linear`.
