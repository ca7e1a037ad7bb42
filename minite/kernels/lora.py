"""Fused LoRA linear (chapter 09): y = x W^T + s (x A^T) B^T, forward and backward, as GEMMs that pay.

    x: (N, K)   W: (O, K) frozen   A: (r, K)   B: (O, r)   s = alpha / r          -> y: (N, O)

Unfused, a LoRA layer is three GEMMs (x W^T, x A^T, (x A^T) B^T) plus an add: the (N, O) output is written, read
and written again. Here the thin product is computed once and the adapter rides on the base GEMM:

    g  = x A^T                (N, r) fp32   a skinny GEMM: one pass over x (8192 x 4096 bf16: 64 MiB, ~15 us)
    y  = x W^T + (s g) B^T    (N, O)        ONE GEMM; the adapter is one more K-step (of r) after its main loop

so y is written once and nothing is recomputed. (The first version computed x A^T inside every column tile of y:
+r/BLOCK_N of the base GEMM's work, on small 4-warp tiles: 0.57x the three GEMMs on an H200.) The backward is the
same two kernels and one more:

    dg = s dy B               (N, r)        the skinny kernel again, on dy and B
    dx = dy W + dg A          (N, K)        the forward's GEMM kernel, with W and A read the other way round
    dA = dg^T x,  dB = s dy^T g             reductions over the N rows: r is the narrow side of each tile and the
                                            rows are split over enough programs to fill the GPU (partials summed)

r is padded to BLOCK_R >= 16 inside the tiles (masked loads give zeros): every tl.dot dimension stays >= 16, as a
GPU needs, for any r >= 1. The base layer, its adapter, dropout and merge live in minite/layers/lora.py
(section 6 of this concept, LoRALinear).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from minite import _validate as _v
from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import gpu_tiles, launchable, op, register_autograd, register_op, sm_count

__all__ = ["lora_linear_ref", "lora_linear", "LoRALinearFunction", "lora_fwd", "lora_bwd", "lora_tiles"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_R = 128  # above this the (BLOCK_M, r) tiles crowd the registers: the three-GEMM path runs instead


# ----------------------------------------------------------------------------------------- 1. reference
def lora_linear_ref(x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                    scaling: float = 1.0) -> torch.Tensor:
    """x W^T + s (x A^T) B^T in fp32 (fp64 stays fp64), returned in x's dtype. The spec."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    x32 = x.to(ct)
    y = x32 @ weight.to(ct).t() + scaling * ((x32 @ lora_A.to(ct).t()) @ lora_B.to(ct).t())
    return y.to(x.dtype)


# -------------------------------------------------------------------------------------------- 2. kernels
@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    # F32: fp32 inputs (exact "ieee" fp32 products, not TF32) and bf16 on the CPU interpreter, which cannot
    # multiply bf16: upcast both tiles. Otherwise a native fp16/bf16 tensor-core dot into the fp32 accumulator.
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _lora_down_kernel(X_ptr, A_ptr, G_ptr, N, K, R, scaling, X_row_stride, A_k_stride, A_r_stride,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, F32: tl.constexpr):
    # The skinny GEMM. G (N, R) fp32 = scaling * X (N, K) @ A_op (K, R), A_op[k, j] at A_ptr + k * A_k_stride +
    # j * A_r_stride: A^T (forward, g = x A^T) or B (backward, dg = s dy B, with K = O). Grid (cdiv(N, BLOCK_M),):
    # each program walks its rows of X once; the (BLOCK_K, BLOCK_R) slice of A_op is small and stays in L2.
    scaling = tl.cast(scaling, tl.float32)  # a Python float, fp64 under Inductor
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of X and G
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)  # the rank, padded: columns R..BLOCK_R-1 load as 0 and are not stored
    x_ptrs = X_ptr + rm[:, None] * X_row_stride + rk[None, :]            # (BLOCK_M, BLOCK_K)
    a_ptrs = A_ptr + rk[:, None] * A_k_stride + rr[None, :] * A_r_stride  # (BLOCK_K, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=(rm[:, None] < N) & (rk[None, :] < K - k0), other=0.0)
        a = tl.load(a_ptrs, mask=(rk[:, None] < K - k0) & (rr[None, :] < R), other=0.0)
        acc = _dot(x, a, acc, F32)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K * A_k_stride
    tl.store(G_ptr + rm[:, None] * R + rr[None, :], acc * scaling, mask=(rm[:, None] < N) & (rr[None, :] < R))


@triton.jit
def _lora_gemm_kernel(X_ptr, W_ptr, G_ptr, B_ptr, Y_ptr, N, K, O, R, scaling, X_row_stride, W_k_stride,
                      W_n_stride, B_r_stride, B_n_stride, Y_row_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, F32: tl.constexpr):
    # Y (N, O) = X (N, K) @ W_op (K, O) + (scaling * G (N, R)) @ B_op (R, O), with W_op[k, n] at W_ptr +
    # k * W_k_stride + n * W_n_stride (and B_op alike). Forward: X = x, W_op = W^T, G = g, B_op = B^T. Backward
    # (dx): X = dy, W_op = W, G = dg (already scaled: scaling = 1), B_op = A.
    scaling = tl.cast(scaling, tl.float32)  # a Python float, fp64 under Inductor
    # One program per (BLOCK_M, BLOCK_N) tile of Y, in grouped order (the Triton matmul tutorial's): GROUP_M row
    # tiles sweep the columns together, so their rows of X and the columns of W_op they read stay in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_n = tl.cdiv(O, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_m
    pid_n = (pid % (GROUP_M * num_n)) // group_m
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of X and Y
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of W_op and Y
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X_ptr + rm[:, None] * X_row_stride + rk[None, :]                    # (BLOCK_M, BLOCK_K)
    w_ptrs = W_ptr + rk[:, None] * W_k_stride + rn[None, :] * W_n_stride        # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the base GEMM
        x = tl.load(x_ptrs, mask=(rm[:, None] < N) & (rk[None, :] < K - k0), other=0.0)
        w = tl.load(w_ptrs, mask=(rk[:, None] < K - k0) & (rn[None, :] < O), other=0.0)
        acc = _dot(x, w, acc, F32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * W_k_stride
    # The adapter: one more K-step over the rank (two when r > BLOCK_R), not pipelined (one step has nothing to
    # overlap with). s is folded into the thin (BLOCK_M, BLOCK_R) side: r multiplies instead of BLOCK_N.
    for r0 in tl.range(0, R, BLOCK_R, num_stages=1):
        rr = r0 + tl.arange(0, BLOCK_R)
        g = tl.load(G_ptr + rm[:, None] * R + rr[None, :], mask=(rm[:, None] < N) & (rr[None, :] < R), other=0.0)
        b = tl.load(B_ptr + rr[:, None] * B_r_stride + rn[None, :] * B_n_stride,
                    mask=(rr[:, None] < R) & (rn[None, :] < O), other=0.0)              # (BLOCK_R, BLOCK_N)
        g = g * scaling
        if not F32:
            g = g.to(X_ptr.dtype.element_ty)  # a tensor-core dot takes both operands in the input dtype
        acc = _dot(g, b, acc, F32)
    tl.store(Y_ptr + rm[:, None] * Y_row_stride + rn[None, :], acc.to(Y_ptr.dtype.element_ty),
             mask=(rm[:, None] < N) & (rn[None, :] < O))


# dA (r, K) = dg^T x and dB (O, r) = s dy^T g are both OUT (M, R) = scaling * P^T Q over the N rows, with P = x
# (M = K) or dy (M = O) and Q = dg or g, fp32 (N, R). r is the tile's narrow N side, M its wide side (>= 64 rows
# per warpgroup: wgmma); the N rows are split into `splits` chunks, one program each, so that
# cdiv(M, BLOCK_M) * splits fills the GPU; each writes its fp32 partial OUT[split] and torch sums them.
@triton.jit
def _lora_wgrad_kernel(P_ptr, Q_ptr, OUT_ptr, N, M, R, rows_per_split, scaling, P_row_stride, OUT_m_stride,
                       OUT_r_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       F32: tl.constexpr):
    scaling = tl.cast(scaling, tl.float32)  # a Python float, fp64 under Inductor
    split = tl.program_id(1).to(tl.int64)
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) columns of P
    rr = tl.arange(0, BLOCK_R)
    lo = split * rows_per_split
    hi = tl.minimum(lo + rows_per_split, N)  # this program's rows: [lo, hi)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        pt = tl.load(P_ptr + rn[None, :] * P_row_stride + rm[:, None],
                     mask=(rm[:, None] < M) & (rn[None, :] < hi), other=0.0)            # P^T (BLOCK_M, BLOCK_N)
        q = tl.load(Q_ptr + rn[:, None] * R + rr[None, :], mask=(rn[:, None] < hi) & (rr[None, :] < R),
                    other=0.0)                                                          # (BLOCK_N, BLOCK_R) fp32
        if not F32:
            q = q.to(P_ptr.dtype.element_ty)
        acc = _dot(pt, q, acc, F32)
    tl.store(OUT_ptr + split * M * R + rm[:, None] * OUT_m_stride + rr[None, :] * OUT_r_stride, acc * scaling,
             mask=(rm[:, None] < M) & (rr[None, :] < R))


# ------------------------------------------------------------------------------------------ 3. launchers
# GPU tiles, per kernel. "gemm": (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages), the Triton matmul tutorial's
# Hopper tile; "down": (BLOCK_M, BLOCK_K, warps, stages); "wgrad": (BLOCK_M, BLOCK_N, warps, stages). sm_90 (triton
# 3.7.1's ptxas, the JIT's specialisation, bf16, 8192 x 4096 x 4096, r = 16 / 64): gemm m64n256k16, 190-254 regs,
# 144 KB; down m64n{16,64}k16, 36-72 regs; wgrad m64n{16,64}k16 (8 warps: 64 rows each), 40-71 regs; no spills,
# no mma.sync. NOT timed on a GPU yet.
GPU_TILES = {"gemm": (128, 256, 64, 8, 8, 3), "down": (64, 64, 4, 4), "wgrad": (128, 64, 8, 3)}
# fp32 on a GPU: "ieee" products on the CUDA cores (the tests' precision path), on tiles that do not spill
GPU_TILES_F32 = {"gemm": (64, 64, 32, 8, 4, 2), "down": (32, 16, 4, 2), "wgrad": (64, 32, 4, 2)}


def lora_tiles(x: Tensor, N: int, K: int, O: int) -> dict:
    """Tiles for the three kernels on x's device, plus "sms" (programs that fill it) for the row split."""
    if gpu_tiles(x):
        return dict(GPU_TILES_F32 if x.dtype == torch.float32 else GPU_TILES, sms=sm_count(x.device))

    def fit(n):  # interpreter: ~0.5 ms per program and loop step, so tiles as large as the problem (<= 64)
        return max(16, min(64, triton.next_power_of_2(max(n, 1))))
    return {"gemm": (fit(N), fit(max(O, K)), fit(max(K, O)), 8, 4, 1), "down": (fit(N), fit(max(K, O)), 4, 1),
            "wgrad": (fit(max(K, O)), fit(N), 4, 1), "sms": sm_count(x.device)}


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 or (t.dtype == torch.bfloat16 and interpreting())


def _br(r: int, cap: int = MAX_R) -> int:
    return max(16, min(cap, triton.next_power_of_2(r)))


def _down(x2: Tensor, a_op: Tensor, scaling: float, t: dict) -> Tensor:
    """scaling * x2 (N, K) @ a_op (K, r) -> (N, r) fp32; a_op any strided view."""
    (N, K), R = x2.shape, a_op.shape[1]
    g = torch.empty((N, R), dtype=torch.float32, device=x2.device)
    bm, bk, warps, stages = t["down"]
    if N:
        launchable(_lora_down_kernel)[(triton.cdiv(N, bm),)](
            x2, a_op, g, N, K, R, scaling, x2.stride(0), a_op.stride(0), a_op.stride(1), BLOCK_M=bm, BLOCK_K=bk,
            BLOCK_R=_br(R), F32=_f32(x2), num_warps=warps, num_stages=stages)
    return g


def _gemm(x2: Tensor, w_op: Tensor, g: Tensor, b_op: Tensor, scaling: float, t: dict) -> Tensor:
    """x2 (N, K) @ w_op (K, O) + scaling * g (N, r) @ b_op (r, O) -> (N, O) in x2's dtype."""
    (N, K), O, R = x2.shape, w_op.shape[1], g.shape[1]
    y = torch.empty((N, O), dtype=x2.dtype, device=x2.device)
    bm, bn, bk, group, warps, stages = t["gemm"]
    if N and O:
        launchable(_lora_gemm_kernel)[(triton.cdiv(N, bm) * triton.cdiv(O, bn),)](
            x2, w_op, g, b_op, y, N, K, O, R, scaling, x2.stride(0), w_op.stride(0), w_op.stride(1), b_op.stride(0),
            b_op.stride(1), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=_br(R, bk), GROUP_M=group,
            F32=_f32(x2), num_warps=warps, num_stages=stages)
    return y


def _wgrad(p: Tensor, q: Tensor, scaling: float, out_shape: tuple[int, int], transposed: bool, t: dict) -> Tensor:
    """scaling * p^T q summed over the N rows: p (N, M), q (N, r) fp32 -> (M, r), or (r, M) when `transposed`."""
    (N, M), R = p.shape, q.shape[1]
    bm, bn, warps, stages = t["wgrad"]
    m_tiles, steps = triton.cdiv(M, bm), triton.cdiv(N, bn)
    splits = t.get("splits") or max(1, min(steps, triton.cdiv(t["sms"], max(m_tiles, 1))))
    per = max(1, triton.cdiv(steps, splits)) * bn  # rows per split, whole steps
    splits = max(1, triton.cdiv(N, per))
    part = torch.empty((splits, *out_shape), dtype=torch.float32, device=p.device)  # (splits, M, r) or (splits, r, M)
    if M:
        launchable(_lora_wgrad_kernel)[(m_tiles, splits)](
            p, q, part, N, M, R, per, scaling, p.stride(0), 1 if transposed else R, M if transposed else 1,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=_br(R), F32=_f32(p), num_warps=warps, num_stages=stages)
    return part.sum(0) if splits > 1 else part[0]


@register_op("lora_fwd", eager_only=("blocks",))  # torch.ops.minite.lora_fwd, for torch.compile (section 4)
def lora_fwd(x2: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float,
             blocks: dict | None = None) -> tuple[Tensor, Tensor]:
    """x2 (N, K), unit column stride -> (y (N, O) in x's dtype, g = x A^T (N, r) fp32). `blocks`: lora_tiles()."""
    t = blocks or lora_tiles(x2, x2.shape[0], x2.shape[1], weight.shape[0])
    g = _down(x2, lora_A.t(), 1.0, t)                                 # g = x A^T, once
    return _gemm(x2, weight.t(), g, lora_B.t(), float(scaling), t), g  # y = x W^T + (s g) B^T


@register_op("lora_bwd", eager_only=("blocks",))
def lora_bwd(dy: Tensor, x2: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, g: Tensor, scaling: float,
             blocks: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dy (N, O) -> (dx (N, K), dA (r, K), dB (O, r)); g = x A^T from the forward."""
    (N, K), (O, R) = x2.shape, lora_B.shape
    t = blocks or lora_tiles(x2, N, K, O)
    dg = _down(dy, lora_B, float(scaling), t)               # dg = s dy B (N, r)
    dx = _gemm(dy, weight, dg, lora_A, 1.0, t)              # dx = dy W + dg A (N, K)
    dA = _wgrad(x2, dg, 1.0, (R, K), True, t)               # dA = dg^T x (r, K)
    dB = _wgrad(dy, g, float(scaling), (O, R), False, t)    # dB = s dy^T g (O, r)
    return dx, dA.to(lora_A.dtype), dB.to(lora_B.dtype)


# ------------------------------------------------------------------------------------ 4. autograd.Function
def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(t.shape[:-1].numel(), t.shape[-1])  # (..., C) -> (N, C), a view when possible (C = 0 too)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class LoRALinearFunction(torch.autograd.Function):
    """Its setup_ctx and backward are also the gradient of torch.ops.minite.lora_fwd (x2 (N, K) -> y, g): one formula.
    `blocks`: the kernels' tiles forced by a test (a dict like lora_tiles' return), else the heuristic's."""

    @staticmethod
    def forward(ctx, x, weight, lora_A, lora_B, scaling, blocks=None):
        x2 = _rows(x)
        w, a, b = weight.contiguous(), lora_A.contiguous(), lora_B.contiguous()
        fwd = op("lora_fwd", lora_fwd) if blocks is None else functools.partial(lora_fwd, blocks=blocks)
        y, g = fwd(x2, w, a, b, scaling)  # torch.ops.minite.lora_fwd under torch.compile
        LoRALinearFunction.setup_ctx(ctx, (x2, w, a, b, scaling), (y, g))
        ctx.blocks = blocks
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        x2, w, a, b, scaling = inputs
        ctx.save_for_backward(x2, w, a, b, output[1])  # g = x A^T: (N, r), a sliver next to x
        ctx.scaling = scaling
        ctx.blocks = None
        ctx.x_shape = x2.shape

    @staticmethod
    def backward(ctx, dy, _dg=None):
        x2, w, a, b, g = ctx.saved_tensors
        dy2 = _rows(dy)
        bwd = op("lora_bwd", lora_bwd) if ctx.blocks is None else functools.partial(lora_bwd, blocks=ctx.blocks)
        dx, dA, dB = bwd(dy2, x2, w, a, b, g, ctx.scaling)
        dW = (dy2.t().float() @ x2.float()).to(w.dtype) if ctx.needs_input_grad[1] else None  # only if unfrozen
        # One gradient per input of the Function (blocks last); the op has no `blocks`: autograd drops a trailing None.
        return dx.view(ctx.x_shape), dW, dA, dB, None, None


register_autograd("lora_fwd", LoRALinearFunction.backward, setup_context=LoRALinearFunction.setup_ctx)


# -------------------------------------------------------------------------------------------- 5. functional
def _check(x, weight, lora_A, lora_B):
    ts = {"x": x, "weight": weight, "lora_A": lora_A, "lora_B": lora_B}
    for name, t in ts.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"lora_linear: {name} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if weight.dim() != 2 or lora_A.dim() != 2 or lora_B.dim() != 2:
        raise ValueError(f"lora_linear: weight, lora_A, lora_B must be 2-D, got {tuple(weight.shape)}, "
                         f"{tuple(lora_A.shape)}, {tuple(lora_B.shape)}")
    (O, K), (r, Ka), (Ob, rb) = weight.shape, lora_A.shape, lora_B.shape
    if x.shape[-1] != K or Ka != K or Ob != O or rb != r:
        raise ValueError(f"lora_linear: shapes do not fit: x {tuple(x.shape)}, weight {(O, K)} (O, K), lora_A "
                         f"{(r, Ka)} (r, K), lora_B {(Ob, rb)} (O, r)")
    if len({t.dtype for t in ts.values()}) > 1 or len({t.device for t in ts.values()}) > 1:
        raise ValueError("lora_linear: x, weight, lora_A, lora_B must share dtype and device, got "
                         + ", ".join(f"{n} {t.dtype} {t.device}" for n, t in ts.items()))


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, *,
                scaling: float = 1.0, backend: str | None = None) -> torch.Tensor:
    """x W^T + s (x A^T) B^T. x (..., K), weight (O, K), lora_A (r, K), lora_B (O, r) -> (..., O).

    The Triton backend runs the fused kernels for fp32/fp16/bf16 and r <= 128; fp64 and larger r take the
    reference (three GEMMs).
    """
    _check(x, weight, lora_A, lora_B)
    scaling = _v.real("lora_linear", "scaling", scaling)  # finite: NaN or inf would fill y with NaN
    if resolve_backend(x, backend) == "triton" and x.dtype in _DTYPES and lora_A.shape[0] <= MAX_R:
        return LoRALinearFunction.apply(x, weight, lora_A, lora_B, scaling)
    return lora_linear_ref(x, weight, lora_A, lora_B, scaling)
