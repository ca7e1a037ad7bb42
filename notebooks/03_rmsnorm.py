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
# # 03 — RMSNorm and LayerNorm: a fused, memory-bound kernel with a two-stage backward
#
# Every transformer block normalizes its activations twice. The GPT of this course uses **RMSNorm**
# (Zhang & Sennrich, *Root Mean Square Layer Normalization*, NeurIPS 2019, [arXiv:1910.07467](https://arxiv.org/abs/1910.07467));
# the original GPT-2 used **LayerNorm** (Ba, Kiros & Hinton, *Layer Normalization*, 2016,
# [arXiv:1607.06450](https://arxiv.org/abs/1607.06450)). We build both in one kernel and learn three things:
#
# 1. why a normalization is **memory-bound**, and how much traffic fusing saves;
# 2. how to **derive the backward** by hand (and check it);
# 3. how to reduce a weight gradient over millions of rows **without atomics**: a two-stage reduction.
#
# **Traffic arithmetic.** Take B·T = 16,384 rows (8 sequences of 2,048 tokens) and C = 4,096 in bf16: x is
# 16,384 × 4,096 × 2 B = 128 MiB. A normalization does ~5 flops per element, 0.3 GFLOP in all: an H100 (989 TFLOP/s
# bf16) would need 0.3 µs of compute. Reading x and writing y takes 268 MB / 3.35 TB/s ≈ **80 µs**. The op is
# bandwidth-bound by a factor of ~250, so the only thing that matters is **how many times the data crosses HBM**.
# Eager PyTorch runs one kernel per operator (upcast, square, mean, rsqrt, multiply, multiply, downcast...), and
# every one of them reads and writes a full N × C tensor. A fused kernel reads x once and writes y once.

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

# %% [markdown]
# ## 1. The math (forward)
#
# For one row $x \in \mathbb{R}^C$ with weight $w$ (and bias $b$):
#
# $$\text{RMSNorm:}\quad r = \Big(\tfrac{1}{C}\textstyle\sum_j x_j^2 + \epsilon\Big)^{-1/2},
# \qquad \hat x_i = x_i\, r,\qquad y_i = w_i\,\hat x_i$$
#
# $$\text{LayerNorm:}\quad \mu = \tfrac{1}{C}\textstyle\sum_j x_j,
# \quad r = \Big(\tfrac{1}{C}\textstyle\sum_j (x_j-\mu)^2 + \epsilon\Big)^{-1/2},
# \quad \hat x_i = (x_i-\mu)\, r,\quad y_i = w_i\,\hat x_i + b_i$$
#
# RMSNorm drops the mean subtraction (and the bias): Zhang & Sennrich show re-centring is not what makes LayerNorm
# work, re-*scaling* is, and dropping it saves one of the two reductions over the row. We call $r$ the **rstd**
# (reciprocal standard deviation). It is one number per row: the kernel stores it (4 bytes per row) so the
# backward does not have to reduce the row again.
#
# ## 2. The backward, step by step
#
# Let $g_i = \partial L/\partial \hat x_i = \mathrm{d}y_i\, w_i$ (the upstream gradient through the scale).
#
# **RMSNorm.** With $m = \frac1C\sum_j x_j^2$ and $r = (m+\epsilon)^{-1/2}$:
#
# $$\frac{\partial r}{\partial x_j} = -\tfrac12 (m+\epsilon)^{-3/2}\,\frac{2x_j}{C} = -\frac{r^3 x_j}{C}$$
#
# $$\frac{\partial \hat x_i}{\partial x_j} = \frac{\partial (x_i r)}{\partial x_j}
# = r\,\delta_{ij} + x_i \frac{\partial r}{\partial x_j} = r\,\delta_{ij} - \frac{r^3 x_i x_j}{C}$$
#
# $$\mathrm{d}x_j = \sum_i g_i \frac{\partial \hat x_i}{\partial x_j} = r\, g_j - \frac{r^3 x_j}{C}\sum_i g_i x_i
# = r\Big(g_j - \hat x_j \cdot \tfrac1C \textstyle\sum_i g_i \hat x_i\Big)$$
#
# (using $r^2 x_i x_j = \hat x_i \hat x_j$). Read it as: take $g$, remove its component along $\hat x$
# (normalization cannot change the length of $\hat x$), scale by $r$.
#
# **LayerNorm.** Now $\hat x_i = (x_i-\mu) r$ and both $\mu$ and $r$ depend on every $x_j$:
# $\partial \mu/\partial x_j = 1/C$ and, by the same steps on $v = \frac1C\sum (x_k-\mu)^2$ (the $\mu$ terms cancel
# because $\sum_k (x_k-\mu) = 0$), $\partial r/\partial x_j = -r^3 (x_j-\mu)/C$. So
#
# $$\frac{\partial \hat x_i}{\partial x_j} = r\big(\delta_{ij} - \tfrac1C\big) - \frac{r\, \hat x_i \hat x_j}{C}
# \quad\Longrightarrow\quad
# \mathrm{d}x_j = r\Big(g_j - \tfrac1C \textstyle\sum_i g_i - \hat x_j\cdot \tfrac1C\sum_i g_i \hat x_i\Big)$$
#
# one more term: the mean of $g$ is removed as well.
#
# **Parameters.** $w$ and $b$ are shared by all N rows, so their gradients sum over rows:
#
# $$\mathrm{d}w_i = \sum_{\text{rows}} \mathrm{d}y_i\, \hat x_i, \qquad \mathrm{d}b_i = \sum_{\text{rows}} \mathrm{d}y_i$$
#
# That sum over rows is the one part of the backward that does not fit "one program per row". Section 5 solves it.

# %% [markdown]
# ## 3. Naive PyTorch, and how many bytes it moves
#
# The reference below is correct and readable. To see what it costs, we run it under a `TorchDispatchMode` that
# records every aten operator eager PyTorch launches, forward **and backward**, with the bytes each one reads and
# writes. It runs on the `meta` device: shapes only, no data, no compute.

# %%
# Counts bytes each aten op reads and writes (chapter 00 builds this counter; it lives in minite.bytecount).
from minite.bytecount import CountBytes


# %%
def naive_rmsnorm(x, w, eps=1e-6):
    xf = x.float()                                   # pass 1: read bf16, write fp32 copy
    ms = xf.pow(2).mean(-1, keepdim=True)            # pass 2 (pow, writes N x C) + pass 3 (mean, reads it)
    return (xf * torch.rsqrt(ms + eps) * w.float()).to(x.dtype)  # passes 4, 5 (two muls), 6 (downcast)

N, C = 16384, 4096
x = torch.empty(N, C, dtype=torch.bfloat16, device="meta", requires_grad=True)
w = torch.empty(C, dtype=torch.bfloat16, device="meta", requires_grad=True)
dy = torch.empty(N, C, dtype=torch.bfloat16, device="meta")
with CountBytes() as fwd:
    y = naive_rmsnorm(x, w)
with CountBytes() as bwd:
    y.backward(dy)
big = N * C  # elements in one activation
for name, cb in (("forward", fwd), ("backward", bwd)):
    print(f"{name}: {len(cb.ops)} aten ops, {cb.total() / 2**20:.0f} MiB moved "
          f"= {cb.total() / big:.1f} bytes per element")
    # every op, in launch order; in parentheses: ops on a C- or N-sized vector (w's cast...), negligible traffic
    print("   ", ", ".join(op if r + wr > 8 * C else f"({op})" for op, r, wr in cb.ops))
fused_fwd = 2 * big + 2 * big            # read x, write y (bf16); rstd is 4 bytes per ROW
fused_bwd = 3 * 2 * big                  # read x and dy, write dx
print(f"fused: forward {fused_fwd / big:.0f} bytes/element, backward {fused_bwd / big:.0f} bytes/element")

# %% [markdown]
# Eager RMSNorm moves an order of magnitude more bytes than necessary: fp32 intermediates (4 bytes per element,
# twice the bf16 input) are written and re-read by each operator. The fused forward reads x (2 B) and writes y
# (2 B) per element; the fused backward reads x and dy and writes dx (6 B per element) plus small per-program
# partials. `torch.compile` can fuse much of the forward on its own; the backward's sum over rows is where a
# hand-written kernel still earns its keep.
#
# Check the naive version against PyTorch's own `F.rms_norm`, on real data:

# %% tags=["nbval-check-output"]
import torch.nn.functional as F
from minite.kernels.rmsnorm import rmsnorm_ref, layernorm_ref
x = torch.randn(6, 48) * 3 + 1
w = torch.randn(48)
b = torch.randn(48)
assert_close(naive_rmsnorm(x, w), F.rms_norm(x, (48,), w, 1e-6), name="naive vs F.rms_norm")
assert_close(rmsnorm_ref(x, w), F.rms_norm(x, (48,), w, 1e-6), name="rmsnorm_ref vs F.rms_norm")
assert_close(layernorm_ref(x, w, b), F.layer_norm(x, (48,), w, b, 1e-5), name="layernorm_ref vs F.layer_norm")
print("PASS: the references agree with torch's built-ins")

# %% [markdown]
# ## 4. The forward kernel: one program per row
#
# `minite/kernels/rmsnorm.py` holds one kernel for both norms; the constexpr `LAYERNORM` switches the mean
# subtraction and bias on, so the compiler builds two specialised kernels and the branch costs nothing at run time.
#
# * **One program per row.** The grid is `(N,)`. A row (C ≤ 65,536 elements) fits in one program: the whole row
#   is loaded once into registers, reduced, scaled and stored. `BLOCK_SIZE` is the next power of two ≥ C; the
#   tail lanes are masked (`other=0.0`) and, for LayerNorm, forced back to 0 after centring, or they would add
#   $\mu^2$ each to the variance.
# * **fp32 statistics.** The row is loaded and converted to fp32 immediately; the mean of squares of bf16 values
#   summed in bf16 would lose everything past the 8th bit. Only the final `y` is rounded, once, on store.
# * **How `tl.sum` reduces.** This is the idea of FasterTransformer's layer-norm kernel, written for you by the
#   compiler: each thread sums the elements it holds, a warp combines its 32 partial sums with shuffles
#   (`__shfl_xor_sync`, no memory traffic), then the warps of the block exchange their results through shared
#   memory. In Triton you choose `num_warps` (how many warps share a row: more for wider rows) and `tl.sum` emits
#   the thread → warp → block tree.
# * **Saved for backward:** `rstd` (and `mean`), one fp32 number per row: 4 bytes next to the row's 2C bytes.

# %%
from minite.kernels import rmsnorm as K
print(inspect.getsource(K._norm_fwd_kernel.fn))

# %% [markdown]
# ## 5. The backward kernel: dx per row, dw in two stages
#
# `dx` is per row: the formula from section 2, with `xhat` recomputed from `x`, `mean` and `rstd` (recomputing is
# cheaper than storing an N × C fp32 `xhat` and reading it back). `dw` (and `db`) sum over **all** rows. Options:
#
# * **Atomics** (`tl.atomic_add(DW + cols, dy * xhat)` from every row): N = 16,384 programs hammer the same C
#   addresses, so the adds serialize (contention), and floating-point addition is not associative, so the order the
#   GPU happens to pick changes the bits of `dw` from run to run (**non-deterministic** training).
# * **Two stages** (what we do, as Liger-Kernel and the Triton layer-norm tutorial do): launch P programs, with P a
#   few per SM (`4 × 132 = 528` on an H100). Program `p` walks its own contiguous chunk of ⌈N/P⌉ rows, keeps a
#   running `dw` partial **in registers**, and writes it once to `DW_partial[p, :]`. Stage two sums the (P, C) fp32
#   partials: `dw_partial.sum(0)`. That read is P·C·4 bytes, ~8.25 MiB (2.2 M fp32 numbers) for P = 528 and
#   C = 4,096, against 256 MiB of x and dy. No atomics, no contention, the same order every run: **bitwise
#   deterministic**.
#
# Spreading rows over P programs (instead of one program per row) is what makes the register accumulator possible:
# each program reuses its `w` load and its partial sum across N/P rows.

# %%
print(inspect.getsource(K._norm_bwd_kernel.fn))

# %% [markdown]
# ## 6. Checks: kernel vs reference, forward and backward
#
# `check_op` runs the Triton path and the reference on the same inputs and one random upstream gradient, and compares
# the output and **every** input gradient: `grad[0]` = dx, `grad[1]` = dw, `grad[2]` = db. Odd C exercises the
# masks; 13 rows over 4 backward programs (on the CPU) exercises the row loop and a short last chunk.

# %% tags=["nbval-check-output"]
from minite.ops import rmsnorm, layernorm
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for shape in ((13, 37), (2, 3, 64)):
        x = torch.randn(shape).to(dtype)
        w = (1 + 0.5 * torch.randn(shape[-1])).to(dtype)
        b = (0.5 * torch.randn(shape[-1])).to(dtype)
        assert check_op("rmsnorm", lambda x, w: rmsnorm(x, w, backend="triton"), rmsnorm_ref, x, w)
        assert check_op("layernorm", lambda x, w, b: layernorm(x, w, b, backend="triton"), layernorm_ref, x, w, b)

# %% [markdown]
# The two-stage reduction does not depend on how rows are split: 1 program (a serial loop), 4, or one program per
# row give the same `dw`, and running the same split twice gives the same bits.

# %% tags=["nbval-check-output"]
x, w = torch.randn(13, 24), torch.randn(24)
dy = torch.randn(13, 24)
y, rstd = K.rmsnorm_fwd(x, w, 1e-6)
xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
rmsnorm_ref(xr, wr).backward(dy)
for P in (1, 4, 13):
    dx, dw = K.rmsnorm_bwd(dy, x, w, rstd, n_programs=P)
    dx2, dw2 = K.rmsnorm_bwd(dy, x, w, rstd, n_programs=P)
    err = max((dx - xr.grad).abs().max().item(), (dw - wr.grad).abs().max().item())
    print(f"P={P:2d}: matches autograd: {err < 1e-5}, bitwise repeatable: {torch.equal(dw, dw2)}")

# %% [markdown]
# ## 7. Plot: bytes moved, naive vs fused
#
# Counted on the `meta` device as above, for B·T = 16,384 rows of bf16 and the hidden sizes of GPT-2 small (768) up
# to Llama-70B (8,192). The fused backward includes writing and re-reading the (P, C) fp32 partials, P = 528.

# %%
N, P = 16384, 528
sizes = [768, 1024, 2048, 4096, 8192]
naive_mb, fused_mb = [], []
for C in sizes:
    x = torch.empty(N, C, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(C, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with CountBytes() as cb:
        naive_rmsnorm(x, w).backward(torch.empty(N, C, dtype=torch.bfloat16, device="meta"))
    naive_mb.append(cb.total() / 2**20)
    fwd = 2 * N * C * 2 + 2 * C + 4 * N                        # x, y, w, rstd
    bwd = 3 * N * C * 2 + 2 * C + 4 * N + 2 * P * C * 4 + 2 * C  # x, dy, dx, w, rstd, partials out+in, dw
    fused_mb.append((fwd + bwd) / 2**20)
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(sizes, naive_mb, "o-", label="eager PyTorch (fwd + bwd)")
ax.plot(sizes, fused_mb, "s-", label="fused Triton (fwd + bwd)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("hidden size C")
ax.set_ylabel("MiB moved (B·T = 16,384 rows, bf16)")
ax.set_title("RMSNorm memory traffic")
ax.legend()
ax.grid(alpha=0.3)
plt.show()
for C, n, f in zip(sizes, naive_mb, fused_mb):
    print(f"C={C:5d}: eager {n:7.0f} MiB, fused {f:6.0f} MiB, ratio {n / f:.1f}x, "
          f"fused at 3.35 TB/s: {f * 2**20 / 3.35e12 * 1e6:.0f} us")

# %% [markdown]
# ## 8. GPU benchmark (runs only when a CUDA device is present)
#
# `benchmarks/bench_rmsnorm.py` is the full version (forward and forward+backward, vs eager and `torch.compile`,
# Liger-Kernel when installed, results saved to `benchmarks/results/`). A short version:

# %%
if torch.cuda.is_available():
    from triton.testing import do_bench
    for C in (1024, 4096, 8192):
        x = torch.randn(16384, C, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(C, device="cuda", dtype=torch.bfloat16)
        ms_fused = do_bench(lambda: rmsnorm(x, w, backend="triton"))
        ms_eager = do_bench(lambda: naive_rmsnorm(x, w))
        gbs = 2 * x.numel() * x.element_size() / (ms_fused * 1e-3) / 1e9
        print(f"C={C}: fused {ms_fused * 1e3:.0f} us ({gbs:.0f} GB/s, {gbs / 3350:.0%} of H100 peak), "
              f"eager {ms_eager * 1e3:.0f} us")
else:
    print("No CUDA device here: the kernels above ran on the Triton CPU interpreter (correct, not fast).")

# %% [markdown]
# ## 9. Where it runs in the GPT
#
# `minite/models/gpt.py` builds every block as `x = x + attn(norm1(x))`, `x = x + mlp(norm2(x))`, plus a final
# norm before the LM head, all `minite.nn.RMSNorm` (`minite.nn.LayerNorm` is the drop-in for a GPT-2-style
# model): 2L + 1 norms per forward pass. The module's `state_dict` holds just `weight` (and `bias`), so checkpoints
# do not depend on the backend. The lines that use it:

# %%
import pathlib, minite
gpt = pathlib.Path(minite.__file__).parent / "models" / "gpt.py"
lines = gpt.read_text().splitlines() if gpt.exists() else []
hits = [f"gpt.py:{i}: {ln.strip()}" for i, ln in enumerate(lines, 1) if "Norm(" in ln or "norm(" in ln]
print("\n".join(hits) if hits else "minite/models/gpt.py does not use the norms yet")
print(minite.nn.RMSNorm(8), list(minite.nn.RMSNorm(8).state_dict()))

# %% [markdown]
# **Going further.** In a pre-norm block the residual add and the next norm read the same tensor: a fused
# `residual + x -> (sum, norm(sum))` kernel saves another full read and write per block (Liger-Kernel and vLLM
# ship one). It is the same kernel with one more load and one more store: try it.
