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
# # 00 — Triton from zero: exercises
#
# Four graded tasks. Replace each `raise NotImplementedError()` with your code, run the cell and the check cell
# right after it. The check cells are graded: `python -m minite.grading grade exercises/00_triton_from_zero.ipynb`
# (it reruns the notebook with pristine check cells and prints `score: k/4`). Read
# `notebooks/00_triton_from_zero.ipynb` first. Without a GPU, kernels run on the Triton interpreter.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # run kernels on the CPU interpreter; read when kernels are decorated
import inspect, math
import matplotlib.pyplot as plt
from minite._triton import triton, tl, interpreting
from minite.testing import check_op
import minite.kernels.softmax as S
from minite.kernels.softmax import softmax, softmax_ref
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %% [markdown]
# ## Task 1: masked vector add
#
# Write the body of `add_kernel`: program `pid` handles elements `pid * BLOCK_SIZE ... pid * BLOCK_SIZE +
# BLOCK_SIZE - 1`; mask off the ones `>= n_elements`; load `x` and `y`, store `x + y`.
# Hints: `tl.program_id(0)`, `tl.arange(0, BLOCK_SIZE)`, `tl.load(ptr + offs, mask=mask, other=0.0)`,
# `tl.store(ptr + offs, value, mask=mask)`.

# %% minite={"task": "vector_add"}
@triton.jit
def add_kernel(X_ptr, Y_ptr, Z_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,)
    mask = offs < n_elements
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    y = tl.load(Y_ptr + offs, mask=mask, other=0.0)
    tl.store(Z_ptr + offs, x + y, mask=mask)
    ### END SOLUTION


def add(x, y, block_size=128):
    z = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block_size),)](x, y, z, n, BLOCK_SIZE=block_size)
    return z


# %% minite={"check": "vector_add"} tags=["nbval-check-output"]
# CHECK: vector_add
g = torch.Generator().manual_seed(0)
for n in (1, 129, 1000):  # odd sizes: the last block is partly masked
    x, y = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    assert check_op(f"add n={n}", add, torch.add, x, y, grad=False)
print("PASS: vector_add")


# %% [markdown]
# ## Task 2: row-softmax forward kernel
#
# One program per row; the whole row fits in one block (`BLOCK_SIZE >= n_cols`). Row `row` of the input starts at
# `X_ptr + row * X_row_stride`, row `row` of the output at `Y_ptr + row * Y_row_stride` (the strides differ when
# the check passes a column slice of a wider tensor). Load the row (masked lanes: `-inf`), convert to fp32 at once,
# subtract the max, exponentiate, divide by the sum, store cast to the output type
# (`y.to(Y_ptr.dtype.element_ty)`). Hints: `tl.max(v, axis=0)`, `tl.sum(v, axis=0)`, `tl.exp`.

# %% minite={"task": "softmax_forward"}
@triton.jit
def softmax_fwd_kernel(X_ptr, Y_ptr, X_row_stride, Y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,)
    mask = cols < n_cols
    x = tl.load(X_ptr + row * X_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    e = tl.exp(z)
    y = e / tl.sum(e, axis=0)
    tl.store(Y_ptr + row * Y_row_stride + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


def my_softmax_fwd(x):
    """Softmax over the last dim of a 2-D x whose rows are contiguous (x.stride(1) == 1)."""
    assert x.dim() == 2 and x.stride(1) == 1
    N, C = x.shape
    y = torch.empty(N, C, device=x.device, dtype=x.dtype)  # (N, C), row stride C
    softmax_fwd_kernel[(N,)](x, y, x.stride(0), y.stride(0), C, BLOCK_SIZE=triton.next_power_of_2(C))
    return y


# %% minite={"check": "softmax_forward"} tags=["nbval-check-output"]
# CHECK: softmax_forward
g = torch.Generator().manual_seed(0)
for (N, C), dtype in [((1, 1), torch.float32), ((7, 33), torch.float32), ((5, 1000), torch.float16),
                      ((4, 100), torch.bfloat16)]:
    x = (3 * torch.randn(N, C, generator=g)).to(dtype).to(DEVICE)
    assert check_op("softmax forward", my_softmax_fwd, softmax_ref, x, grad=False)
    wide = torch.nn.functional.pad(x, (0, 7))  # (N, C + 7)
    strided = lambda t: my_softmax_fwd(wide[:, :C])  # noqa: E731  (a view: row stride C + 7, not C)
    assert check_op("softmax forward, row stride C+7", strided, softmax_ref, x, grad=False)
x = (1e4 * torch.randn(3, 50, generator=g)).to(DEVICE)  # large magnitudes and -inf must not give inf/NaN
x[:, :10] = float("-inf")
assert check_op("softmax forward, -inf and 1e4", my_softmax_fwd, softmax_ref, x, grad=False)
print("PASS: softmax_forward")


# %% [markdown]
# ## Task 3: softmax backward kernel
#
# Implement $dx = y\,(dy - \langle dy, y\rangle)$ for one row per program: load `y` and `dy` (masked lanes: `0`),
# convert to fp32, compute the row's dot product, then `dx`, store it cast to `DX_ptr.dtype.element_ty`. The three
# tensors share one row stride. The check wires your kernel into an autograd Function whose forward is minite's
# kernel, and compares gradients with autograd through `softmax_ref`.

# %% minite={"task": "softmax_backward"}
@triton.jit
def softmax_bwd_kernel(Y_ptr, DY_ptr, DX_ptr, row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,)
    mask = cols < n_cols
    offs = row * row_stride + cols
    y = tl.load(Y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=0)  # <dy, y>, one scalar per row
    dx = y * (dy - dot)
    tl.store(DX_ptr + offs, dx.to(DX_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


class MySoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # x: (N, C)
        y = S.softmax_fwd(x, -1)  # minite's forward kernel
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        N, C = y.shape
        softmax_bwd_kernel[(N,)](y, dy, dx, C, C, BLOCK_SIZE=triton.next_power_of_2(C))
        return dx


# %% minite={"check": "softmax_backward"} tags=["nbval-check-output"]
# CHECK: softmax_backward
g = torch.Generator().manual_seed(0)
for (N, C), dtype in [((1, 1), torch.float32), ((7, 33), torch.float32), ((5, 1000), torch.float16),
                      ((4, 100), torch.bfloat16)]:
    x = (3 * torch.randn(N, C, generator=g)).to(dtype).to(DEVICE)
    assert check_op("softmax fwd+bwd", MySoftmax.apply, softmax_ref, x)
print("PASS: softmax_backward")


# %% [markdown]
# ## Task 4: online softmax statistics (the seed of flash attention)
#
# Rows too long for one block are read in blocks. Keep, per row, the running max `m` and the running sum
# `d = sum(exp(x_k - m))` over the blocks seen so far; a block that raises the max to `m_new` rescales the old
# sum by `exp(m - m_new)`. Write the update in PyTorch for a batch of rows: `x_blk` is `(N, b)`, `m` and `d` are `(N,)`.
# Return `(m_new, d_new)`. Start values are `m = -inf`, `d = 0`; the check feeds blocks that are entirely `-inf`
# for some rows, so make sure `exp(-inf - (-inf))` cannot produce NaN (hint: `torch.where`).

# %% minite={"task": "online_softmax"}
def online_update(m, d, x_blk):
    ### BEGIN SOLUTION
    m_new = torch.maximum(m, x_blk.amax(dim=-1))                       # (N,)
    # a row whose max is still -inf has seen only -inf: its sum stays 0 (avoid exp(-inf + inf) = NaN)
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    d_new = d * torch.exp(m - safe) + torch.exp(x_blk - safe[:, None]).sum(dim=-1)
    return m_new, d_new
    ### END SOLUTION


# %% minite={"check": "online_softmax"} tags=["nbval-check-output"]
# CHECK: online_softmax
g = torch.Generator().manual_seed(0)
x = 5 * torch.randn(6, 70, generator=g, dtype=torch.float64)
x[1, :40] = float("-inf")   # the first blocks of row 1 are all -inf
x[2] = torch.linspace(-3, 30, 70, dtype=torch.float64)  # the max keeps rising: every block rescales
m, d = torch.full((6,), float("-inf"), dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
for blk in x.split(16, dim=-1):
    m, d = online_update(m, d, blk)
assert torch.equal(m, x.amax(-1)), "running max"
assert torch.allclose(d, torch.exp(x - x.amax(-1, keepdim=True)).sum(-1), rtol=1e-12), "running sum"
assert check_op("softmax from online stats", lambda t: torch.exp(t - m[:, None]) / d[:, None], softmax_ref, x,
                grad=False)
print("PASS: online_softmax")

# %% [markdown]
# That's the chapter. With the online statistics you have everything flash attention needs except the matmuls:
# chapter 07 carries `m` and `d` across blocks of keys and rescales a running output the same way.
