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
# # 15 — FP8 at scale: graded exercises
#
# Three tasks, each a step harder than the last, on what the lesson did not write. In each task cell, replace
#
# ```python
#     ### BEGIN YOUR CODE
#     raise NotImplementedError()
#     ### END YOUR CODE
# ```
#
# with your code (keep the marker lines), run the cell, then run the check cell right after it. Grade with
# `python -m minite.grading grade exercises/15_fp8_at_scale_exercise.ipynb`.
#
# 1. **E8M0 scale selection**: the OCP MX shared scale of a block from its amax, as E8M0 bits;
# 2. **a 1 × 128 quantize kernel** (a whole kernel): DeepSeek-V3's activation quantization, bit-exact;
# 3. **an MXFP8 GEMM tile loop** (a whole kernel): E8M0 scales decoded in the kernel, two 32-element scale groups
#    per K step, a ragged K.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
from minite._triton import triton, tl
from minite.formats import mx_scale_bits_ref, quantize_blockwise_ref
from minite.formats.specs import encode_bits_tl
from minite.kernels.fp8_block import block_scaled_gemm, block_scaled_gemm_ref, quantize_mx
from minite.testing import fp8_dot_tolerance
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %% [markdown]
# ## Task 1 — E8M0 scale selection
#
# An MX block shares one scale $X = 2^e$, stored as the E8M0 byte $e + 127$ (bias 127; `0xFF` is NaN; no sign, no
# zero, no infinity). OCP MX v1.0 picks the exponent from the block's largest magnitude `amax` and the element
# format: `emax_elem` is the exponent of the element format's largest normal (8 for E4M3, 15 for E5M2), and the
# block's largest element must land in the element format's top binade. Write `mx_scale_bits(amax, emax_elem)`:
#
# * `amax`: a float32 tensor of block maxima (any shape), `amax >= 0` or NaN or inf;
# * returns a `torch.uint8` tensor of E8M0 bytes of the same shape;
# * the exponent is clamped into E8M0's range [-127, 127]; an all-zero block (`amax == 0`) gets the smallest scale;
#   a block with an inf or NaN gets the NaN scale;
# * exact for every float32 amax, subnormals included (think about what `torch.log2` does at a power of two, and
#   about `torch.frexp`).

# %% minite={"task": "mx_scale_bits"}
def mx_scale_bits(amax, emax_elem):
    """OCP MX shared scale of each block, as E8M0 bytes (uint8)."""
    ### BEGIN SOLUTION
    _, exp = torch.frexp(amax.double())                   # amax = m * 2^exp, m in [0.5, 1): floor(log2) = exp - 1
    e = (exp.long() - 1 - emax_elem).clamp(-127, 127)
    e = torch.where(amax == 0, torch.full_like(e, -127), e)
    return torch.where(torch.isfinite(amax), e + 127, torch.full_like(e, 255)).to(torch.uint8)
    ### END SOLUTION


# %% minite={"check": "mx_scale_bits"} tags=["nbval-check-output"]
# CHECK: mx_scale_bits
g = torch.Generator().manual_seed(1)
edges = torch.tensor([0.0, 1.0, 6.0, 448.0, 500.0, 511.99, 512.0, 2.0 ** -126, 2.0 ** -130, 1e-45, 3e38,
                      float("inf"), float("nan")])
amax = torch.cat([edges, torch.rand(3000, generator=g) * 10 ** (torch.rand(3000, generator=g) * 76 - 38)])
for emax_elem in (8, 15):
    got = mx_scale_bits(amax, emax_elem)
    want = mx_scale_bits_ref(amax, emax_elem)                  # minite's reference (formats/mx.py)
    assert got.shape == want.shape and got.element_size() == 1, "one byte per block"
    assert torch.equal(got.to(torch.int32), want.to(torch.int32)), "E8M0 bytes differ from the OCP rule"
    print(f"PASS: mx_scale_bits [emax_elem = {emax_elem}]")

# %% [markdown]
# ## Task 2 — the 1 × 128 quantize kernel
#
# DeepSeek-V3 quantizes activations with one scale per 1 × 128 slice of a row. Write `quantize_1x128_kernel`, one
# program per (`ROWS` rows) × (one block of `BLOCK` = 128 columns) of a contiguous (R, C) input. For each row of its
# tile it must
#
# 1. load the block (masked: C need not be a multiple of 128, R not a multiple of ROWS; missing elements count as
#    0) and convert it to fp32;
# 2. compute the row's block amax and the scale `448 / amax`, or 1 when amax is 0 (inputs are finite);
# 3. encode `x * scale` as E4M3 bits with chapter 01's `encode_bits_tl(y, 4, 3, True, True)` (round to nearest
#    even, saturate) and store them as `tl.uint8` into `Y_ptr` (R, C) row-major;
# 4. store `scale_inv = 1 / scale` (fp32) into `S_ptr`, an (R, cdiv(C, BLOCK)) row-major tensor.
#
# The scales must equal the reference's to the last bit on a GPU too: compute both divisions with `tl.div_rn`
# (IEEE round-to-nearest division; Triton's `/` on fp32 is an approximate division on NVIDIA GPUs). The launcher is
# below the kernel.

# %% minite={"task": "quantize_1x128_kernel"}
@triton.jit
def quantize_1x128_kernel(X_ptr, Y_ptr, S_ptr, R, C, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    r0 = tl.program_id(0).to(tl.int64) * ROWS
    c0 = tl.program_id(1).to(tl.int64) * BLOCK
    r = r0 + tl.arange(0, ROWS)
    c = c0 + tl.arange(0, BLOCK)
    inside = (r[:, None] < R) & (c[None, :] < C)
    v = tl.load(X_ptr + r[:, None] * C + c[None, :], mask=inside, other=0.0).to(tl.float32)
    peak = tl.max(tl.abs(v), axis=1)                                  # (ROWS,)
    good = peak > 0.0
    s = tl.where(good, tl.div_rn(tl.full((ROWS,), 448.0, tl.float32), tl.where(good, peak, 1.0)), 1.0)
    q = encode_bits_tl(v * s[:, None], 4, 3, True, True)
    tl.store(Y_ptr + r[:, None] * C + c[None, :], q.to(tl.uint8), mask=inside)
    n_blocks = tl.cdiv(C, BLOCK)
    inv = tl.div_rn(tl.full((ROWS,), 1.0, tl.float32), s)
    tl.store(S_ptr + r * n_blocks + tl.program_id(1), inv, mask=r < R)
    ### END SOLUTION


def quantize_1x128(x, ROWS=16, BLOCK=128):
    """x (R, C) -> (E4M3 data (R, C), scale_inv (R, cdiv(C, 128)) fp32)."""
    x = x.contiguous()
    R, C = x.shape
    data = torch.empty((R, C), dtype=torch.uint8, device=x.device)
    scale_inv = torch.empty((R, triton.cdiv(C, BLOCK)), dtype=torch.float32, device=x.device)
    quantize_1x128_kernel[(triton.cdiv(R, ROWS), triton.cdiv(C, BLOCK))](x, data, scale_inv, R, C, ROWS=ROWS,
                                                                         BLOCK=BLOCK)
    return data.view(torch.float8_e4m3fn), scale_inv


# %% minite={"check": "quantize_1x128_kernel"} tags=["nbval-check-output"]
# CHECK: quantize_1x128_kernel
g = torch.Generator().manual_seed(2)
for (R, C), dtype in (((21, 300), torch.float32), ((16, 128), torch.float32), ((37, 200), torch.bfloat16)):
    x = torch.randn(R, C, generator=g) * torch.logspace(-5, 4, C)         # every block a different size
    x[1] = 0.0                                                            # an all-zero row: scale 1
    x[2, :3] = torch.tensor([1e6, -1e-30, 0.0])
    x = x.to(dtype)
    data, scale_inv = quantize_1x128(x.to(DEVICE))
    want = quantize_blockwise_ref(x, (1, 128))                            # minite's reference (formats/mx.py)
    assert torch.equal(data.view(torch.uint8).cpu().to(torch.int32), want.data.view(torch.uint8).to(torch.int32)), \
        "fp8 bits differ"
    assert torch.equal(scale_inv.cpu(), want.scale), "scales differ"
    print(f"PASS: quantize_1x128_kernel [{R}x{C}, {str(dtype)[6:]}]")

# %% [markdown]
# ## Task 3 — an MXFP8 GEMM tile loop
#
# $C = \hat A \hat B$ where A (M, K) and B (K, N) are MXFP8: E4M3 elements, one E8M0 scale per 32 consecutive
# elements **along K** for both operands (A: per 1 × 32 slice of a row; B: per 32 × 1 slice of a column).
# `SA_ptr` holds A's scale bytes (M, cdiv(K, 32)) and `SB_ptr` B's (cdiv(K, 32), N), both `uint8`, with the strides
# given. Byte `b` means $2^{b - 127}$, except `b == 255`, which is NaN (and must make the results that use it NaN).
#
# Write `mx_matmul_kernel`: one program per (BLOCK_M, BLOCK_N) tile of C (a 2-D grid), fp32 output. The K loop
# steps by **BLOCK_K = 64**: each step spans two scale groups, and the products of one group must be scaled by
# *that* group's scales (no dequantizing before `tl.dot`: its operands are the raw fp8 tiles; every `tl.dot` on
# this GPU-legal path has K ≥ 32). K need not be a multiple of 32 or 64: elements past K are zeros, and a scale
# past the last group does not exist.

# %% minite={"task": "mx_matmul_kernel"}
@triton.jit
def mx_matmul_kernel(A_ptr, B_ptr, C_ptr, SA_ptr, SB_ptr, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     stride_sam, stride_sak, stride_sbk, stride_sbn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ### BEGIN SOLUTION
    G: tl.constexpr = 32
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    n_groups = tl.cdiv(K, G)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for h in tl.static_range(BLOCK_K // G):                       # the scale groups of this K step
            grp = k0 // G + h
            kk = grp * G + tl.arange(0, G)
            ta = tl.load(A_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                         mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)
            tb = tl.load(B_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                         mask=(kk[:, None] < K) & n_ok[None, :], other=0.0)
            prod = tl.dot(ta, tb, input_precision="ieee")
            ea = tl.load(SA_ptr + rm * stride_sam + grp * stride_sak, mask=m_ok & (grp < n_groups), other=127)
            eb = tl.load(SB_ptr + grp * stride_sbk + rn * stride_sbn, mask=n_ok & (grp < n_groups), other=127)
            ia, ib = ea.to(tl.int32), eb.to(tl.int32)                # E8M0 byte -> fp32 bits: exponent field
            fa = tl.where(ia == 0, 0x00400000, ia << 23)                 # (2^-127 is an fp32 subnormal)
            fb = tl.where(ib == 0, 0x00400000, ib << 23)
            fa = tl.where(ia == 255, 0x7FC00000, fa).to(tl.float32, bitcast=True)
            fb = tl.where(ib == 255, 0x7FC00000, fb).to(tl.float32, bitcast=True)
            total += prod * fa[:, None] * fb[None, :]
    tl.store(C_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, total, mask=m_ok[:, None] & n_ok[None, :])
    ### END SOLUTION


def mx_matmul(qa, qb, BLOCK_M=32, BLOCK_N=32):
    """qa (M, K) and qb (K, N): minite MX BlockScaledTensors (qb = quantize_mx(w).t() for a weight w (N, K))."""
    (M, K), N = qa.shape, qb.shape[1]
    c = torch.empty(M, N, device=qa.device, dtype=torch.float32)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    mx_matmul_kernel[grid](qa.data, qb.data, c, qa.scale, qb.scale, M, N, K,
                           qa.data.stride(0), qa.data.stride(1), qb.data.stride(0), qb.data.stride(1),
                           c.stride(0), c.stride(1), qa.scale.stride(0), qa.scale.stride(1),
                           qb.scale.stride(0), qb.scale.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=64)
    return c


# %% minite={"check": "mx_matmul_kernel"} tags=["nbval-check-output"]
# CHECK: mx_matmul_kernel
g = torch.Generator().manual_seed(3)
for M, K, N in ((33, 200, 45), (64, 96, 70), (16, 40, 20)):
    a = torch.randn(M, K, generator=g) * 10.0 ** (4 * torch.rand(K, generator=g) - 2)   # K-groups of all sizes
    w = torch.randn(N, K, generator=g)
    if M == 16:
        a[5, 3] = float("nan")                                     # a NaN scale: row 5 of C is NaN, no other
    qa, qb = quantize_mx(a.to(DEVICE)), quantize_mx(w.to(DEVICE)).t()
    got = mx_matmul(qa, qb).cpu()
    exact = block_scaled_gemm_ref(qa, qb, torch.float64).cpu()                 # minite: dequantize, fp64 matmul
    err32 = (block_scaled_gemm_ref(qa, qb, torch.float32).cpu().double() - exact).nan_to_num().abs().max().item()
    acc = fp8_dot_tolerance(qa.dequantize(torch.float32), qb.dequantize(torch.float32), device=DEVICE, atol=0.0,
                            rtol=0.0, promote_every=32)["atol"]
    extra = acc if isinstance(acc, float) else acc.nan_to_num().max().item()
    tol = 2 * err32 + 1e-6 * exact.nan_to_num().abs().max().item() + extra   # 2x the error of fp32 torch (the course rule)
    assert torch.equal(torch.isnan(got), torch.isnan(exact)), "NaN pattern differs"
    assert torch.allclose(got.double().nan_to_num(), exact.nan_to_num(), atol=tol, rtol=0.0), "values differ"
    mine = block_scaled_gemm(qa, qb, out_dtype=torch.float32).cpu()          # minite's kernel
    assert torch.allclose(got.nan_to_num(), mine.nan_to_num(), atol=2 * tol + 1e-4, rtol=1e-5), "differs from minite"
    print(f"PASS: mx_matmul_kernel [{M}x{K}x{N}]")
