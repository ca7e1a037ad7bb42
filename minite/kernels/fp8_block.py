"""Block-scaled FP8 (chapter 15): quantize per 1x128 / 128x128 / MX-32 block, and a GEMM that applies the scales.

    C (M, N) = A (M, K) @ B (K, N)      A: one scale per 1 x SK slice of a row    (SK = 128 blockwise, 32 MX)
                                        B: one scale per SK x 128 tile (DeepSeek-V3's weights) or SK x 1 column slice

A per-tensor scale leaves the sum over K (chapter 02: one multiply in the epilogue). A per-block scale does not:
it changes every SK elements of K. So the blockwise K loop runs one SK-block at a time, lets the tensor cores sum
that block's SK products into a *fresh* accumulator, and adds it to the fp32 accumulator times the two scales::

    acc += tl.dot(a_blk, b_blk) * (sa * sb)[:, None]          # once per K-block: the scales and the promotion

That one line is also DeepSeek-V3's fix for Hopper's ~14-bit FP8 accumulator (§3.3.2): a partial sum never runs
longer than SK = 128 products before it reaches fp32 (N_C = 128, cuBLAS's interval too); the kernel states it in
``PROMOTION_INTERVAL`` and the sm_90 gate checks the build against it. The scales are loaded before the dot (their
latency hides behind the tensor cores), and a 128 x 128 weight tile gives B one scale per program: a scalar.

MX scales are powers of two (E8M0), so fp8 * 2^e is exact in bf16 (8 significant bits hold E4M3's 4; bf16 has
fp32's exponents: it overflows where the fp32 reference does, and only scales below 2^-117 can round an element
into its subnormals). Hopper has no MX tensor cores, and an FP8 MMA per 32-wide group waits every 32 products: the
MX kernel dequantizes each K slab in registers and runs a bf16 MMA into one fp32 accumulator. The interpreter
decodes fp8 bits exactly (``FP8_MMA``/``BF16_MMA`` off: its fp8 cast reads NaN as 480) and dots in fp16 (blockwise:
it holds every fp8 value) or fp32 (MX: its bf16 arithmetic is wrong).

The quantize kernel encodes with chapter 01's integer ``encode_bits_tl`` (bit-exact on the interpreter, whose own
fp8 casts are wrong, and on the GPU) and computes scales with ``tl.div_rn`` (IEEE division: Triton's ``/`` is an
approximate division on the GPU), so it matches ``formats/mx.py`` bit for bit everywhere.

Sections: 1. references (formats/mx.py's quantize references; ``block_scaled_gemm_ref``); 2. kernels;
3. launchers, each also the custom op ``torch.ops.minite.block_quantize`` / ``block_scaled_mm`` on CUDA, so that
torch.compile keeps the kernels in its graph; 4. ``BlockFP8LinearFunction``: the linear layer's three GEMMs under
the block recipes (used by kernels/fp8_linear.py); 5. functional API. The module is ``minite.nn.Linear``.
"""
from __future__ import annotations

import torch

from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.formats.fp8 import FP8_DTYPES
from minite.formats.mx import (
    MX_BLOCK,
    BlockScaledTensor,
    check_block_args,
    elem_emax,
    quantize_blockwise_ref,
    quantize_mx_ref,
)
from minite.formats.specs import decode_scale_tl, encode_bits_tl
from minite.kernels._common import gpu_tiles, launchable, op, register_op
from minite.kernels.fp8_gemm import fp8_to_fp32_tl

__all__ = ["block_scaled_gemm_ref", "quantize_blockwise", "quantize_mx", "block_scaled_gemm", "quantize_block_fwd",
           "block_scaled_gemm_fwd", "block_quantize", "block_scaled_mm", "BlockFP8LinearFunction", "GPU_TILES"]


# ----------------------------------------------------------------------------------------------- 1. reference
def block_scaled_gemm_ref(a: BlockScaledTensor, b: BlockScaledTensor, out_dtype=torch.float32) -> torch.Tensor:
    """The spec: dequantize both operands (fp32; fp64 when out_dtype is fp64), matmul, cast once."""
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (a.dequantize(acc) @ b.dequantize(acc)).to(out_dtype)


# ----------------------------------------------------------------------------------------------- 2. kernels
@triton.jit
def _quantize_block_kernel(X_ptr, Y_ptr, S_ptr, R, C, X_row_stride, S_row_stride,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TILE: tl.constexpr, MX: tl.constexpr,
                           POW2: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, FN: tl.constexpr,
                           FP8_MAX: tl.constexpr, EMAX_ELEM: tl.constexpr):
    # One program per (BLOCK_R, BLOCK_C) tile of x (R, C); BLOCK_C = the scale block along the row (128 or 32).
    # TILE: one scale for the whole tile (128 x 128 weights); else one per row of the tile (1 x BLOCK_C).
    pid_r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)                     # (BLOCK_R,)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)                     # (BLOCK_C,)
    mask = (rows[:, None] < R) & (cols[None, :] < C)                  # ragged edges load 0: amax unchanged
    x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Block amax. On the GPU max() drops NaN (maxnum), so NaNs are counted and put back (formats/fp8.py does too).
    n_nan = tl.sum((x != x).to(tl.int32), axis=1)                     # (BLOCK_R,)
    amax = tl.max(tl.abs(x), axis=1)                                  # (BLOCK_R,)
    if TILE:                                                          # the tile's max, broadcast to every row
        amax = tl.zeros((BLOCK_R,), tl.float32) + tl.max(amax, axis=0)
        n_nan = tl.zeros((BLOCK_R,), tl.int32) + tl.sum(n_nan, axis=0)
    amax = tl.where(n_nan > 0, float("nan"), amax)
    if MX:
        # OCP MX: shared exponent floor(log2 amax) - EMAX_ELEM, read off amax's fp32 exponent field. amax = 0 or
        # an fp32 subnormal clamp to -127; inf / NaN (field 255) make a NaN scale (E8M0 0xFF).
        e32 = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        shared = tl.maximum(e32 - 127 - EMAX_ELEM, -127)
        bits = tl.where(e32 == 255, 255, shared + 127)
        # 1 / X = 2^-shared, built from its exponent field: 127 - shared is in [EMAX_ELEM, 254], always normal
        inv = ((127 - shared) << 23).to(tl.float32, bitcast=True)
        inv = tl.where(e32 == 255, float("nan"), inv)
        y = x * inv[:, None]                                          # exact: a power of two
        s_out = bits.to(tl.uint8)
    else:
        # DeepSeek-V3 / TransformerEngine: scale = FP8_MAX / amax; 1 for an all-zero or non-finite block
        ok = (amax > 0.0) & (amax < float("inf"))                     # NaN fails both
        scale = tl.where(ok, tl.div_rn(tl.full((BLOCK_R,), FP8_MAX, tl.float32), tl.where(ok, amax, 1.0)), 1.0)
        if POW2:                                                      # round down to a power of two
            scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # 0xFF800000
        y = x * scale[:, None]
        s_out = tl.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), scale)  # scale_inv, stored fp32
        s_out = tl.where(amax < float("inf"), s_out, float("nan"))    # inf / NaN in the block: scale_inv NaN
    # Round to nearest even, saturate to ±max (inf too), NaN stays NaN: chapter 01's integer encoding.
    q = encode_bits_tl(y, EXP_BITS, MAN_BITS, True, FN).to(tl.uint8)
    tl.store(Y_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    if TILE:                                                          # one scale: lane 0 stores it
        first = tl.arange(0, BLOCK_R) == 0
        tl.store(S_ptr + pid_r * S_row_stride + pid_c + tl.arange(0, BLOCK_R) * 0, s_out, mask=first)
    else:
        tl.store(S_ptr + rows * S_row_stride + pid_c, s_out, mask=rows < R)


@triton.jit
def _grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # (pid_m, pid_n) in grouped order: GROUP_M row tiles share their B column tiles while those are in L2
    pid = tl.program_id(0).to(tl.int64)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % group_size), (pid % (GROUP_M * num_n)) // group_size


@triton.jit
def _block_scaled_gemm_kernel(A_ptr, B_ptr, C_ptr, SA_ptr, SB_ptr, M, N, K,
                              A_row_stride, A_col_stride, B_row_stride, B_col_stride, C_row_stride, C_col_stride,
                              SA_row_stride, SA_col_stride, SB_row_stride, SB_col_stride,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              SCALE_N: tl.constexpr, GROUP_M: tl.constexpr, FP8_MMA: tl.constexpr):
    # Blockwise: C (M, N) = A (M, K) @ B (K, N); fp32 scales SA (M, cdiv(K, BLOCK_K)), SB (cdiv(K, BLOCK_K),
    # cdiv(N, SCALE_N)). BLOCK_K IS the scale block along K, and the promotion interval: each K-block's dot starts
    # from zero (at most BLOCK_K products in the tensor core's FP8 accumulator), then reaches fp32 scaled.
    pid_m, pid_n = _grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K)                                     # (BLOCK_K,)
    a_ptrs = A_ptr + offs_m[:, None] * A_row_stride + offs_k[None, :] * A_col_stride   # (BLOCK_M, BLOCK_K)
    b_ptrs = B_ptr + offs_k[:, None] * B_row_stride + offs_n[None, :] * B_col_stride   # (BLOCK_K, BLOCK_N)
    sa_ptrs = SA_ptr + offs_m * SA_row_stride                          # (BLOCK_M,) each row's scale, K-block 0
    # B's scale: one per program and K-block when a scale tile spans the whole column tile (128 x 128 weights)
    B_SCALAR: tl.constexpr = SCALE_N % BLOCK_N == 0
    if B_SCALAR:
        sb_ptrs = SB_ptr + (pid_n * BLOCK_N // SCALE_N) * SB_col_stride
    else:
        sb_ptrs = SB_ptr + (offs_n // SCALE_N) * SB_col_stride         # (BLOCK_N,) a column's scale
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        # the scales first: their loads are in flight while the tensor cores work on the K-block (B's scales per
        # column after it: 32 more registers held across the dot spilled at 128 x 128)
        sa = tl.load(sa_ptrs + kb * SA_col_stride, mask=offs_m < M, other=0.0)
        if B_SCALAR:
            sb = tl.load(sb_ptrs + kb * SB_row_stride)
        k = kb * BLOCK_K + offs_k
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)   # fp8
        b = tl.load(b_ptrs, mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if FP8_MMA:
            part = tl.dot(a, b)                                        # fresh: BLOCK_K products in FP8's accumulator
        else:  # the interpreter: the bits decoded exactly into fp16 (as fp8_gemm), fp32 sums
            part = tl.dot(fp8_to_fp32_tl(a, False).to(tl.float16), fp8_to_fp32_tl(b, False).to(tl.float16))
        if B_SCALAR:
            acc += part * (sa * sb)[:, None]                           # promotion, scaled: once per K-block
        else:
            sb = tl.load(sb_ptrs + kb * SB_row_stride, mask=offs_n < N, other=0.0)
            acc += (part * sa[:, None]) * sb[None, :]
        a_ptrs += BLOCK_K * A_col_stride
        b_ptrs += BLOCK_K * B_row_stride
    c_ptrs = C_ptr + offs_m[:, None] * C_row_stride + offs_n[None, :] * C_col_stride
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _mx_gemm_kernel(A_ptr, B_ptr, C_ptr, SA_ptr, SB_ptr, M, N, K,
                    A_row_stride, A_col_stride, B_row_stride, B_col_stride, C_row_stride, C_col_stride,
                    SA_row_stride, SA_col_stride, SB_row_stride, SB_col_stride,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr,
                    GROUP_M: tl.constexpr, BF16_MMA: tl.constexpr):
    # MX: C (M, N) = A (M, K) @ B (K, N); E8M0 scales SA (M, cdiv(K, SCALE_K)), SB (cdiv(K, SCALE_K), N).
    # A scale is a power of two, so fp8 * 2^e is exact in bf16 (8 significant bits hold fp8's 4 or 3; bf16 has
    # fp32's exponent range): each BLOCK_K slab is dequantized in registers and summed by a bf16 MMA into one
    # fp32 accumulator carried through the K loop (no FP8 accumulator: nothing to promote).
    G: tl.constexpr = BLOCK_K // SCALE_K                               # scale groups per K slab
    pid_m, pid_n = _grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K)                                     # (BLOCK_K,)
    offs_g = tl.arange(0, G)                                           # (G,)
    a_ptrs = A_ptr + offs_m[:, None] * A_row_stride + offs_k[None, :] * A_col_stride   # (BLOCK_M, BLOCK_K)
    b_ptrs = B_ptr + offs_k[:, None] * B_row_stride + offs_n[None, :] * B_col_stride   # (BLOCK_K, BLOCK_N)
    sa_ptrs = SA_ptr + offs_m[:, None] * SA_row_stride + offs_g[None, :] * SA_col_stride  # (BLOCK_M, G)
    sb_ptrs = SB_ptr + offs_g[:, None] * SB_row_stride + offs_n[None, :] * SB_col_stride  # (G, BLOCK_N)
    n_groups = tl.cdiv(K, SCALE_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        g = kb * G + offs_g
        sa = tl.load(sa_ptrs, mask=(offs_m[:, None] < M) & (g[None, :] < n_groups), other=127)    # E8M0 bits
        sb = tl.load(sb_ptrs, mask=(g[:, None] < n_groups) & (offs_n[None, :] < N), other=127)
        k = kb * BLOCK_K + offs_k
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)   # fp8
        b = tl.load(b_ptrs, mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        # each scale repeated over its SCALE_K elements along K
        xa = tl.reshape(tl.broadcast_to(decode_scale_tl(sa.to(tl.int32), 8, 127)[:, :, None], (BLOCK_M, G, SCALE_K)),
                        (BLOCK_M, BLOCK_K))
        xb = tl.reshape(tl.broadcast_to(decode_scale_tl(sb.to(tl.int32), 8, 127)[:, None, :], (G, SCALE_K, BLOCK_N)),
                        (BLOCK_K, BLOCK_N))
        a = fp8_to_fp32_tl(a, BF16_MMA) * xa                            # exact (a power of two)
        b = fp8_to_fp32_tl(b, BF16_MMA) * xb
        if BF16_MMA:
            acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)    # exact casts; products exact in fp32
        else:  # the interpreter computes bf16 wrongly: the same values in fp32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * A_col_stride
        b_ptrs += BLOCK_K * B_row_stride
        sa_ptrs += G * SA_col_stride
        sb_ptrs += G * SB_row_stride
    c_ptrs = C_ptr + offs_m[:, None] * C_row_stride + offs_n[None, :] * C_col_stride
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------- 3. launchers
@register_op("block_quantize")  # torch.ops.minite.block_quantize, for torch.compile (section 4)
def block_quantize(x: torch.Tensor, br: int, bc: int, mx: bool, fp8_dtype: torch.dtype,
                   pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the quantize kernel: x (R, C) -> (the fp8 bits as uint8 (R, C), scales (cdiv(R, br), cdiv(C, bc)):
    fp32 scale_inv, or E8M0 bits (uint8) with mx). Blocks (1, SK) or (SK, SK) blockwise, (1, 32) MX."""
    R, C = x.shape
    xc = x.contiguous()
    exp_bits, man_bits, fn = FP8_DTYPES[fp8_dtype]
    data = torch.empty((R, C), dtype=torch.uint8, device=x.device)
    sdt = torch.uint8 if mx else torch.float32
    scale = torch.empty((triton.cdiv(R, br), triton.cdiv(C, bc)), dtype=sdt, device=x.device)
    tile = br > 1
    # Rows per program: the tile's rows (TILE), else 16 rows of one block each (GPU: 16 x 128 = 2048 values).
    # A 128 x 128 tile at 32 warps is 16 values a thread: no register spills on sm_90 (8 warps spilled 356 B).
    block_r = triton.next_power_of_2(br) if tile else 16
    warps = 32 if br >= 128 else 8 if tile else 4
    if R and C:
        grid = (triton.cdiv(R, block_r), triton.cdiv(C, bc))
        launchable(_quantize_block_kernel)[grid](
            xc, data, scale, R, C, xc.stride(0), scale.stride(0), BLOCK_R=block_r, BLOCK_C=bc, TILE=tile,
            MX=mx, POW2=pow2, EXP_BITS=exp_bits, MAN_BITS=man_bits, FN=fn,
            FP8_MAX=float(torch.finfo(fp8_dtype).max), EMAX_ELEM=elem_emax(fp8_dtype), num_warps=warps)
    return data, scale


def quantize_block_fwd(x: torch.Tensor, block, kind: str, fp8_dtype=torch.float8_e4m3fn,
                       pow2: bool = False) -> BlockScaledTensor:
    """The quantize kernel (the custom op under torch.compile) -> a BlockScaledTensor of `x`."""
    data, scale = op("block_quantize", block_quantize)(x.detach(), block[0], block[1], kind == "mx", fp8_dtype, pow2)
    return BlockScaledTensor(data.view(fp8_dtype), scale, block, kind, x.dtype)


# GPU tiles (BLOCK_M, BLOCK_N, num_warps, num_stages), chosen with the faithful sm_90 compile (the JIT's
# specialisation; minite/gpu_examples.py's shapes), NOT yet timed on a GPU. 128 x 128 at 8 warps: two warpgroups
# of m64n128 wgmma (N = 128 per warpgroup: the operands' shared-memory reads keep up with the tensor cores; 64 x 64
# ran m64n32 at 0.29x torch._scaled_mm). Blockwise (BLOCK_K = the scale block, 128): fp8 wgmma m64n128k32, 176
# registers, 0 spills, cp.async 4 stages (128 KB). B scaled per 128 x 1 column (the weight gradient): one warpgroup
# of 64 x 128 (234 registers, 0 spills; 2 blocks fit an SM), as 128 x 128 spills its B scales (a vector, not a
# scalar). MX: bf16 wgmma m64n128k16, BLOCK_K = MX_BLOCK_K = 64 (two E8M0 groups a slab): 165 registers, 0 spills;
# a 128-wide slab needs 255 registers, the most a thread may have.
GPU_TILES = {"blockwise": (128, 128, 8, 4), "blockwise_cols": (64, 128, 4, 4), "mx": (128, 128, 8, 4)}
MX_BLOCK_K = 64  # MX: K per loop step (a multiple of the scale block)

# The FP8 promotion interval each kernel states (minite/gpu_compile.py's convention, checked by the gate on the
# sm_90 TTGIR): the blockwise GEMM's K-block dot starts from zero, so at most BLOCK_K products (the scale block,
# 128 in DeepSeek-V3's recipe: cuBLAS's interval) sum in the FP8 accumulator. MX has no FP8 dot on the GPU.
PROMOTION_INTERVAL = {"_block_scaled_gemm_kernel": "BLOCK_K"}


def _tiles(M: int, N: int, on_gpu: bool, kind: str) -> tuple[int, int, int, int]:
    if on_gpu:
        return GPU_TILES[kind]
    def fit(n):  # interpreter: ~0.5 ms per program, so few programs; tl.dot dims >= 16 stay GPU-legal
        return max(16, min(64, triton.next_power_of_2(n)))
    return fit(M), fit(N), 4, 1


@register_op("block_scaled_mm", eager_only=("tiles",))
def block_scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, sk: int, sn: int, mx: bool,
                    out_dtype: torch.dtype, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Launch the GEMM: fp8 a (M, K) @ b (K, N), scales sa per (1, sk), sb per (sk, sn) -> (M, N) of `out_dtype`.
    `tiles` = (BLOCK_M, BLOCK_N, warps, stages), a test's; strided views of a and b are fine."""
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    on_gpu = gpu_tiles(a)
    if on_gpu and not mx and sk < 32:  # an fp8 tl.dot needs K >= 32 on the GPU
        raise ValueError(f"block_scaled_gemm: on the GPU the scale block along K must be >= 32, got {sk}")
    kind = "mx" if mx else "blockwise" if sn % 128 == 0 else "blockwise_cols"
    bm, bn, warps, stages = tiles or _tiles(M, N, on_gpu, kind)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    args = (a, b, out, sa, sb, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), out.stride(1), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    hw = not interpreting()  # the GPU's (and the gate's) MMA; the interpreter's exact fp32 stand-in
    if mx:
        launchable(_mx_gemm_kernel)[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=max(MX_BLOCK_K, sk), SCALE_K=sk,
                                          GROUP_M=8, BF16_MMA=hw, num_warps=warps, num_stages=stages)
    else:
        launchable(_block_scaled_gemm_kernel)[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=sk, SCALE_N=sn,
                                                    GROUP_M=8, FP8_MMA=hw, num_warps=warps, num_stages=stages)
    return out


def block_scaled_gemm_fwd(a: BlockScaledTensor, b: BlockScaledTensor, out_dtype=torch.bfloat16,
                          tiles: tuple | None = None) -> torch.Tensor:
    """The GEMM of two BlockScaledTensors (the custom op under torch.compile): (M, K) @ (K, N) -> (M, N)."""
    args = (a.data, b.data, a.scale, b.scale, a.block[1], b.block[1], a.kind == "mx", out_dtype)
    return block_scaled_mm(*args, tiles=tiles) if tiles else op("block_scaled_mm", block_scaled_mm)(*args)


# ------------------------------------------------------------------------------------------ 4. autograd
def _rows(t: torch.Tensor, recipe, fp8_dtype, backend) -> BlockScaledTensor:
    """`t` (R, C) with one scale per 1 x SK slice of each row (activations, gradients)."""
    if recipe.kind == "mx":
        return quantize_mx(t, block=recipe.block, fp8_dtype=fp8_dtype, backend=backend)
    return quantize_blockwise(t, block=(1, recipe.block), fp8_dtype=fp8_dtype, pow2=recipe.pow2, backend=backend)


class BlockFP8LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with three block-scaled FP8 GEMMs. Every operand is scaled along its GEMM's K:

        forward  y  = x  @ W^T   x per 1 x SK along K;   W per SK x SK tile (blockwise) or 1 x SK along K (MX)
        dgrad    dx = dy @ W     dy per 1 x SK along O;  W: the same tiles (a tile is a tile both ways), or MX
                                 blocks along O (W quantized again, transposed)
        wgrad    dW = dy^T @ x   dy per 1 x SK along N (dy quantized a second time), x per SK x 1 along N

    Saves x as the wgrad reads it, quantized along N at the forward (FP8 + a scale per SK values: half of bf16's
    bytes; Transformer Engine's column-wise copy), the same numbers as quantizing it in the backward; and qW."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, backend):
        O, K = weight.shape
        fwd = recipe.fp8_format.fwd
        x2 = x.reshape(-1, K)                                             # (N, K)
        qx = _rows(x2, recipe, fwd, backend)                              # (N, K), 1 x SK blocks
        if recipe.kind == "mx":
            qw = _rows(weight, recipe, fwd, backend)                      # (O, K), 1 x 32 blocks along K
        else:
            qw = quantize_blockwise(weight, block=(recipe.block, recipe.block), fp8_dtype=fwd, pow2=recipe.pow2,
                                    backend=backend)                      # (O, K), SK x SK tiles
        y = block_scaled_gemm(qx, qw.t(), out_dtype=x.dtype, backend=backend)   # (N, K) @ (K, O)
        if bias is not None:
            y = y + bias.to(y.dtype)
        qxt = _rows(x2.t(), recipe, fwd, backend).t() if ctx.needs_input_grad[1] else None  # (N, K), SK x 1 blocks
        ctx.save_for_backward(*(qxt.data, qxt.scale) if qxt else (None, None), weight, qw.data, qw.scale)
        ctx.recipe, ctx.backend, ctx.has_bias, ctx.x_shape = recipe, backend, bias is not None, x.shape
        ctx.qw_block, ctx.qxt_block, ctx.x_dtype = qw.block, qxt.block if qxt is not None else None, x.dtype
        return y.reshape(*x.shape[:-1], O)                                # (..., O)

    @staticmethod
    def backward(ctx, grad_y):
        qxt_data, qxt_scale, weight, qw_data, qw_scale = ctx.saved_tensors
        recipe, backend = ctx.recipe, ctx.backend
        bwd = recipe.fp8_format.bwd
        g2 = grad_y.reshape(-1, weight.shape[0])                          # (N, O)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            qg = _rows(g2, recipe, bwd, backend)                          # (N, O), blocks along O
            if recipe.kind == "mx":                                       # W (O, K) with blocks along O
                qw = _rows(weight.t(), recipe, recipe.fp8_format.fwd, backend).t()
            else:                                                         # the forward's tiles
                qw = BlockScaledTensor(qw_data, qw_scale, ctx.qw_block, "blockwise", weight.dtype)
            dx = block_scaled_gemm(qg, qw, out_dtype=ctx.x_dtype, backend=backend).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            qgt = _rows(g2.t(), recipe, bwd, backend)                     # (O, N), blocks along N
            qxt = BlockScaledTensor(qxt_data, qxt_scale, ctx.qxt_block, recipe.kind, ctx.x_dtype)  # the forward's
            dw = block_scaled_gemm(qgt, qxt, out_dtype=weight.dtype, backend=backend)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(weight.dtype)
        return dx, dw, db, None, None


# ------------------------------------------------------------------------------------- 5. functional API
def _pow2_block(where, n):
    if n < 16 or n & (n - 1):
        raise ValueError(f"{where}: the Triton kernel needs a power-of-two block >= 16 along a row, got {n} "
                         "(the torch backend takes any block)")


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int] = (1, 128), *,
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2: bool = False,
                       backend: str | None = None) -> BlockScaledTensor:
    """x (R, C) -> fp8 with one fp32 scale per `block` = (1, 128) (activations) or (128, 128) (weights).

    scale = fp8_max / amax(block) (power of two with pow2=True); a ragged last block is treated as zero-padded.
    """
    block = tuple(block) if isinstance(block, (tuple, list)) else block
    if resolve_backend(x, backend) == "triton":
        check_block_args("quantize_blockwise", x, block, fp8_dtype)
        _pow2_block("quantize_blockwise", block[1])
        if block[0] not in (1, block[1]):
            raise ValueError(f"quantize_blockwise: the Triton kernel takes blocks (1, B) or (B, B), got {block}")
        return quantize_block_fwd(x, block, "blockwise", fp8_dtype, pow2)
    return quantize_blockwise_ref(x, block, fp8_dtype, pow2)


def quantize_mx(x: torch.Tensor, *, block: int = MX_BLOCK, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                backend: str | None = None) -> BlockScaledTensor:
    """x (R, C) -> MXFP8: one E8M0 scale per 1 x `block` (32) slice of each row (OCP MX v1.0)."""
    if resolve_backend(x, backend) == "triton":
        check_block_args("quantize_mx", x, (1, block), fp8_dtype)
        _pow2_block("quantize_mx", block)
        return quantize_block_fwd(x, (1, block), "mx", fp8_dtype)
    return quantize_mx_ref(x, block, fp8_dtype)


def _check_gemm(a, b, out_dtype):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, BlockScaledTensor):
            raise ValueError(f"block_scaled_gemm: {name} must be a BlockScaledTensor, got {type(t).__name__}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"block_scaled_gemm: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if a.kind != b.kind or a.block[0] != 1 or b.block[0] != a.block[1] or b.block[1] not in (1, a.block[1]):
        raise ValueError(f"block_scaled_gemm: needs a scaled per (1, SK) and b per (SK, SK) or (SK, 1) of one kind; "
                         f"got a {a.kind} {a.block}, b {b.kind} {b.block}")
    if a.device != b.device:
        raise ValueError(f"block_scaled_gemm: a is on {a.device}, b on {b.device}")
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"block_scaled_gemm: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")


def block_scaled_gemm(a: BlockScaledTensor, b: BlockScaledTensor, *, out_dtype: torch.dtype = torch.bfloat16,
                      backend: str | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) with per-block scales applied to the fp32 partial sum of every K-block."""
    _check_gemm(a, b, out_dtype)
    if resolve_backend(a.data, backend) == "triton":
        _pow2_block("block_scaled_gemm", a.block[1])
        return block_scaled_gemm_fwd(a, b, out_dtype)
    return block_scaled_gemm_ref(a, b, out_dtype)
