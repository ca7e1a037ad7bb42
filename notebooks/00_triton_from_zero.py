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
# # 00 — Triton from zero: execution model, roofline, vector add, fused softmax
#
# Every later chapter of this course writes a GPU kernel, checks it against a PyTorch reference and explains
# why it is faster. This chapter builds the vocabulary once:
#
# 1. **the execution model**: programs, blocks, masks, strides;
# 2. **memory traffic and the roofline**: why most of a transformer's non-matmul ops are limited by memory
#    bandwidth, not by arithmetic, and how to predict their runtime with one division;
# 3. **a first kernel**: masked vector add;
# 4. **a real one**: row softmax, forward and backward, fused into one read and one write per element
#    (the naive PyTorch version moves the data about 8 times), with an *online* max/sum for rows that do not fit
#    in one block: the trick flash attention (chapter 07) is built on.
#
# The library version lives in `minite/kernels/softmax.py` (`minite.ops.softmax`, `minite.nn.Softmax`). Without a
# GPU, Triton's **interpreter** (`TRITON_INTERPRET=1`) runs the same kernels on the CPU, slowly but exactly, so
# every check here runs on a laptop; the benchmark section needs a GPU.

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
# moving data; a slice of columns keeps the row stride of the parent. Kernels therefore take the **row stride** as an
# argument instead of assuming `C`:
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
# For an H100 SXM: 989 TFLOP/s (dense bf16 tensor cores) and 3.35 TB/s of HBM3. The **ridge point**
# $989 / 3.35 \approx 295$ FLOP/byte separates memory-bound kernels (left) from compute-bound ones (right).
#
# | op | FLOPs per element | bytes per element | intensity |
# |---|---|---|---|
# | vector add, fp32: `z = x + y` | 1 | 4 + 4 read, 4 write = 12 | 0.083 |
# | row softmax, bf16, **fused**: max, subtract, exp, sum, divide | ~5 | 2 read + 2 write = 4 | ~1.25 |
# | row softmax, bf16, **naive** PyTorch (8 passes, section 4) | ~5 | 8 × 2 = 16 | ~0.31 |
# | matmul bf16, $M=N=K=8192$: $2MNK$ FLOPs over $2(MK+KN+MN)$ bytes | | | $8192/3 \approx 2731$ |
#
# Softmax sits two orders of magnitude left of the ridge: its speed is **bytes / bandwidth**, and the only way to
# make it faster is to move fewer bytes. Fusing does exactly that.

# %% tags=["nbval-check-output"]
import numpy as np
BW, PEAK = 3.35e12, 989e12  # H100 SXM: HBM3 bytes/s, dense bf16 FLOP/s
ridge = PEAK / BW
ops = {"vector add fp32": 1 / 12, "softmax bf16, naive": 5 / 16, "softmax bf16, fused": 5 / 4,
       "matmul bf16 8192^3": 8192 / 3}
for name, I in ops.items():
    att = min(PEAK, I * BW)
    bound = "memory" if I < ridge else "compute"
    print(f"{name:20s} I = {I:8.3f} FLOP/B -> {att / 1e12:7.2f} TFLOP/s attainable ({bound}-bound)")
print(f"ridge point: {ridge:.0f} FLOP/B")

I = np.logspace(-2, 4, 400)
fig, ax = plt.subplots(figsize=(7, 4))
ax.loglog(I, np.minimum(PEAK, I * BW) / 1e12, "k-", lw=2, label="H100 roofline")
ax.axvline(ridge, color="gray", ls=":", lw=1)
ax.text(ridge * 1.15, 2, f"ridge {ridge:.0f} FLOP/B", color="gray")
for (name, i), c in zip(ops.items(), ["C0", "C3", "C2", "C1"]):
    ax.plot(i, min(PEAK, i * BW) / 1e12, "o", ms=9, color=c, label=f"{name} (I={i:.3g})")
ax.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="attainable TFLOP/s",
       title="Roofline: H100 SXM, 3.35 TB/s HBM, 989 TFLOP/s bf16")
ax.legend(loc="lower right", fontsize=8)
plt.show()

# %% [markdown]
# **Memory-traffic arithmetic, the back-of-the-envelope that predicts a memory-bound kernel's runtime.** The
# attention scores of one layer of a small GPT, batch 8 × 12 heads × $T = 1024$ queries, are $N = 98\,304$ rows
# of $C = 1024$ columns in bf16: 201 MB. A fused softmax reads them once and writes them once (402 MB,
# 0.12 ms at 3.35 TB/s); the naive one moves them 8 times (1.6 GB, 0.48 ms). Same FLOPs, four times the time.

# %% tags=["nbval-check-output"]
N, C, elem = 8 * 12 * 1024, 1024, 2  # (B*H*T, T) bf16 attention scores
for name, passes in [("fused", 2), ("naive", 8)]:
    nbytes = passes * N * C * elem
    print(f"{name}: {passes} passes = {nbytes / 1e9:.2f} GB -> {nbytes / BW * 1e3:.3f} ms at 3.35 TB/s")


# %% [markdown]
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


for n in (1, 1000, 4096):  # 1000 is not a multiple of 256: the mask matters
    x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    assert check_op(f"vector add n={n}", add, torch.add, x, y, grad=False)

# %% [markdown]
# ## 4. Row softmax: the math
#
# For one row $x \in \mathbb{R}^C$:
#
# $$ y_i = \frac{e^{x_i}}{\sum_{k=1}^{C} e^{x_k}} = \frac{e^{x_i - m}}{\sum_k e^{x_k - m}}, \qquad m = \max_k x_k . $$
#
# Both forms are equal (the factor $e^{-m}$ cancels), but only the second is safe: $e^{89} $ already overflows fp32,
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
# ## 5. Naive PyTorch, op by op, and its memory passes
#
# Eager PyTorch runs one kernel per operation, and each kernel reads its inputs from HBM and writes its output
# back. Written out, the stable softmax is five ops, the backward four:

# %%
def naive_softmax(x, dim=-1):
    xf = x.float()                       # compute in fp32 (a no-op for fp32 input)
    m = xf.amax(dim, keepdim=True)       # read N*C, write N
    z = xf - m                           # read N*C (+N), write N*C
    e = z.exp()                          # read N*C, write N*C
    s = e.sum(dim, keepdim=True)         # read N*C, write N
    return (e / s).to(x.dtype)           # read N*C (+N), write N*C      -> 5 reads + 3 writes = 8 passes


def naive_softmax_bwd(y, dy, dim=-1):
    p = dy * y                           # read 2*N*C, write N*C
    dot = p.sum(dim, keepdim=True)       # read N*C, write N
    t = dy - dot                         # read N*C (+N), write N*C
    return y * t                         # read 2*N*C, write N*C         -> 6 reads + 3 writes = 9 passes


# %% [markdown]
# Rather than trust the comments, count. A `TorchDispatchMode` sees every aten op PyTorch runs; we log the bytes of
# its tensor inputs (reads) and outputs (writes). On the `meta` device nothing is computed, only shapes flow, so
# this works for any size instantly.

# %%
import inspect
from minite.bytecount import CountBytes, nbytes  # the counter, kept in minite for later chapters

print(inspect.getsource(nbytes))
print(inspect.getsource(CountBytes))


# %% tags=["nbval-check-output"]
def passes(fn, *shapes_and_dtype, dtype=torch.float32):
    """Run fn on meta tensors; return (per-op table, total bytes / (N*C*element size))."""
    ts = [torch.empty(s, device="meta", dtype=dtype) for s in shapes_and_dtype]
    with CountBytes() as cb:
        fn(*ts)
    unit = ts[0].numel() * ts[0].element_size()
    return cb.ops, sum(r + w for _, r, w in cb.ops) / unit


N, C = 4096, 1000
for title, fn, shapes in [("forward", naive_softmax, [(N, C)]), ("backward", naive_softmax_bwd, [(N, C), (N, C)])]:
    ops, total = passes(fn, *shapes)
    print(f"naive {title}: {len(ops)} kernels, {total:.2f} passes over N*C elements")
    for name, r, w in ops:
        print(f"    {name:6s} reads {r / (N * C * 4):.2f}  writes {w / (N * C * 4):.2f}  (x N*C*4 bytes)")
print("fused forward: 1 read + 1 write = 2 passes; fused backward: read y, dy + write dx = 3 passes")

# %% [markdown]
# ## 6. The fused kernel
#
# **One program per row.** Program `i` loads row `i` into registers (masked lanes read $-\infty$: they change
# neither the max nor the sum, since $e^{-\infty} = 0$), computes max, exp, sum and the division there, and stores
# the row: 2 passes instead of 8. Loads are converted to fp32 at once (bf16 arithmetic is slow on some GPUs and
# wrong on the CPU interpreter) and the result is cast back to the output's type on the store.
#
# **Rows longer than a block.** A program can hold only so much in registers (`MAX_BLOCK_SIZE` = 8192 columns
# here). For longer rows the kernel walks the row in blocks and keeps two running numbers: the max so far $m$
# and the sum so far $d = \sum e^{x_k - m}$. When a new block raises the max to $m'$, the old sum is rescaled:
#
# $$ d' = d\, e^{m - m'} + \sum_{k \in \text{block}} e^{x_k - m'} . $$
#
# This is **online softmax** (Milakov & Gimelshein, 2018). A second sweep writes $y = e^{x - m} / d$, so long rows
# cost 3 passes instead of 2. Flash attention (chapter 07) uses exactly this recurrence, with the row of
# attention scores never written to memory at all. Check the recurrence in plain PyTorch first:

# %% tags=["nbval-check-output"]
row = 3 * torch.randn(50, generator=torch.Generator().manual_seed(0))
m, d = torch.tensor(-float("inf")), torch.tensor(0.0)
for blk in row.split(16):  # blocks of 16, 16, 16, 2 columns
    m_new = torch.maximum(m, blk.max())
    d = d * torch.exp(m - m_new) + torch.exp(blk - m_new).sum()
    m = m_new
print("running max == max:", bool(m == row.max()),
      "| running sum == sum:", bool(torch.isclose(d, torch.exp(row - row.max()).sum())))

# %% [markdown]
# Here is minite's forward kernel. Note the `SINGLE_BLOCK` constexpr: Triton compiles a separate kernel per
# value of a `tl.constexpr`, so the branch costs nothing at run time. `ACC_DTYPE` is fp32, or fp64 for fp64
# input (which lets `torch.autograd.gradcheck` test the kernel with finite differences).

# %%
print(inspect.getsource(S._softmax_fwd_kernel.fn))

# %% [markdown]
# The backward kernel is the formula from section 4, $dx = y\,(dy - \langle dy, y\rangle)$: one dot product per
# row, then an elementwise expression. And the launcher: move `dim` last, make the tensor contiguous, flatten it
# to `(N, C)`, pick the block from a tiny heuristic (no autotuning: it breaks on the CPU interpreter), launch
# `N` programs.

# %%
print(inspect.getsource(S._softmax_bwd_kernel.fn))
print(inspect.getsource(S._launch_config))
print(inspect.getsource(S.softmax_fwd))


# %% [markdown]
# `SoftmaxFunction` (a `torch.autograd.Function`) calls the two launchers and saves only `y`; the functional
# `minite.ops.softmax(x, *, dim=-1, backend=None)` validates its input and picks the Triton path on a GPU or under
# the interpreter, the reference `softmax_ref` otherwise.
#
# ## 7. Check it against the naive version
#
# `check_op` runs both functions on copies of the input, back-propagates the same random upstream gradient through
# both, and compares the output and the input gradient with the tolerance for the dtype (fp16: ~2 ulp, bf16: ~2 ulp,
# fp32: 1e-5). Odd shapes on purpose: a single column, a row one past a power of two, a softmax over a middle
# dimension, and a row longer than one block (the looped path).

# %% tags=["nbval-check-output"]
def triton_softmax(x, dim=-1):
    return softmax(x, dim=dim, backend="triton")


torch.manual_seed(0)
for shape, dim in [((1, 1), -1), ((3, 1000), -1), ((7, 4097), -1), ((2, 3, 17), 1), ((2, 20000), -1)]:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (3 * torch.randn(shape)).to(dtype).to(DEVICE)
        assert check_op(f"softmax dim={dim}", triton_softmax, naive_softmax, x, dim=dim)

# %% [markdown]
# ## 8. Plots: bytes moved, and what softmax does
#
# Left: HBM bytes moved per element by an `(N = 4096, C)` fp32 softmax, forward and forward+backward, counted from
# the naive ops (with the `CountBytes` mode above) versus the fused kernels; multiply by $N \cdot C$ for the total.
# The step after $C = 8192$ is the looped path's second read: fused still moves 2.1× (fwd+bwd) to 2.7×
# (forward) fewer bytes than naive. Right: the kernel's output for one row of logits at three *temperatures*
# $\tau$ (softmax of $x/\tau$): small $\tau$ sharpens towards the argmax, large $\tau$ flattens towards uniform.

# %% tags=["nbval-check-output"]
Cs = [2 ** k for k in range(7, 17)]  # 128 .. 65536 columns
N, elem = 4096, 4
naive_f = [passes(naive_softmax, (N, C))[1] for C in Cs]  # fp32: no casts, 8 passes
naive_b = [passes(naive_softmax_bwd, (N, C), (N, C))[1] for C in Cs]
loops = [C > S.MAX_BLOCK_SIZE for C in Cs]  # the looped path reads x (or y, dy) a second time
fused_f = [2 + lp for lp in loops]
fused_b = [3 + 2 * lp for lp in loops]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
for ys, style, c, label in [([p + q for p, q in zip(naive_f, naive_b)], "s--", "C1", "naive fwd+bwd"),
                            (naive_f, "o--", "C3", "naive forward"),
                            ([p + q for p, q in zip(fused_f, fused_b)], "s-", "C0", "fused fwd+bwd"),
                            (fused_f, "o-", "C2", "fused forward")]:
    a1.semilogx(Cs, [elem * p for p in ys], style, color=c, label=label, base=2)
a1.axvline(S.MAX_BLOCK_SIZE, color="gray", ls=":", lw=1)
a1.text(S.MAX_BLOCK_SIZE * 1.1, 50, "MAX_BLOCK_SIZE:\nlooped path", color="gray", fontsize=8)
a1.set(xlabel="row length C", ylabel="HBM bytes per element", ylim=(0, 95),
       title=f"fp32 softmax of ({N}, C): bytes moved per element")
a1.legend(fontsize=8, loc="upper left", ncol=2)

logits = (torch.linspace(-2, 3, 16) + 0.5 * torch.randn(16, generator=torch.Generator().manual_seed(1))).to(DEVICE)
for tau, c in [(0.5, "C3"), (1.0, "C0"), (2.0, "C2")]:
    a2.plot(triton_softmax(logits / tau).cpu(), "o-", color=c, label=f"softmax(x / {tau})")
a2.set(xlabel="column", ylabel="probability", title="one row, three temperatures")
a2.legend(fontsize=8)
plt.show()
print(f"at C = 4096: naive fwd+bwd {naive_f[5] + naive_b[5]:.1f} passes, fused {fused_f[5] + fused_b[5]} passes")

# %% [markdown]
# ## 9. Benchmark (GPU only)
#
# `triton.testing.do_bench` runs a function many times and returns the median milliseconds. Bandwidth counts the
# bytes the fused kernel must move (2 × N × C × 2 bytes in bf16); a good kernel reaches 80–90 % of the HBM peak.
# The full sweep, with forward+backward and `torch.compile`, is `python benchmarks/bench_softmax.py`.

# %%
if torch.cuda.is_available():
    rows, Cs_b, res = 4096, [1024, 2048, 4096, 8192, 16384, 32768], []
    for C in Cs_b:
        x = torch.randn(rows, C, device="cuda", dtype=torch.bfloat16)
        gbps = lambda ms: 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9  # noqa: E731
        ms_m = triton.testing.do_bench(lambda: triton_softmax(x))
        ms_t = triton.testing.do_bench(lambda: torch.softmax(x, dim=-1))
        res.append((gbps(ms_m), gbps(ms_t)))
        print(f"C={C:6d}: minite {ms_m * 1e3:7.1f} us {gbps(ms_m):6.0f} GB/s | torch {ms_t * 1e3:7.1f} us "
              f"{gbps(ms_t):6.0f} GB/s")
    plt.figure(figsize=(6, 3.5))
    plt.semilogx(Cs_b, [r[0] for r in res], "o-", label="minite (Triton)")
    plt.semilogx(Cs_b, [r[1] for r in res], "s-", label="torch.softmax")
    plt.axhline(3350, color="gray", ls=":", label="H100 HBM peak")
    plt.xlabel("row length C"), plt.ylabel("GB/s"), plt.title(f"softmax ({rows}, C) bf16 forward")
    plt.legend()
    plt.show()
else:
    print("No CUDA device: skipping the benchmark (run this notebook on a GPU, or benchmarks/bench_softmax.py).")

# %% [markdown]
# ## 10. Where it is used in the GPT
#
# Every attention layer computes, for each head, $\text{softmax}\big(QK^\top/\sqrt{D} + \text{mask}\big)\,V$:
# a softmax over rows of length $T$ of a `(B, H, T, T)` score matrix, with the causal mask written as $-\infty$
# above the diagonal (which is why the kernel must treat $-\infty$ cleanly: $e^{-\infty} = 0$, never NaN).
# Below, attention written with `minite.ops.softmax` matches PyTorch's fused `scaled_dot_product_attention`.
#
# Even fused, that softmax reads and writes the whole $T \times T$ matrix: at $T = 4096$ with 12 heads in bf16
# it is 400 MB per sequence per layer. **Flash attention (chapter 07)** removes it: it streams blocks of $K$ and
# $V$ through the online max/sum recurrence of section 6 and never materializes the scores. The same recurrence
# gives the fused cross-entropy over a 50k-token vocabulary (chapter 06), a row far longer than one block.
#
# Softmax is the heart of attention, but the GPT does not call this softmax kernel directly: for now the
# attention of `minite/models/gpt.py` runs PyTorch's `scaled_dot_product_attention` through `minite.ops.attention`
# (a reference path). Chapter 07 replaces it with a flash-attention kernel that fuses this very softmax (the online
# max/sum of section 6) into the attention tiles.

# %% tags=["nbval-check-output"]
import minite
B, H, T, D = 1, 2, 8, 16
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, T, D, generator=g).to(DEVICE) for _ in range(3))  # (B, H, T, D) each
scores = q @ k.transpose(-2, -1) / math.sqrt(D)                               # (B, H, T, T)
causal = torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril()
scores = scores.masked_fill(~causal, float("-inf"))                            # future keys: -inf
out = minite.ops.softmax(scores, dim=-1) @ v                                   # (B, H, T, D)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()  # fp32; SDPA's GPU kernels sum in another order
print("PASS: causal attention with minite.ops.softmax matches scaled_dot_product_attention")

# %% [markdown]
# ## Summary
#
# * A Triton kernel is one **program** working on a **block**; the grid is how many programs run; **masks** guard
#   the ragged edge; **strides** locate rows.
# * Elementwise ops and row reductions are **memory-bound**: runtime ≈ bytes / bandwidth. Count passes over the
#   data; fuse to cut them (softmax: 8 → 2 forward, 9 → 3 backward).
# * Softmax backward is $dx = y\,(dy - \langle dy, y \rangle)$, from the saved output alone.
# * **Online softmax** lets one program handle a row of any length, and is the heart of flash attention.
#
# Next: `exercises/00_triton_from_zero.ipynb`: write the vector add, the softmax forward and backward kernels, and
# the online statistics yourself; `python -m minite.grading grade exercises/00_triton_from_zero.ipynb` scores them.
