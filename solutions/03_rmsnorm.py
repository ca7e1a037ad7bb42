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
# # 03 — RMSNorm: exercises
#
# Read `notebooks/03_rmsnorm.ipynb` first. Three graded tasks; each is followed by a check cell (do not edit it).
#
# Notation: x is (N, C), one row per token; $r = (\frac1C\sum_j x_j^2+\epsilon)^{-1/2}$ (rstd),
# $\hat x = x\,r$, $y = w \odot \hat x$.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect
import matplotlib.pyplot as plt
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %%
from minite.kernels import rmsnorm as K
from minite.kernels.rmsnorm import rmsnorm_ref


# %% [markdown]
# ## Task 1 — the forward kernel
#
# Write the body of `rmsnorm_fwd_kernel`: one program per row. Load the row (masked, `other=0.0`) and convert it to
# fp32 at once, compute the mean of squares, `rstd`, store `rstd` for the row and `y = x * rstd * w` in `Y`'s dtype.

# %% minite={"task": "rmsnorm_fwd_kernel"}
@triton.jit
def rmsnorm_fwd_kernel(X_ptr, W_ptr, Y_ptr, Rstd_ptr, X_row_stride, Y_row_stride, N_COLS, eps,
                       BLOCK_SIZE: tl.constexpr):
    """One program per row: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps); store rstd[row] too."""
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < N_COLS
    x = tl.load(X_ptr + row * X_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N_COLS + eps)
    tl.store(Rstd_ptr + row, rstd)
    tl.store(Y_ptr + row * Y_row_stride + cols, (x * rstd * w).to(Y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


def my_rmsnorm_fwd(x, w, eps=1e-6):
    """Launcher (given): x (N, C) -> y (N, C), rstd (N,) fp32."""
    x = x.contiguous()
    N, C = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    rmsnorm_fwd_kernel[(N,)](x, w, y, rstd, x.stride(0), y.stride(0), C, eps,
                             BLOCK_SIZE=triton.next_power_of_2(C))
    return y, rstd


# %% minite={"check": "rmsnorm_fwd_kernel"} tags=["nbval-check-output"]
# CHECK: rmsnorm_fwd_kernel
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for shape in ((5, 37), (3, 64)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        w = (1 + torch.randn(shape[-1], generator=torch.Generator().manual_seed(2))).to(dtype)
        ok &= check_op("rmsnorm fwd kernel", lambda x, w: my_rmsnorm_fwd(x, w)[0], rmsnorm_ref, x, w, grad=False)
        _, rstd = my_rmsnorm_fwd(x, w)
        assert_close(rstd, torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6), name="rstd")
assert ok
print("PASS: rmsnorm_fwd_kernel")


# %% [markdown]
# ## Task 2 — the backward formula
#
# Implement the backward derived in the lesson, in plain PyTorch, for all rows at once:
# $\mathrm{d}x = r\,(g - \hat x \cdot \mathrm{mean}(g \odot \hat x))$ with $g = \mathrm{d}y \odot w$, and
# $\mathrm{d}w = \sum_{\text{rows}} \mathrm{d}y \odot \hat x$.

# %% minite={"task": "rmsnorm_backward"}
def rmsnorm_backward(dy, x, w, rstd):
    """The backward of y = x * rstd * w in plain PyTorch, from the derivation (no autograd).
    dy, x: (N, C); w: (C,); rstd: (N,) fp32. Return dx (N, C) and dw (C,), both fp32."""
    dy, x, w = dy.float(), x.float(), w.float()
    ### BEGIN SOLUTION
    xhat = x * rstd[:, None]                                   # (N, C)
    g = dy * w                                                 # (N, C) gradient w.r.t. xhat
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy * xhat).sum(0)                                    # (C,) sum over rows
    return dx, dw
    ### END SOLUTION


# %% minite={"check": "rmsnorm_backward"} tags=["nbval-check-output"]
# CHECK: rmsnorm_backward
g = torch.Generator().manual_seed(3)
x = torch.randn(7, 33, generator=g, dtype=torch.float64)
w = torch.randn(33, generator=g, dtype=torch.float64)
dy = torch.randn(7, 33, generator=g, dtype=torch.float64)
xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
rmsnorm_ref(xr, wr, 1e-6).backward(dy)
rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6).float()
dx, dw = rmsnorm_backward(dy, x, w, rstd)
assert_close(dx, xr.grad.float(), name="dx")
assert_close(dw, wr.grad.float(), name="dw")
print("PASS: rmsnorm_backward")


# %% [markdown]
# ## Task 3 — the backward kernel with a two-stage dw reduction
#
# Write the body of `rmsnorm_bwd_kernel`. P programs each take a contiguous chunk of `ROWS_PER_PROGRAM` rows
# (the last chunk may be shorter, or empty). For every row, write `dx`; accumulate `dy * xhat` into a register
# partial sum, and store it once, at the end, to row `pid` of the (P, C) fp32 `DW_partial`. The launcher then sums
# the partials (stage 2). No atomics.

# %% minite={"task": "rmsnorm_bwd_kernel"}
@triton.jit
def rmsnorm_bwd_kernel(DY_ptr, X_ptr, W_ptr, Rstd_ptr, DX_ptr, DW_partial_ptr, row_stride, N_ROWS, N_COLS,
                       ROWS_PER_PROGRAM, BLOCK_SIZE: tl.constexpr):
    """Program p handles rows [p * ROWS_PER_PROGRAM, min((p + 1) * ROWS_PER_PROGRAM, N_ROWS)):
    writes dx for each of its rows and ONE partial sum of dw to DW_partial[p, :] (fp32, shape (P, N_COLS)).
    All (N, C) tensors share row_stride."""
    ### BEGIN SOLUTION
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < N_COLS
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    row_start = pid * ROWS_PER_PROGRAM
    row_end = tl.minimum(row_start + ROWS_PER_PROGRAM, N_ROWS)
    for row in range(row_start, row_end):
        x = tl.load(X_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / N_COLS))
        tl.store(DX_ptr + row * row_stride + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
    tl.store(DW_partial_ptr + pid * N_COLS + cols, dw_acc, mask=mask)
    ### END SOLUTION


class MyRMSNorm(torch.autograd.Function):
    """Given: minite's forward launcher + your backward kernel and the stage-2 reduction."""
    @staticmethod
    def forward(ctx, x, w):
        y, rstd = K.rmsnorm_fwd(x, w, 1e-6)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        N, C = x.shape
        P = min(N, 4)  # 4 programs: several rows each
        dx = torch.empty_like(x)
        dw_partial = torch.zeros(P, C, dtype=torch.float32, device=x.device)
        rmsnorm_bwd_kernel[(P,)](dy, x, w, rstd, dx, dw_partial, x.stride(0), N, C, triton.cdiv(N, P),
                                 BLOCK_SIZE=triton.next_power_of_2(C))
        return dx, dw_partial.sum(0).to(w.dtype)  # stage 2


# %% minite={"check": "rmsnorm_bwd_kernel"} tags=["nbval-check-output"]
# CHECK: rmsnorm_bwd_kernel
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for shape in ((11, 37), (4, 32)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        w = (1 + torch.randn(shape[-1], generator=torch.Generator().manual_seed(5))).to(dtype)
        ok &= check_op("rmsnorm two-stage bwd", MyRMSNorm.apply, rmsnorm_ref, x, w)
assert ok
print("PASS: rmsnorm_bwd_kernel")
