"""FP8 GEMM with per-tensor scales (chapter 02): out = (A_fp8 @ B_fp8) * a_scale_inv * b_scale_inv.

Both operands are ``Float8Tensor``s (1 byte per element: half the memory traffic of bf16, and on Hopper twice
the tensor-core rate). The kernel is a plain tiled matmul: load fp8 tiles, ``tl.dot`` them into an fp32
accumulator, and apply the two per-tensor scales once, in the epilogue (a per-tensor scale commutes with the
sum over K, so there is no reason to touch every product). The output is bf16 / fp16 / fp32.

Accumulation. Hopper's FP8 tensor cores add the products of one MMA chain into an accumulator that keeps only
about 14 bits (DeepSeek-V3 §3.3.2), and Triton on sm_90 never promotes it by default: at K = 8192 the error is
~46x cuBLAS's. ``accumulate="split"`` promotes the partial sums to the fp32 accumulator every N_C = BLOCK_K = 128
elements of K (``tl.dot(..., max_num_imprecise_acc=BLOCK_K)``), which matches cuBLAS's error (H100, measured);
``"fast"`` never promotes. TransformerEngine's convention, followed by ``minite.nn.Linear``: fast accumulation in
the forward GEMM, split accumulation in dgrad and wgrad (gradients are summed over many more terms). Hopper's
FP8 MMA also wants both operands K-contiguous ("TN"): the launcher makes K-contiguous copies of strided
operands (1 byte per element, a cheap transpose) instead of letting the kernel stream a transposed tile.

There is no autograd here: fp8 operands have no gradient. kernels/fp8_linear.py wires three of these GEMMs
(forward, dgrad, wgrad) into an autograd Function, and ``minite.nn.Linear`` (layers/linear.py) is its module:
sections 4 and 6 of this concept live there.
"""

from __future__ import annotations

import torch

from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.formats.fp8 import Float8Tensor
from minite.formats.specs import decode_bits_tl
from minite.kernels._common import gpu_tiles, launchable, op, register_op

__all__ = ["fp8_gemm", "fp8_gemm_ref", "fp8_gemm_fwd", "ACCUMULATE", "PROMOTION_INTERVAL", "fp8_to_fp32_tl"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACCUMULATE = ("fast", "split")  # never promote / promote every BLOCK_K elements of K to fp32
# The promotion interval the kernel states (minite/gpu_compile.py's convention; the gate reads the sm_90 TTGIR):
# "split" every BLOCK_K products; "fast" never, on purpose (torch._scaled_mm's use_fast_accum=True).
PROMOTION_INTERVAL = {"_fp8_gemm_kernel": lambda c: c["BLOCK_K"] if c["SPLIT_ACC"] else None}


# ----------------------------------------------------------------------------------------------- 1. reference
def fp8_gemm_ref(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The spec: dequantize both operands to fp32, matmul in fp32, cast once to `out_dtype`."""
    return (a.dequantize(torch.float32) @ b.dequantize(torch.float32)).to(out_dtype)


# ----------------------------------------------------------------------------------------------- 2. kernel
@triton.jit
def fp8_to_fp32_tl(x, HW: tl.constexpr):
    """fp8 -> fp32, exact. HW: the GPU's cast. The interpreter's own cast reads E4M3's NaN (S.1111.111) as ±480,
    so there the bits are decoded with chapter 01's integer decode (chapter 15's kernels use it too)."""
    if HW:
        return x.to(tl.float32)
    bits = x.to(tl.uint8, bitcast=True).to(tl.int32)
    if x.dtype == tl.float8e4nv:
        return decode_bits_tl(bits, 4, 3, True)
    return decode_bits_tl(bits, 5, 2, False)


@triton.jit
def _fp8_gemm_kernel(A_ptr, B_ptr, C_ptr, A_scale_inv_ptr, B_scale_inv_ptr, M, N, K,
                     A_row_stride, A_col_stride, B_row_stride, B_col_stride, C_row_stride, C_col_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, SPLIT_ACC: tl.constexpr, FP8_MMA: tl.constexpr):
    # C (M, N) = A (M, K) @ B (K, N). One program per (BLOCK_M, BLOCK_N) tile of C.
    pid = tl.program_id(0).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row-tiles share their B column-tiles while they are still in L2.
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BLOCK_M,) rows of A and C
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BLOCK_N,) cols of B and C
    offs_k = tl.arange(0, BLOCK_K)                                     # (BLOCK_K,)
    # Strided pointers: any layout works, e.g. B = W.t() (K contiguous, what Hopper's fp8 MMA prefers).
    a_ptrs = A_ptr + offs_m[:, None] * A_row_stride + offs_k[None, :] * A_col_stride   # (BLOCK_M, BLOCK_K)
    b_ptrs = B_ptr + offs_k[:, None] * B_row_stride + offs_n[None, :] * B_col_stride   # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Masks for the ragged edges (odd M, N, K): out-of-range elements load as 0 and add nothing.
        a_mask = (offs_m[:, None] < M) & ((k0 + offs_k)[None, :] < K)
        b_mask = ((k0 + offs_k)[:, None] < K) & (offs_n[None, :] < N)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)                    # fp8 tile, stays fp8
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if not FP8_MMA:  # the interpreter: the bits decoded exactly into fp16 (it holds every fp8 value, NaN and
            # inf too), an fp16 dot with fp32 sums
            acc = tl.dot(fp8_to_fp32_tl(a, False).to(tl.float16), fp8_to_fp32_tl(b, False).to(tl.float16), acc)
        elif SPLIT_ACC:
            # Promote every BLOCK_K products: the MMA chain of one K-block runs in the tensor core's ~14-bit
            # accumulator, then is added to `acc` in full fp32 (what cuBLAS does unless fast accumulation is on).
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)                                    # fp8 x fp8 -> (imprecise) fp32
        a_ptrs += BLOCK_K * A_col_stride
        b_ptrs += BLOCK_K * B_row_stride
    # Epilogue: both per-tensor scales at once, sum_k (qa*sa)(qb*sb) = sa*sb * sum_k qa*qb.
    acc = acc * (tl.load(A_scale_inv_ptr) * tl.load(B_scale_inv_ptr))
    c_ptrs = C_ptr + offs_m[:, None] * C_row_stride + offs_n[None, :] * C_col_stride
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=c_mask)     # one rounding, to the output dtype


# (M, N) -> (N, M) copy of a byte tensor, tile by tile: reads and writes both coalesced (Triton stages the tile
# through shared memory to change its layout), where torch's strided copy of a transposed 1-byte tensor is not.
@triton.jit
def _transpose_kernel(X_ptr, Y_ptr, M, N, X_row_stride, X_col_stride,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BLOCK_M,) rows of X
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BLOCK_N,) cols of X
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(X_ptr + offs_m[:, None] * X_row_stride + offs_n[None, :] * X_col_stride, mask=mask, other=0)
    tl.store(Y_ptr + offs_n[None, :] * M + offs_m[:, None], x, mask=mask)   # Y (N, M) contiguous


# ----------------------------------------------------------------------------------------------- 3. launcher
# H100 tiles per accumulation mode: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). BLOCK_K = 128 = N_C, the
# promotion interval of "split". From benchmarks/bench_fp8_gemm.py --sweep on an H100 (8192^3, 2026-11-23):
# 256x128x128, 8 warps, 3 stages was the fastest of 8 tilings in both modes (fast 1302, split 1020 TFLOP/s);
# 128x128x128 gave 1146 / 869, 128x256x128 1089 / 605 (split needs a second accumulator: registers).
GPU_TILES = {"fast": (256, 128, 128, 8, 3), "split": (256, 128, 128, 8, 3)}


def _tiles(M: int, N: int, K: int, on_gpu: bool, accumulate: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). On the GPU every fp8 tl.dot dim must be >= 16 (K >= 32)."""
    if on_gpu:
        return GPU_TILES[accumulate]
    # Interpreter: ~0.5 ms per program and per loop step, so tiles as large as the problem (capped at 64).
    def fit(n, lo):
        return max(lo, min(64, triton.next_power_of_2(n)))
    return fit(M, 16), fit(N, 16), fit(K, 32), 4, 1


def _k_major(t: torch.Tensor, k_dim: int) -> torch.Tensor:
    """`t` (2-D, bytes) with unit stride along `k_dim`: itself if so already, else a transposed copy (viewed back
    to t's shape). Hopper's FP8 MMA reads both operands K-major; a strided tile would go through a slow path."""
    if t.stride(k_dim) == 1:
        return t
    src = t if k_dim == 0 else t.t()                                   # the copy is made along rows of src
    M, N = src.shape
    out = torch.empty((N, M), dtype=t.dtype, device=t.device)          # (N, M) contiguous = src^T
    if M and N:
        launchable(_transpose_kernel)[(triton.cdiv(M, 64), triton.cdiv(N, 64))](
            src.view(torch.uint8), out.view(torch.uint8), M, N, src.stride(0), src.stride(1), BLOCK_M=64, BLOCK_N=64)
    return out.t() if k_dim == 0 else out                              # t's shape, unit stride along k_dim


@register_op("fp8_gemm")  # torch.ops.minite.fp8_gemm, for torch.compile
def fp8_gemm_raw(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                 out_dtype: torch.dtype, split_acc: bool) -> torch.Tensor:
    """(M, K) @ (K, N) fp8 data with fp32 per-tensor scale_inv (1-element tensors) -> (M, N) of `out_dtype`.
    Plain tensors only, so ``torch.library`` can register it as an op."""
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    a, b = _k_major(a, 1), _k_major(b, 0)                              # A (M, K) and B (K, N), both K-contiguous
    BM, BN, BK, warps, stages = _tiles(M, N, K, gpu_tiles(a), "split" if split_acc else "fast")
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    launchable(_fp8_gemm_kernel)[grid](a, b, out, a_scale_inv.reshape(1), b_scale_inv.reshape(1), M, N, K,
                                       a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
                                       out.stride(1), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8,
                                       SPLIT_ACC=split_acc, FP8_MMA=not interpreting(), num_warps=warps,
                                       num_stages=stages)
    return out


def fp8_gemm_fwd(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, accumulate: str = "split") -> torch.Tensor:
    """Launch the kernel: (M, K) @ (K, N) -> (M, N) of `out_dtype`. Operands may be strided views."""
    return op("fp8_gemm", fp8_gemm_raw)(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, accumulate == "split")


# ------------------------------------------------------------------------------------- 5. functional API
def _check(a, b, out_dtype):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Float8Tensor):
            raise ValueError(f"fp8_gemm: {name} must be a Float8Tensor (see minite.formats.quantize), "
                             f"got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"fp8_gemm: {name} must be 2-D, got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_gemm: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"fp8_gemm: a is on {a.device}, b on {b.device}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_gemm: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")


def fp8_gemm(a: Float8Tensor, b: Float8Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
             accumulate: str = "split", backend: str | None = None) -> torch.Tensor:
    """(a.data @ b.data) * a.scale_inv * b.scale_inv with fp32 accumulation, returned as `out_dtype`.

    a: (M, K) and b: (K, N) ``Float8Tensor``s, any mix of E4M3/E5M2, any strides (``w_q.t()`` is fine).
    accumulate: "split" promotes partial sums to fp32 every 128 elements of K (cuBLAS's accuracy); "fast" keeps
    them in the tensor core's ~14-bit accumulator on Hopper (faster, ~40x the error at K = 8192).
    """
    _check(a, b, out_dtype)
    if accumulate not in ACCUMULATE:
        raise ValueError(f"fp8_gemm: accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    if resolve_backend(a.data, backend) == "triton":
        return fp8_gemm_fwd(a, b, out_dtype, accumulate)
    return fp8_gemm_ref(a, b, out_dtype)
