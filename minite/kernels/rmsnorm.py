"""RMSNorm (Zhang & Sennrich 2019) and LayerNorm (Ba et al. 2016), fused forward and backward (chapter 03).

    RMSNorm:   y = x / sqrt(mean(x^2) + eps) * w
    LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * w + b

One Triton kernel pair serves both: the constexpr LAYERNORM switches the mean subtraction and the bias on.
Forward: one program per row block, fp32 statistics (fp64 for fp64), rstd (and mean) saved. Backward: each of ~2
programs per SM walks a chunk of rows, writes dx and ONE partial of dw (db) per program, reduced by `.sum(0)`;
a LayerNorm row wider than DB_IN_KERNEL_MAX gets db from the host (dy summed over rows): no register spills.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from minite import _validate as _v
from minite._triton import tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import (
    compute_dtype,
    gpu_tiles,
    launchable,
    op,
    register_autograd,
    register_op,
    row_launch,
    sm_count,
    tl_compute_dtype,
)

__all__ = ["rmsnorm_ref", "layernorm_ref", "rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd",
           "RMSNormFunction", "LayerNormFunction", "rmsnorm", "layernorm", "RMSNorm", "LayerNorm"]

MAX_FUSED_SIZE = 65536  # one row must fit in one program's registers/SRAM: the Triton tutorial's 64 KB bound
# GPU knobs (bench_rmsnorm.py --sweep): elements per program step, backward programs per SM, backward warp cap
# per op (H100, C=16384 fwd+bwd: RMSNorm 1.02 ms at <=16 warps vs 1.08 at 32), forward warp cap (16 warps at
# C=16384: <= 64 registers, so two rows in flight per SM; 32 warps leave room for one), and the widest LayerNorm
# row whose backward keeps db in registers beside dw (16384 columns still spill 104 B at 32 warps, 168 at 16; the
# old kernel's 212 B took 2.18 ms fwd+bwd on an H100, Liger 1.50).
ROW_ELEMS, BWD_PROGRAMS_PER_SM, BWD_MAX_WARPS = 4096, 2, {"rmsnorm": 16, "layernorm": 16}
FWD_MAX_WARPS, DB_IN_KERNEL_MAX = 16, 8192


# ------------------------------------------------------------------------------------------ 1. references
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The spec: x (..., C), weight (C,) -> (..., C) in x.dtype, computed in fp32."""
    xf = x.to(compute_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)


def layernorm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The spec: x (..., C), weight/bias (C,) -> (..., C) in x.dtype; biased variance like nn.LayerNorm."""
    xf = x.to(compute_dtype(x.dtype))
    xc = xf - xf.mean(-1, keepdim=True)  # (..., C) centred
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return (xc * rstd * weight.to(xf.dtype) + bias.to(xf.dtype)).to(x.dtype)


# ------------------------------------------------------------------------------------------ 2. kernels
@triton.jit
def _norm_fwd_kernel(X_ptr, W_ptr, B_ptr, Y_ptr, Mean_ptr, Rstd_ptr, X_row_stride, Y_row_stride, N_ROWS, N_COLS,
                     eps, LAYERNORM: tl.constexpr, ACC: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr):
    # BLOCK_ROWS rows per program (several when rows are short, so each program has enough bytes in flight).
    eps = tl.cast(eps, ACC)  # a Python float is fp64 under Inductor: compute in ACC (fp32, or fp64 for gradcheck)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (BLOCK_ROWS,) int64
    cols = tl.arange(0, BLOCK_SIZE)  # BLOCK_SIZE = next power of 2 >= N_COLS
    cmask = cols < N_COLS
    mask = (rows[:, None] < N_ROWS) & cmask[None, :]  # (BLOCK_ROWS, BLOCK_SIZE)
    # Load the rows once and upcast at once (bf16 arithmetic is wrong on the CPU interpreter).
    x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :], mask=mask, other=0.0).to(ACC)
    if LAYERNORM:
        mean = tl.sum(x, axis=1) / N_COLS  # (BLOCK_ROWS,) first reduction: the row means
        xc = tl.where(mask, x - mean[:, None], 0.0)  # padding lanes must stay 0, or they pollute the variance
        tl.store(Mean_ptr + rows, mean, mask=rows < N_ROWS)  # saved for backward
    else:
        xc = x  # RMSNorm: no centring -> one reduction instead of two
    var = tl.sum(xc * xc, axis=1) / N_COLS  # mean of squares (the variance for centred x)
    rstd = 1.0 / tl.sqrt(var + eps)  # one scalar per row
    tl.store(Rstd_ptr + rows, rstd, mask=rows < N_ROWS)  # 4 bytes per row: cheaper than re-reducing in backward
    # w (and b) are read after the reductions: loaded earlier they would stay live in registers across them
    w = tl.load(W_ptr + cols, mask=cmask, other=0.0).to(ACC)[None, :]  # (1, BLOCK_SIZE)
    y = xc * rstd[:, None] * w
    if LAYERNORM:
        y += tl.load(B_ptr + cols, mask=cmask, other=0.0).to(ACC)[None, :]
    tl.store(Y_ptr + rows[:, None] * Y_row_stride + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


# Backward, per row, with xhat = (x - mean) * rstd (mean = 0 for RMSNorm) and g = dy * w:
#   RMSNorm   dx = rstd * (g - xhat * mean(g * xhat))
#   LayerNorm dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
#   dw = sum over rows of dy * xhat        db = sum over rows of dy
# dw (db) sum over ALL rows, so each program keeps a running partial for its rows in registers and writes it
# once to DW_partial[pid]; the host sums the (n_programs, C) partials. No atomics: no contention on the C
# addresses, and the summation order is fixed, so the result is bitwise deterministic.
# Registers are the limit at wide rows: a whole row of x and dy plus the fp32 partials, C / threads values each,
# in at most 65536 / threads registers per thread. So the partials are updated BEFORE the row reductions (dy
# dies early), and a LayerNorm row too wide for two partials leaves db (= dy summed over rows) to the host
# (DB=False: one extra read of dy, cheaper than spilling every row: see DB_IN_KERNEL_MAX).
@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _norm_bwd_kernel(DY_ptr, X_ptr, W_ptr, Mean_ptr, Rstd_ptr, DX_ptr, DW_ptr, DB_ptr,
                     DY_row_stride, X_row_stride, DX_row_stride, N_ROWS, N_COLS, ROWS_PER_PROGRAM,
                     LAYERNORM: tl.constexpr, DB: tl.constexpr, ACC: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    cmask = cols < N_COLS
    dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_SIZE), dtype=ACC)  # this program's partial sums, in fp32 registers
    db_acc = tl.zeros((BLOCK_ROWS, BLOCK_SIZE) if DB else (1, 1), dtype=ACC)  # (1, 1): unused, no registers
    row_start = pid * ROWS_PER_PROGRAM  # a contiguous chunk of rows per program, BLOCK_ROWS at a time
    row_end = tl.minimum(row_start + ROWS_PER_PROGRAM, N_ROWS)
    for r0 in range(row_start, row_end, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)  # (BLOCK_ROWS,)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]  # (BLOCK_ROWS, BLOCK_SIZE)
        rstd = tl.load(Rstd_ptr + rows, mask=rmask, other=0.0)[:, None]  # (BLOCK_ROWS, 1)
        x = tl.load(X_ptr + rows[:, None] * X_row_stride + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY_ptr + rows[:, None] * DY_row_stride + cols[None, :], mask=mask, other=0.0).to(ACC)
        # w is re-read per block (from L1/L2): holding it across the loop costs registers that wide rows lack.
        w = tl.load(W_ptr + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        if LAYERNORM:
            mean = tl.load(Mean_ptr + rows, mask=rmask, other=0.0)[:, None]
            xhat = (x - mean) * rstd  # recomputed, never stored; padding lanes have dy = 0, so they add nothing
        else:
            xhat = x * rstd
        dw_acc += dy * xhat  # the partials first: after this, dy lives on only inside g
        if DB:
            db_acc += dy
        g = dy * w  # gradient w.r.t. xhat
        if LAYERNORM:  # both row sums in ONE reduction (one trip through shared memory, one barrier)
            gx, gs = tl.reduce((g * xhat, g), 1, _add_pair)
            dx = g - xhat * (gx / N_COLS)[:, None] - (gs / N_COLS)[:, None]  # minus the mean: x was centred
        else:
            dx = g - xhat * (tl.sum(g * xhat, axis=1) / N_COLS)[:, None]  # remove the component along xhat
        tl.store(DX_ptr + rows[:, None] * DX_row_stride + cols[None, :], (dx * rstd).to(DX_ptr.dtype.element_ty),
                 mask=mask)
    # Stage 1 of the reduction: one (C,) partial per program. Stage 2 is a .sum(0) on the host side.
    tl.store(DW_ptr + pid * N_COLS + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if DB:
        tl.store(DB_ptr + pid * N_COLS + cols, tl.sum(db_acc, axis=0), mask=cmask)


# ------------------------------------------------------------------------------------------ 3. launchers
def _settings(n_cols: int, bwd: str | None = None) -> tuple[int, int, int]:
    """(BLOCK_SIZE, num_warps, BLOCK_ROWS): rows shorter than ROW_ELEMS are taken several at a time, so a program
    keeps enough bytes in flight to stream HBM."""
    block, num_warps = row_launch(n_cols, MAX_FUSED_SIZE)
    return block, min(num_warps, BWD_MAX_WARPS[bwd] if bwd else FWD_MAX_WARPS), max(1, ROW_ELEMS // block)


def _n_programs(x2d: torch.Tensor) -> int:
    """Programs for the backward: BWD_PROGRAMS_PER_SM per SM (cached device query), one wave; 4 on the
    interpreter. Each writes one (C,) partial of dw, so fewer programs also mean a cheaper stage 2."""
    return max(1, min(x2d.shape[0], BWD_PROGRAMS_PER_SM * sm_count(x2d.device) if gpu_tiles(x2d) else 4))


def _norm_fwd(x, weight, bias, eps: float):
    """x (..., C) -> y (..., C), mean (N,) or None, rstd (N,) with N = prod(x.shape[:-1])."""
    shape, C = x.shape, x.shape[-1]
    x2d = x.reshape(-1, C)  # (N, C); a view when it can be
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()  # the kernel needs unit stride along C
    N = x2d.shape[0]
    weight, bias = weight.contiguous(), bias.contiguous() if bias is not None else None  # kernel reads W_ptr + cols
    y = torch.empty((N, C), dtype=x.dtype, device=x.device)  # (N, C)
    stat_dtype = compute_dtype(x.dtype)
    rstd = torch.empty(N, dtype=stat_dtype, device=x.device)  # (N,)
    mean = torch.empty(N, dtype=stat_dtype, device=x.device) if bias is not None else None  # (N,)
    block, num_warps, rows = _settings(C)
    if N > 0:
        launchable(_norm_fwd_kernel)[(triton.cdiv(N, rows),)](
            x2d, weight, bias if bias is not None else weight, y, mean if mean is not None else rstd, rstd,
            x2d.stride(0), y.stride(0), N, C, eps, LAYERNORM=bias is not None, ACC=tl_compute_dtype(x.dtype),
            BLOCK_SIZE=block, BLOCK_ROWS=rows, num_warps=num_warps)
    return y.view(shape), mean, rstd


def _norm_bwd(dy, x, weight, mean, rstd, *, n_programs: int | None = None):
    """-> dx (x.shape, x.dtype), dw (C,) in weight.dtype, db (C,) or None (LayerNorm when mean is given)."""
    C = x.shape[-1]
    x2d = x.reshape(-1, C).contiguous()  # (N, C)
    dy2d = dy.reshape(-1, C).contiguous()  # (N, C); autograd may hand us a non-contiguous gradient
    N, weight = x2d.shape[0], weight.contiguous()  # a strided weight (w[::2]) would be read wrongly otherwise
    P = n_programs or _n_programs(x2d)
    rows_per_program = triton.cdiv(N, P) if N else 0
    dx = torch.empty_like(x2d)  # (N, C)
    db_in_kernel = mean is not None and C <= DB_IN_KERNEL_MAX  # wider: db = dy summed over rows, on the host
    dw_partial = torch.zeros((P, C), dtype=rstd.dtype, device=x.device)  # (P, C), fp32 partials
    db_partial = torch.zeros((P, C), dtype=rstd.dtype, device=x.device) if db_in_kernel else None
    block, num_warps, rows = _settings(C, bwd="rmsnorm" if mean is None else "layernorm")
    if N > 0:
        launchable(_norm_bwd_kernel)[(P,)](
            dy2d, x2d, weight, mean if mean is not None else rstd, rstd, dx, dw_partial,
            db_partial if db_partial is not None else dw_partial, dy2d.stride(0), x2d.stride(0), dx.stride(0), N, C,
            rows_per_program, LAYERNORM=mean is not None, DB=db_in_kernel, ACC=tl_compute_dtype(x.dtype),
            BLOCK_SIZE=block, BLOCK_ROWS=rows, num_warps=num_warps)
    dw = dw_partial.sum(0).to(weight.dtype)  # stage 2: reduce P partials -> (C,)
    db = None if mean is None else (db_partial.sum(0) if db_in_kernel else dy2d.sum(0, dtype=rstd.dtype)).to(
        weight.dtype)
    return dx.view(x.shape), dw, db


@register_op("rmsnorm_fwd")  # torch.ops.minite.rmsnorm_fwd, for torch.compile (section 4)
def rmsnorm_fwd(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """-> (y, rstd)"""
    y, _, rstd = _norm_fwd(x, weight, None, eps)
    return y, rstd


@register_op("rmsnorm_bwd", eager_only=("n_programs",))
def rmsnorm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, *,
                n_programs: int | None = None) -> tuple[Tensor, Tensor]:
    """-> (dx, dw)"""
    dx, dw, _ = _norm_bwd(dy, x, weight, None, rstd, n_programs=n_programs)
    return dx, dw


@register_op("layernorm_fwd")
def layernorm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """-> (y, mean, rstd)"""
    return _norm_fwd(x, weight, bias, eps)


@register_op("layernorm_bwd", eager_only=("n_programs",))
def layernorm_bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, *,
                  n_programs: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx, dw, db)"""
    return _norm_bwd(dy, x, weight, mean, rstd, n_programs=n_programs)


# ------------------------------------------------------------------------------------------ 4. autograd
# Each Function's setup_ctx and backward are also the gradient of its torch.ops.minite.*_fwd op: one formula.
class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = op("rmsnorm_fwd", rmsnorm_fwd)(x, weight, eps)  # torch.ops.minite.* under torch.compile
        RMSNormFunction.setup_ctx(ctx, (x, weight, eps), (y, rstd))
        return y

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1])  # x, weight, rstd

    @staticmethod
    def backward(ctx, dy, _drstd=None):  # the op also returns rstd, which gets no gradient
        x, weight, rstd = ctx.saved_tensors
        dx, dw = op("rmsnorm_bwd", rmsnorm_bwd)(dy, x, weight, rstd)
        return dx, dw, None


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = op("layernorm_fwd", layernorm_fwd)(x, weight, bias, eps)
        LayerNormFunction.setup_ctx(ctx, (x, weight, bias, eps), (y, mean, rstd))
        return y

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1], output[2])  # x, weight, mean, rstd

    @staticmethod
    def backward(ctx, dy, _dmean=None, _drstd=None):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = op("layernorm_bwd", layernorm_bwd)(dy, x, weight, mean, rstd)
        return dx, dw, db, None


register_autograd("rmsnorm_fwd", RMSNormFunction.backward, setup_context=RMSNormFunction.setup_ctx)
register_autograd("layernorm_fwd", LayerNormFunction.backward, setup_context=LayerNormFunction.setup_ctx)


# ------------------------------------------------------------------------------------------ 5. functional
def _check_size(op: str, x) -> None:
    if x.shape[-1] > MAX_FUSED_SIZE:
        raise ValueError(f"{op}: the Triton kernel keeps a whole row in one program; C={x.shape[-1]} exceeds "
                         f"{MAX_FUSED_SIZE}. Use backend='torch'.")


def rmsnorm(x: Tensor, weight: Tensor, *, eps: float = 1e-6, backend: str | None = None) -> Tensor:
    """RMSNorm over the last dim: x (..., C), weight (C,) -> (..., C) in x.dtype."""
    _v.norm_args("rmsnorm", x, weight, None, eps)
    if x.numel() and resolve_backend(x, backend, op="rmsnorm") == "triton":  # empty: nothing to launch (exact ref)
        _check_size("rmsnorm", x)
        return RMSNormFunction.apply(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def layernorm(x: Tensor, weight: Tensor, bias: Tensor, *, eps: float = 1e-5, backend: str | None = None) -> Tensor:
    """LayerNorm over the last dim: x (..., C), weight/bias (C,) -> (..., C) in x.dtype."""
    if bias is None:
        raise ValueError("layernorm: bias is required (pass torch.zeros(C) for none)")
    _v.norm_args("layernorm", x, weight, bias, eps)
    if x.numel() and resolve_backend(x, backend, op="layernorm") == "triton":
        _check_size("layernorm", x)
        return LayerNormFunction.apply(x, weight, bias, eps)
    return layernorm_ref(x, weight, bias, eps)


# ------------------------------------------------------------------------------------------ 6. modules
class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim. state_dict: {'weight'}."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: str | None = None, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))  # (C,)
        self.dim, self.eps, self.backend = dim, eps, backend

    def forward(self, x: Tensor) -> Tensor:
        return rmsnorm(x, self.weight, eps=self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, backend={self.backend}"


class LayerNorm(nn.Module):
    """y = (x - mean) / std * weight + bias over the last dim. state_dict: {'weight', 'bias'}."""

    def __init__(self, dim: int, eps: float = 1e-5, backend: str | None = None, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))  # (C,)
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))  # (C,)
        self.dim, self.eps, self.backend = dim, eps, backend

    def forward(self, x: Tensor) -> Tensor:
        return layernorm(x, self.weight, self.bias, eps=self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, backend={self.backend}"
