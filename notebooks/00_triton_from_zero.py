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
# # 00 — Triton from zero: execution model, roofline, vector add, fused softmax, tiled matmul, debugging
#
# Every later chapter of this course writes a GPU kernel, checks it against a PyTorch reference and explains
# why it is faster. This chapter builds the vocabulary once, and you write every kernel in it yourself, cell by
# cell:
#
# 1. **the execution model**: programs, blocks, masks, strides;
# 2. **memory traffic and the roofline**: why most of a transformer's non-matmul ops are limited by memory
#    bandwidth, not by arithmetic, and how to predict their runtime with one division;
# 3. **a first kernel**: masked vector add;
# 4. **a real one**: row softmax, forward and backward, fused into one read and one write per element, and the
#    *online* max/sum for rows that do not fit in one block (the trick flash attention, chapter 07, is built on);
# 5. **debugging a kernel on the CPU**: `print` and `breakpoint()` inside a kernel, `tl.device_print`, reading an
#    `InterpreterError`, and a planted bug found step by step;
# 6. **a tiled matmul with `tl.dot`**: blocks, the K loop, the fp32 accumulator, masks, tile order and L2, and
#    where a matmul sits on the roofline (chapter 02's FP8 GEMM is this kernel with fp8 tiles).
#
# The library's softmax lives in `minite/kernels/softmax.py` (`minite.ops.softmax`, `minite.nn.Softmax`); the
# kernels below are checked against it. Without a GPU, Triton's **interpreter** (`TRITON_INTERPRET=1`) runs the
# same kernels on the CPU, slowly but exactly, so every cell runs on a laptop. The GPU numbers at the end were
# measured on an H100 and are read from `benchmarks/results/`.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import json, math
import matplotlib.pyplot as plt
import numpy as np
from minite._triton import triton, tl, interpreting
from minite.testing import check_op
from minite.bytecount import CountBytes
import minite.kernels.softmax as S
from minite.kernels.softmax import softmax
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)
print(f"device: {DEVICE}, Triton interpreter: {interpreting()}")

# %% [markdown]
# ## 1. The GPU execution model in four words: programs, blocks, masks, strides
#
# A GPU (an H100 has 132 *streaming multiprocessors*, SMs) runs a **kernel** as a **grid** of independent
# **programs** (CUDA calls them thread blocks). Triton asks you to write *one* program; you pick how many run.
# Each program
#
# * knows its index `pid = tl.program_id(0)` and nothing else: programs cannot talk to each other;
# * works on a whole **block** of elements at once, `tl.arange(0, BLOCK_SIZE)` (a power of two); Triton spreads the
#   block over the program's threads (`num_warps` × 32) and vector registers for you;
# * moves data explicitly: `tl.load` from global memory (HBM, 80 GB at 3.35 TB/s) into registers, `tl.store` back.
#   Everything in between happens in registers and on-chip SRAM, which is ~10× faster than HBM.
#
# ```
# x: n = 10 elements, BLOCK_SIZE = 4  ->  grid = cdiv(10, 4) = 3 programs
#
#  offset   0  1  2  3 | 4  5  6  7 | 8  9 10 11
#  program  ---- 0 --- | ---- 1 --- | ---- 2 ---
#  mask     1  1  1  1 | 1  1  1  1 | 1  1  0  0    <- offsets 10, 11 do not exist: no load, no store
# ```
#
# The grid rarely divides the data evenly, so the last program's block hangs over the end. A **mask**
# `offs < n` switches those lanes off: a masked `tl.load` returns `other=` instead of touching memory, a masked
# `tl.store` writes nothing. Let us play the grid in plain PyTorch:

# %% tags=["nbval-check-output"]
n, BLOCK_SIZE = 10, 4
grid = triton.cdiv(n, BLOCK_SIZE)  # ceil(10 / 4) = 3 programs
for pid in range(grid):  # on the GPU these run in parallel, in any order
    offs = pid * BLOCK_SIZE + torch.arange(BLOCK_SIZE)
    mask = offs < n
    print(f"program {pid}: offsets {offs.tolist()}, mask {mask.int().tolist()}")

# %% [markdown]
# **Strides.** A tensor is a pointer to its first element plus one stride per dimension: element `(i, j)` of a 2-D
# tensor lives at `ptr + i * stride(0) + j * stride(1)` (in elements). A row-major `(N, C)` tensor has strides
# `(C, 1)`: rows are contiguous, the next row starts `C` elements later. A transpose swaps the strides without
# moving data; a slice of columns keeps the row stride of the parent. Kernels therefore take strides as arguments
# instead of assuming `C`:
#
# ```
# (3, 4) row-major, strides (4, 1)          memory:  a00 a01 a02 a03 | a10 a11 a12 a13 | a20 ...
# row i starts at ptr + i * 4               program i of a row kernel reads  ptr + i * row_stride + [0, 1, 2, 3]
# ```

# %% tags=["nbval-check-output"]
a = torch.arange(12.0).view(3, 4)
print("a:        shape", tuple(a.shape), "strides", a.stride())
print("a.t():    shape", tuple(a.t().shape), "strides", a.t().stride(), "(same memory, strides swapped)")
print("a[:, :3]: shape", tuple(a[:, :3].shape), "strides", a[:, :3].stride(), "(row stride stays 4)")

# %% [markdown]
# ## 2. Memory traffic and the roofline
#
# A kernel needs time for its arithmetic *and* for moving its bytes between HBM and the chip; the two overlap, so
# the slower one wins. The **arithmetic intensity** $I = \text{FLOPs} / \text{bytes moved}$ decides which:
#
# $$ \text{attainable FLOP/s} = \min\big(\text{peak FLOP/s},\; I \times \text{bandwidth}\big) $$
#
# An H100 SXM has **two** compute roofs. Matmuls run on the tensor cores: 989 TFLOP/s dense in bf16. Everything
# else (adds, exp, max, the arithmetic of a softmax) runs on the ordinary **CUDA cores**: about 67 TFLOP/s in fp32,
# 15× lower. Both sit over the same 3.35 TB/s of HBM3. So the ridge point, where memory stops being the limit, is
# at $67 / 3.35 \approx 20$ FLOP/byte for elementwise code and $989 / 3.35 \approx 295$ FLOP/byte for a matmul.
#
# How many bytes does softmax move? We count them instead of guessing: a `TorchDispatchMode`
# (`minite.bytecount.CountBytes`) sees every aten op PyTorch runs and logs the bytes of its tensor inputs (reads)
# and outputs (writes). On the `meta` device nothing is computed, only shapes flow, so this is instant for any
# size. The naive softmax below upcasts bf16 to fp32 first, as careful code must, and that upcast is traffic too.

# %%
def naive_softmax(x, dim=-1):
    xf = x.float()                       # upcast: read 2 B, write 4 B per element for bf16 input (no-op for fp32)
    m = xf.amax(dim, keepdim=True)       # read N*C, write N
    z = xf - m                           # read N*C (+N), write N*C
    e = z.exp()                          # read N*C, write N*C
    s = e.sum(dim, keepdim=True)         # read N*C, write N
    return (e / s).to(x.dtype)           # read N*C (+N), write N*C, then the downcast: read 4 B, write 2 B


def naive_softmax_bwd(y, dy, dim=-1):
    p = dy * y                           # read 2*N*C, write N*C
    dot = p.sum(dim, keepdim=True)       # read N*C, write N
    t = dy - dot                         # read N*C (+N), write N*C
    return y * t                         # read 2*N*C, write N*C


def bytes_per_element(fn, *shapes, dtype=torch.float32):
    """Run fn on meta tensors of `shapes`; return (per-op log, bytes moved / number of elements of the first)."""
    ts = [torch.empty(s, device="meta", dtype=dtype) for s in shapes]
    with CountBytes() as cb:
        fn(*ts)
    return cb.ops, cb.total() / ts[0].numel()


N, C = 4096, 1024
for dtype in (torch.float32, torch.bfloat16):
    ops, b = bytes_per_element(naive_softmax, (N, C), dtype=dtype)
    print(f"naive softmax forward, {str(dtype)[6:]:8s}: {len(ops)} kernels, {b:5.2f} bytes per element "
          f"(fused: {2 * torch.finfo(dtype).bits // 8} bytes)")
for name, r, w in bytes_per_element(naive_softmax, (N, C), dtype=torch.bfloat16)[0]:
    print(f"    {name:10s} reads {r / (N * C):5.2f} B/elem, writes {w / (N * C):5.2f} B/elem")

# %% [markdown]
# In bf16 the naive forward moves **44 bytes per element** (the fp32 upcast and downcast are two of its seven
# kernels); a fused kernel reads 2 and writes 2. With about 5 FLOPs per element (max, subtract, exp, sum, divide),
# the intensities are:

# %% tags=["nbval-check-output"]
BW, PEAK_TC, PEAK_CUDA = 3.35e12, 989e12, 67e12  # H100 SXM: HBM3 bytes/s, bf16 tensor-core and fp32 CUDA-core FLOP/s
naive_bytes = bytes_per_element(naive_softmax, (N, C), dtype=torch.bfloat16)[1]
elementwise = {"vector add fp32": (1, 12), "softmax bf16, naive": (5, naive_bytes), "softmax bf16, fused": (5, 4)}
for name, (flops, nbytes) in elementwise.items():
    I = flops / nbytes
    print(f"{name:20s} I = {I:6.3f} FLOP/B -> {min(PEAK_CUDA, I * BW) / 1e12:6.2f} TFLOP/s attainable "
          f"(memory-bound: ridge {PEAK_CUDA / BW:.0f} FLOP/B)")
S_mm = 8192
I_mm = 2 * S_mm ** 3 / (2 * 3 * S_mm ** 2)  # bf16 matmul: 2MNK FLOPs over 2(MK + KN + MN) bytes
print(f"{'matmul bf16 8192^3':20s} I = {I_mm:6.0f} FLOP/B -> {min(PEAK_TC, I_mm * BW) / 1e12:6.0f} TFLOP/s attainable "
      f"(compute-bound: ridge {PEAK_TC / BW:.0f} FLOP/B)")

I = np.logspace(-2, 4, 400)
fig, ax = plt.subplots(figsize=(7.5, 4.2))
ax.loglog(I, np.minimum(PEAK_TC, I * BW) / 1e12, "k-", lw=2, label="tensor cores, bf16 (989 TFLOP/s)")
ax.loglog(I, np.minimum(PEAK_CUDA, I * BW) / 1e12, "k--", lw=1.5, label="CUDA cores, fp32 (67 TFLOP/s)")
for (name, (flops, nbytes)), c in zip(elementwise.items(), ["C0", "C3", "C2"]):
    i = flops / nbytes
    ax.plot(i, min(PEAK_CUDA, i * BW) / 1e12, "o", ms=9, color=c, label=f"{name} (I={i:.3g})")
ax.plot(I_mm, min(PEAK_TC, I_mm * BW) / 1e12, "o", ms=9, color="C1", label=f"matmul bf16 8192³ (I={I_mm:.0f})")
ax.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="attainable TFLOP/s",
       title="Roofline of an H100 SXM: 3.35 TB/s HBM, two compute roofs")
ax.legend(loc="lower right", fontsize=8)
plt.show()

# %% [markdown]
# Softmax sits far left of even the CUDA-core ridge: its speed is **bytes / bandwidth**, and the only way to make
# it faster is to move fewer bytes. Fusing does exactly that. The matmul is the opposite case (section 9).
#
# **The back-of-the-envelope that predicts a memory-bound kernel's runtime.** The attention scores of one layer of
# a small GPT, batch 8 × 12 heads × $T = 1024$ queries, are $N = 98\,304$ rows of $C = 1024$ columns in bf16.

# %% tags=["nbval-check-output"]
N_att, C_att = 8 * 12 * 1024, 1024  # (B*H*T, T) bf16 attention scores
for name, per_elem in [("fused", 4), ("naive", naive_bytes)]:
    nbytes = per_elem * N_att * C_att
    print(f"{name}: {per_elem:4.1f} B/elem = {nbytes / 1e9:.2f} GB -> {nbytes / BW * 1e3:.3f} ms at 3.35 TB/s")


# %% [markdown]
# Same FLOPs, 11 times the time.
#
# ## 3. A first kernel: masked vector add
#
# One program per block of `BLOCK_SIZE` elements. Read it top to bottom: which block am I, which offsets are
# mine, which of them exist, load, compute, store. The launcher allocates the output and picks the grid.

# %% tags=["nbval-check-output"]
@triton.jit
def add_kernel(X_ptr, Y_ptr, Z_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)               # which block am I? (int64: no overflow past 2**31)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,) element offsets of my block
    mask = offs < n_elements                            # the last block hangs over the end
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    y = tl.load(Y_ptr + offs, mask=mask, other=0.0)
    tl.store(Z_ptr + offs, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    x, y = x.contiguous(), y.contiguous()
    z = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block_size),)](x, y, z, n, BLOCK_SIZE=block_size)  # grid = number of programs
    return z


g = torch.Generator().manual_seed(0)
for n in (1, 1000, 4096):  # 1000 is not a multiple of 256: the mask matters
    x, y = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    assert check_op(f"vector add n={n}", add, torch.add, x, y, grad=False)

# %% [markdown]
# ## 4. Row softmax: the math
#
# For one row $x \in \mathbb{R}^C$:
#
# $$ y_i = \frac{e^{x_i}}{\sum_{k=1}^{C} e^{x_k}} = \frac{e^{x_i - m}}{\sum_k e^{x_k - m}}, \qquad m = \max_k x_k . $$
#
# Both forms are equal (the factor $e^{-m}$ cancels), but only the second is safe: $e^{89}$ already overflows fp32,
# while $x_k - m \le 0$ keeps every exponential in $(0, 1]$ and the denominator in $[1, C]$.
#
# **Backward.** Given the upstream gradient $dy = \partial L / \partial y$, we need $dx = \partial L / \partial x$.
# Differentiate $y_i = e^{x_i} / s$ with $s = \sum_k e^{x_k}$, $\partial s / \partial x_j = e^{x_j}$:
#
# $$ \frac{\partial y_i}{\partial x_j} = \frac{\delta_{ij} e^{x_i}\, s - e^{x_i} e^{x_j}}{s^2}
#    = y_i\,(\delta_{ij} - y_j). $$
#
# The chain rule sums over the outputs $i$:
#
# $$ dx_j = \sum_i dy_i\, \frac{\partial y_i}{\partial x_j} = \sum_i dy_i\, y_i\, \delta_{ij} - y_j \sum_i dy_i\, y_i
#         = y_j \Big( dy_j - \underbrace{\textstyle\sum_i dy_i\, y_i}_{\langle dy,\; y \rangle} \Big). $$
#
# The $C \times C$ Jacobian is never formed: the backward is one dot product per row and one elementwise
# expression, and it needs only the **output** $y$ (saved by the forward), not $x$.

# %% tags=["nbval-check-output"]
x = torch.tensor([1000.0, 1001.0, 1002.0])
naive = torch.exp(x) / torch.exp(x).sum()            # exp(1000) = inf -> inf / inf = nan
stable = torch.exp(x - x.max()) / torch.exp(x - x.max()).sum()
print("without the max:", naive.tolist())
print("with the max:   ", [round(v, 4) for v in stable.tolist()])

# %% [markdown]
# ## 5. The fused forward kernel, built step by step
#
# **One program per row.** Program `i` loads row `i` into registers, computes max, exp, sum and the division
# there, and stores the row: 1 read + 1 write. We write it in three steps, each one a kernel you can run.
#
# *Step 1: find my row.* Row `i` starts at `X_ptr + i * X_row_stride`; the columns are `tl.arange(0, BLOCK_SIZE)`
# with `BLOCK_SIZE` the next power of two ≥ C, so a mask switches off the lanes past the end. This first version
# only copies the row, to check the addressing (on a column slice, where the row stride is not C):

# %% tags=["nbval-check-output"]
@triton.jit
def copy_rows_kernel(X_ptr, Y_ptr, X_row_stride, Y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)                  # (BLOCK_SIZE,)
    mask = cols < n_cols
    x = tl.load(X_ptr + row * X_row_stride + cols, mask=mask, other=0.0)
    tl.store(Y_ptr + row * Y_row_stride + cols, x, mask=mask)


wide = torch.randn(5, 13, generator=g).to(DEVICE)
xs = wide[:, :10]                                    # (5, 10) view, row stride 13
ys = torch.empty(5, 10, device=DEVICE)
copy_rows_kernel[(5,)](xs, ys, xs.stride(0), ys.stride(0), 10, BLOCK_SIZE=16)
assert torch.equal(ys, xs), "each program must read its row at row * X_row_stride and write it at row * Y_row_stride"
print("PASS: row addressing with a row stride of", xs.stride(0))

# %% [markdown]
# *Step 2: the math.* Two choices matter. The masked lanes must not disturb the result: they load $-\infty$,
# which changes neither the max nor the sum ($e^{-\infty} = 0$). And the row is converted to fp32 as soon as it is
# loaded (bf16 arithmetic is slow on some GPUs and wrong on the CPU interpreter); the store casts back to the
# output's element type, so one kernel serves fp32, fp16 and bf16.

# %%
@triton.jit
def softmax_fwd_kernel(X_ptr, Y_ptr, X_row_stride, Y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)                                      # (BLOCK_SIZE,)
    mask = cols < n_cols
    x = tl.load(X_ptr + row * X_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)                                                # scalar: the row max
    e = tl.exp(x - m)                                                    # in (0, 1]; masked lanes give 0
    y = e / tl.sum(e, axis=0)
    tl.store(Y_ptr + row * Y_row_stride + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)


# %% [markdown]
# *Step 3: the launcher.* It flattens everything but the softmax dimension into rows, allocates the output and
# launches one program per row.

# %%
def softmax_fwd(x):
    """Softmax over the last dim, for rows that fit in one block."""
    x2 = x.reshape(-1, x.shape[-1])                     # (N, C); a view when possible
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N, C = x2.shape
    y2 = torch.empty(N, C, device=x.device, dtype=x.dtype)
    softmax_fwd_kernel[(N,)](x2, y2, x2.stride(0), y2.stride(0), C, BLOCK_SIZE=triton.next_power_of_2(C))
    return y2.view(x.shape)


# %% [markdown]
# ## 6. The backward kernel
#
# The formula from section 4, $dx = y\,(dy - \langle dy, y\rangle)$, one row per program: load `y` and `dy` (masked
# lanes read 0, which adds nothing to the dot product), one `tl.sum` for the dot product, one elementwise
# expression, one store. An `autograd.Function` wires the two kernels together and saves only `y`.

# %%
@triton.jit
def softmax_bwd_kernel(Y_ptr, DY_ptr, DX_ptr, row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    base = row * row_stride                              # y, dy and dx share one contiguous layout
    y = tl.load(Y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(y * dy, axis=0))
    tl.store(DX_ptr + base + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)


class LessonSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = softmax_fwd(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        y2 = y.reshape(-1, y.shape[-1]).contiguous()
        dy2 = dy.reshape(-1, y.shape[-1]).to(y.dtype).contiguous()
        dx2 = torch.empty_like(y2)
        N, C = y2.shape
        softmax_bwd_kernel[(N,)](y2, dy2, dx2, C, C, BLOCK_SIZE=triton.next_power_of_2(C))
        return dx2.view(y.shape)


lesson_softmax = LessonSoftmax.apply

# %% [markdown]
# ## 7. Check it against the naive version and against minite's
#
# `check_op` runs both functions on copies of the input, back-propagates the same random upstream gradient through
# both, and compares the output and the input gradient with the tolerance for the dtype (fp16 and bf16: ~2 ulp,
# fp32: 1e-5). Odd shapes on purpose: a single column, a row one past a power of two, a 3-D input, rows of
# $\pm 10^4$ and of $-\infty$. Then the same against `minite.ops.softmax`, whose kernels add what this lesson
# leaves out: a softmax along any dimension, fp64 (for `gradcheck`), and rows longer than one block (next
# section).

# %% tags=["nbval-check-output"]
def minite_softmax(x):
    return softmax(x, dim=-1, backend="triton")


g = torch.Generator().manual_seed(0)
for shape in [(1, 1), (3, 1000), (7, 257), (2, 3, 17)]:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)
        assert check_op("lesson softmax vs naive", lesson_softmax, naive_softmax, x)
        assert check_op("lesson softmax vs minite", lesson_softmax, minite_softmax, x)
x = (1e4 * torch.randn(3, 50, generator=g)).to(DEVICE)
x[:, :10] = float("-inf")                               # large magnitudes and -inf: no inf, no NaN
assert check_op("lesson softmax, -inf and 1e4", lesson_softmax, naive_softmax, x, grad=False)

# %% [markdown]
# ## 8. Rows longer than a block: online softmax
#
# A program can hold only so much in registers: minite caps a block at `MAX_BLOCK_SIZE` = 8192 columns (the
# vocabulary row of a cross-entropy is 50k). A longer row is walked in blocks. The naive way needs three sweeps:
# one for the max, one for the sum of $e^{x-m}$, one to write $y$. **Online softmax** (Milakov & Gimelshein, 2018)
# merges the first two: keep the max so far $m$ and the sum so far $d = \sum e^{x_k - m}$. When a new block
# raises the max to $m'$, every term already in $d$ was computed against the old max and is too large by a factor
# $e^{m' - m}$; the old sum is rescaled:
#
# $$ d' = d\, e^{m - m'} + \sum_{k \in \text{block}} e^{x_k - m'} . $$
#
# After the last block, $m$ and $d$ are the row's true max and sum, from **one** sweep; a second sweep writes
# $y = e^{x - m} / d$. Long rows then cost 3 passes over memory instead of 4. Flash attention (chapter 07) runs
# exactly this recurrence over blocks of keys and never writes the score row at all. The picture: the running
# statistics of one row of 200 values walked in blocks of 32, against the full row's.

# %% tags=["nbval-check-output"]
row = 2 * torch.randn(200, generator=torch.Generator().manual_seed(3)) + torch.linspace(0, 6, 200)
ms, ds = [], []
m_run, d_run = -math.inf, 0.0
for blk in row.split(32):
    m_new = max(m_run, blk.max().item())
    d_run = d_run * math.exp(m_run - m_new) + torch.exp(blk - m_new).sum().item()
    m_run = m_new
    ms.append(m_run), ds.append(d_run)
m_full, d_full = row.max().item(), torch.exp(row - row.max()).sum().item()
print(f"after {len(ms)} blocks: max {ms[-1]:.4f} (full row {m_full:.4f}), sum {ds[-1]:.4f} (full row {d_full:.4f})")
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3))
a1.plot(row, lw=0.8, color="gray"); a1.step([32 * (i + 1) - 1 for i in range(len(ms))], ms, "C3", where="pre")
a1.set(title="one row; red: running max after each block", xlabel="column")
a2.plot(range(1, len(ds) + 1), ds, "o-", label="running sum d (against the running max)")
a2.axhline(d_full, color="k", ls=":", label="sum of exp(x - max) of the full row")
a2.set(xlabel="blocks seen", title="d jumps down whenever the max rises (rescaling)"); a2.legend(fontsize=8)
plt.show()

# %% [markdown]
# Writing this recurrence as a Triton kernel, with the $-\infty$ corner cases it must survive, is an exercise.
# minite's forward kernel (`minite/kernels/softmax.py`) does it behind a `SINGLE_BLOCK` constexpr: Triton compiles
# a separate kernel per value of a `tl.constexpr`, so the branch costs nothing at run time. Here it is on rows
# longer than one block (the block cap lowered to 64 so that the interpreter stays fast):

# %% tags=["nbval-check-output"]
old_cap, S.MAX_BLOCK_SIZE = S.MAX_BLOCK_SIZE, 64
try:
    x = (3 * torch.randn(4, 300, generator=g)).to(DEVICE)   # 300 columns = 5 blocks of 64
    assert check_op("minite softmax, looped path (5 blocks per row)", minite_softmax, naive_softmax, x)
finally:
    S.MAX_BLOCK_SIZE = old_cap

# %% [markdown]
# ## 9. Debugging a kernel on the CPU
#
# Under `TRITON_INTERPRET=1` a kernel is ordinary Python: each program runs one after the other, every `tl.*`
# value is a NumPy array in disguise, and the Python debugging tools work inside the kernel body.
#
# **`print` inside a kernel.** A plain `print` runs once per program and shows the block's values (on a GPU,
# `print` of a tensor is not allowed: use `tl.device_print`). `tl.device_print(prefix, value)` works on both: on
# the GPU it prints from every thread (a lot of output: guard it with `if pid == 0:`), under the interpreter it
# prints the program id and the whole block. `tl.static_print` prints at compile time (constexprs, shapes).

# %%
@triton.jit
def add_kernel_verbose(X_ptr, Y_ptr, Z_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    print("program", pid, "offs", offs, "mask", mask, "x", x)   # interpreter only
    tl.device_print("x + 1 =", x + 1)                             # interpreter and GPU
    tl.store(Z_ptr + offs, x + tl.load(Y_ptr + offs, mask=mask, other=0.0), mask=mask)


x6 = torch.arange(6.0).to(DEVICE)
if interpreting():
    add_kernel_verbose[(2,)](x6, x6, torch.empty_like(x6), 6, BLOCK_SIZE=4)

# %% [markdown]
# **`breakpoint()` inside a kernel.** Put `breakpoint()` on any line of a `@triton.jit` function and run it under
# the interpreter: you land in `pdb` inside program 0 with every local in scope (`p x`, `p mask`, `p x.shape`,
# `n` to step a line, `c` to go on to the next program). In JupyterLab the debugger prompt opens under the cell.
# It is not executed here, because a notebook that waits for input never finishes; try it in a copy of a cell:
#
# ```python
# @triton.jit
# def add_kernel(X_ptr, ...):
#     ...
#     x = tl.load(X_ptr + offs, mask=mask, other=0.0)
#     breakpoint()          # (Pdb) p offs  ->  array([0, 1, 2, 3])
# ```
#
# **Reading an `InterpreterError`.** A shape mistake is reported when the bad line runs, wrapped in
# `triton.runtime.errors.InterpreterError`. The last line names the problem; the traceback above it (here cut to
# the message) points at the kernel line. Here a `(4,)` block is added to an `(8,)` one:

# %% tags=["nbval-check-output"]
@triton.jit
def shape_bug_kernel(X_ptr, Y_ptr, n, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    bias = tl.arange(0, 8)                                       # (8,), but the block is (BLOCK_SIZE,) = (4,)
    x = tl.load(X_ptr + offs, mask=offs < n, other=0.0)
    tl.store(Y_ptr + offs, x + bias, mask=offs < n)


if interpreting():
    try:
        shape_bug_kernel[(2,)](x6, torch.empty_like(x6), 6, BLOCK_SIZE=4)
    except Exception as err:  # InterpreterError under the interpreter
        print(f"{type(err).__name__}: {err}")
else:
    print("InterpreterError: ValueError('Cannot make_shape_compatible: incompatible dimensions at index 0: 4 and 8')")

# %% [markdown]
# **A planted bug, found step by step.** Here is a softmax kernel someone "simplified": it loads the masked lanes
# with `other=0.0`, the default everyone types. Step 1: the check fails, but not everywhere.

# %%
@triton.jit
def buggy_softmax_kernel(X_ptr, Y_ptr, row_stride, n_cols, BLOCK_SIZE: tl.constexpr, DEBUG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(X_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    m = tl.max(x, axis=0)
    e = tl.exp(x - m)
    s = tl.sum(e, axis=0)
    if DEBUG:
        print("row", row, "x", x, "max", m, "sum", s)
    tl.store(Y_ptr + row * row_stride + cols, (e / s).to(Y_ptr.dtype.element_ty), mask=mask)


def buggy_softmax(x, debug=False):
    y = torch.empty_like(x)
    buggy_softmax_kernel[(x.shape[0],)](x, y, x.stride(0), x.shape[1], BLOCK_SIZE=triton.next_power_of_2(x.shape[1]),
                                        DEBUG=debug)
    return y


x = (3 * torch.randn(4, 100, generator=torch.Generator().manual_seed(0))).to(DEVICE)
assert not check_op("buggy softmax, C = 100", buggy_softmax, naive_softmax, x, grad=False)  # the bug shows
x = (3 * torch.randn(4, 128, generator=torch.Generator().manual_seed(0))).to(DEVICE)
assert check_op("buggy softmax, C = 128", buggy_softmax, naive_softmax, x, grad=False)  # ... and hides

# %% [markdown]
# Step 2: narrow it down. C = 128 passes, C = 100 fails: the difference is that 28 lanes of the 128-wide block are
# masked, so suspect the masked lanes. Step 3: the smallest failing case, with the debug print switched on (a
# constexpr, so the `print` is compiled away when `DEBUG=False`): one row of 3 columns, all negative.

# %%
x = torch.tensor([[-1.0, -2.0, -3.0]]).to(DEVICE)
y = buggy_softmax(x, debug=interpreting())
print("kernel:", [round(v, 4) for v in y[0].tolist()], " sum", round(y.sum().item(), 4))
print("naive: ", [round(v, 4) for v in naive_softmax(x)[0].tolist()])

# %% [markdown]
# Step 4: read the print. The block is 4 wide for 3 columns; the fourth lane loaded `0.0`, which is larger than
# every real value, so the "max" is 0, and that lane adds $e^0 = 1$ to the sum. The row then sums to less than 1.
# When the row has a positive value, the max is right but the sum still gets $e^{-m}$ per masked lane: the error
# is smaller and easy to miss with a loose tolerance. Step 5: the fix is `other=-float("inf")` (our
# `softmax_fwd_kernel` above). Step 6: re-run the failing checks on the fixed kernel, and add the all-negative row
# to the test set, since it is the input that exposes the bug best.

# %% tags=["nbval-check-output"]
for C in (3, 100, 128):
    x = (3 * torch.randn(4, C, generator=torch.Generator().manual_seed(0)) - 5).to(DEVICE)
    assert check_op(f"fixed softmax, C = {C}", softmax_fwd, naive_softmax, x, grad=False)

# %% [markdown]
# ## 10. A tiled matmul with `tl.dot`
#
# $C = AB$ with $A$ of shape $(M, K)$ and $B$ of shape $(K, N)$. Each output tile is a small matmul, so one program
# computes one `(BLOCK_M, BLOCK_N)` tile of $C$:
#
# ```
#        K                 N                              N
#    +-------+        +--+--+--+              +--+--+--+--+
#  M |  A    |  x   K |  |B |  |    =      M  |  |  |  |  |   program (pid_m, pid_n) owns one tile of C:
#    |-------| pid_m  |  |  |  |              |--+--+--+--|   it walks K in steps of BLOCK_K, loading an A tile
#    | a a a |------->|  |b |  |              |  |  |C |  |   (BLOCK_M, BLOCK_K) and a B tile (BLOCK_K, BLOCK_N)
#    |-------|        |  |b |  |              |--+--+--+--|   and adds their product into an fp32 accumulator
#    +-------+        +--+--+--+              +--+--+--+--+
#                        pid_n
# ```
#
# * **Blocks**: `offs_m` (BLOCK_M,), `offs_n` (BLOCK_N,), `offs_k` (BLOCK_K,). A 2-D block of pointers comes from
#   broadcasting a column of offsets against a row: `A_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak`
#   is `(BLOCK_M, BLOCK_K)`. With strides as arguments, `B = W.t()` works without a copy.
# * **The K loop** advances both pointer blocks by `BLOCK_K` along K; `tl.dot(a, b, acc)` multiplies the two tiles
#   on the tensor cores and adds into `acc`. For fp32 tiles, `input_precision` says how: `"tf32"` (a GPU's default)
#   rounds the inputs to TF32's 10 mantissa bits for the tensor cores' speed, `"ieee"` keeps exact fp32 products
#   (slower, on the ordinary cores). The interpreter computes exact products either way. We pass it explicitly.
# * **The accumulator is fp32** (`tl.zeros(..., tl.float32)`), whatever the input type: chapter 01 shows why a
#   low-precision running sum stalls. The output is rounded once, in the store.
# * **Masks**: M, N and K need not be multiples of the blocks. Out-of-range A and B elements load as 0 and add
#   nothing to the sum; out-of-range C elements are not stored.
# * **Tile sizes**: on a GPU every `tl.dot` dimension must be at least 16 (32 for fp8 K). The CPU interpreter
#   accepts any size, so we use GPU-legal 16 × 16 × 32 tiles here, and tiny grids (it costs ~0.5 ms per program
#   and K step); an H100 runs 128 × 128 × 64.

# %%
@triton.jit
def matmul_kernel(A_ptr, B_ptr, C_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n                       # row-major tile order: tile row by tile row
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K)                                        # (BLOCK_K,)
    a_ptrs = A_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak   # (BLOCK_M, BLOCK_K)
    b_ptrs = B_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn   # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (k0 + offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptrs, mask=(k0 + offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="tf32")   # (BLOCK_M, BLOCK_N) += (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul(a, b, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32):
    (M, K), (K2, N) = a.shape, b.shape
    assert K == K2, f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}"
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return c


# %% [markdown]
# Check it against `torch.matmul` on ragged shapes (every edge masked), a transposed operand, fp16 inputs (fp32
# accumulation inside, one rounding to fp16 at the store), and against **minite's FP8 GEMM** (chapter 02): the
# same tiled kernel with fp8 tiles. Fed the dequantized fp8 values, ours must agree with it to fp32 rounding.

# %% tags=["nbval-check-output"]
def torch_matmul(a, b):
    return (a.float() @ b.float()).to(a.dtype)


# On a GPU, tl.dot of fp32 tiles runs in TF32 (inputs rounded to 10 mantissa bits): fp32 checks need TF32 tolerances.
TF32 = dict(atol=5e-2, rtol=1e-2) if DEVICE == "cuda" else {}
g = torch.Generator().manual_seed(0)
for (M, N, K), dtype in [((16, 16, 32), torch.float32), ((33, 20, 70), torch.float32), ((40, 17, 45), torch.float16)]:
    a, b = torch.randn(M, K, generator=g).to(dtype).to(DEVICE), torch.randn(K, N, generator=g).to(dtype).to(DEVICE)
    tol = TF32 if dtype == torch.float32 else {}
    assert check_op(f"matmul {M}x{K} @ {K}x{N}", matmul, torch_matmul, a, b, grad=False, **tol)
x_in, w = torch.randn(30, 50, generator=g).to(DEVICE), torch.randn(24, 50, generator=g).to(DEVICE)  # w: (N, K)
assert check_op("matmul with B = W.t() (strided)", matmul, torch_matmul, x_in, w.t(), grad=False, **TF32)

from minite.formats import quantize
from minite.kernels.fp8_gemm import fp8_gemm
qa = quantize(torch.randn(33, 64, generator=g).to(DEVICE), backend="torch")   # E4M3, per-tensor scale
qb = quantize(torch.randn(20, 64, generator=g).to(DEVICE), backend="torch")
ours = matmul(qa.dequantize(torch.float32), qb.dequantize(torch.float32).t())
theirs = fp8_gemm(qa, qb.t(), out_dtype=torch.float32, backend="triton")
assert check_op("lesson matmul vs minite's fp8_gemm", lambda t: ours, lambda t: theirs, ours, grad=False, **TF32)

# %% [markdown]
# **Where a matmul sits on the roofline, and why the tile order matters.** A matmul of $M = N = K = 4096$ in bf16
# does $2MNK$ FLOPs over, at the very least, $2(MK + KN + MN)$ bytes: $I \approx 1365$ FLOP/B, far right of the
# 295 ridge. But that minimum assumes every input is read from HBM *once*. One program reads a
# `(BLOCK_M, K)` strip of A and a `(K, BLOCK_N)` strip of B to produce `BLOCK_M × BLOCK_N` outputs:
#
# $$ I_\text{tile} = \frac{2\,B_M B_N K}{2\,(B_M + B_N)\,K} = \frac{B_M B_N}{B_M + B_N} \quad\text{FLOP/B (bf16)}, $$
#
# which is only 64 FLOP/B for 128 × 128 tiles: **if every program fetched its strips from HBM, the matmul would be
# memory-bound.** It is not, because the strips are shared: all programs of one tile row read the same A strip,
# all programs of one tile column the same B strip, and the 50 MB L2 cache serves the repeats, *if* the programs
# that share a strip run at about the same time. Programs start roughly in `pid` order, ~132 at a time (one or two
# per SM). Row-major order (`pid_m = pid // num_pid_n`) runs a whole tile row at once: with 32 × 32 tiles of C,
# a wave of 32 programs needs 1 A strip but 32 different B strips, 33 strips for 32 tiles.
#
# **Grouped ordering** walks the tiles in bands of `GROUP_M` tile rows, column by column inside a band:
#
# ```
#  row-major (pid of each tile)          grouped, GROUP_M = 2
#   0  1  2  3                            0  2  4  6
#   4  5  6  7                            1  3  5  7
#   8  9 10 11                            8 10 12 14
#  12 13 14 15                            9 11 13 15
# ```
#
# The first 4 programs need 1 A strip + 4 B strips in row-major order, but 2 A strips + 2 B strips grouped;
# for a wave of 64 programs over a 32 × 32 grid with `GROUP_M = 8`: 2 + 32 = 34 strips row-major, 8 + 8 = 16
# grouped. Fewer distinct strips per wave means more L2 hits and fewer HBM bytes. Working out `pid_m`, `pid_n`
# from `pid` for the grouped order is part of the exercise. Below: the roofline point of the tile alone and the
# measured H100 bf16 matmul (cuBLAS, `torch.matmul`, from `benchmarks/results/h100-2026-11-23_fp8_gemm.json`).

# %% tags=["nbval-check-output"]
with open("../benchmarks/results/h100-2026-11-23_fp8_gemm.json") as f:
    gemm_h100 = json.load(f)
bf16 = {r["size"]: r["tflops"] for r in gemm_h100["bench"] if r["table"] == "gemm" and r["impl"] == "torch bf16"}
for B_tile in (16, 64, 128, 256):
    I_tile = B_tile * B_tile / (2 * B_tile)
    print(f"tile {B_tile:3d}x{B_tile:<3d}: I from HBM without L2 reuse = {I_tile:5.0f} FLOP/B -> at most "
          f"{min(PEAK_TC, I_tile * BW) / 1e12:4.0f} TFLOP/s")
I_4096 = 2 * 4096 ** 3 / (2 * 3 * 4096 ** 2)
print(f"measured on {gemm_h100['device']} ({gemm_h100['date']}): torch bf16 4096^3 {bf16[4096]:.0f} TFLOP/s "
      f"= {bf16[4096] / 989:.0%} of the tensor-core peak, I (one read of each input) = {I_4096:.0f} FLOP/B")
fig, ax = plt.subplots(figsize=(7.5, 4))
ax.loglog(I, np.minimum(PEAK_TC, I * BW) / 1e12, "k-", lw=2, label="H100 tensor cores, bf16")
for B_tile, c in [(16, "C0"), (128, "C2")]:
    i = B_tile / 2
    ax.plot(i, min(PEAK_TC, i * BW) / 1e12, "s", ms=8, color=c, label=f"{B_tile}² tile, every strip from HBM")
ax.plot(I_4096, bf16[4096], "*", ms=14, color="C3",
        label=f"measured: torch bf16 4096³, {bf16[4096]:.0f} TFLOP/s")
ax.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="TFLOP/s",
       title=f"matmul on the roofline ({gemm_h100['device']}, {gemm_h100['date']})")
ax.legend(fontsize=8, loc="lower right")
plt.show()

# %% [markdown]
# cuBLAS reaches 76 % of the peak at $4096^3$: big tiles, an L2-friendly order and a pipelined K loop. Our
# row-major 16 × 16 kernel is a teaching kernel; the FP8 GEMM of chapter 02 uses 128 × 128 tiles and the grouped
# order you write in the exercise.
#
# ## 11. Plots: bytes moved, and what softmax does
#
# Left: HBM bytes moved per element by an `(N = 4096, C)` bf16 softmax, forward and forward+backward, counted from
# the naive ops (upcasts included) versus the fused kernels. The step after $C = 8192$ is the looped path's second
# read of $x$ (and of $y$, $dy$ in the backward). Right: softmax of one row of logits at three *temperatures*
# $\tau$ (softmax of $x/\tau$): small $\tau$ sharpens towards the argmax, large $\tau$ flattens towards uniform.

# %% tags=["nbval-check-output"]
Cs = [2 ** k for k in range(7, 17)]  # 128 .. 65536 columns
N, elem = 4096, 2
naive_f = [bytes_per_element(naive_softmax, (N, C), dtype=torch.bfloat16)[1] for C in Cs]
naive_b = [bytes_per_element(naive_softmax_bwd, (N, C), (N, C), dtype=torch.bfloat16)[1] for C in Cs]
loops = [C > S.MAX_BLOCK_SIZE for C in Cs]
fused_f = [elem * (2 + lp) for lp in loops]           # read x (twice if looped), write y
fused_b = [elem * (3 + 2 * lp) for lp in loops]       # read y, dy (twice if looped), write dx
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
for ys, style, c, label in [([p + q for p, q in zip(naive_f, naive_b)], "s--", "C1", "naive fwd+bwd"),
                            (naive_f, "o--", "C3", "naive forward"),
                            ([p + q for p, q in zip(fused_f, fused_b)], "s-", "C0", "fused fwd+bwd"),
                            (fused_f, "o-", "C2", "fused forward")]:
    a1.semilogx(Cs, ys, style, color=c, label=label, base=2)
a1.axvline(S.MAX_BLOCK_SIZE, color="gray", ls=":", lw=1)
a1.text(S.MAX_BLOCK_SIZE * 1.1, 30, "MAX_BLOCK_SIZE:\nlooped path", color="gray", fontsize=8)
a1.set(xlabel="row length C", ylabel="HBM bytes per element", ylim=(0, 75),
       title=f"bf16 softmax of ({N}, C): bytes moved per element")
a1.legend(fontsize=8, loc="upper left", ncol=2)
logits = (torch.linspace(-2, 3, 16) + 0.5 * torch.randn(16, generator=torch.Generator().manual_seed(1))).to(DEVICE)
for tau, c in [(0.5, "C3"), (1.0, "C0"), (2.0, "C2")]:
    a2.plot(lesson_softmax((logits / tau)[None])[0].cpu(), "o-", color=c, label=f"softmax(x / {tau})")
a2.set(xlabel="column", ylabel="probability", title="one row, three temperatures")
a2.legend(fontsize=8)
plt.show()
print(f"at C = 4096, bf16: naive fwd+bwd {naive_f[5] + naive_b[5]:.0f} B/elem, fused {fused_f[5] + fused_b[5]} B/elem")

# %% [markdown]
# ## 12. Measured on an H100
#
# `benchmarks/bench_softmax.py` on an NVIDIA H100 80GB HBM3 (torch 2.11, triton 3.6), bf16, N = 4096 rows; the
# results are committed in `benchmarks/results/h100-2026-11-23_softmax.json`. Bandwidth counts the bytes a fused
# kernel must move (forward: read $x$, write $y$; forward+backward: 5 passes).

# %% tags=["nbval-check-output"]
with open("../benchmarks/results/h100-2026-11-23_softmax.json") as f:
    sm = json.load(f)
title = f"softmax (4096, C) bf16 on {sm['device']}, {sm['date']}"
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
    for impl, style in (("minite", "o-"), ("torch", "s-"), ("torch.compile", "^--")):
        rs = sorted((r["C"], r["GBps"]) for r in sm["results"] if r["impl"] == impl and r["mode"] == mode)
        ax.semilogx([c for c, _ in rs], [v for _, v in rs], style, base=2, label=impl)
    ax.axhline(sm["peak_bw"] / 1e9, color="gray", ls=":", label="HBM peak 3.35 TB/s")
    ax.set(xlabel="row length C", ylabel="GB/s", title=f"{mode}", ylim=(0, 3500))
    ax.legend(fontsize=8)
fig.suptitle(title)
plt.tight_layout()
plt.show()
print(f"{'C':>6} {'fwd vs torch':>13} {'fwd+bwd vs torch':>17} {'fwd+bwd ms':>11}")
for C in sorted({r["C"] for r in sm["results"]}):
    f_ = next(r for r in sm["results"] if r["impl"] == "minite" and r["mode"] == "fwd" and r["C"] == C)
    b_ = next(r for r in sm["results"] if r["impl"] == "minite" and r["mode"] == "fwd+bwd" and r["C"] == C)
    print(f"{C:6d} {f_['speedup_vs_torch']:12.2f}x {b_['speedup_vs_torch']:16.2f}x {b_['ms']:11.3f}")

# %% [markdown]
# What the numbers say, good and bad:
#
# * **Forward: good.** 1.1–2.7× `torch.softmax` up to C = 16384, 76–80 % of the HBM peak at C = 8192–16384.
#   At C = 32768 the looped path (two reads of $x$) is level with torch.
# * **Forward+backward: poor for short rows.** At C = 1024–4096 minite's fwd+bwd runs at **0.11–0.28× torch**
#   (4–11 % of peak). The time barely changes while the bytes quadruple (0.30, 0.25, 0.47 ms for C = 1024, 2048,
#   4096): the signature of a kernel that waits on the **host**, not on memory (an inference from the timings,
#   not yet profiled). The Python around the two launches (input checks, `movedim`/`contiguous`, the
#   `autograd.Function`) costs more than the ~20 µs the kernels need. `torch.compile`'s numbers show the same flat
#   shape (0.12–0.17×; caution: in that run some compile columns hit dynamo's recompile limit and fell back to
#   eager, see the notes in the JSON). From C = 8192 the GPU work dominates and minite is 0.9–1.35× torch.
#   Cutting that host overhead (fewer Python steps, CUDA graphs, registering the kernel for `torch.compile`) is
#   open work, not done in this chapter.
#
# ## 13. Where it is used in the GPT
#
# Every attention layer computes, for each head, $\text{softmax}\big(QK^\top/\sqrt{D} + \text{mask}\big)\,V$:
# a softmax over rows of length $T$ of a `(B, H, T, T)` score matrix, with the causal mask written as $-\infty$
# above the diagonal (which is why the kernel must treat $-\infty$ cleanly: $e^{-\infty} = 0$, never NaN).
# Below, attention written with our lesson softmax matches PyTorch's fused `scaled_dot_product_attention`.
#
# Even fused, that softmax reads and writes the whole $T \times T$ matrix: at $T = 4096$ with 12 heads in bf16
# it is 400 MB per sequence per layer. **Flash attention (chapter 07)** removes it: it streams blocks of $K$ and
# $V$ through the online max/sum recurrence of section 8 and never materializes the scores, and its two products
# are tiled `tl.dot`s like section 10's. The same recurrence gives the fused cross-entropy over a 50k-token
# vocabulary (chapter 06). For now the GPT's attention (`minite/models/gpt.py`) runs PyTorch's
# `scaled_dot_product_attention` through `minite.ops.attention`.

# %% tags=["nbval-check-output"]
B, H, T, D = 1, 2, 8, 16
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, T, D, generator=g).to(DEVICE) for _ in range(3))  # (B, H, T, D) each
scores = q @ k.transpose(-2, -1) / math.sqrt(D)                               # (B, H, T, T)
causal = torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril()
scores = scores.masked_fill(~causal, float("-inf"))                            # future keys: -inf
out = lesson_softmax(scores) @ v                                               # (B, H, T, D)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()  # fp32; SDPA's GPU kernels sum in another order
print("PASS: causal attention with the lesson's softmax matches scaled_dot_product_attention")

# %% [markdown]
# ## Summary
#
# * A Triton kernel is one **program** working on a **block**; the grid is how many programs run; **masks** guard
#   the ragged edge; **strides** locate rows and tiles.
# * Elementwise ops and row reductions are **memory-bound** (under the 67 TFLOP/s CUDA-core roof, far left of
#   its ridge): runtime ≈ bytes / bandwidth. Count the bytes, upcasts included; fuse to cut them (bf16 softmax
#   forward: 44 → 4 bytes per element).
# * Softmax backward is $dx = y\,(dy - \langle dy, y \rangle)$, from the saved output alone.
# * **Online softmax** lets one program handle a row of any length, and is the heart of flash attention.
# * Under the interpreter a kernel is Python: `print`, `breakpoint()`, `tl.device_print`; shrink the failing case
#   until one print explains it.
# * A matmul is tiles + a K loop + an fp32 accumulator; its intensity comes from reusing strips, which the tile
#   order makes possible.
#
# Next: `exercises/00_triton_from_zero_exercise.ipynb`. Four kernels this lesson did not write: a 2-D transpose, the
# log-softmax, the online softmax for long rows, and a grouped-order matmul with a fused bias + ReLU epilogue.
# `python -m minite.grading grade exercises/00_triton_from_zero_exercise.ipynb` scores them.
