"""Row softmax (chapter 00): y = exp(x - max(x)) / sum(exp(x - max(x))) along one dimension.

The template every concept file copies (DESIGN.md §2): reference -> kernels -> launchers -> autograd.Function ->
functional -> Module. The launchers are also the torch.compile ops ``torch.ops.minite.softmax_fwd/_bwd``
(``@register_op``), and the Function's setup_ctx and backward are the forward op's gradient (``register_autograd``).

The kernels run one program per row. A row of at most ``MAX_BLOCK_SIZE`` columns is read once and written once
(the fused minimum: 2 passes over memory, where naive PyTorch makes about 8). Longer rows are walked in blocks
with an online max/sum, so any row length works (then x is read twice).
"""

from __future__ import annotations

import torch
from torch import nn

from minite._triton import tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import launchable, op, register_autograd, register_op, row_launch, tl_compute_dtype

__all__ = ["softmax_ref", "softmax_fwd", "softmax_bwd", "SoftmaxFunction", "softmax", "Softmax", "MAX_BLOCK_SIZE"]

# Columns one program holds at once. 8192 fp32 values over 16 warps is 16 registers per thread on an H100;
# longer rows take the looped path (C=16384 fwd+bwd: 0.295 ms vs torch.compile's 0.281 on an H100; a single
# 16384-wide block at 32 warps is untried). Tests lower it (monkeypatch) to exercise the loop on small shapes.
MAX_BLOCK_SIZE = 8192
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ------------------------------------------------------------------------------------------ 1. reference
def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The spec: numerically stable softmax, computed in fp32 (fp64 for fp64 input), returned in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    # Subtracting the row max changes nothing mathematically (it cancels in the ratio) but keeps exp() <= 1.
    # It is detached because the output does not depend on it: its gradient is exactly zero.
    z = xf - xf.amax(dim=dim, keepdim=True).detach()
    e = z.exp()
    return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)


# ------------------------------------------------------------------------------------------ 2. kernels
@triton.jit
def _softmax_fwd_kernel(
    X_ptr, Y_ptr,                 # (N, C) input and output; each row is contiguous
    X_row_stride, Y_row_stride,   # elements between the starts of two rows
    n_cols,                       # C
    BLOCK_SIZE: tl.constexpr,     # columns handled at once (a power of 2)
    SINGLE_BLOCK: tl.constexpr,   # True when C <= BLOCK_SIZE: the whole row fits, read it once
    ACC_DTYPE: tl.constexpr,      # tl.float32, or tl.float64 for fp64 input (gradcheck)
):
    # One program per row; int64 so row * stride cannot overflow on large tensors.
    row = tl.program_id(0).to(tl.int64)
    X_ptr += row * X_row_stride
    Y_ptr += row * Y_row_stride
    cols = tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        # Lanes past the end read -inf: they do not change the max and contribute exp(-inf) = 0 to the sum.
        x = tl.load(X_ptr + cols, mask=mask, other=-float("inf")).to(ACC_DTYPE)
        z = x - tl.max(x, axis=0)
        e = tl.exp(z)
        y = e / tl.sum(e, axis=0)
        tl.store(Y_ptr + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1, online statistics: after each block, m = max so far and d = sum of exp(x - m) so far.
        # A new block with a larger max rescales the old sum: d' = d * exp(m - m') + sum(exp(x_blk - m')).
        # m starts at -inf (a finite start such as -3e38 breaks fp64 rows whose values are all below it). While
        # every value seen is -inf, m_new is -inf and exp(-inf - (-inf)) would be NaN: shift by 0 instead, which
        # gives exp(-inf) = 0 for the old (empty) sum and for the -inf lanes. Any finite shift is exact.
        m = tl.full([], -float("inf"), ACC_DTYPE)
        d = tl.full([], 0.0, ACC_DTYPE)
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            x = tl.load(X_ptr + start + cols, mask=mask, other=-float("inf")).to(ACC_DTYPE)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # the guard: never -inf - (-inf)
            d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
            m = m_new
        # Pass 2: read x again, normalise with the final statistics, write y.
        inv_d = 1.0 / d
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            x = tl.load(X_ptr + start + cols, mask=mask, other=-float("inf")).to(ACC_DTYPE)
            y = tl.exp(x - m) * inv_d
            tl.store(Y_ptr + start + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)


# Backward. y_i = exp(x_i) / sum_k exp(x_k) has the Jacobian  dy_i/dx_j = y_i * (delta_ij - y_j), so
#     dx_j = sum_i dy_i * y_i * (delta_ij - y_j) = y_j * (dy_j - sum_i dy_i * y_i)
# i.e. dx = y * (dy - <dy, y>): one dot product per row, then an elementwise op. It needs y (saved by the
# forward), not x. Memory: read y and dy, write dx (3 passes; the looped path reads y and dy twice).
@triton.jit
def _softmax_bwd_kernel(
    Y_ptr, DY_ptr, DX_ptr,                        # (N, C) saved output, upstream grad, input grad
    Y_row_stride, DY_row_stride, DX_row_stride,
    n_cols,                                       # C
    BLOCK_SIZE: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    Y_ptr += row * Y_row_stride
    DY_ptr += row * DY_row_stride
    DX_ptr += row * DX_row_stride
    cols = tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        # Lanes past the end read 0 for both: they add nothing to the dot product.
        y = tl.load(Y_ptr + cols, mask=mask, other=0.0).to(ACC_DTYPE)
        dy = tl.load(DY_ptr + cols, mask=mask, other=0.0).to(ACC_DTYPE)
        dot = tl.sum(y * dy, axis=0)  # <dy, y>, a scalar per row
        dx = y * (dy - dot)
        tl.store(DX_ptr + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: accumulate <dy, y> over the blocks of the row.
        dot = tl.full([], 0.0, ACC_DTYPE)
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            y = tl.load(Y_ptr + start + cols, mask=mask, other=0.0).to(ACC_DTYPE)
            dy = tl.load(DY_ptr + start + cols, mask=mask, other=0.0).to(ACC_DTYPE)
            dot += tl.sum(y * dy, axis=0)
        # Pass 2: dx = y * (dy - dot), block by block.
        for start in range(0, n_cols, BLOCK_SIZE):
            mask = start + cols < n_cols
            y = tl.load(Y_ptr + start + cols, mask=mask, other=0.0).to(ACC_DTYPE)
            dy = tl.load(DY_ptr + start + cols, mask=mask, other=0.0).to(ACC_DTYPE)
            dx = y * (dy - dot)
            tl.store(DX_ptr + start + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ 3. launchers
def _launch_config(n_cols: int) -> tuple[int, bool, int]:
    """(BLOCK_SIZE, SINGLE_BLOCK, num_warps) for rows of `n_cols` columns (the shared heuristic, no autotune)."""
    block, num_warps = row_launch(n_cols, MAX_BLOCK_SIZE)
    return block, block >= n_cols, num_warps


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Move `dim` last, make it contiguous and flatten: (..., C, ...) -> (N, C)."""
    t = t.movedim(dim, -1).contiguous()
    return t.view(-1, t.shape[-1])  # (N, C)


def _from_rows(t2d: torch.Tensor, shape_moved: torch.Size, dim: int) -> torch.Tensor:
    """Inverse of _as_rows: (N, C) -> (..., C) -> `dim` back in place (a view, no copy)."""
    return t2d.view(shape_moved).movedim(-1, dim)


@register_op("softmax_fwd")  # torch.ops.minite.softmax_fwd, for torch.compile (section 4)
def softmax_fwd(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Launch the forward kernel: softmax of `x` along `dim`, same shape and dtype as `x`."""
    x2 = _as_rows(x, dim)  # (N, C)
    N, C = x2.shape
    y2 = torch.empty_like(x2)  # (N, C)
    if x2.numel() > 0:  # an empty grid is an error for Triton; there is nothing to do anyway
        block, single, num_warps = _launch_config(C)
        launchable(_softmax_fwd_kernel)[(N,)](
            x2, y2, x2.stride(0), y2.stride(0), C,
            BLOCK_SIZE=block, SINGLE_BLOCK=single, ACC_DTYPE=tl_compute_dtype(x.dtype), num_warps=num_warps,
        )
    return _from_rows(y2, x.movedim(dim, -1).shape, dim)


@register_op("softmax_bwd")
def softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Launch the backward kernel: dx = y * (dy - sum(dy * y, dim)), same shape and dtype as `y`."""
    y2, dy2 = _as_rows(y, dim), _as_rows(dy.to(y.dtype), dim)  # (N, C) each
    N, C = y2.shape
    dx2 = torch.empty_like(y2)  # (N, C)
    if y2.numel() > 0:
        block, single, num_warps = _launch_config(C)
        launchable(_softmax_bwd_kernel)[(N,)](
            y2, dy2, dx2, y2.stride(0), dy2.stride(0), dx2.stride(0), C,
            BLOCK_SIZE=block, SINGLE_BLOCK=single, ACC_DTYPE=tl_compute_dtype(y.dtype), num_warps=num_warps,
        )
    return _from_rows(dx2, y.movedim(dim, -1).shape, dim)


# ------------------------------------------------------------------------------------------ 4. autograd
class SoftmaxFunction(torch.autograd.Function):
    """Triton forward and backward; saves only the output y (the backward needs y, not x). Its setup_ctx and
    backward are also the gradient of torch.ops.minite.softmax_fwd (registered below): one formula."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        y = op("softmax_fwd", softmax_fwd)(x, dim)  # torch.ops.minite.softmax_fwd under torch.compile
        SoftmaxFunction.setup_ctx(ctx, (x, dim), y)
        return y

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        ctx.save_for_backward(output)  # y
        ctx.dim = inputs[1]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        return op("softmax_bwd", softmax_bwd)(y, dy, ctx.dim), None  # no gradient for `dim`


register_autograd("softmax_fwd", SoftmaxFunction.backward, setup_context=SoftmaxFunction.setup_ctx)


# ------------------------------------------------------------------------------------------ 5. functional
def _check_inputs(x, dim) -> int:
    """Validate and return `dim` as a non-negative index; clear errors instead of a crash inside a kernel."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"softmax expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED:
        raise ValueError(f"softmax needs a floating-point tensor (float16, bfloat16, float32 or float64), "
                         f"got dtype {x.dtype} with shape {tuple(x.shape)}")
    if x.dim() == 0:
        raise ValueError("softmax needs a tensor with at least 1 dimension, got a 0-dim tensor (a scalar)")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"softmax dim must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"softmax dim={dim} is out of range for a tensor of shape {tuple(x.shape)} "
                         f"(valid: {-x.dim()} .. {x.dim() - 1})")
    return dim % x.dim()


def softmax(x: torch.Tensor, *, dim: int = -1, backend: str | None = None) -> torch.Tensor:
    """Softmax of `x` along `dim`: exp(x) / sum(exp(x), dim), computed stably in fp32 (fp64 for fp64 input).

    backend: None/"auto" (Triton on CUDA or under the interpreter, else PyTorch), "torch" or "triton".
    """
    dim = _check_inputs(x, dim)
    if x.numel() == 0:  # torch.softmax's answer: an empty tensor of the same shape (nothing to normalise)
        resolve_backend(x, backend)  # a bad backend name is still an error
        return x.clone()
    if resolve_backend(x, backend, op="softmax") == "triton":
        return SoftmaxFunction.apply(x, dim)
    return softmax_ref(x, dim)


# ------------------------------------------------------------------------------------------ 6. module
class Softmax(nn.Module):
    """``nn.Softmax`` with minite's backend switch: ``Softmax(dim=-1, backend=None)``."""

    def __init__(self, dim: int = -1, backend: str | None = None):
        super().__init__()
        self.dim, self.backend = dim, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, dim=self.dim, backend=self.backend)

    def extra_repr(self) -> str:
        return f"dim={self.dim}" + (f", backend={self.backend!r}" if self.backend is not None else "")
