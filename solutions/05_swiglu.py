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
# # 05 — SwiGLU: exercises
#
# Three graded tasks. Fill in the code between the markers, run the cell and the `# CHECK` cell after it.
# Reference: Shazeer, *GLU Variants Improve Transformer* (2020), [arXiv:2002.05202](https://arxiv.org/abs/2002.05202),
# and the lesson `notebooks/05_swiglu.ipynb`.
#
# $h = \mathrm{silu}(g)\,u$, $\mathrm{silu}(g) = g\,\sigma(g)$.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect
import matplotlib.pyplot as plt
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %%
from minite.kernels.swiglu import swiglu_ref, swiglu_fwd, swiglu_bwd, _rows, _block_size


# %% [markdown]
# ## Task 1 — the derivative of SiLU
#
# Write `silu_grad(g)` returning $\frac{d}{dg}\,\mathrm{silu}(g)$ elementwise, using `torch.sigmoid` only (no
# autograd). Derive it first: $\sigma' = \sigma(1-\sigma)$, then the product rule.

# %% minite={"task": "silu_grad"}
def silu_grad(g: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))
    ### END SOLUTION


# %% minite={"check": "silu_grad"} tags=["nbval-check-output"]
# CHECK: silu_grad
g = torch.linspace(-10, 10, 401, dtype=torch.float64, requires_grad=True)
(expected,) = torch.autograd.grad(F.silu(g).sum(), g)
got = silu_grad(g.detach())
assert_close(got, expected, name="silu_grad")
assert got.shape == g.shape and got.dtype == torch.float64
print("PASS: silu_grad")


# %% [markdown]
# ## Task 2 — the forward kernel body
#
# Program `(row, j)` handles columns `j * BLOCK_SIZE ... + BLOCK_SIZE - 1` of one row. Rows of `gate` and `up` can
# be strided (`G_row_stride`, `U_row_stride`); `Y` is contiguous `(N, H)`. Load with a mask and `other=0.0`,
# upcast to `tl.float32` at once, compute $\mathrm{silu}(g)\,u$, store cast to `Y_ptr.dtype.element_ty`.

# %% minite={"task": "swiglu forward kernel"}
@triton.jit
def my_swiglu_fwd_kernel(G_ptr, G_row_stride, U_ptr, U_row_stride, Y_ptr, H, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < H
    g = tl.load(G_ptr + row * G_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + row * U_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y_ptr + row * H + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


def my_swiglu_fwd(gate, up):
    g, u = _rows(gate), _rows(up)  # (N, H), strided rows allowed
    N, H = g.shape
    y = torch.empty((N, H), dtype=g.dtype, device=g.device)
    bs = _block_size(H)
    my_swiglu_fwd_kernel[(N, triton.cdiv(H, bs))](g, g.stride(0), u, u.stride(0), y, H, BLOCK_SIZE=bs)
    return y.view(gate.shape)


# %% minite={"check": "swiglu forward kernel"} tags=["nbval-check-output"]
# CHECK: swiglu forward kernel
gen = torch.Generator().manual_seed(0)
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    gu = (2 * torch.randn(6, 2 * 37, generator=gen)).to(dtype).to(DEVICE)
    gate, up = gu.chunk(2, dim=-1)  # strided halves, as in the GPT
    ok &= check_op("my_swiglu_fwd", my_swiglu_fwd, swiglu_ref, gate, up, grad=False)
assert ok
print("PASS: swiglu forward kernel")


# %% [markdown]
# ## Task 3 — the backward kernel body (recompute, don't store)
#
# Given `dy`, `gate`, `up` (all contiguous `(N, H)` here), write $\bar u = \bar h\,\mathrm{silu}(g)$ and
# $\bar g = \bar h\,u\,\mathrm{silu}'(g)$ into `DU_ptr` and `DG_ptr`. Recompute $\sigma(g)$ from `gate`.

# %% minite={"task": "swiglu backward kernel"}
@triton.jit
def my_swiglu_bwd_kernel(DY_ptr, G_ptr, U_ptr, DG_ptr, DU_ptr, H, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < H
    offs = row * H + cols
    dy = tl.load(DY_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(DU_ptr + offs, (dy * g * sig).to(DU_ptr.dtype.element_ty), mask=mask)
    tl.store(DG_ptr + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


class MySwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)  # the inputs only
        return swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = (t.contiguous() for t in ctx.saved_tensors)
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        H = gate.shape[-1]
        bs = _block_size(H)
        my_swiglu_bwd_kernel[(gate.numel() // H, triton.cdiv(H, bs))](dy, gate, up, dg, du, H, BLOCK_SIZE=bs)
        return dg, du


# %% minite={"check": "swiglu backward kernel"} tags=["nbval-check-output"]
# CHECK: swiglu backward kernel
gen = torch.Generator().manual_seed(1)
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for shape in ((5, 37), (2, 3, 64)):
        gate = (3 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
        up = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        ok &= check_op("MySwiGLU fwd+bwd", MySwiGLU.apply, swiglu_ref, gate, up)
assert ok
print("PASS: swiglu backward kernel")
