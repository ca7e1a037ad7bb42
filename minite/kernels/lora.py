"""Fused LoRA linear (chapter 09): y = x W^T + s * (x A^T) B^T in one pass over x, forward and backward.

    x: (N, K)   W: (O, K) frozen   A: (r, K)   B: (O, r)   s = alpha / r          -> y: (N, O)

Unfused, a LoRA layer is three GEMMs (x W^T, x A^T, (xA^T) B^T) plus an add: x is read twice from HBM and the
(N, O) output is written, read and written again. The fused forward reads each x tile once and feeds it to two
tl.dot's (the base tile and the thin x A^T tile), then adds s * (x A^T) B^T in the epilogue before the one store.
The price: every column-tile program recomputes its rows' x A^T (r/BLOCK_N extra work relative to the base GEMM),
which is why fusing pays for small r only (benchmarks/bench_lora.py measures where).

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
from minite.kernels._common import launchable, op, register_autograd, register_op

__all__ = ["lora_linear_ref", "lora_linear", "LoRALinearFunction", "lora_fwd", "lora_bwd"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_R = 128  # above this the (BLOCK_M, r) accumulators crowd the registers: the three-GEMM path runs instead


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
def _lora_fwd_kernel(X_ptr, W_ptr, A_ptr, B_ptr, Y_ptr, XA_ptr, N, K, O, R, scaling,
                     X_row_stride, Y_row_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, F32: tl.constexpr):
    scaling = tl.cast(scaling, tl.float32)  # alpha / r: a Python float, fp64 under Inductor
    # Grid (cdiv(N, BLOCK_M), cdiv(O, BLOCK_N)): program (i, j) owns the (BLOCK_M, BLOCK_N) tile of y.
    # W (O, K), A (R, K), B (O, R) are contiguous; XA (N, R) fp32 receives x A^T for the backward.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)  # rank, padded to >= 16: columns r..BLOCK_R-1 load as 0 and add nothing
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x W^T
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)   # x A^T
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(X_ptr + rm[:, None] * X_row_stride + kk[None, :],
                    mask=(rm[:, None] < N) & (kk[None, :] < K), other=0.0)                  # (BLOCK_M, BLOCK_K)
        wt = tl.load(W_ptr + rn[None, :] * K + kk[:, None],
                     mask=(rn[None, :] < O) & (kk[:, None] < K), other=0.0)                 # W^T (BLOCK_K, BLOCK_N)
        at = tl.load(A_ptr + rr[None, :] * K + kk[:, None],
                     mask=(rr[None, :] < R) & (kk[:, None] < K), other=0.0)                 # A^T (BLOCK_K, BLOCK_R)
        acc = _dot(x, wt, acc, F32)  # the same x tile, in registers, feeds both products: x is read once
        xa = _dot(x, at, xa, F32)
    bt = tl.load(B_ptr + rn[None, :] * R + rr[:, None], mask=(rr[:, None] < R) & (rn[None, :] < O), other=0.0)
    xs = xa * scaling  # (BLOCK_M, BLOCK_R): s folded into the thin side, r multiplies instead of BLOCK_N
    if not F32:
        xs = xs.to(X_ptr.dtype.element_ty)  # a tensor-core dot needs both operands in the input dtype
    acc = _dot(xs, bt, acc, F32)  # epilogue: + s (x A^T) B^T, (BLOCK_M, BLOCK_R) @ (BLOCK_R, BLOCK_N)
    y_mask = (rm[:, None] < N) & (rn[None, :] < O)
    tl.store(Y_ptr + rm[:, None] * Y_row_stride + rn[None, :], acc.to(Y_ptr.dtype.element_ty), mask=y_mask)
    if pid_n == 0:  # one column of programs saves x A^T (N, R) for dB; the others computed it only for their tile
        tl.store(XA_ptr + rm[:, None] * R + rr[None, :], xa, mask=(rm[:, None] < N) & (rr[None, :] < R))


# Backward (the notebook derives it). With g = x A^T (N, r) and dy (N, O):
#   dg = s * dy B                 (N, r)     one pass over dy, fused with dx's main product
#   dx = dy W + dg A              (N, K)
#   dA = dg^T x                   (r, K)     reductions over the N rows: a second kernel
#   dB = s * dy^T g               (O, r)
#   dW: none, W is frozen (a caller that wants it gets dy^T x from torch).
@triton.jit
def _lora_bwd_dx_kernel(DY_ptr, W_ptr, A_ptr, B_ptr, DX_ptr, DG_ptr, N, K, O, R, scaling, DY_row_stride,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, F32: tl.constexpr):
    scaling = tl.cast(scaling, tl.float32)  # alpha / r: a Python float, fp64 under Inductor
    # Grid (cdiv(N, BLOCK_M), cdiv(K, BLOCK_N)): program (i, j) owns a (BLOCK_M, BLOCK_N) tile of dx (N, K);
    # the reduction runs over the O output features in steps of BLOCK_K.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # input features
    ro = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dy W
    dg = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)   # dy B
    for o0 in range(0, O, BLOCK_K):
        oo = o0 + ro
        dy = tl.load(DY_ptr + rm[:, None] * DY_row_stride + oo[None, :],
                     mask=(rm[:, None] < N) & (oo[None, :] < O), other=0.0)                 # (BLOCK_M, BLOCK_K)
        w = tl.load(W_ptr + oo[:, None] * K + rn[None, :], mask=(oo[:, None] < O) & (rn[None, :] < K), other=0.0)
        b = tl.load(B_ptr + oo[:, None] * R + rr[None, :], mask=(oo[:, None] < O) & (rr[None, :] < R), other=0.0)
        acc = _dot(dy, w, acc, F32)  # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
        dg = _dot(dy, b, dg, F32)    # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_R)
    dg = dg * scaling
    a = tl.load(A_ptr + rr[:, None] * K + rn[None, :], mask=(rr[:, None] < R) & (rn[None, :] < K), other=0.0)
    dgl = dg
    if not F32:
        dgl = dg.to(DY_ptr.dtype.element_ty)
    acc = _dot(dgl, a, acc, F32)  # + dg A, (BLOCK_M, BLOCK_R) @ (BLOCK_R, BLOCK_N)
    tl.store(DX_ptr + rm[:, None] * K + rn[None, :], acc.to(DX_ptr.dtype.element_ty),
             mask=(rm[:, None] < N) & (rn[None, :] < K))
    if pid_n == 0:
        tl.store(DG_ptr + rm[:, None] * R + rr[None, :], dg, mask=(rm[:, None] < N) & (rr[None, :] < R))


@triton.jit
def _lora_bwd_dadb_kernel(X_ptr, DY_ptr, G_ptr, DG_ptr, DA_ptr, DB_ptr, N, K, O, R, scaling,
                          X_row_stride, DY_row_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_R: tl.constexpr, F32: tl.constexpr):
    scaling = tl.cast(scaling, tl.float32)  # alpha / r: a Python float, fp64 under Inductor
    # One launch, two jobs: programs 0..cdiv(K, BLOCK_N)-1 each own a (BLOCK_R, BLOCK_N) tile of dA (r, K);
    # the rest each own a (BLOCK_N, BLOCK_R) tile of dB (O, r). Both loop over the N rows in steps of BLOCK_M.
    pid = tl.program_id(0).to(tl.int64)
    n_ka = tl.cdiv(K, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    rm0 = tl.arange(0, BLOCK_M)
    if pid < n_ka:
        rk = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        da = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for m0 in range(0, N, BLOCK_M):
            rm = m0 + rm0
            dgt = tl.load(DG_ptr + rm[None, :] * R + rr[:, None], mask=(rr[:, None] < R) & (rm[None, :] < N),
                          other=0.0)                                                        # dg^T (BLOCK_R, BLOCK_M)
            x = tl.load(X_ptr + rm[:, None] * X_row_stride + rk[None, :],
                        mask=(rm[:, None] < N) & (rk[None, :] < K), other=0.0)              # (BLOCK_M, BLOCK_N)
            if not F32:
                dgt = dgt.to(X_ptr.dtype.element_ty)
            da = _dot(dgt, x, da, F32)
        tl.store(DA_ptr + rr[:, None] * K + rk[None, :], da.to(DA_ptr.dtype.element_ty),
                 mask=(rr[:, None] < R) & (rk[None, :] < K))
    else:
        ro = (pid - n_ka) * BLOCK_N + tl.arange(0, BLOCK_N)
        db = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for m0 in range(0, N, BLOCK_M):
            rm = m0 + rm0
            dyt = tl.load(DY_ptr + rm[None, :] * DY_row_stride + ro[:, None],
                          mask=(ro[:, None] < O) & (rm[None, :] < N), other=0.0)            # dy^T (BLOCK_N, BLOCK_M)
            g = tl.load(G_ptr + rm[:, None] * R + rr[None, :], mask=(rm[:, None] < N) & (rr[None, :] < R),
                        other=0.0)                                                          # (BLOCK_M, BLOCK_R)
            if not F32:
                g = g.to(DY_ptr.dtype.element_ty)
            db = _dot(dyt, g, db, F32)
        tl.store(DB_ptr + ro[:, None] * R + rr[None, :], (db * scaling).to(DB_ptr.dtype.element_ty),
                 mask=(ro[:, None] < O) & (rr[None, :] < R))


# ------------------------------------------------------------------------------------------ 3. launchers
def _blocks(M: int, N: int, K: int, r: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R). Every tl.dot dimension >= 16 on every device."""
    br = max(16, triton.next_power_of_2(r))
    if on_gpu:  # Triton matmul tutorial's fp16 tile, smaller K step: the two extra (., BLOCK_R) tiles need room
        return 64, 128, 32, br

    def fit(n):  # interpreter: ~0.5 ms per program and loop step, so tiles as large as the problem (<= 64)
        return max(16, min(64, triton.next_power_of_2(n)))
    return fit(M), fit(N), fit(K), br


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 or (t.dtype == torch.bfloat16 and interpreting())


@register_op("lora_fwd", eager_only=("blocks",))  # torch.ops.minite.lora_fwd, for torch.compile (section 4)
def lora_fwd(x2: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float,
             blocks: tuple[int, int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """x2 (N, K), unit column stride -> (y (N, O) in x's dtype, g = x A^T (N, r) fp32)."""
    (N, K), (O, R) = x2.shape, lora_B.shape
    y = torch.empty((N, O), dtype=x2.dtype, device=x2.device)
    g = torch.empty((N, R), dtype=torch.float32, device=x2.device)
    BM, BN, BK, BR = blocks or _blocks(N, O, K, R, x2.is_cuda)
    if N and O:
        grid = (triton.cdiv(N, BM), triton.cdiv(O, BN))
        launchable(_lora_fwd_kernel)[grid](x2, weight, lora_A, lora_B, y, g, N, K, O, R, float(scaling), x2.stride(0),
                               y.stride(0), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, F32=_f32(x2))
    return y, g


@register_op("lora_bwd", eager_only=("blocks",))
def lora_bwd(dy: Tensor, x2: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, g: Tensor, scaling: float,
             blocks: tuple[int, int, int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dy (N, O) -> (dx (N, K), dA (r, K), dB (O, r)); g = x A^T from the forward."""
    (N, K), (O, R) = x2.shape, lora_B.shape
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    dA, dB = torch.empty_like(lora_A), torch.empty_like(lora_B)
    dg = torch.empty((N, R), dtype=torch.float32, device=x2.device)
    BM, BN, BK, BR = blocks or _blocks(N, K, O, R, x2.is_cuda)
    if N and K:
        launchable(_lora_bwd_dx_kernel)[(triton.cdiv(N, BM), triton.cdiv(K, BN))](
            dy, weight, lora_A, lora_B, dx, dg, N, K, O, R, float(scaling), dy.stride(0),
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, F32=_f32(x2))
    else:
        dx.zero_()
        dg.zero_()
    launchable(_lora_bwd_dadb_kernel)[(triton.cdiv(K, BN) + triton.cdiv(O, BN),)](
        x2, dy, g, dg, dA, dB, N, K, O, R, float(scaling), x2.stride(0), dy.stride(0),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_R=BR, F32=_f32(x2))
    return dx, dA, dB


# ------------------------------------------------------------------------------------ 4. autograd.Function
def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])  # (..., C) -> (N, C), a view when possible
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class LoRALinearFunction(torch.autograd.Function):
    """Its setup_ctx and backward are also the gradient of torch.ops.minite.lora_fwd (x2 (N, K) -> y, g): one formula.
    `blocks`: tile sizes (BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R) forced by a test, else the heuristic's."""

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
