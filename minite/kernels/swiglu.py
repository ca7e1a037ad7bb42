"""SwiGLU (chapter 05): the SiLU-gated linear unit of Shazeer 2020, "GLU Variants Improve Transformer".

    h = silu(gate) * up,   silu(g) = g * sigmoid(g)        gate, up: (..., H)

The GPT's MLP is ``down(swiglu(gate(x), up(x)))`` (``minite.nn.SwiGLU``, in minite/layers/mlp.py). Eager PyTorch
runs ``F.silu(gate) * up`` as two kernels and autograd keeps *three* (N, H) tensors for the backward (gate,
silu(gate), up). The fused kernel reads gate and up once, writes h once, and its backward recomputes silu(gate)
from the saved inputs, so only gate and up are kept.
"""
from __future__ import annotations

import torch

from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import _acc, compute_dtype, launchable, op, register_autograd, register_op, row_launch

__all__ = ["swiglu_ref", "swiglu", "SwiGLUFunction", "swiglu_fwd", "swiglu_bwd"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BLOCK_GPU, BLOCK_CPU = 2048, 4096  # columns per program on a GPU (bench_swiglu.py) and on the CPU interpreter


# ----------------------------------------------------------------------------------------- 1. reference
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 (fp64 stays fp64), returned in gate's dtype. The spec."""
    g, u = gate.to(compute_dtype(gate.dtype)), up.to(compute_dtype(gate.dtype))
    return (g * torch.sigmoid(g) * u).to(gate.dtype)


# -------------------------------------------------------------------------------------------- 2. kernels
@triton.jit
def _block(H, BLOCK_SIZE: tl.constexpr):
    # A 1-D grid over (row, column block), column blocks fastest: programs that run together stream neighbouring
    # bytes. -> (row (int64: row * stride overflows int32 for big N * H), the program's columns, their mask)
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(H, BLOCK_SIZE)
    row = pid // n_col_blocks
    cols = (pid - row * n_col_blocks) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    return row.to(tl.int64), cols, cols < H


@triton.jit
def _swiglu_fwd_kernel(G_ptr, G_row_stride, U_ptr, U_row_stride, Y_ptr, H,
                       BLOCK_SIZE: tl.constexpr, FP64: tl.constexpr):
    # Program p owns BLOCK_SIZE columns of one row of the (N, H) tensors. Rows may be strided (gate and up are
    # often two halves of one (N, 2H) projection): no copy needed. Contiguous inputs come as ONE row of N * H.
    row, cols, mask = _block(H, BLOCK_SIZE)
    g = _acc(tl.load(G_ptr + row * G_row_stride + cols, mask=mask, other=0.0), FP64)  # (BLOCK_SIZE,)
    u = _acc(tl.load(U_ptr + row * U_row_stride + cols, mask=mask, other=0.0), FP64)
    sig = 1.0 / (1.0 + tl.exp(-g))  # sigmoid(g); exp(-g) -> inf gives sig = 0, no NaN
    y = g * sig * u  # silu(g) * up: HBM sees gate and up read once, y written once
    tl.store(Y_ptr + row * H + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)  # y is contiguous (N, H)


# Backward (the notebook derives it):  y = s(g) * u  with  s(g) = g * sig(g)
#   dL/du = dy * g * sig(g)
#   dL/dg = dy * u * s'(g),   s'(g) = sig(g) + g * sig(g) * (1 - sig(g)) = sig(g) * (1 + g * (1 - sig(g)))
# sig(g) is recomputed from the saved gate instead of being stored by the forward: one (N, H) tensor less.
@triton.jit
def _swiglu_bwd_kernel(DY_ptr, DY_row_stride, G_ptr, G_row_stride, U_ptr, U_row_stride, DG_ptr, DU_ptr, H,
                       BLOCK_SIZE: tl.constexpr, FP64: tl.constexpr):
    row, cols, mask = _block(H, BLOCK_SIZE)
    dy = _acc(tl.load(DY_ptr + row * DY_row_stride + cols, mask=mask, other=0.0), FP64)
    g = _acc(tl.load(G_ptr + row * G_row_stride + cols, mask=mask, other=0.0), FP64)
    u = _acc(tl.load(U_ptr + row * U_row_stride + cols, mask=mask, other=0.0), FP64)
    sig = 1.0 / (1.0 + tl.exp(-g))  # recomputed: a few FLOPs instead of an (N, H) activation in memory
    silu = g * sig
    dsilu = sig * (1.0 + g * (1.0 - sig))  # d silu / d g
    # dgate and dup are contiguous (N, H)
    tl.store(DU_ptr + row * H + cols, (dy * silu).to(DU_ptr.dtype.element_ty), mask=mask)
    tl.store(DG_ptr + row * H + cols, (dy * u * dsilu).to(DG_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ 3. launchers
def _block_size(H: int) -> int:
    # GPU: 2048 columns per program, 16 per thread at 4 warps: two 16-byte loads per input in flight per thread.
    # CPU interpreter: every program costs ~0.5 ms of Python overhead, so fewer, larger programs.
    return row_launch(H, BLOCK_CPU if interpreting() else BLOCK_GPU)[0]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., H) -> (N, H) with unit column stride; a view (no copy) whenever the rows are evenly strided."""
    t2 = t.reshape(-1, t.shape[-1])  # (N, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(kernel, ts, outs, H: int) -> None:
    """Launch `kernel` on (N, H) inputs `ts` and contiguous outputs `outs`: when every input is contiguous too,
    as ONE row of N * H elements (no per-row tail block; int32 column offsets need N * H < 2**31)."""
    N = ts[0].shape[0]
    if N > 1 and all(t.stride(0) == H for t in ts) and N * H < 2**31:
        N, H = 1, N * H
    bs = _block_size(H)
    args = [a for t in ts for a in (t, t.stride(0))]
    launchable(kernel)[(N * triton.cdiv(H, bs),)](*args, *outs, H, BLOCK_SIZE=bs, FP64=ts[0].dtype == torch.float64)


@register_op("swiglu_fwd")  # torch.ops.minite.swiglu_fwd, for torch.compile (section 4)
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel. gate, up: (..., H) same shape/dtype -> y (..., H), contiguous."""
    g, u = _rows(gate), _rows(up)  # (N, H) each
    N, H = g.shape
    y = torch.empty((N, H), dtype=g.dtype, device=g.device)
    if y.numel():
        _launch(_swiglu_fwd_kernel, (g, u), (y,), H)
    return y.view(gate.shape)


@register_op("swiglu_bwd")
def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: (dy, gate, up) -> (dgate, dup), each shaped like gate (contiguous)."""
    d, g, u = _rows(dy), _rows(gate), _rows(up)  # (N, H) each
    N, H = g.shape
    dg = torch.empty((N, H), dtype=g.dtype, device=g.device)
    du = torch.empty((N, H), dtype=u.dtype, device=u.device)
    if dg.numel():
        _launch(_swiglu_bwd_kernel, (d, g, u), (dg, du), H)
    return dg.view(gate.shape), du.view(gate.shape)


# ------------------------------------------------------------------------------------ 4. autograd.Function
class SwiGLUFunction(torch.autograd.Function):
    """Its setup_ctx and backward are also the gradient of torch.ops.minite.swiglu_fwd: one formula."""

    @staticmethod
    def forward(ctx, gate, up):
        SwiGLUFunction.setup_ctx(ctx, (gate, up), None)
        return op("swiglu_fwd", swiglu_fwd)(gate, up)  # torch.ops.minite.swiglu_fwd under torch.compile

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        ctx.save_for_backward(*inputs)  # only the inputs: silu(gate) is recomputed in the backward

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return op("swiglu_bwd", swiglu_bwd)(dy, gate, up)


register_autograd("swiglu_fwd", SwiGLUFunction.backward, setup_context=SwiGLUFunction.setup_ctx)


# -------------------------------------------------------------------------------------------- 5. functional
def _check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"swiglu: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"swiglu: {name} has dtype {t.dtype}; expected one of fp16, bf16, fp32, fp64")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate dtype {gate.dtype} != up dtype {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"swiglu: gate is on {gate.device} but up is on {up.device}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up. gate, up: (..., H), same shape, dtype and device -> (..., H) in their dtype."""
    _check_inputs(gate, up)
    if gate.dim() == 0:  # a scalar: the kernels work on rows, so run it as one row of one element
        return swiglu(gate.reshape(1), up.reshape(1), backend=backend).reshape(())
    if gate.numel() and resolve_backend(gate, backend, op="swiglu") == "triton":
        return SwiGLUFunction.apply(gate, up)
    return swiglu_ref(gate, up)


# ----------------------------------------------------------------------------------------------- 6. Module
# The module that uses this op is the gated MLP, down(swiglu(gate(x), up(x))): it holds Linear layers, so it lives
# one floor up, in minite/layers/mlp.py (minite.nn.SwiGLU).
