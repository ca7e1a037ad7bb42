"""Rotary position embeddings, RoPE (Su et al. 2021, RoFormer), as one fused kernel (chapter 04).

Pair i of a head vector, (x[i], x[i + D/2]), is the complex number z_i = x[i] + j x[i + D/2]; RoPE multiplies it by
e^{j t theta_i} with theta_i = base^(-2i/D) at position t:

    y[i]       = x[i] cos(t theta_i) - x[i + D/2] sin(t theta_i)
    y[i + D/2] = x[i] sin(t theta_i) + x[i + D/2] cos(t theta_i)

The rotation is orthogonal, so the backward is the rotation by -t theta_i: the same kernel with sin negated.
Layouts: (B, H, T, D) ("bhtd", default, like SDPA) or (B, T, H, D) ("bthd", straight out of a qkv projection).
Positions are those of the cos/sin rows passed in: slice the cache at an offset for a KV-cache decode step.
"""
from __future__ import annotations

import torch
from torch import nn

from minite import _validate as _v
from minite._triton import tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import compute_dtype, launchable, op, register_autograd, register_op, tl_compute_dtype

__all__ = ["rope_cos_sin", "rope_ref", "rope_fwd", "rope_bwd", "RoPEFunction", "rope", "RotaryEmbedding"]

LAYOUTS = ("bhtd", "bthd")


def rope_cos_sin(T: int, D: int, *, base: float = 10000.0, offset: int = 0,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache: cos, sin of shape (T, D/2), fp32, for positions offset .. offset + T - 1."""
    if D <= 0 or D % 2:
        raise ValueError(f"rope_cos_sin: head dim D must be even and > 0 (pairs are rotated), got D={D}")
    if T < 0 or offset < 0:
        raise ValueError(f"rope_cos_sin: T and offset must be >= 0, got T={T}, offset={offset}")
    # Frequencies in fp64 then rounded once: t * theta_i reaches ~1e5 radians, where fp32 angles lose digits.
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))  # (D/2,)
    t = torch.arange(offset, offset + T, dtype=torch.float64)  # (T,)
    freqs = torch.outer(t, inv_freq)  # (T, D/2) angles t * theta_i
    return freqs.cos().float().to(device), freqs.sin().float().to(device)


# ------------------------------------------------------------------------------------------ 1. reference
def _rotate(x, cos, sin, layout: str):
    xf = x.to(compute_dtype(x.dtype))  # fp32 math, fp64 for gradcheck
    if layout == "bthd":
        cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2) broadcasts over H in (B, T, H, D/2)
    x1, x2 = xf.chunk(2, dim=-1)  # halves (..., D/2)
    y = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return y.to(x.dtype)


def rope_ref(x, cos, sin, *, layout: str = "bhtd"):
    """The spec: x (B, H, T, D) (or (B, T, H, D) with layout="bthd"), cos/sin (T, D/2) -> x's shape and dtype."""
    return _rotate(x, cos, sin, layout)


# ------------------------------------------------------------------------------------------ 2. kernel
# Forward rotates by +angle; backward (SIGN = -1) by -angle: R(a)^T = R(-a), since R is orthogonal.
# The grid is one program per (b, t): cos/sin of position t are loaded ONCE and reused for all H heads.
@triton.jit
def _rope_kernel(X_ptr, Y_ptr, Cos_ptr, Sin_ptr, T, H,
                 X_stride_b, X_stride_h, X_stride_t, Y_stride_b, Y_stride_h, Y_stride_t, CS_stride_t,
                 HALF: tl.constexpr, SIGN: tl.constexpr, ACC: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 before any pointer arithmetic
    b = pid // T
    t = pid % T
    heads = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF): pair index i
    mask = (heads < H) & (cols < HALF)  # (BLOCK_H, BLOCK_HALF)
    # cos/sin row t: (1, BLOCK_HALF), broadcast over the heads.
    cos = tl.load(Cos_ptr + t * CS_stride_t + cols, mask=cols < HALF, other=0.0).to(ACC)
    sin = tl.load(Sin_ptr + t * CS_stride_t + cols, mask=cols < HALF, other=0.0).to(ACC) * SIGN
    # The strides make both layouts one code path: only the (b, h, t) strides differ; D has unit stride.
    x_row = X_ptr + b * X_stride_b + t * X_stride_t + heads * X_stride_h  # (BLOCK_H, 1) pointers
    x1 = tl.load(x_row + cols, mask=mask, other=0.0).to(ACC)  # first half  x[..., :D/2]
    x2 = tl.load(x_row + HALF + cols, mask=mask, other=0.0).to(ACC)  # second half x[..., D/2:]
    # Complex multiply (x1 + j x2) * (cos + j sin), written out.
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    y_row = Y_ptr + b * Y_stride_b + t * Y_stride_t + heads * Y_stride_h
    tl.store(y_row + cols, y1.to(Y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + HALF + cols, y2.to(Y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ 3. launchers
@register_op("rope")  # torch.ops.minite.rope, for torch.compile (section 4): the forward (sign 1) and backward (-1)
def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, sign: int) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()  # D must have unit stride; any (b, h, t) strides are fine (e.g. a qkv split)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()  # one row stride is passed for both
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, same layout as x
    if layout == "bhtd":
        B, H, T, D = x.shape  # (B, H, T, D)
        xs, ys = (x.stride(0), x.stride(1), x.stride(2)), (y.stride(0), y.stride(1), y.stride(2))
    else:
        B, T, H, D = x.shape  # (B, T, H, D)
        xs, ys = (x.stride(0), x.stride(2), x.stride(1)), (y.stride(0), y.stride(2), y.stride(1))
    if B * T * H == 0:
        return y
    launchable(_rope_kernel)[(B * T,)](x, y, cos, sin, T, H, *xs, *ys, cos.stride(0), HALF=D // 2, SIGN=sign,
                                       ACC=tl_compute_dtype(x.dtype), BLOCK_H=triton.next_power_of_2(H),
                                       BLOCK_HALF=triton.next_power_of_2(D // 2), num_warps=4 if H * D <= 4096 else 8)
    return y


def rope_fwd(x, cos, sin, *, layout: str = "bhtd"):
    """y = rotate(x, +t theta). Under torch.compile: torch.ops.minite.rope."""
    return op("rope", _launch)(x, cos, sin, layout, 1)


def rope_bwd(dy, cos, sin, *, layout: str = "bhtd", sign: int = 1):
    """dx = rotate(dy, -sign t theta): the transpose of a rotation is its inverse (sign: the forward's)."""
    return op("rope", _launch)(dy, cos, sin, layout, -sign)


# ------------------------------------------------------------------------------------------ 4. autograd
class RoPEFunction(torch.autograd.Function):
    """Differentiable in x only: cos/sin are a fixed cache (buffers), they get no gradient. Its setup_ctx and
    backward are also the gradient of torch.ops.minite.rope(x, cos, sin, layout, sign): one formula."""

    @staticmethod
    def forward(ctx, x, cos, sin, layout):
        RoPEFunction.setup_ctx(ctx, (x, cos, sin, layout, 1), None)  # the forward rotates by +t theta
        return rope_fwd(x, cos, sin, layout=layout)

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        _, cos, sin, layout, sign = inputs
        ctx.save_for_backward(cos, sin)
        ctx.layout = layout
        ctx.sign = sign

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        # Five gradients, one per input of the op; the Function has four (autograd drops a trailing None).
        return rope_bwd(dy, cos, sin, layout=ctx.layout, sign=ctx.sign), None, None, None, None


register_autograd("rope", RoPEFunction.backward, setup_context=RoPEFunction.setup_ctx)


# ------------------------------------------------------------------------------------------ 5. functional
def _check_inputs(x, cos, sin, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"rope: layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"rope: x must be 4-D ({'B, H, T, D' if layout == 'bhtd' else 'B, T, H, D'}), got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if not x.is_floating_point():
        raise ValueError(f"rope: x must be floating point, got dtype {x.dtype}")
    D = x.shape[-1]
    T = x.shape[2] if layout == "bhtd" else x.shape[1]
    if D % 2:
        raise ValueError(f"rope: head dim D must be even (pairs are rotated), got D={D} in x shape {tuple(x.shape)}")
    for name, c in (("cos", cos), ("sin", sin)):
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != (T, D // 2):
            raise ValueError(f"rope: {name} must have shape (T, D/2) = ({T}, {D // 2}) for x of shape "
                             f"{tuple(x.shape)} (layout {layout!r}), got {tuple(getattr(c, 'shape', ()))}")
        if not c.is_floating_point():
            raise ValueError(f"rope: {name} must be floating point, got dtype {c.dtype}")
        if c.device != x.device:
            raise ValueError(f"rope: {name} is on {c.device} but x is on {x.device}")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str = "bhtd",
         backend: str | None = None) -> torch.Tensor:
    """Rotate x (B, H, T, D) (or (B, T, H, D) with layout="bthd") by the angles in cos/sin (T, D/2)."""
    _check_inputs(x, cos, sin, layout)
    if x.numel() and resolve_backend(x, backend, op="rope") == "triton":  # empty (D = 0, T = 0, ...): the ref
        return RoPEFunction.apply(x, cos, sin, layout)
    return rope_ref(x, cos, sin, layout=layout)


# ------------------------------------------------------------------------------------------ 6. module
class RotaryEmbedding(nn.Module):
    """Holds the cos/sin cache (T_max, D/2) as non-persistent buffers: state_dict stays empty, the cache is
    rebuilt from (head_dim, max_seq_len, base). forward(x, offset) rotates positions offset .. offset + T - 1."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0, backend: str | None = None,
                 *, layout: str = "bhtd", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"RotaryEmbedding: layout must be one of {LAYOUTS}, got {layout!r}")
        cos, sin = rope_cos_sin(max_seq_len, head_dim, base=base)  # (T_max, D/2) each, fp32 (from fp64 angles)
        cos, sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)  # as .to() would
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, base
        self.backend, self.layout = backend, layout

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        _v.integer("RotaryEmbedding", "offset", offset)
        T = x.shape[2 if self.layout == "bhtd" else 1] if x.dim() == 4 else 0  # rope() validates x's shape
        if offset < 0 or offset + T > self.max_seq_len:
            raise ValueError(f"RotaryEmbedding: positions {offset}..{offset + T - 1} are outside the cache "
                             f"[0, {self.max_seq_len}); raise max_seq_len")
        cos, sin = self.cos[offset:offset + T], self.sin[offset:offset + T]  # (T, D/2) views, no copy
        return rope(x, cos, sin, layout=self.layout, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, base={self.base}, "
                f"layout={self.layout!r}, backend={self.backend}")
