"""FP8 GEMM with per-tensor scales (chapter 02): out = (A_fp8 @ B_fp8) * a_scale_inv * b_scale_inv.

Both operands are ``Float8Tensor``s (1 byte per element: half the memory traffic of bf16, and on Hopper twice
the tensor-core rate). The kernel is a plain tiled matmul: load fp8 tiles, ``tl.dot`` them into an fp32
accumulator, and apply the two per-tensor scales once, in the epilogue (a per-tensor scale commutes with the
sum over K, so there is no reason to touch every product). The output is bf16 / fp16 / fp32.

There is no autograd here: fp8 operands have no gradient. ``minite.nn.Linear`` (layers/linear.py) wires three
of these GEMMs (forward, dgrad, wgrad) into an autograd Function. Sections 4 and 6 of a concept file (Function,
Module) therefore live there.
"""

from __future__ import annotations

import torch

from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.formats.fp8 import Float8Tensor

__all__ = ["fp8_gemm", "fp8_gemm_ref", "fp8_gemm_fwd"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- 1. reference
def fp8_gemm_ref(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The spec: dequantize both operands to fp32, matmul in fp32, cast once to `out_dtype`."""
    return (a.dequantize(torch.float32) @ b.dequantize(torch.float32)).to(out_dtype)


# ----------------------------------------------------------------------------------------------- 2. kernel
@triton.jit
def _fp8_gemm_kernel(A_ptr, B_ptr, C_ptr, A_scale_inv_ptr, B_scale_inv_ptr, M, N, K,
                     A_row_stride, A_col_stride, B_row_stride, B_col_stride, C_row_stride, C_col_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
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
        acc = tl.dot(a, b, acc)                                        # fp8 x fp8 -> fp32 accumulator
        a_ptrs += BLOCK_K * A_col_stride
        b_ptrs += BLOCK_K * B_row_stride
    # Epilogue: both per-tensor scales at once, sum_k (qa*sa)(qb*sb) = sa*sb * sum_k qa*qb.
    acc = acc * (tl.load(A_scale_inv_ptr) * tl.load(B_scale_inv_ptr))
    c_ptrs = C_ptr + offs_m[:, None] * C_row_stride + offs_n[None, :] * C_col_stride
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=c_mask)     # one rounding, to the output dtype


# ----------------------------------------------------------------------------------------------- 3. launcher
def _blocks(M: int, N: int, K: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). tl.dot needs every block >= 16."""
    if on_gpu:
        # H100 fp8: 128x128x64 tiles, 8 warps (the Triton matmul tutorial's fp8 configuration).
        return 128, 128, 64, 8
    # Interpreter: ~0.5 ms per program and per loop step, so tiles as large as the problem (capped at 64).
    def fit(n):
        return max(16, min(64, triton.next_power_of_2(n)))
    return fit(M), fit(N), fit(K), 4


def fp8_gemm_fwd(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Launch the kernel: (M, K) @ (K, N) -> (M, N) of `out_dtype`. Operands may be strided views."""
    (M, K), (_, N) = a.shape, b.shape
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    BM, BN, BK, warps = _blocks(M, N, K, a.data.is_cuda)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _fp8_gemm_kernel[grid](a.data, b.data, out, a.scale_inv.reshape(1), b.scale_inv.reshape(1), M, N, K,
                           a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1),
                           out.stride(0), out.stride(1), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8,
                           num_warps=warps, num_stages=1 if interpreting() else 3)
    return out


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
             backend: str | None = None) -> torch.Tensor:
    """(a.data @ b.data) * a.scale_inv * b.scale_inv with fp32 accumulation, returned as `out_dtype`.

    a: (M, K) and b: (K, N) ``Float8Tensor``s, any mix of E4M3/E5M2, any strides (``w_q.t()`` is fine).
    """
    _check(a, b, out_dtype)
    if resolve_backend(a.data, backend) == "triton":
        return fp8_gemm_fwd(a, b, out_dtype)
    return fp8_gemm_ref(a, b, out_dtype)
