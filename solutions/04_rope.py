# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: minite,tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (minite)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 — RoPE: exercises
#
# Read `notebooks/04_rope.ipynb` first. Two graded tasks, each followed by a check cell (do not edit it).
# Halves pairing: pair $i$ is $(x_i, x_{i+D/2})$, rotated by the angle $t\,\theta_i$, $\theta_i = \text{base}^{-2i/D}$.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect, math
import matplotlib.pyplot as plt
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
from minite.kernels.rope import rope_cos_sin, rope_ref
_ = torch.manual_seed(0)


# %%
def complex_rope(x, positions, base=10000.0):
    """Independent formula with complex numbers: pair i is z_i = x[i] + j x[i + D/2] (halves layout);
    multiply by exp(j * t * theta_i), theta_i = base^(-2i/D). x (..., T, D) -> (..., T, D), fp64."""
    D = x.shape[-1]
    z = torch.view_as_complex(torch.stack(x.double().chunk(2, dim=-1), dim=-1).contiguous())  # (..., T, D/2)
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angle = positions.double()[:, None] * theta[None, :]  # (T, D/2)
    y = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle))  # (..., T, D/2, 2)
    return torch.cat([y[..., 0], y[..., 1]], dim=-1)


# %% [markdown]
# ## Task 1 — the cos/sin cache
#
# Return `cos`, `sin` of shape (T, D/2) in float32 for positions `offset .. offset + T - 1`. The check compares the
# rotation they produce against the complex-number formula $z_i e^{\mathrm{j} t\theta_i}$, including a position of
# 100,000 (where angles computed in float32 would be visibly wrong).

# %% minite={"task": "rope_cache"}
def rope_cache(T, D, base=10000.0, offset=0):
    """cos, sin of shape (T, D/2), float32: angle[t, i] = (offset + t) * base ** (-2i / D).
    Compute the angles in float64 and round cos/sin once to float32."""
    ### BEGIN SOLUTION
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)       # (D/2,)
    t = torch.arange(offset, offset + T, dtype=torch.float64)                  # (T,)
    angle = torch.outer(t, inv_freq)                                           # (T, D/2)
    return angle.cos().float(), angle.sin().float()
    ### END SOLUTION


# %% minite={"check": "rope_cache"} tags=["nbval-check-output"]
# CHECK: rope_cache
for (T, D, base, offset) in ((5, 8, 10000.0, 0), (7, 12, 500.0, 30), (3, 64, 10000.0, 100000)):
    cos, sin = rope_cache(T, D, base=base, offset=offset)
    assert cos.shape == sin.shape == (T, D // 2) and cos.dtype == sin.dtype == torch.float32, (cos.shape, cos.dtype)
    x = torch.randn(1, 2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    expected = complex_rope(x, torch.arange(offset, offset + T), base=base)
    assert_close(rope_ref(x, cos.double(), sin.double()), expected, atol=1e-6, rtol=1e-6, name="rotation")
print("PASS: rope_cache")


# %% [markdown]
# ## Task 2 — the rotation kernel (forward, and backward as the inverse rotation)
#
# Write the body of `rope_kernel`: one program per (b, t) loads cos/sin row t once and rotates the H heads as a
# (BLOCK_H, BLOCK_HALF) tile. Convert loads to fp32 at once and round once on store. `SIGN` negates sin: the given
# autograd Function uses `SIGN = -1` for the backward, since $R_t^\top = R_{-t}$.

# %% minite={"task": "rope_kernel"}
@triton.jit
def rope_kernel(X_ptr, Y_ptr, Cos_ptr, Sin_ptr, T, H, stride_b, stride_h, stride_t,
                HALF: tl.constexpr, SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One program per (b, t) (pid = b * T + t). x and y share strides; the last dim has stride 1.
    Rotate all H heads at position t: y1 = x1 cos - x2 (SIGN sin), y2 = x1 (SIGN sin) + x2 cos,
    with x1 = x[..., :HALF], x2 = x[..., HALF:]; cos/sin are contiguous (T, HALF) fp32."""
    ### BEGIN SOLUTION
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    cos = tl.load(Cos_ptr + t * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(Sin_ptr + t * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32) * SIGN
    off = b * stride_b + t * stride_t + heads * stride_h
    x1 = tl.load(X_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X_ptr + off + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_ptr + off + cols, (x1 * cos - x2 * sin).to(Y_ptr.dtype.element_ty), mask=mask)
    tl.store(Y_ptr + off + HALF + cols, (x1 * sin + x2 * cos).to(Y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


def _launch(x, cos, sin, sign):
    x = x.contiguous()                                     # (B, H, T, D)
    B, H, T, D = x.shape
    y = torch.empty_like(x)
    rope_kernel[(B * T,)](x, y, cos.contiguous(), sin.contiguous(), T, H, x.stride(0), x.stride(1), x.stride(2),
                          HALF=D // 2, SIGN=sign, BLOCK_H=triton.next_power_of_2(H),
                          BLOCK_HALF=triton.next_power_of_2(D // 2))
    return y


class MyRoPE(torch.autograd.Function):
    """Given: forward = your kernel with SIGN=+1, backward = the same kernel with SIGN=-1."""
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, -1), None, None


# %% minite={"check": "rope_kernel"} tags=["nbval-check-output"]
# CHECK: rope_kernel
ok = True
for dtype in (torch.float32, torch.float16):
    for (B, H, T, D) in ((1, 3, 5, 6), (2, 2, 4, 16)):
        cos, sin = rope_cos_sin(T, D, offset=3)
        x = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(D)).to(dtype)
        ok &= check_op("rope kernel fwd+bwd", lambda x: MyRoPE.apply(x, cos, sin), lambda x: rope_ref(x, cos, sin), x)
assert ok
print("PASS: rope_kernel")
