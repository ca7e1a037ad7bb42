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
# # 15 — FP8 at scale: blockwise scaling, MXFP8, and when FP8 pays
#
# Chapter 02 trained with one fp32 scale per tensor, TransformerEngine's 2022 recipe. The stacks that train large
# models today scale finer:
#
# * **blockwise** (DeepSeek-V3, [arXiv:2412.19437](https://arxiv.org/abs/2412.19437) §3.3; TransformerEngine's
#   `Float8BlockScaling`): one scale per **1 × 128** slice of a row for activations and gradients, one per
#   **128 × 128** tile for weights. DeepSeek-V3 trained its 671B model this way; its FP8-vs-BF16 comparison
#   (§3.3 and Appendix B.1) was made on smaller validation models (about 16B and 230B parameters, the same recipe),
#   where the FP8 loss stayed within 0.25 % of BF16's. There is no BF16 run of the 671B model to compare with.
# * **MXFP8** (the OCP Microscaling spec v1.0; `MXFP8BlockScaling`): one power-of-two scale per **32** elements,
#   stored in 8 bits as **E8M0**. Blackwell's tensor cores apply these scales in hardware.
#
# **The arithmetic that decides whether any of it is worth it.** A GEMM of $M = N = K = S$ costs $2S^3$ FLOP:
# at $S = 8192$ that is 1.11 ms in bf16 on an H100 (989 TFLOP/s) and 0.56 ms in fp8 (1979). Producing the fp8
# operands reads each bf16 operand once (2 B) and writes it once (1 B): $2 \cdot 3S^2$ B = 403 MB, 0.12 ms at
# 3.35 TB/s. FP8 wins by 0.43 ms. At $S = 1024$ the same sums give a GEMM saving of 1.1 µs against 1.9 µs of
# quantization: **FP8 loses**. Small layers, such as every layer of the GPTs this course trains, are on the wrong
# side of that line. Section 5 works out where the line is.
#
# Plan: why one scale per tensor loses precision to a single outlier → the formats (E8M0, MX-32, 1×128 / 128×128)
# → Hopper's accumulator, and why block scales bring their own fix → the block-scaled GEMM, written in cells →
# when FP8 pays: a roofline model and the small-layer rule → the four recipes side by side on a GPT.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import json, math, contextlib, random
import matplotlib.pyplot as plt
import minite
from minite._triton import triton, tl
from minite.formats import (E8M0, E4M3, encode, decode, bit_string, quantize, quantize_blockwise_ref, quantize_mx_ref,
                            mx_scale_bits_ref, fp8_autocast, DelayedScaling, CurrentScaling, BlockwiseScaling,
                            MXFP8Scaling)
from minite.kernels.fp8_block import block_scaled_gemm, block_scaled_gemm_ref, quantize_blockwise, quantize_mx
from minite.testing import assert_close, fp8_dot_tolerance
from minite.models.gpt import GPT, GPTConfig
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %% [markdown]
# ## 1. One outlier, one scale
#
# A per-tensor scale maps the tensor's largest magnitude onto E4M3's 448. E4M3 spans about 17.8 binades from its
# smallest subnormal ($2^{-9}$) to 448 ($\log_2(448 \cdot 2^9) = 17.8$), but only the top 14.8 of them (from $2^{-6}$)
# are normal numbers with 3 mantissa bits; below
# $2^{-6}$ (after scaling) precision falls off, and below $2^{-10}$ values become 0. A tensor whose typical
# values already span a few decades (channels of different size, as real activations have) has little room to
# spare. One outlier 100× larger than everything else moves the scale down by $\log_2 100 \approx 6.6$ binades,
# and pushes the tensor's small values into the subnormals.
#
# With one scale per block, the outlier only costs its own block. Below: a (256, 512) tensor with values spread
# over three decades, one element replaced by an outlier of growing size, quantized three ways. The error is
# the **mean relative error per element** (each element counts, not only the large ones), measured outside the
# outlier's own 1 × 128 block.

# %%
g = torch.Generator().manual_seed(0)
base = torch.randn(256, 512, generator=g) * 10 ** (-3 * torch.rand(256, 512, generator=g))   # 3 decades of sizes
keep = torch.ones_like(base, dtype=torch.bool)
keep[3, :128] = False                                            # the outlier's block (1 x 128 and its MX blocks)


def mean_rel_err(deq, x):
    return ((deq - x).abs() / x.abs())[keep].mean().item()


factors = [1, 3, 10, 30, 100, 300, 1000, 3000, 10000]
errs = {"per-tensor": [], "1x128 blockwise": [], "MX-32 (E8M0)": []}
for f in factors:
    x = base.clone()
    x[3, 7] = f * base.abs().max()                                # one outlier, f times the largest value
    errs["per-tensor"].append(mean_rel_err(quantize(x, backend="torch").dequantize(), x))
    errs["1x128 blockwise"].append(mean_rel_err(quantize_blockwise_ref(x, (1, 128)).dequantize(), x))
    errs["MX-32 (E8M0)"].append(mean_rel_err(quantize_mx_ref(x).dequantize(), x))
fig, ax = plt.subplots(figsize=(7, 4))
for (name, e), st in zip(errs.items(), ("o-", "s-", "^-")):
    ax.loglog(factors, e, st, label=name)
ax.axvline(100, color="gray", ls=":")
ax.set(xlabel="outlier / largest other value", ylabel="mean relative error per element (E4M3)",
       title="one outlier: per-tensor vs 1x128 vs MX-32 scaling")
ax.legend()
plt.show()
i = factors.index(100)
for name, e in errs.items():
    print(f"100x outlier, {name:16s}: mean relative error {e[i]:.4f} (no outlier: {e[0]:.4f})")

# %% [markdown]
# With no outlier all three are alike (E4M3's rounding, about 2 % per element on average). A 100× outlier makes
# the per-tensor error about six times larger, and it keeps growing with the outlier; the block-scaled tensors do
# not notice. MX-32's error sits a little above blockwise 1 × 128 for a reason of its own, section 2.
#
# ## 2. The formats
#
# **Blockwise (DeepSeek-V3).** For each block $b$ (1 × 128 or 128 × 128), with $m = 448$ for E4M3:
#
# $$s_b = \frac{m}{\operatorname{amax}_b}, \qquad q = \operatorname{rne}_8\big(\operatorname{clamp}(s_b x,\,-m,\,m)\big),
# \qquad \hat x = q\, s_b^{-1}$$
#
# an fp32 scale per block (1 for an all-zero block). The block's largest value lands exactly on 448. A block that
# holds inf or NaN gets a NaN scale: it decodes to NaN, never to a finite stand-in (E4M3 has no inf).
#
# **MX (OCP Microscaling v1.0, §6.3).** The shared scale of a block of 32 is a power of two,
#
# $$X = 2^{\lfloor \log_2 \operatorname{amax} \rfloor - e_{\max}}, \qquad q = \operatorname{rne}_8\big(\operatorname{clamp}(x / X)\big), \qquad \hat x = q X,$$
#
# where $e_{\max}$ is the exponent of the element format's largest normal: 448 = 1.75 · 2⁸, so $e_{\max} = 8$ for
# E4M3 (15 for E5M2). Dividing by a power of two is exact, and $X$ needs no mantissa: it is stored as **E8M0**,
# 8 exponent bits, bias 127, no sign, no zero, no infinity, `0xFF` = NaN. It is a format like chapter 01's: the
# same `encode`, `decode` and `bit_string` take `E8M0` as they take `E4M3`. Here are a few of its values, decoded
# by minite and by torch's own `float8_e8m0fnu` dtype:

# %% tags=["nbval-check-output"]
bits = torch.tensor([0, 1, 119, 126, 127, 128, 254, 255], dtype=torch.int32)
ours = decode(bits, E8M0)
theirs = bits.to(torch.uint8).view(torch.float8_e8m0fnu).float()
for b, v, t in zip(bits.tolist(), ours.tolist(), theirs.tolist()):
    value = "NaN" if b == 255 else f"2^{b - 127:+4d} = {v:.6g}"
    print(f"E8M0 bits {bit_string(b, E8M0)} = 0x{b:02X} -> {value}  (torch: {t:.6g})")
assert torch.equal(ours[:-1], theirs[:-1]) and math.isnan(ours[-1]) and math.isnan(theirs[-1])
print(f"range: {E8M0.min:.3g} .. {E8M0.max:.3g}: 2^-127 (bits 0x00) is an fp32 subnormal, 2^-126 .. 2^127 are "
      "fp32's normal exponents")
# encoding keeps a value's exponent, rounded down (the MX rule below); E4M3 for comparison rounds to nearest
x = torch.tensor([6.0, 0.75, 448.0, 500.0])
print("E8M0:", encode(x, E8M0).tolist(), "->", decode(encode(x, E8M0), E8M0).tolist())
print("E4M3:", [bit_string(b, E4M3) for b in encode(x, E4M3).tolist()], "->", decode(encode(x, E4M3), E4M3).tolist())

# %% [markdown]
# **What the power of two costs.** $\operatorname{amax}/X = \operatorname{amax} / 2^{\lfloor\log_2\operatorname{amax}\rfloor - 8}$
# lies in $[256, 512)$. E4M3 stops at 448, so when $\operatorname{amax}/X$ falls in $[448, 512)$, the top quarter of
# its binade in linear terms ($64/256$; about 19 % in log terms, $\log_2(512/448) = 0.19$), it and its neighbours
# above 448 X **saturate** (the OCP rule clamps them). Blockwise scaling maps amax onto 448
# exactly and never clamps; MX trades that for a scale that costs 1 byte per 32 values (blockwise: 4 bytes per
# 128) and a multiply that is exact. How often does the clamp bite on normally distributed data?

# %% tags=["nbval-check-output"]
x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(1))
q = quantize_mx_ref(x)
X = q.scale_inv().repeat_interleave(32, 1)                        # each element's block scale
clamped = (x.abs() > 448 * X)
print(f"blocks whose top saturates: {clamped.view(4096, 32, 32).any(-1).float().mean().item():.1%}; "
      f"elements saturated: {clamped.float().mean().item():.3%}")
nz = x != 0
print(f"mean relative error: MX-32 {((q.dequantize() - x).abs() / x.abs())[nz].mean().item():.4f}, 1x32 blockwise "
      f"{((quantize_blockwise_ref(x, (1, 32)).dequantize() - x).abs() / x.abs())[nz].mean().item():.4f}")

# %% [markdown]
# About one block in six saturates its top element(s), and MX's mean error is a little above blockwise's at the
# same block size (blockwise also spends the whole range: its amax lands on 448, not somewhere in [256, 448]).
# (This is why NVIDIA's MXFP8 recipes round the scale
# *up* instead, `2^⌈log₂(amax/448)⌉`: no clamping, at the cost of up to one binade of unused range. minite follows
# the OCP rule; `e8m0_encode(x, "ceil")` rounds up for the other.) Choosing the E8M0 scale is exercise task 1.
#
# **The kernels agree with the references bit for bit.** minite's quantize kernel (`minite/kernels/fp8_block.py`)
# does one pass per block: load, amax, scale, encode with chapter 01's integer `encode_bits_tl`, store the fp8 bits
# and the scale. It computes $448/\operatorname{amax}$ with `tl.div_rn` (IEEE division; Triton's `/` is an
# approximate division on the GPU, and torch's `448.0 / t` is $448 \cdot (1/t)$: both can be one ulp off).
# Ragged edges (K = 200 is not a multiple of 128) behave as if zero-padded. Writing a 1 × 128 quantize kernel is
# exercise task 2.

# %% tags=["nbval-check-output"]
g = torch.Generator().manual_seed(2)
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(37, 200, generator=g) * torch.logspace(-4, 4, 200)).to(DEVICE, dtype)
    for name, kernel, ref in (("1x128", lambda t: quantize_blockwise(t, (1, 128)), lambda t: quantize_blockwise_ref(t, (1, 128))),
                              ("128x128", lambda t: quantize_blockwise(t, (128, 128)),
                               lambda t: quantize_blockwise_ref(t, (128, 128))),
                              ("MX-32", lambda t: quantize_mx(t), lambda t: quantize_mx_ref(t))):
        a, b = kernel(x), ref(x.cpu())
        same = torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8)) and torch.equal(a.scale.cpu(), b.scale)
        assert same, name
        print(f"PASS: {name} quantize kernel == reference, bits and scales [{str(dtype)[6:]}, (37, 200)]")

# %% [markdown]
# ## 3. The accumulator, and why block scales fix it for free
#
# Chapter 02 measured Hopper's FP8 tensor cores: the running sum of one MMA chain keeps about 14 significant bits,
# so a GEMM that never leaves the tensor core ("fast accumulation") loses accuracy as K grows. The fix is to
# *promote*: every $N_C$ elements of K, add the tensor core's partial sum into an fp32 accumulator and start
# afresh. Here is the error against K, recorded on an H100 in chapter 02's benchmark (the same fp8 operands,
# error against their fp64 product, M = N = 1024):

# %%
with open("../benchmarks/results/fp8_gemm_error_vs_k_nvidia-h100-80gb-hbm3.json") as f:
    rec = json.load(f)
curves = {}
for r in rec["results"]:
    if r["table"] == "error":
        curves.setdefault(r["impl"], []).append((r["K"], r["max_err_over_std"]))
fig, ax = plt.subplots(figsize=(7, 4))
for (name, pts), st in zip(sorted(curves.items()), ("o-", "s--", "D-", "^:")):
    ks, es = zip(*sorted(pts))
    ax.loglog(ks, es, st, label=name)
ax.set(xlabel="K", ylabel="max |error| / std(output)",
       title=f"FP8 GEMM error vs K — recorded data, {rec['device']}\n(torch {rec['torch']}, triton {rec['triton']})")
ax.legend(fontsize=8)
plt.show()
for name, pts in sorted(curves.items()):
    print(f"{name:30s} K=256: {dict(pts)[256]:.1e}   K=32768: {dict(pts)[32768]:.1e}")

# %% [markdown]
# Fast accumulation (minite's "fast" mode and cuBLAS's `use_fast_accum`, identical curves) grows 20× from
# K = 256 to 32768; promoting every 128 ("split", and cuBLAS's default) stays flat. DeepSeek-V3 reports the same
# effect (a ~2 % relative error at K = 4096 without promotion) and promotes every $N_C = 128$.
#
# A block-scaled GEMM needs no extra mechanism for this. The scales change every 128 elements of K (every 32 for
# MX), so they cannot be applied in the epilogue as chapter 02's per-tensor scales were; the partial sum of each
# K-block has to leave the tensor core to be multiplied by $s^{-1}_{a}\,s^{-1}_{b}$ anyway:
#
# $$C_{mn} = \sum_{k\text{-blocks } j} \; s^{-1}_{a}[m, j]\; s^{-1}_{b}[j, n] \; \underbrace{\sum_{k \in j} q^a_{mk}\, q^b_{kn}}_{\text{tensor core, 128 products}}$$
#
# The multiply and the add into the fp32 accumulator are the promotion. That is the kernel of the next section.
#
# ## 4. The block-scaled GEMM, in cells
#
# A is (M, K), scaled per 1 × 128 along K: `SA` is (M, cdiv(K, 128)). B is (K, N), scaled per 128 × 128 tile:
# `SB` is (cdiv(K, 128), cdiv(N, 128)). One program computes a (BLOCK_M, BLOCK_N) tile of C; its K loop steps by
# BLOCK_K = 128, exactly one scale block, so each step needs one scale per row of the A tile and one per 128
# columns of the B tile (`offs_n // 128`: BLOCK_N may be smaller or larger than a scale tile). A ragged K (200)
# is masked to zeros, which add nothing.

# %%
@triton.jit
def blockwise_matmul_kernel(A_ptr, B_ptr, C_ptr, SA_ptr, SB_ptr, M, N, K,
                            stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                            stride_sam, stride_sak, stride_sbk, stride_sbn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # rows of A and C
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # columns of B and C
    offs_k = tl.arange(0, BLOCK_K)                                   # one scale block of K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        a = tl.load(A_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)          # (BLOCK_M, BLOCK_K) fp8
        b = tl.load(B_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)          # (BLOCK_K, BLOCK_N) fp8
        part = tl.dot(a, b, input_precision="ieee")                 # a fresh sum of BLOCK_K products
        sa = tl.load(SA_ptr + offs_m * stride_sam + kb * stride_sak, mask=offs_m < M, other=0.0)             # (BM,)
        sb = tl.load(SB_ptr + kb * stride_sbk + (offs_n // 128) * stride_sbn, mask=offs_n < N, other=0.0)  # (BN,)
        acc += part * sa[:, None] * sb[None, :]                      # scale it and promote it to fp32
    tl.store(C_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def blockwise_matmul(qa, qb, out_dtype=torch.float32, BLOCK_M=32, BLOCK_N=32):
    """qa: (M, K) per 1x128, qb: (K, N) per 128x128 (BlockScaledTensors) -> (M, N)."""
    (M, K), N = qa.shape, qb.shape[1]
    c = torch.empty(M, N, device=qa.device, dtype=out_dtype)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    blockwise_matmul_kernel[grid](qa.data, qb.data, c, qa.scale, qb.scale, M, N, K,
                                  qa.data.stride(0), qa.data.stride(1), qb.data.stride(0), qb.data.stride(1),
                                  c.stride(0), c.stride(1), qa.scale.stride(0), qa.scale.stride(1),
                                  qb.scale.stride(0), qb.scale.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                  BLOCK_K=128)
    return c


# %% [markdown]
# Check it against the fp64 product of the dequantized operands and against minite's `block_scaled_gemm`, on
# ragged shapes, with the weight stored as (N, K) and used transposed, as `Linear` does (a 128 × 128 tile is the
# same tile either way round). The bound (the course's attention-class rule, after FlagAttention's tests): at most
# 2× the error of the same computation in fp32
# PyTorch (dequantize, fp32 matmul), plus on a GPU the tensor core's accumulator over the 128 products of a block.

# %% tags=["nbval-check-output"]
g = torch.Generator().manual_seed(3)
for M, K, N in ((33, 200, 45), (64, 256, 130)):
    a = (torch.randn(M, K, generator=g) * 10 ** (2 * torch.rand(K, generator=g) - 1)).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(DEVICE)
    qa, qw = quantize_blockwise(a, (1, 128)), quantize_blockwise(w, (128, 128))
    out = blockwise_matmul(qa, qw.t())
    exact = block_scaled_gemm_ref(qa, qw.t(), torch.float64)
    err = (out.double() - exact).abs().max().item()
    err32 = (block_scaled_gemm_ref(qa, qw.t(), torch.float32).double() - exact).abs().max().item()
    acc = fp8_dot_tolerance(qa.dequantize(torch.float32), qw.t().dequantize(torch.float32), device=DEVICE,
                            atol=0.0, rtol=0.0, promote_every=128)["atol"]
    extra = acc if isinstance(acc, float) else acc.max().item()
    assert err <= 2 * err32 + 1e-6 * exact.abs().max().item() + extra, (err, err32)
    assert_close(out, block_scaled_gemm(qa, qw.t(), out_dtype=torch.float32), name="vs minite",
                 atol=1e-4 + 2 * extra, rtol=1e-5)
    print(f"PASS: blockwise_matmul vs fp64 (within 2x fp32 torch's error) and vs minite [{M}x{K}x{N}]")

# %% [markdown]
# minite's kernel is the same loop with three changes: B may be scaled per 128 × 1 *column* slice instead of per
# tile (the weight-gradient GEMM needs that, below); the scales are loaded *before* the dot, so that their latency
# hides behind the tensor cores, and a 128 × 128 weight tile gives B one scale per program; and it runs 128 × 128
# tiles at 8 warps, two warpgroups of `m64n128k32` FP8 wgmma (the faithful sm_90 build: 176 registers, no spills).
# Its promotion interval is stated in the file (`PROMOTION_INTERVAL`: the K-block, 128, as cuBLAS promotes) and the
# compile gate checks the build against it. MX is a kernel of its own: an E8M0 scale is a power of two, so
# fp8 · 2^e is *exact* in bf16 (8 significant bits hold E4M3's 4, and bf16 has fp32's exponents); it dequantizes
# each 64-wide K slab in registers and runs a bf16 wgmma into one fp32 accumulator (exercise task 3 writes an MX
# GEMM the simple way, one FP8 dot per 32-wide group). **Neither has been timed on a GPU yet**:
# `benchmarks/bench_fp8_block.py` compares them with bf16 and with cuBLAS's FP8 (`torch._scaled_mm`) at 4096³ and
# 8192³.
#
# **In a linear layer** every GEMM scales its operands along *its own* K:
#
# | GEMM | A (scaled per 1 × 128 along K) | B |
# |---|---|---|
# | forward $y = x W^\top$ | $x$ (N, K), along K | $W^\top$: 128 × 128 tiles |
# | dgrad $dx = dy\, W$ | $dy$ (N, O), along O | $W$: the same tiles |
# | wgrad $dW = dy^\top x$ | $dy^\top$, along N (tokens): dy quantized a second time | $x$ per 128 × 1 along N |
#
# `BlockwiseScaling` and `MXFP8Scaling` (in `minite.formats`) run `minite.nn.Linear` this way.
#
# ## 5. When FP8 pays
#
# A **model**, not a measurement: every number comes from H100 SXM peak figures (989 TFLOP/s bf16, 1979 fp8,
# 3.35 TB/s HBM) and an assumed 4 µs per kernel launch. For one forward GEMM of $M = N = K = S$:
#
# * bf16: $t = \max(2S^3/P_{16},\; 3 \cdot 2S^2 / B)$ (two operands in, one out, 2 bytes each);
# * fp8: $t = \max(2S^3/P_8,\; (2S^2 + 2S^2)/B)$, plus quantizing both operands, $2 \cdot 3 S^2 / B$ (read 2 B,
#   write 1 B), plus two more launches.
#
# FP8 pays where the GEMM time it saves, $2S^3(1/P_{16} - 1/P_8)$, exceeds the quantization it adds.

# %%
P16, P8, BW, LAUNCH = 989e12, 1979e12, 3.35e12, 4e-6
S = torch.logspace(math.log10(256), math.log10(32768), 200, dtype=torch.float64)
t16 = torch.maximum(2 * S**3 / P16, 6 * S**2 / BW) + LAUNCH
gemm8 = torch.maximum(2 * S**3 / P8, 4 * S**2 / BW) + LAUNCH
quant = 6 * S**2 / BW + 2 * LAUNCH
speedup = t16 / (gemm8 + quant)
cross = S[(speedup > 1).nonzero()[0, 0]].item()
fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4))
a1.loglog(S, t16 * 1e3, label="bf16 GEMM")
a1.loglog(S, gemm8 * 1e3, label="fp8 GEMM alone")
a1.loglog(S, (gemm8 + quant) * 1e3, label="fp8 GEMM + quantize both operands")
a1.set(xlabel="M = N = K", ylabel="ms (model)", title="MODEL from H100 peak numbers (not measured)")
a1.legend(fontsize=8)
a2.semilogx(S, speedup)
a2.axhline(1, color="gray", ls=":")
a2.axvline(cross, color="C3", ls="--", label=f"crossover S = {cross:.0f}")
a2.axhline(2, color="gray", ls="-.", lw=0.8)
a2.set(xlabel="M = N = K", ylabel="bf16 time / fp8 time (model)", title="speed-up of FP8 over bf16 (model)")
a2.legend()
plt.show()
for s in (1024, 2048, 4096, 8192):
    j = (S - s).abs().argmin()
    print(f"S = {s:5d}: model speed-up {speedup[j].item():.2f}x (quantize = {100 * (quant / (gemm8 + quant))[j].item():.0f}% of the fp8 time)")
print(f"model crossover: S = {cross:.0f}")

# %% [markdown]
# This is the best case **for minite's unfused design**, which runs a standalone quantize pass per operand per GEMM:
# even with both GEMMs at peak and the quantize passes at full bandwidth, FP8 loses below
# $S \approx 2.8$k, gains 1.3× at 4096 and 1.6× at 8192 (the quantize passes are still a fifth of its time there). Real kernels sit below peak, which moves the line right:
# chapter 02 measured minite's FP8 `Linear` at 0.88× bf16 at 4096, and the GPT at the `gpu` preset (width 384)
# 5.3× *slower* in FP8 than in bf16.
#
# **The small-layer rule.** For a linear layer with $N$ tokens, $K$ inputs and $O$ outputs, the forward saves
# $2NKO\,(1/P_{16} - 1/P_8)$ and quantizes $x$ and $W$ at 3 B per element: $3K(N + O)/B$. FP8 pays when
#
# $$\frac{NO}{N + O} > \frac{3}{2\,B\,(1/P_{16} - 1/P_8)} \approx 890 \quad\text{(H100 peaks)}.$$
#
# With many tokens ($N \gg O$) the left side is about $O$; with $N \approx O$ it is $O/2$. So, **in this unfused
# design**, a layer whose smallest dimension is below ~1–2 thousand cannot win, and launch overheads and sub-peak
# kernels push the
# threshold higher (the square case above crosses at 2.8k once two launches of 4 µs are counted). minite's rule is
# `--fp8.min_dim=N` (`min_dim` on every recipe): a `Linear` with $\min(\text{in}, \text{out}) < N$ runs
# unquantized. From the model, **N = 2048 on an H100** sits between the many-token bound (~900) and the square
# crossover (~2800); it is a model's answer for minite's kernels, to be replaced by a measured one. It is not a law
# of FP8: Transformer Engine fuses the activation's cast into the kernel that produces it (the norm, the
# activation function) and casts each weight once per step, not once per GEMM, so most of the $3K(N + O)/B$ term
# disappears and much smaller layers pay there. Every layer of the course's GPTs is
# below it, which is the honest answer to "why is my FP8 run slower". The default stays 0 (every layer in FP8), so
# that FP8 can be studied on small models, as in this chapter and chapter 02.

# %% tags=["nbval-check-output"]
for width, heads in ((384, 6), (768, 12), (4096, 32)):      # the gpu preset, GPT-2 small's width, a 7B's width
    with torch.device("meta"):                               # shapes only: no memory, no initialisation
        model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=heads, n_embd=width))
    lin = [m for m in model.modules() if isinstance(m, minite.nn.Linear)]
    fp8 = [f"{m.in_features}x{m.out_features}" for m in lin if min(m.in_features, m.out_features) >= 2048]
    print(f"width {width:4d}, --fp8.min_dim=2048: {len(fp8)} of {len(lin)} Linear layers per block in FP8 {fp8}")

# %% [markdown]
# ## 6. The four recipes on a GPT
#
# The course's GPT (1 layer, width 128: every GEMM dimension a whole number of 128-blocks) on a corpus of
# additions, 60 AdamW steps from the same seed and batches: fp32, bf16 (`torch.autocast`: the yardstick of what
# rounding alone does to this run), then `fp8_autocast` with each recipe. On this CPU
# the linear layers take the torch reference path (the same quantization, scales and fp8 bits as the kernels; the
# interpreted kernels would take minutes); on a GPU the same cell runs the Triton kernels.

# %%
rng = random.Random(0)
text = "".join(f"{a}+{b}={a + b};" for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(6000)))
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text])
train_ids, val_ids = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
T, B, STEPS = 32, 16, 60


def batch(src, g):
    ix = torch.randint(len(src) - T - 1, (B,), generator=g)
    return torch.stack([src[i:i + T] for i in ix]), torch.stack([src[i + 1:i + T + 1] for i in ix])   # (B, T)


def run(recipe):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(chars), block_size=T, n_layer=1, n_head=2, n_embd=128,
                          vocab_multiple=16)).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    if recipe is None:
        ctx = contextlib.nullcontext
    elif recipe == "bf16":
        ctx = lambda: torch.autocast(DEVICE, dtype=torch.bfloat16)      # noqa: E731
    else:
        ctx = lambda: fp8_autocast(recipe=recipe)                       # noqa: E731
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
    return losses, val


if DEVICE == "cpu":
    torch.set_num_threads(1)
RECIPES = {"fp32": None, "bf16": "bf16", "delayed": DelayedScaling(), "current": CurrentScaling(), "blockwise": BlockwiseScaling(),
           "mxfp8": MXFP8Scaling()}
runs = {name: run(r) for name, r in RECIPES.items()}

# %%
def smooth(v, k=8):
    return [sum(v[max(0, i - k + 1):i + 1]) / len(v[max(0, i - k + 1):i + 1]) for i in range(len(v))]
plt.figure(figsize=(7, 4))
for name, (losses, val) in runs.items():
    plt.plot(smooth(losses), label=f"{name} (val {val:.3f})")
plt.xlabel("step"); plt.ylabel("train loss (8-step mean)"); plt.title("tiny GPT, width 128: fp32, bf16, four FP8 recipes")
plt.legend()
plt.show()
for name, (losses, val) in runs.items():
    print(f"{name:10s} val loss {val:.4f}  ({val - runs['fp32'][1]:+.4f} vs fp32)")
lo, hi = sorted((runs["fp32"][1], runs["bf16"][1]))
slack = 0.1 * (hi - lo)  # a tenth of the band's own width: float noise, never a second band
assert all(lo - slack < runs[n][1] < hi + slack for n in ("delayed", "current", "blockwise", "mxfp8")), runs
print(f"PASS: every FP8 recipe's val loss inside the fp32-bf16 band [{lo:.3f}, {hi:.3f}] (± a tenth of its width)")

# %% [markdown]
# At this size every recipe tracks fp32 about as closely as bf16 does: bf16 and fp32 differ only by rounding, yet
# end several hundredths apart after 60 steps of a steeply falling curve, so the order of the FP8 recipes says
# little (chapter 02 made the same observation). The assert states the claim: each recipe inside the band that fp32
# and bf16 span (with a tenth of its width to spare), so a recipe that rounds worse than bf16 does fails it. What a 60-step CPU run cannot show is the reason block scaling exists: outlier
# features appear in activations only at scale (billions of parameters), and that is where a per-tensor scale
# starts to lose the small values, as section 1 showed on a synthetic tensor. `tests/test_fp8_recipes.py` checks the
# same thing through `python -m minite.train` (each recipe within 0.02 of fp32 at 20 steps) and that a checkpoint
# resumes bit for bit under each recipe.
#
# ## 7. Where it is used
#
# * `python -m minite.train --precision fp8 --fp8.recipe=delayed|current|blockwise|mxfp8 [--fp8.min_dim=2048]`.
# * `minite.formats`: `E8M0` (a format like `E4M3`: `encode`, `decode`, `bit_string`; `e8m0_encode(x, "ceil")`
#   rounds up), `BlockScaledTensor`, `quantize_blockwise_ref`,
#   `quantize_mx_ref`, `mx_scale_bits_ref`, and the recipes `BlockwiseScaling`, `MXFP8Scaling` (with `min_dim`, as
#   `DelayedScaling` and `CurrentScaling` have).
# * `minite/kernels/fp8_block.py`: the quantize kernel (1 × 128, 128 × 128, MX-32), `block_scaled_gemm`, and the
#   linear layer's three block-scaled GEMMs, which saves x for the weight gradient as its fp8 copy; under
#   `torch.compile` the kernels are the custom ops `block_quantize` and `block_scaled_mm`, in the graph.
# * `benchmarks/bench_fp8_block.py`: the block GEMMs beside bf16 and `torch._scaled_mm`, on one GPU (below).

# %% [markdown]
# ## 8. Measured on a GPU
#
# `benchmarks/bench_fp8_block.py` on one NVIDIA H200 (2026-11-28, torch 2.11, triton 3.6), peers in the same run:
# the bf16 GEMM and `torch._scaled_mm` with row-wise scales (cuBLAS's FP8), at $M = N = K = S$. The kernels it timed
# are the ones *before* this chapter's Hopper rework, and they lost: 64 × 64 tiles gave `m64n32k32` wgmma (shared
# memory bound), the scale loads waited behind each dot, and MX ran on fp8 wgmma 32 elements at a time. Since then
# (not measured yet) the blockwise kernel runs 128 × 128 tiles with its scales loaded before the dot, and MX
# dequantizes exactly to bf16 ($2^e$ scales) on bf16 wgmma; the expectation from their sm_90 builds is 600-800
# TFLOP/s blockwise, still below `_scaled_mm`, because each 128-wide K block still waits for its dot before it is
# promoted (DeepGEMM overlaps that with two warpgroups).

# %%
from minite.recorded import recorded

gemm = {}
for name, rec in recorded("fp8_block").items():
    for r in rec["results"]:
        if r.get("table") == "gemm" and "tflops" in r:
            gemm.setdefault((rec["device"], r["impl"]), []).append((r["S"], r["tflops"]))
if not gemm:
    print("no recorded GPU run of bench_fp8_block.py in benchmarks/results/ (a source checkout holds them)")
else:
    devices = sorted({d for d, _ in gemm})
    fig, axes = plt.subplots(1, len(devices), figsize=(7 * len(devices), 4), squeeze=False)
    for ax, dev in zip(axes[0], devices):
        for (d, impl), pts in sorted(gemm.items()):
            if d == dev:
                ax.plot(*zip(*sorted(pts)), "o-", label=impl)
        ax.set(xscale="log", xlabel="M = N = K", ylabel="TFLOP/s", title=f"{dev} (recorded, 2026-11-28)")
        ax.legend(fontsize=8)
    plt.show()
    for (d, impl), pts in sorted(gemm.items()):
        print(f"{d}: {impl:26s} " + ", ".join(f"S={s}: {t:.0f} TFLOP/s" for s, t in sorted(pts)))
