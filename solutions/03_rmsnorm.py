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
# # 03 — LayerNorm: exercises
#
# The lesson (`notebooks/03_rmsnorm.ipynb`) built RMSNorm's forward and backward kernels. Here you build
# **LayerNorm's**, the norm of GPT-2 (Ba, Kiros & Hinton 2016, [arXiv:1607.06450](https://arxiv.org/abs/1607.06450)):
# for a row $x \in \mathbb{R}^C$,
#
# $$\mu = \tfrac1C\textstyle\sum_j x_j,\qquad r = \Big(\tfrac1C\textstyle\sum_j (x_j-\mu)^2+\epsilon\Big)^{-1/2},
# \qquad \hat x = (x-\mu)\,r,\qquad y = w\odot\hat x + b .$$
#
# Three graded tasks. Write your code between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the
# `raise NotImplementedError()` line), run the cell, then run the `# CHECK` cell after it (do not edit check cells).
# Tasks 1 and 3 are whole Triton kernels: only the signature and the spec are given.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %%
from minite.kernels.rmsnorm import layernorm_ref


def randn(*shape, seed, dtype=torch.float32, scale=1.0, shift=0.0):
    """Seeded CPU draw, then cast and move to DEVICE (the same numbers on every machine)."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + shift).to(dtype).to(DEVICE)


# %% [markdown]
# ## Task 1 — LayerNorm's forward kernel (whole kernel)
#
# Spec. One program per row of the contiguous-in-C (N, C) input (row `r` starts at `X_ptr + r * x_row_stride`;
# `Y_ptr` likewise with `y_row_stride`). `BLOCK_SIZE` is a power of two ≥ `N_COLS`. Compute in fp32 whatever the
# input dtype (fp32, fp16, bf16), with the **biased** variance (divide by C, as `nn.LayerNorm`). Store `y` in `Y`'s
# dtype, and the row's $\mu$ and $r$ (fp32) to `Mean_ptr[r]` and `Rstd_ptr[r]`. Watch the padding lanes.

# %% minite={"task": "layernorm_fwd_kernel"}
@triton.jit
def layernorm_fwd_kernel(X_ptr, W_ptr, B_ptr, Y_ptr, Mean_ptr, Rstd_ptr, x_row_stride, y_row_stride, N_COLS, eps,
                         BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_SIZE)
    inside = offs < N_COLS
    xs = tl.load(X_ptr + r * x_row_stride + offs, mask=inside, other=0.0).to(tl.float32)
    mu = tl.sum(xs, axis=0) / N_COLS
    centred = tl.where(inside, xs - mu, 0.0)  # padding lanes would add mu^2 each to the variance
    inv_std = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / N_COLS + eps)
    tl.store(Mean_ptr + r, mu)
    tl.store(Rstd_ptr + r, inv_std)
    scale = tl.load(W_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    shift = tl.load(B_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    out = centred * inv_std * scale + shift
    tl.store(Y_ptr + r * y_row_stride + offs, out.to(Y_ptr.dtype.element_ty), mask=inside)
    ### END SOLUTION


def my_layernorm_fwd(x, w, b, eps=1e-5):
    """Launcher (given): x (N, C) -> y (N, C) in x.dtype, mean (N,) fp32, rstd (N,) fp32."""
    x = x.contiguous()
    N, C = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(N, dtype=torch.float32, device=x.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    layernorm_fwd_kernel[(N,)](x, w, b, y, mean, rstd, x.stride(0), y.stride(0), C, eps,
                               BLOCK_SIZE=triton.next_power_of_2(C))
    return y, mean, rstd


# %% minite={"check": "layernorm_fwd_kernel"} tags=["nbval-check-output"]
# CHECK: layernorm_fwd_kernel
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for k, (N, C) in enumerate(((5, 37), (3, 64), (2, 100))):
        x = randn(N, C, seed=10 + k, dtype=dtype, scale=2.0, shift=3.0)  # a large mean: centring matters
        w = randn(C, seed=20 + k, dtype=dtype, shift=1.0)
        b = randn(C, seed=30 + k, dtype=dtype)
        ok &= check_op("layernorm fwd kernel", lambda x, w, b: my_layernorm_fwd(x, w, b)[0], layernorm_ref,
                       x, w, b, grad=False)
        _, mean, rstd = my_layernorm_fwd(x, w, b)
        xf = x.float()
        assert_close(mean, xf.mean(-1), name="mean")
        assert_close(rstd, torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5), name="rstd")
assert ok
print("PASS: layernorm_fwd_kernel")


# %% [markdown]
# ## Task 2 — LayerNorm's backward, derived
#
# The lesson derived RMSNorm's backward. Derive LayerNorm's on paper (remember that $\mu$, and so $r$, depend on
# every $x_j$), then implement it in plain PyTorch for all rows at once, **without autograd**: given the upstream
# gradient `dy` of $y$, return $\partial L/\partial x$, $\partial L/\partial w$ and $\partial L/\partial b$.

# %% minite={"task": "layernorm_backward"}
def layernorm_backward(dy, x, w, mean, rstd):
    """dy, x: (N, C); w: (C,); mean, rstd: (N,). Return dx (N, C), dw (C,), db (C,), in dy's dtype (no autograd)."""
    ### BEGIN SOLUTION
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dy * w
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)
    ### END SOLUTION


# %% minite={"check": "layernorm_backward"} tags=["nbval-check-output"]
# CHECK: layernorm_backward
for k, (N, C) in enumerate(((7, 33), (4, 8))):
    x = randn(N, C, seed=40 + k, dtype=torch.float64, scale=2.0, shift=1.0)
    w = randn(C, seed=50 + k, dtype=torch.float64)
    b = randn(C, seed=60 + k, dtype=torch.float64)
    dy = randn(N, C, seed=70 + k, dtype=torch.float64)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    layernorm_ref(xr, wr, br, 1e-5).backward(dy)
    mean, rstd = x.mean(-1), torch.rsqrt(x.var(-1, unbiased=False) + 1e-5)
    dx, dw, db = layernorm_backward(dy, x, w, mean, rstd)
    assert_close(dx, xr.grad, name="dx")
    assert_close(dw, wr.grad, name="dw")
    assert_close(db, br.grad, name="db")
print("PASS: layernorm_backward")


# %% [markdown]
# ## Task 3 — LayerNorm's backward kernel, with a deterministic two-stage reduction (whole kernel)
#
# Spec. `P` programs (the grid is `(P,)`). Program `p` owns the contiguous rows
# `[p * ROWS_PER_PROGRAM, min((p + 1) * ROWS_PER_PROGRAM, N_ROWS))` (the last chunks may be short or empty). For each
# of its rows it writes `dx` (in `DX`'s dtype) from `dy`, `x`, `w` and the saved `mean`, `rstd` (fp32, one per row).
# It also writes **one** fp32 partial sum of `dw` and one of `db` over its rows to row `p` of the contiguous
# (P, N_COLS) buffers `DW_partial` and `DB_partial`, and must write them even when its chunk is empty: the launcher
# allocates them with `torch.empty` and sums them over `p` (stage 2). No atomics, no lock. `DY`, `X` and `DX` share
# `row_stride`; columns are contiguous; compute in fp32.

# %% minite={"task": "layernorm_bwd_kernel"}
@triton.jit
def layernorm_bwd_kernel(DY_ptr, X_ptr, W_ptr, Mean_ptr, Rstd_ptr, DX_ptr, DW_partial_ptr, DB_partial_ptr,
                         row_stride, N_ROWS, N_COLS, ROWS_PER_PROGRAM, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    p = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_SIZE)
    inside = offs < N_COLS
    scale = tl.load(W_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    sum_dw = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    sum_db = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    lo = p * ROWS_PER_PROGRAM
    hi = tl.minimum(lo + ROWS_PER_PROGRAM, N_ROWS)
    for r in range(lo, hi):
        xs = tl.load(X_ptr + r * row_stride + offs, mask=inside, other=0.0).to(tl.float32)
        grad_y = tl.load(DY_ptr + r * row_stride + offs, mask=inside, other=0.0).to(tl.float32)
        inv_std = tl.load(Rstd_ptr + r)
        xhat = tl.where(inside, (xs - tl.load(Mean_ptr + r)) * inv_std, 0.0)
        gh = grad_y * scale
        c1 = tl.sum(gh, axis=0) / N_COLS
        c2 = tl.sum(gh * xhat, axis=0) / N_COLS
        grad_x = inv_std * (gh - c1 - xhat * c2)
        tl.store(DX_ptr + r * row_stride + offs, grad_x.to(DX_ptr.dtype.element_ty), mask=inside)
        sum_dw += grad_y * xhat
        sum_db += grad_y
    tl.store(DW_partial_ptr + p * N_COLS + offs, sum_dw, mask=inside)
    tl.store(DB_partial_ptr + p * N_COLS + offs, sum_db, mask=inside)
    ### END SOLUTION


class MyLayerNorm(torch.autograd.Function):
    """Given: the forward is minite's kernel; the backward is your kernel (stage 1) and a sum over p (stage 2)."""
    n_programs = 4

    @staticmethod
    def forward(ctx, x, w, b):
        from minite.kernels.rmsnorm import layernorm_fwd
        y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
        ctx.save_for_backward(x, w, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        x, dy = x.contiguous(), dy.contiguous()
        N, C = x.shape
        P = MyLayerNorm.n_programs
        dx = torch.empty_like(x)
        dw_partial = torch.empty(P, C, dtype=torch.float32, device=x.device)
        db_partial = torch.empty(P, C, dtype=torch.float32, device=x.device)
        layernorm_bwd_kernel[(P,)](dy, x, w, mean, rstd, dx, dw_partial, db_partial, x.stride(0), N, C,
                                   triton.cdiv(N, P), BLOCK_SIZE=triton.next_power_of_2(C))
        return dx, dw_partial.sum(0).to(w.dtype), db_partial.sum(0).to(w.dtype)


# %% minite={"check": "layernorm_bwd_kernel"} tags=["nbval-check-output"]
# CHECK: layernorm_bwd_kernel
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for k, ((N, C), P) in enumerate((((11, 37), 4), ((4, 32), 3), ((3, 20), 8))):  # P=3, N=4: an empty chunk
        MyLayerNorm.n_programs = P
        x = randn(N, C, seed=80 + k, dtype=dtype, scale=2.0, shift=1.0)
        w = randn(C, seed=90 + k, dtype=dtype, shift=1.0)
        b = randn(C, seed=100 + k, dtype=dtype)
        ok &= check_op(f"layernorm two-stage bwd, P={P}", MyLayerNorm.apply, layernorm_ref, x, w, b)
MyLayerNorm.n_programs = 4
x, w, b = randn(9, 24, seed=7), randn(24, seed=8), randn(24, seed=9)
grads = []
for _ in range(2):
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    MyLayerNorm.apply(xr, wr, br).backward(randn(9, 24, seed=6))
    grads.append((wr.grad, br.grad))
assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1]), "dw/db not deterministic"
assert ok
print("PASS: layernorm_bwd_kernel")
