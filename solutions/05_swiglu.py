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
# # 05 — GeGLU: exercises
#
# The lesson (`notebooks/05_swiglu.ipynb`) fused SwiGLU, $h = \mathrm{silu}(g)\,u$. Shazeer's *GLU Variants Improve
# Transformer* (2020, [arXiv:2002.05202](https://arxiv.org/abs/2002.05202)) also tests **GeGLU**, used by T5 v1.1
# and Gemma, where the gate is a GELU:
#
# $$h = \mathrm{gelu}(g)\,u,\qquad \mathrm{gelu}(g) = g\,\Phi(g) = \frac{g}{2}\Big(1 + \mathrm{erf}\big(g/\sqrt2\big)\Big)$$
#
# with $\Phi$ the standard normal CDF. This is the **exact (erf) GELU**, `F.gelu(g)` with its default
# `approximate="none"`, not the tanh approximation (`approximate="tanh"`, GPT-2's "gelu_new"). Every task below uses
# the erf form.
#
# Three graded tasks: GELU's derivative, then GeGLU **with dropout fused in**, forward and backward, where the
# backward regenerates the dropout mask from a seed instead of storing it. Write your code between
# `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the `raise NotImplementedError()` line), run the cell, then
# the `# CHECK` cell after it (do not edit check cells). Tasks 2 and 3 are whole Triton kernels: only the signature
# and the spec are given. `tl.erf`, `tl.exp`, `tl.sqrt` and `tl.rand` exist in Triton (and work on the CPU
# interpreter).

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %%
def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    """Seeded CPU draw, then cast and move to DEVICE (the same numbers on every machine)."""
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(DEVICE)


def geglu_ref(gate, up):
    """The spec: exact-GELU(gate) * up computed in fp32, returned in gate's dtype."""
    return (F.gelu(gate.float(), approximate="none") * up.float()).to(gate.dtype)


# %% [markdown]
# ## Task 1 — the derivative of the exact GELU
#
# Derive $\frac{d}{dg}\mathrm{gelu}(g)$ on paper, then write `gelu_grad(g)` returning it elementwise with
# `torch.erf`, `torch.exp` and arithmetic only (no autograd, no `F.gelu`).

# %% minite={"task": "gelu_grad"}
def gelu_grad(g: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    cdf = 0.5 * (1.0 + torch.erf(g / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
    return cdf + g * pdf
    ### END SOLUTION


# %% minite={"check": "gelu_grad"} tags=["nbval-check-output"]
# CHECK: gelu_grad
g = torch.linspace(-10, 10, 401, dtype=torch.float64, device=DEVICE, requires_grad=True)
(expected,) = torch.autograd.grad(F.gelu(g, approximate="none").sum(), g)
got = gelu_grad(g.detach())
assert got.shape == g.shape and got.dtype == torch.float64, (got.shape, got.dtype)
assert_close(got, expected, name="gelu_grad")
print("PASS: gelu_grad")


# %% [markdown]
# ## Tasks 2 and 3 — GeGLU with dropout fused in, the mask never stored
#
# A GLU MLP with dropout applies it to the hidden activation: $y = \mathrm{gelu}(g)\,u \cdot m / (1 - p)$, with
# $m_{ij} \in \{0, 1\}$ kept with probability $1 - p$ (inverted dropout: the kept values are scaled so that the
# expectation is unchanged). Eager PyTorch makes a random tensor, a boolean mask it **stores for the backward**
# ($N \cdot H$ bytes), and more passes. Fused, the mask is a pure function of a seed and the element's index:
# Triton's `tl.rand(seed, offsets)` (counter-based Philox: the same `(seed, offset)` always gives the same number,
# in any program, in any kernel), so the backward regenerates it instead of reading it back, as the lesson
# recomputes the activation instead of storing it.
#
# The convention, which the checks rely on: element `(row, col)` of the (N, H) output uses the number
# `tl.rand(seed, row * H + col)` and is **kept when that number is `>= p`**. The cell below writes those numbers
# with a small helper kernel, for the reference only.

# %%
@triton.jit
def _uniform_kernel(R_ptr, n, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # the flat index row * H + col
    tl.store(R_ptr + offs, tl.rand(seed, offs), mask=offs < n)


def geglu_dropout_ref(gate, up, p, seed):
    """The spec: gelu(gate) * up * keep / (1 - p) in fp32, keep = (tl.rand(seed, row * H + col) >= p)."""
    r = torch.empty(gate.numel(), device=gate.device)
    _uniform_kernel[(triton.cdiv(r.numel(), 1024),)](r, r.numel(), seed, BLOCK=1024)
    keep = (r.view(gate.shape) >= p).float()
    return (F.gelu(gate.float(), approximate="none") * up.float() * keep / (1 - p)).to(gate.dtype)


# %% [markdown]
# **Task 2 — the forward kernel (whole kernel).** Grid `(N, cdiv(H, BLOCK))`: program `(row, j)` computes columns
# `j * BLOCK .. j * BLOCK + BLOCK - 1` (masked past `H`) of row `row` of $y$. Row `row` of the gate starts at
# `G_ptr + row * g_stride` and of up at `U_ptr + row * u_stride` (gate and up may be strided halves of one
# projection); columns are contiguous. `Y` is a contiguous (N, H) tensor. `p` is the drop probability
# ($0 \le p < 1$), `seed` an integer. Inputs are fp32, fp16 or bf16: compute in fp32 and round once, to `Y`'s dtype.
# Store nothing but `Y`.

# %% minite={"task": "geglu_dropout_fwd_kernel"}
@triton.jit
def geglu_dropout_fwd_kernel(G_ptr, g_stride, U_ptr, u_stride, Y_ptr, H, p, seed, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    keep = tl.rand(seed, r * H + c) >= p  # regenerated, never stored
    r64 = r.to(tl.int64)
    a = tl.load(G_ptr + r64 * g_stride + c, mask=m, other=0.0).to(tl.float32)
    b = tl.load(U_ptr + r64 * u_stride + c, mask=m, other=0.0).to(tl.float32)
    act = 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476)) * b
    out = tl.where(keep, act / (1.0 - p), 0.0)
    tl.store(Y_ptr + r64 * H + c, out.to(Y_ptr.dtype.element_ty), mask=m)
    ### END SOLUTION


def _rows(t):
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _block(H):
    return max(16, min(1024 if torch.cuda.is_available() else 4096, triton.next_power_of_2(H)))


def my_geglu_dropout_fwd(gate, up, p, seed):
    """Launcher (given): gate, up (..., H), rows may be strided -> y (..., H) contiguous."""
    g, u = _rows(gate), _rows(up)
    N, H = g.shape
    y = torch.empty((N, H), dtype=g.dtype, device=g.device)
    geglu_dropout_fwd_kernel[(N, triton.cdiv(H, _block(H)))](g, g.stride(0), u, u.stride(0), y, H, p, seed,
                                                             BLOCK=_block(H))
    return y.view(gate.shape)


# %% minite={"check": "geglu_dropout_fwd_kernel"} tags=["nbval-check-output"]
# CHECK: geglu_dropout_fwd_kernel
ok = True
for dtype, p, seed in ((torch.float32, 0.25, 1), (torch.float16, 0.5, 2), (torch.bfloat16, 0.1, 3)):
    gate, up = randn(5, 37, seed=1, dtype=dtype, scale=3.0), randn(5, 37, seed=2, dtype=dtype)
    ok &= check_op("geglu+dropout fwd", lambda g, u: my_geglu_dropout_fwd(g, u, p, seed),
                   lambda g, u: geglu_dropout_ref(g, u, p, seed), gate, up, grad=False)
    gu = randn(2, 3, 2 * 45, seed=3, dtype=dtype, scale=2.0)  # strided halves of one projection
    ok &= check_op("geglu+dropout fwd, strided halves", lambda gu: my_geglu_dropout_fwd(*gu.split(45, -1), p, seed),
                   lambda gu: geglu_dropout_ref(*gu.split(45, -1), p, seed), gu, grad=False)
big = randn(64, 1000, seed=4, scale=3.0) + 10.0  # gelu(g) u != 0 everywhere: a zero is a dropped element
dropped = float((my_geglu_dropout_fwd(big, torch.ones_like(big), 0.3, 5) == 0).float().mean())
print(f"dropped fraction at p = 0.3: {dropped:.2f}")
assert abs(dropped - 0.3) < 0.02
assert ok
print("PASS: geglu_dropout_fwd_kernel")


# %% [markdown]
# **Task 3 — the backward kernel (whole kernel).** Same grid and indexing as task 2. Given the upstream gradient
# $\bar y$ (row stride `dy_stride`), the saved **inputs** gate and up (row strides as in task 2), `p` and `seed`,
# write $\partial L/\partial g$ to `DG` and $\partial L/\partial u$ to `DU`, both contiguous (N, H), in their dtype.
# The forward saved nothing else, no mask and no activation: regenerate and recompute what you need (task 1 gives
# the derivative). Compute in fp32.

# %% minite={"task": "geglu_dropout_bwd_kernel"}
@triton.jit
def geglu_dropout_bwd_kernel(DY_ptr, dy_stride, G_ptr, g_stride, U_ptr, u_stride, DG_ptr, DU_ptr, H, p, seed,
                             BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    scale = tl.where(tl.rand(seed, r * H + c) >= p, 1.0 / (1.0 - p), 0.0)  # the forward's mask, regenerated
    r64 = r.to(tl.int64)
    grad = tl.load(DY_ptr + r64 * dy_stride + c, mask=m, other=0.0).to(tl.float32) * scale
    a = tl.load(G_ptr + r64 * g_stride + c, mask=m, other=0.0).to(tl.float32)
    b = tl.load(U_ptr + r64 * u_stride + c, mask=m, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.erf(a * 0.7071067811865476))
    pdf = tl.exp(-0.5 * a * a) * 0.3989422804014327
    tl.store(DU_ptr + r64 * H + c, (grad * a * cdf).to(DU_ptr.dtype.element_ty), mask=m)
    tl.store(DG_ptr + r64 * H + c, (grad * b * (cdf + a * pdf)).to(DG_ptr.dtype.element_ty), mask=m)
    ### END SOLUTION


class MyGeGLUDropout(torch.autograd.Function):
    """Given: the forward is your task-2 kernel; the backward launches your task-3 kernel."""
    @staticmethod
    def forward(ctx, gate, up, p, seed):
        ctx.save_for_backward(gate, up)  # the inputs only: no mask
        ctx.p, ctx.seed = p, seed
        return my_geglu_dropout_fwd(gate, up, p, seed)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        d, g, u = _rows(dy), _rows(gate), _rows(up)
        N, H = g.shape
        dg = torch.empty((N, H), dtype=g.dtype, device=g.device)
        du = torch.empty((N, H), dtype=u.dtype, device=u.device)
        geglu_dropout_bwd_kernel[(N, triton.cdiv(H, _block(H)))](d, d.stride(0), g, g.stride(0), u, u.stride(0), dg,
                                                                 du, H, ctx.p, ctx.seed, BLOCK=_block(H))
        return dg.view(gate.shape), du.view(up.shape), None, None


# %% minite={"check": "geglu_dropout_bwd_kernel"} tags=["nbval-check-output"]
# CHECK: geglu_dropout_bwd_kernel
ok = True
for dtype, p, seed in ((torch.float32, 0.25, 11), (torch.float16, 0.5, 12), (torch.bfloat16, 0.1, 13)):
    for k, shape in enumerate(((5, 37), (2, 3, 64))):
        gate, up = randn(*shape, seed=10 + k, dtype=dtype, scale=3.0), randn(*shape, seed=20 + k, dtype=dtype)
        ok &= check_op("GeGLU+dropout fwd+bwd", lambda g, u: MyGeGLUDropout.apply(g, u, p, seed),
                       lambda g, u: geglu_dropout_ref(g, u, p, seed), gate, up)
    gu = randn(4, 2 * 29, seed=30, dtype=dtype, scale=2.0)
    ok &= check_op("GeGLU+dropout fwd+bwd, strided halves",
                   lambda gu: MyGeGLUDropout.apply(*gu.split(29, -1), p, seed),
                   lambda gu: geglu_dropout_ref(*gu.split(29, -1), p, seed), gu)
assert ok
print("PASS: geglu_dropout_bwd_kernel")
