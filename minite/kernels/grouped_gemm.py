"""Grouped GEMM (chapter 16): every expert's matmul in one launch, over a variable number of rows per expert.

    y[o[e]:o[e+1]] = x[o[e]:o[e+1]] @ w[e]        x (M, K) sorted by expert, w (E, K, N), offsets o (E + 1,)

A mixture-of-experts layer sorts its tokens by expert (minite/layers/moe.py), so expert e's rows are the slice
o[e]:o[e+1] of one (M, K) tensor. A Python loop of E GEMMs pays E launches and, worse, a host sync to read the
offsets (``.tolist()``) before it can slice. Here the offsets stay on the device: the launcher turns them into a
tile table (which expert and which first row each BLOCK_M tile of rows works on) with a few tensor ops, and one
launch covers every expert; an empty expert simply owns no tile. Rows past o[E] (tokens dropped by a capacity
limit) belong to no expert: their output rows are 0.

Backward, for each expert e (the notebook derives it):  dx_e = dy_e @ w[e]^T  and  dw[e] = x_e^T @ dy_e.
dx is the forward kernel again with w's last two strides swapped (w[e]^T is a strided view); dw has its own kernel,
one program per (expert, tile of w[e]) walking down that expert's rows.

Both launchers are custom ops on CUDA (``torch.ops.minite.grouped_gemm_fwd`` / ``grouped_gemm_dw``, DESIGN §2
section 4), with the gradient registered once from ``GroupedGemmFunction``: torch.compile keeps the kernels, and the
device-side tile table, in the graph of a MoE layer instead of breaking it.
"""
from __future__ import annotations

import torch

from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import gpu_tiles, launchable, op, register_autograd, register_op

__all__ = ["grouped_gemm_ref", "grouped_gemm", "GroupedGemmFunction", "grouped_gemm_fwd", "grouped_gemm_dw",
           "tile_table"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------- 1. reference
def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The spec: a loop of E matmuls in fp32 (fp64 stays fp64), returned in x's dtype; rows past offsets[E] are 0.
    It reads the offsets on the host (one sync), which is what the kernel avoids."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    o = offsets.tolist()
    # Every expert's product, empty ones too: the result stays in the autograd graph of x and w even with no row
    # at all (expert parallelism relies on it: a rank that receives no token still runs the backward all-to-all).
    parts = [x[o[e]:o[e + 1]].to(acc) @ w[e].to(acc) for e in range(w.shape[0])]  # (m_e, K) @ (K, N)
    parts.append(x.new_zeros((x.shape[0] - o[-1], w.shape[2]), dtype=acc))  # rows past offsets[E]
    return torch.cat(parts).to(x.dtype)  # (M, N)


# ----------------------------------------------------------------------------------------------- 2. kernels
@triton.jit
def _mm(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:  # the CPU interpreter cannot multiply bf16: fp32 tiles (on a GPU, bf16 goes to the MMA as is)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:  # fp32 inputs: true fp32 products (a GPU's default for fp32 tl.dot is TF32)
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _grouped_gemm_fwd_kernel(X_ptr, W_ptr, Y_ptr, TileExpert_ptr, TileRow_ptr, Offsets_ptr, M, N, K, E, SLOTS,
                             X_row_stride, X_col_stride, W_e_stride, W_k_stride, W_n_stride, Y_row_stride,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # One program per (row-tile slot t, column tile j) of y (M, N). Grouped order (the Triton matmul tutorial's,
    # over the slots): GROUP_M consecutive slots sweep the columns together. The slots are sorted by expert, so a
    # group is (almost always) row tiles of one expert: they share w[e]'s column tiles in L2, and each x row tile
    # is read once per group of columns, not once per column tile (the first version ran row tiles fastest:
    # every column pass streamed all of x again).
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    first = (pid // (GROUP_M * num_n)) * GROUP_M
    group = tl.minimum(SLOTS - first, GROUP_M)
    t = first + (pid % (GROUP_M * num_n)) % group
    offs_n = ((pid % (GROUP_M * num_n)) // group).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of y
    e = tl.load(TileExpert_ptr + t).to(tl.int64)                       # expert of slot t; E: a zero tile
    row0 = tl.load(TileRow_ptr + t).to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)                               # (BLOCK_M,) rows of x and y
    if e < E:
        row_end = tl.load(Offsets_ptr + e + 1).to(tl.int64)             # this expert's rows end here
        m_ok = offs_m < row_end
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X_ptr + offs_m[:, None] * X_row_stride + offs_k[None, :] * X_col_stride       # (BLOCK_M, BLOCK_K)
        w_ptrs = W_ptr + e * W_e_stride + offs_k[:, None] * W_k_stride + offs_n[None, :] * W_n_stride  # (BK, BN)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(x_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            b = tl.load(w_ptrs, mask=(offs_k[:, None] < K - k0) & (offs_n[None, :] < N), other=0.0)
            acc = _mm(a, b, acc, UPCAST, IEEE)
            x_ptrs += BLOCK_K * X_col_stride
            w_ptrs += BLOCK_K * W_k_stride
        tl.store(Y_ptr + offs_m[:, None] * Y_row_stride + offs_n[None, :], acc.to(Y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (offs_n[None, :] < N))
    else:  # rows past o[E] (dropped tokens) belong to no expert: y is not zero-filled, so write their zeros here
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=Y_ptr.dtype.element_ty)
        tl.store(Y_ptr + offs_m[:, None] * Y_row_stride + offs_n[None, :], zero,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# dw[e] (K, N) = x_e^T (K, m_e) @ dy_e (m_e, N): a reduction over the expert's rows, so one program owns a
# (BLOCK_K, BLOCK_N) tile of dw[e] and walks down rows o[e] ... o[e + 1] in steps of BLOCK_M (runtime bounds).
# An empty expert runs no step and stores zeros: its weight gets a zero gradient, as in the loop (dw is not
# zero-filled: every element is stored). Programs run expert by expert; within an expert, grouped order over its
# (k, n) tiles, so a wave's programs share x_e's and dy_e's column tiles in L2.
@triton.jit
def _grouped_gemm_dw_kernel(X_ptr, DY_ptr, DW_ptr, Offsets_ptr, K, N, X_row_stride, DY_row_stride,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    e = (pid // (num_k * num_n)).to(tl.int64)
    pid = pid % (num_k * num_n)
    first = (pid // (GROUP_M * num_n)) * GROUP_M
    group = tl.minimum(num_k - first, GROUP_M)
    offs_k = (first + (pid % (GROUP_M * num_n)) % group).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)  # of dw[e]
    offs_n = ((pid % (GROUP_M * num_n)) // group).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(Offsets_ptr + e).to(tl.int64)
    end = tl.load(Offsets_ptr + e + 1).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        # x_e^T tile (BLOCK_K, BLOCK_M): element [k, m] = x[m, k]
        xt = tl.load(X_ptr + offs_m[None, :] * X_row_stride + offs_k[:, None],
                     mask=m_ok[None, :] & (offs_k[:, None] < K), other=0.0)
        dy = tl.load(DY_ptr + offs_m[:, None] * DY_row_stride + offs_n[None, :],
                     mask=m_ok[:, None] & (offs_n[None, :] < N), other=0.0)  # (BLOCK_M, BLOCK_N)
        acc = _mm(xt, dy, acc, UPCAST, IEEE)
    dw_ptrs = DW_ptr + e * K * N + offs_k[:, None] * N + offs_n[None, :]  # dw (E, K, N) contiguous
    tl.store(dw_ptrs, acc.to(DW_ptr.dtype.element_ty), mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------- 3. launchers
# GPU tiles (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the Triton matmul tutorial's Hopper tile
# (128 x 256 x 64, 8 warps, 3 stages). sm_90 with the JIT's specialisation (bf16, ptxas of triton 3.7.1): all
# wgmma m64n256k16, 0 spills (see the report of issue 33). NOT timed: no GPU has run bench_grouped_gemm.py since.
# dw turns the tile around: a (BLOCK_M, BLOCK_N) tile of dw[e], BLOCK_K rows of x_e / dy_e per step.
GPU_TILES = (128, 256, 64, 8, 8, 3)
GPU_TILES_F32 = (64, 64, 32, 8, 4, 2)  # fp32 on a GPU: "ieee" products on the CUDA cores, a tile that fits


def _tiles(M: int, N: int, K: int, x: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    if gpu_tiles(x):
        return GPU_TILES_F32 if x.dtype == torch.float32 else GPU_TILES
    # Interpreter: ~0.5 ms per program, so few large programs; still >= 16 (GPU-legal, tested here).
    def fit(n):
        return max(16, min(64, triton.next_power_of_2(max(n, 1))))
    return fit(M), fit(N), fit(K), 4, 4, 1


def tile_table(offsets: torch.Tensor, M: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of each BLOCK_M tile of rows, computed on the device (no host sync).

    Expert e needs cdiv(m_e, block_m) tiles; all of them fit in cdiv(M, block_m) + E slots (each expert wastes
    at most one partial tile). The i-th spare slot gets expert E (no expert: a tile of zeros) and first row
    o[E] + i * block_m: together they cover the rows past o[E] (there are always enough: the slots the experts
    leave, cdiv(M, bm) + E - sum_e cdiv(m_e, bm), are at least cdiv(M - o[E], bm)), and the rest lie past M."""
    E = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]                                 # (E,) rows per expert
    tiles = (counts + block_m - 1) // block_m                           # (E,)
    cum = torch.cumsum(tiles, 0)                                        # (E,) tiles before expert e + 1
    slots = torch.arange(triton.cdiv(M, block_m) + E, device=offsets.device)
    expert = torch.searchsorted(cum, slots, right=True)                 # (G,) E for the spare slots
    first = offsets[expert.clamp(max=E - 1)] + (slots - (cum - tiles)[expert.clamp(max=E - 1)]) * block_m
    first = torch.where(slots < cum[-1], first, offsets[E] + (slots - cum[-1]) * block_m)
    return expert.to(torch.int32).contiguous(), first.to(torch.int64).contiguous()


def _flags(x: torch.Tensor) -> dict:
    # fp16 tiles go to tl.dot as they are, on the GPU and under the interpreter (which gets fp16 dots right): the
    # tests run, and the compile gate compiles, the GPU's path. bf16 only on a GPU (the interpreter's is garbage).
    upcast = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting())
    return {"UPCAST": upcast, "IEEE": x.dtype == torch.float32}


@register_op("grouped_gemm_fwd")  # torch.ops.minite.grouped_gemm_fwd, for torch.compile (section 4)
def grouped_gemm_fwd(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w[e] (K, N) per expert -> (M, N) in x's dtype; w may be a strided view (the backward's w^T)."""
    M, K = x.shape
    E, N = w.shape[0], w.shape[2]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=x.dtype, device=x.device)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)  # every element is stored: rows past o[E] as zeros
    BM, BN, BK, group, warps, stages = _tiles(M, N, K, x)
    expert, first = tile_table(offsets, M, BM)
    launchable(_grouped_gemm_fwd_kernel)[(expert.numel() * triton.cdiv(N, BN),)](
        x, w, y, expert, first, offsets, M, N, K, E, expert.numel(), x.stride(0), x.stride(1), w.stride(0),
        w.stride(1), w.stride(2), y.stride(0), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=group, **_flags(x),
        num_warps=warps, num_stages=stages)
    return y


@register_op("grouped_gemm_dw")
def grouped_gemm_dw(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, w_dtype: torch.dtype) -> torch.Tensor:
    """dw (E, K, N) = x_e^T @ dy_e per expert; x (M, K), dy (M, N) with unit column stride."""
    M, K = x.shape
    N = dy.shape[1]
    E = offsets.numel() - 1
    if M == 0 or K == 0 or N == 0:
        return torch.zeros((E, K, N), dtype=w_dtype, device=x.device)
    dw = torch.empty((E, K, N), dtype=w_dtype, device=x.device)  # every element is stored (empty experts: zeros)
    x, dy = x.contiguous(), dy.contiguous()
    BM, BN, BK, group, warps, stages = _tiles(M, N, K, x)
    # the same tile shapes turned around: a (BM, BN) tile of dw[e] (128 x 256 on the GPU), BK rows per step
    launchable(_grouped_gemm_dw_kernel)[(E * triton.cdiv(K, BM) * triton.cdiv(N, BN),)](
        x, dy, dw, offsets, K, N, x.stride(0), dy.stride(0), BLOCK_M=BK, BLOCK_N=BN, BLOCK_K=BM, GROUP_M=group,
        **_flags(x), num_warps=warps, num_stages=stages)
    return dw


# ------------------------------------------------------------------------------------- 4. autograd.Function
class GroupedGemmFunction(torch.autograd.Function):
    """Its setup_ctx and backward are also the gradient of torch.ops.minite.grouped_gemm_fwd: one formula."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        GroupedGemmFunction.setup_ctx(ctx, (x, w, offsets), None)
        return op("grouped_gemm_fwd", grouped_gemm_fwd)(x, w, offsets)  # the custom op under torch.compile

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        ctx.save_for_backward(*inputs)  # x, w, offsets: nothing else, the backward is two more grouped GEMMs

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx_e = dy_e @ w[e]^T: the forward kernel on a strided view of w
            dx = op("grouped_gemm_fwd", grouped_gemm_fwd)(dy, w.transpose(1, 2), offsets)
        if ctx.needs_input_grad[1]:  # dw[e] = x_e^T @ dy_e
            dw = op("grouped_gemm_dw", grouped_gemm_dw)(x, dy, offsets, w.dtype)
        return dx, dw, None


register_autograd("grouped_gemm_fwd", GroupedGemmFunction.backward, setup_context=GroupedGemmFunction.setup_ctx)


# ------------------------------------------------------------------------------------------- 5. functional
def _check(x, w, offsets):
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and isinstance(offsets, torch.Tensor)):
        raise TypeError("grouped_gemm: x, w and offsets must be tensors")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_gemm: need x (M, K) and w (E, K, N), got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if offsets.dim() != 1 or offsets.numel() != w.shape[0] + 1 or offsets.is_floating_point():
        raise ValueError(f"grouped_gemm: offsets must be an integer (E + 1,) = ({w.shape[0] + 1},) tensor, got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_gemm: x is {x.dtype} but w is {w.dtype}")
    if not (x.device == w.device == offsets.device):
        raise ValueError(f"grouped_gemm: x on {x.device}, w on {w.device}, offsets on {offsets.device}")
    # free to read on the CPU (on a GPU it would sync), never while torch.compile traces (a data-dependent read)
    if offsets.device.type == "cpu" and not torch.compiler.is_compiling():  # a bad table reads out of bounds
        o = offsets.tolist()
        if o[0] != 0 or o[-1] > x.shape[0] or any(b < a for a, b in zip(o, o[1:])):
            raise ValueError(f"grouped_gemm: offsets must start at 0, never decrease and end <= M={x.shape[0]}, "
                             f"got {o}")


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
                 backend: str | None = None) -> torch.Tensor:
    """y (M, N): rows offsets[e]:offsets[e+1] of x (M, K) times w[e] (K, N); rows past offsets[E] are 0.
    offsets: non-decreasing, offsets[0] = 0, offsets[E] <= M, on x's device (checked on the CPU; on a GPU the
    check would sync, so it is the caller's: minite's MoE builds offsets from a cumsum of counts)."""
    _check(x, w, offsets)
    if w.shape[0] and x.dtype in _KERNEL_DTYPES and resolve_backend(x, backend) == "triton":
        return GroupedGemmFunction.apply(x, w, offsets)
    return grouped_gemm_ref(x, w, offsets)  # fp64 (gradcheck) and the torch backend


# ----------------------------------------------------------------------------------------------- 6. Module
# The module that uses this op is the mixture-of-experts layer: minite/layers/moe.py (minite.nn.MoE).
