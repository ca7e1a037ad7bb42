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
# # 06 — Cross-entropy, the vocabulary, and its padding
#
# The last layer of a GPT turns $N = B\cdot T$ hidden states into $V$ logits each and scores them with
# cross-entropy. With GPT-2's tokenizer $V = 50257$ (we pad it to **50304**, §8). It is the biggest activation of
# the whole model:
#
# | tensor, $N = 8192$, $V = 50304$ | bytes |
# |---|---|
# | logits, bf16 | $8192 \cdot 50304 \cdot 2 = 824$ MB |
# | their fp32 copy (eager `logits.float()`) | 1.65 GB |
# | log-softmax, fp32, saved for backward | 1.65 GB |
# | dlogits, fp32 then bf16 | 1.65 GB + 0.82 GB |
#
# A 124M-parameter model's weights are 0.25 GB in bf16: the loss alone can take **ten times** the memory of the
# model. This chapter builds (1) a cross-entropy kernel that streams each row once with an **online logsumexp**
# and recomputes the softmax in the backward, and (2) a **fused linear + cross-entropy** that never materialises
# the $(N, V)$ logits at all (the idea behind Liger-Kernel's `FusedLinearCrossEntropy` and Apple's "Cut Your Losses",
# Wijmans et al. 2024, [arXiv:2411.09009](https://arxiv.org/abs/2411.09009)). The online softmax recurrence is
# Milakov & Gimelshein, *Online normalizer calculation for softmax* (2018, [arXiv:1805.02867](https://arxiv.org/abs/1805.02867)).

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import json, pathlib
import matplotlib.pyplot as plt
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)  # every input below: drawn on the CPU from this, then moved to DEVICE


# %% [markdown]
# ## 1. The math
#
# For one row of logits $x \in \mathbb{R}^V$ and target class $t$:
# $$p_j = \mathrm{softmax}(x)_j = \frac{e^{x_j}}{\sum_k e^{x_k}}, \qquad
# \log p_j = x_j - \underbrace{\log\sum_k e^{x_k}}_{\mathrm{lse}(x)}, \qquad
# \ell = -\log p_t = \mathrm{lse}(x) - x_t .$$
#
# **Gradient, step by step.** $\dfrac{\partial\,\mathrm{lse}}{\partial x_j} = \dfrac{e^{x_j}}{\sum_k e^{x_k}} = p_j$
# and $\dfrac{\partial x_t}{\partial x_j} = [j = t]$, so
# $$\frac{\partial \ell}{\partial x_j} = p_j - [j=t]
# \qquad\text{i.e.}\qquad \nabla_x \ell = \mathrm{softmax}(x) - \mathrm{onehot}(t).$$
# No log, no division by $p$: the backward needs only $x$ and the scalar $\mathrm{lse}$ (one float per row).
#
# **Reductions and `ignore_index`.** Rows whose target equals `ignore_index` (padding, prompt tokens) contribute
# 0 loss and 0 gradient. `"sum"` adds the row losses; `"mean"` divides by the number of **non-ignored** rows
# $n_{valid}$, so each row's gradient is $(p - \mathrm{onehot}(t)) / n_{valid}$. (Two common variants change the
# target or add a term: label smoothing, and PaLM's z-loss on $\mathrm{lse}^2$; exercise 06 derives both.)
#
# **Online logsumexp.** A row of 50304 logits does not fit one register tile, so we read it in blocks $B_1, B_2, \dots$
# keeping a running max $m$ and a running sum $s = \sum e^{x_k - m}$ over the blocks seen so far:
# $$m' = \max\big(m, \max_{k\in B} x_k\big), \qquad s' = s\,e^{m - m'} + \sum_{k \in B} e^{x_k - m'},
# \qquad \mathrm{lse} = m + \log s .$$
# The rescale factor $e^{m-m'} \le 1$ corrects the old sum when the max grows; every exponent is $\le 0$, so
# nothing overflows even for logits of $10^4$. One pass over the row, instead of a max pass and a sum pass.

# %%
def online_lse(x, block=1000):
    m, s = torch.tensor(float("-inf"), dtype=x.dtype), torch.tensor(0.0, dtype=x.dtype)
    for start in range(0, x.numel(), block):
        b = x[start:start + block]
        m_new = torch.maximum(m, b.max())
        s = s * torch.exp(m - m_new) + torch.exp(b - m_new).sum()
        m = m_new
    return m + torch.log(s)

x = 30 * torch.randn(50304, dtype=torch.float64, generator=gen)
print("online:", round(online_lse(x).item(), 9), " torch.logsumexp:", round(torch.logsumexp(x, 0).item(), 9))
assert_close(online_lse(x), torch.logsumexp(x, 0), name="online logsumexp, 51 blocks")
print("naive log(sum(exp(x))) in fp32 for x ~ 1e4:", torch.log(torch.exp(torch.tensor([1e4, 0.0])).sum()).item())

# %% [markdown]
# ## 2. Naive PyTorch, memory passes and peak memory counted
#
# `F.cross_entropy(logits.float(), t)` is `log_softmax` + `nll_loss`. We count the bytes each aten op moves
# (forward + backward) on the `meta` device at the real size, and the **peak** bytes alive at once.

# %%
# Counts bytes each aten op reads and writes (chapter 00 builds this counter; it lives in minite.bytecount).
from minite.bytecount import CountBytes, PeakBytes

# %%
N, V = 8192, 50304
lm = torch.empty(N, V, device="meta", dtype=torch.bfloat16, requires_grad=True)
tm = torch.zeros(N, device="meta", dtype=torch.long)
one = N * V * 2  # one bf16 (N, V) tensor
with CountBytes() as cb, PeakBytes() as pb:
    loss = F.cross_entropy(lm.float(), tm)
    loss.backward()
for name, r, w in cb.ops:
    if r + w > one / 10:
        print(f"{name:>26}: read {r / 1e9:5.2f} GB, write {w / 1e9:5.2f} GB")
traffic = sum(r + w for _, r, w in cb.ops)
print(f"eager traffic {traffic / 1e9:.1f} GB = {traffic / one:.0f} x the bf16 logits; peak {pb.peak / 1e9:.1f} GB")
print(f"a fused kernel: fwd reads the logits once, bwd reads them and writes dlogits: {3 * one / 1e9:.1f} GB")


# %% [markdown]
# ## 3. The Triton kernels, in three steps
#
# **Step 1: the online logsumexp of each row.** One program per row loops over the vocabulary in blocks of
# `BLOCK`. Masked lanes load $-\infty$: they add $e^{-\infty} = 0$ to the sum and never win the max. The running
# `m` and `s` are fp32 scalars carried through the loop.

# %%
@triton.jit
def lse_kernel(X_ptr, x_stride, LSE_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)          # running max
    s = tl.full((), 0.0, tl.float32)                    # running sum of exp(x - m)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(X_ptr + row * x_stride + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(LSE_ptr + row, m + tl.log(s))


x = (4 * torch.randn(3, 300, generator=gen)).to(torch.bfloat16).to(DEVICE)
x[0, 250] = 80.0                                         # the max arrives late: the sum must be rescaled
lse = torch.empty(3, device=DEVICE)
lse_kernel[(3,)](x, x.stride(0), lse, 300, BLOCK=64)    # 5 blocks, the last one 44/64 full
assert_close(lse, torch.logsumexp(x.float(), -1), name="lse")
print("PASS: step 1, online logsumexp in blocks of 64")


# %% [markdown]
# **Step 2: the loss.** Add the target: its logit is **one scalar load** at `row * stride + t` (no one-hot, no
# gather over the row). Rows whose target is `ignore_index` get loss 0; their target index is not loaded (and a target
# outside `[0, V)` is masked rather than read past the row). The kernel stores the row loss and its lse, both fp32
# whatever the logits' dtype: the sum of 8192 row losses in bf16 (8 mantissa bits) would be off in the second digit.

# %%
@triton.jit
def ce_fwd_kernel(X_ptr, x_stride, T_ptr, Loss_ptr, LSE_ptr, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X_ptr += row * x_stride                              # int64: N * V passes 2**31 at 8192 x 50304
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(X_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(T_ptr + row)
    valid = t != ignore_index
    inside = valid & (t >= 0) & (t < V)
    x_t = tl.load(X_ptr + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
    tl.store(Loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(LSE_ptr + row, lse)                         # saved: the backward needs no reduction


# %% [markdown]
# **Step 3: the backward.** Recompute $p = e^{x - \mathrm{lse}}$ block by block from the saved lse and write
# $g\,(p - \mathrm{onehot}(t))$ in the logits' dtype, with $g$ the upstream gradient of the row ($1/n_{valid}$ for
# the mean, 0 on ignored rows). Each element is read and then written by the same program, so `DX` may be `X`
# itself: the fused linear-CE of §5 overwrites its logits with their gradient **in place**.

# %%
@triton.jit
def ce_bwd_kernel(X_ptr, x_stride, T_ptr, LSE_ptr, G_ptr, DX_ptr, dx_stride, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X_ptr += row * x_stride
    DX_ptr += row * dx_stride
    t = tl.load(T_ptr + row)
    lse = tl.load(LSE_ptr + row)
    g = tl.where(t != ignore_index, tl.load(G_ptr), 0.0)       # one scalar for "mean" / "sum"
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(X_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)                                     # softmax, recomputed
        dx = p - tl.where(start + cols == t, 1.0, 0.0)          # softmax - one_hot
        tl.store(DX_ptr + start + cols, (g * dx).to(DX_ptr.dtype.element_ty), mask=mask)


def block_for(V):
    # GPU: 4096 fp32 lanes stream HBM well without spilling. CPU interpreter: fewer, larger loop iterations.
    return max(16, min(4096 if torch.cuda.is_available() else 8192, triton.next_power_of_2(V)))


def lesson_ce_fwd(logits, target, ignore_index=-100, block=None):
    """-> per-row loss (N,) fp32, lse (N,) fp32. logits (N, V) with unit column stride."""
    N, V = logits.shape
    loss, lse = torch.empty(N, device=logits.device), torch.empty(N, device=logits.device)
    ce_fwd_kernel[(N,)](logits, logits.stride(0), target, loss, lse, V, ignore_index, BLOCK=block or block_for(V))
    return loss, lse


def lesson_ce_bwd(g, logits, target, lse, ignore_index=-100, out=None, block=None):
    """-> dlogits (N, V) = g * (softmax - onehot), g a (1,) tensor; out=logits works in place."""
    N, V = logits.shape
    dx = torch.empty_like(logits) if out is None else out
    ce_bwd_kernel[(N,)](logits, logits.stride(0), target, lse, g, dx, dx.stride(0), V, ignore_index,
                        BLOCK=block or block_for(V))
    return dx


class LessonCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, reduction, block):
        rows, lse = lesson_ce_fwd(logits, target, block=block)
        n_valid = (target != -100).sum()
        ctx.save_for_backward(logits, target, lse, n_valid)   # logits exist anyway; lse is (N,)
        ctx.reduction, ctx.block = reduction, block
        return rows.sum() / n_valid if reduction == "mean" else rows.sum()

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse, n_valid = ctx.saved_tensors
        g = dloss.reshape(1).float() / (n_valid.clamp(min=1) if ctx.reduction == "mean" else 1)
        return lesson_ce_bwd(g, logits, target, lse, block=ctx.block), None, None, None


def lesson_cross_entropy(logits, target, reduction="mean", block=None):
    return LessonCE.apply(logits, target, reduction, block)


# %% [markdown]
# ## 4. Checks: the lesson's kernels vs `F.cross_entropy` and vs minite, loss and dlogits
#
# V = 37 is one masked block; V = 300 with `BLOCK = 64` is five blocks with a ragged end; V = 50304 is the real
# vocabulary (two rows: on the CPU interpreter every block of every row is a Python-level loop step). One row of each
# has an ignored target.

# %% tags=["nbval-check-output"]
from minite.kernels.cross_entropy import cross_entropy
ref32 = lambda x, t, reduction="mean", block=None: F.cross_entropy(x.float(), t, reduction=reduction)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for N, V, block in ((5, 37, None), (4, 300, 64), (2, 50304, None)):
        x = (3 * torch.randn(N, V, generator=gen)).to(dtype).to(DEVICE)
        t = torch.randint(0, V, (N,), generator=gen).to(DEVICE)
        t[1] = -100
        for red in ("mean", "sum"):
            assert check_op(f"lesson CE {red} vs F.cross_entropy", lesson_cross_entropy, ref32, x, t, red, block)
        assert check_op("lesson CE vs minite", lambda x, t: lesson_cross_entropy(x, t),
                        lambda x, t: cross_entropy(x, t, backend="triton"), x, t)

# %% [markdown]
# ## 5. The fused linear + cross-entropy: never hold the $(N, V)$ logits
#
# Even with a perfect kernel, `logits = x @ W.T` is an $(N, V)$ tensor, and its gradient another. But the
# gradient of the loss w.r.t. the logits is known **as soon as the forward has seen a row**: $p - \mathrm{onehot}$
# needs nothing from later rows. So process `chunk_size` rows at a time, inside the forward:
#
# 1. `logits = x_c @ W.T`: $(n, V)$, the only vocabulary-sized tensor alive;
# 2. the CE kernels compute the rows' loss and overwrite `logits` **in place** with $\partial L/\partial\,\mathrm{logits}$
#    (scaled by $1/n_{valid}$ for the mean);
# 3. fold it in at once: $dx_c = \mathrm{dlogits}\,W$ $(n, C)$ and
#    $dW \mathrel{+}= \mathrm{dlogits}^\top x_c$ $(V, C)$, accumulated in fp32.
#
# The `autograd.Function` saves $dx$ and $dW$; its backward only multiplies them by the upstream scalar. The cost:
# the gradients are computed even when no backward follows (minite's version skips them under `torch.no_grad()`),
# and the `"none"` reduction is not possible. The two CE launchers are parameters, so §6 can count the same code's
# memory on the `meta` device.

# %%
def lesson_linear_ce_fwd(x, w, target, chunk_size=1024, ce_fwd=lesson_ce_fwd, ce_bwd=lesson_ce_bwd):
    """Mean CE of x @ w.T and its gradients dx (N, C), dW (V, C) fp32, for an upstream gradient of 1."""
    N = x.shape[0]
    n_valid = (target != -100).sum()
    g = torch.ones(1, device=x.device) / n_valid.clamp(min=1)
    rows = torch.empty(N, device=x.device)                      # per-row losses, fp32
    dx = torch.empty_like(x)                                    # (N, C)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=x.device)  # (V, C)
    for s in range(0, N, chunk_size):
        xc, tc = x[s:s + chunk_size], target[s:s + chunk_size]
        logits = xc @ w.t()                                     # (n, V)
        rows[s:s + chunk_size], lse = ce_fwd(logits, tc)
        ce_bwd(g, logits, tc, lse, out=logits)                  # logits <- dlogits, in place
        dx[s:s + chunk_size] = logits @ w                       # (n, V) @ (V, C)
        dw += (logits.t() @ xc).float()                         # (V, n) @ (n, C), summed in fp32
    return rows.sum() / n_valid, dx, dw


class LessonLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, target, chunk_size):
        loss, dx, dw = lesson_linear_ce_fwd(x, w, target, chunk_size)
        ctx.save_for_backward(dx, dw)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        dx, dw = ctx.saved_tensors
        return dx * dloss.to(dx.dtype), (dw * dloss).to(ctx.w_dtype), None, None


# %% tags=["nbval-check-output"]
from minite.ops import linear_cross_entropy
from minite.kernels.cross_entropy import linear_cross_entropy_ref
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    x = torch.randn(13, 16, generator=gen).to(dtype).to(DEVICE)
    w = (0.3 * torch.randn(37, 16, generator=gen)).to(dtype).to(DEVICE)
    t = torch.randint(0, 37, (13,), generator=gen).to(DEVICE)
    t[3] = -100
    mine = lambda x, w, t: LessonLinearCE.apply(x, w, t, 5)          # 3 chunks: 5, 5, 3 rows
    assert check_op("lesson linear-CE vs naive", mine, linear_cross_entropy_ref, x, w, t)        # loss, dx, dW
    assert check_op("lesson linear-CE vs minite", mine,
                    lambda x, w, t: linear_cross_entropy(x, w, t, chunk_size=5, backend="triton"), x, w, t)

# %% [markdown]
# ## 6. Peak memory, counted at GPT-2 size
#
# `PeakBytes` on the `meta` device runs the real shapes without allocating anything. Kernels cannot run on `meta`,
# so for the fused path we pass **stand-ins** for the two CE launchers that allocate exactly what they allocate (two
# (n,) fp32 vectors; the backward writes in place) and compute nothing; every other line of `lesson_linear_ce_fwd`
# and of the autograd backward runs as written. $C = 768$, $V = 50304$, bf16; inputs and weights are not counted
# (they exist anyway), as in the GPU measurement.

# %%
def ce_fwd_standin(logits, target):
    n = logits.shape[0]
    return torch.empty(n, device=logits.device), torch.empty(n, device=logits.device)


def ce_bwd_standin(g, logits, target, lse, out=None):
    return out


def meta_inputs(N, C, V, grad):
    """x (N, C), w (V, C) bf16 on meta, created INSIDE the PeakBytes block (then subtracted): PeakBytes would count
    a view of a storage created before the block (w.t()) as a new allocation."""
    x = torch.empty(N, C, device="meta", dtype=torch.bfloat16, requires_grad=grad)
    w = torch.empty(V, C, device="meta", dtype=torch.bfloat16, requires_grad=grad)
    return x, w, (N * C + V * C) * 2


def peak_naive(N, C=768, V=50304):
    with PeakBytes() as pb:
        x, w, inputs = meta_inputs(N, C, V, grad=True)
        linear_cross_entropy_ref(x, w, torch.zeros(N, device="meta", dtype=torch.long)).backward()
    return pb.peak - inputs - 8 * N  # the int64 targets are inputs too


def peak_fused(N, chunk, C=768, V=50304):
    with PeakBytes() as pb:
        x, w, inputs = meta_inputs(N, C, V, grad=False)
        loss, dx, dw = lesson_linear_ce_fwd(x, w, torch.zeros(N, device="meta", dtype=torch.long), chunk,
                                            ce_fwd_standin, ce_bwd_standin)
        dloss = torch.ones((), device="meta")
        grads = dx * dloss.to(dx.dtype), (dw * dloss).to(w.dtype)   # what LessonLinearCE.backward does
    return pb.peak - inputs - 8 * N


rows_n = [512, 1024, 2048, 4096, 8192]
naive = [peak_naive(n) for n in rows_n]
fused = {c: [peak_fused(n, c) for n in rows_n] for c in (1024, 256)}
for i, n in enumerate(rows_n):
    print(f"N={n:5d}: naive {naive[i] / 2**30:5.2f} GiB   fused chunk 1024: {fused[1024][i] / 2**30:4.2f} GiB "
          f"({naive[i] / fused[1024][i]:4.1f}x less)   chunk 256: {fused[256][i] / 2**30:4.2f} GiB")
dw_bytes = 50304 * 768 * 4
print(f"dW in fp32 alone: {dw_bytes / 2**30:.2f} GiB; "
      f"one (1024, V) bf16 logits chunk: {1024 * 50304 * 2 / 2**30:.2f} GiB")

# %% [markdown]
# Read the table from the bottom. At N = 8,192 the fused path needs **0.47 GiB against 7.7 GiB** (16×): the H100
# measurement below finds the same two numbers (0.47 and 7.71 GiB), so the count is right.
#
# **Small N: little to gain.** The fused path has a floor that does not shrink with N: the fp32 dW (0.14 GiB) plus the
# temporaries of `dw += (logits.t() @ xc).float()` and the bf16 dW the backward returns, about 0.36 GiB in all. With
# `chunk_size` = 1024 and N ≤ 1024 there is a single chunk, so the whole (N, V) logits tensor exists as in the naive
# version. Chunking pays once N is several chunks; a smaller chunk (256) lowers the logits term further, at the price
# of more, smaller matmuls.
#
# **An earlier version of this lesson showed the fused path at 0.8× of naive at N = 1,024.** That was the
# measurement, not the method. It counted the fused path's *torch reference* chunk step, which upcasts each chunk to
# fp32 and runs autograd on it (the Triton step does neither). And `PeakBytes` counts a view of a tensor created
# before its block as a new allocation, so `w.t()` added a phantom 74 MiB to both sides. Counting the code that runs,
# with the inputs created inside the block, gives 0.46 against 0.96 GiB at N = 1,024, and matches the GPU.
#
# **Where the remaining 0.47 GiB goes**, and why Liger-Kernel needs only 0.10 GiB: about 0.43 GiB of it is dW-sized
# (the fp32 accumulator, the temporaries of each `+=`, and the bf16 copy the backward returns). Liger (0.8.5)
# accumulates dW in the weight's own dtype, in place (`torch.addmm(..., out=grad_weight)`), and sizes its chunk from
# $V/C$ (about 128 rows here): no fp32 copy, no temporary. The price is a bf16 sum of 64 chunk contributions.

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(rows_n, [a / 2**30 for a in naive], "o-", label="naive: x @ W.T, then CE (counted)")
ax.plot(rows_n, [b / 2**30 for b in fused[1024]], "o-", label="fused linear-CE, chunk 1024 (counted)")
ax.plot(rows_n, [b / 2**30 for b in fused[256]], "o--", label="fused linear-CE, chunk 256 (counted)")
ax.plot([8192] * 3, [7.71, 0.47, 0.10], "k*", ms=10, label="H100 measured: naive, minite, Liger")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("rows N = B*T")
ax.set_ylabel("peak GiB above inputs (fwd + bwd)")
ax.set_title("V = 50304, C = 768, bf16 (H100 points: 2026-11-23)")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## 7. Measured on an H100
#
# `benchmarks/bench_cross_entropy.py` ran on an **NVIDIA H100 80GB HBM3** on **2026-11-23** (torch 2.11, triton 3.6,
# Liger-Kernel 0.8.5). The newest recorded run, plotted here, is
# `benchmarks/results/cross_entropy_nvidia-h100-80gb-hbm3.json`: the CUDA-graph timer (L2 flushed before each replay)
# for minite, `torch.compile` and eager; Liger's CE and every linear-CE row use the eager timer, because they
# synchronise with the host. The day's first run is kept as `h100-2026-11-23_cross_entropy.json`. N = 8,192 rows of
# bf16 logits.

# %%
def results_file(name):
    """benchmarks/results/<name> of this repository (the notebook runs in notebooks/)."""
    for root in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents):
        if (root / "benchmarks" / "results" / name).exists():
            return root / "benchmarks" / "results" / name
    raise FileNotFoundError(name)


H100 = json.loads(results_file("cross_entropy_nvidia-h100-80gb-hbm3.json").read_text())  # newest run
ce = [r for r in H100["results"] if r["table"] == "cross_entropy"]
lin = [r for r in H100["results"] if r["table"] == "linear_ce"]
impls = ("minite triton", "torch.compile", "liger-kernel", "torch eager")
fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
for ax, V in zip(axes[:2], (50304, 50257)):
    for k, mode in enumerate(("fwd", "fwd+bwd")):
        ms = [next(r["ms"] for r in ce if (r["impl"], r["mode"], r["V"]) == (i, mode, V)) for i in impls]
        ax.bar([j + 0.4 * k for j in range(len(impls))], ms, width=0.4, label=mode)
    ax.set_xticks([j + 0.2 for j in range(len(impls))], [i.replace(" ", "\n") for i in impls], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(f"CE, N = 8192, V = {V}, bf16, H100 80GB HBM3, 2026-11-23", fontsize=9)
    ax.legend()
ax = axes[2]
ax.bar(range(3), [r["ms"] for r in lin], width=0.4, label="ms, fwd+bwd")
ax.bar([j + 0.4 for j in range(3)], [r["peak_GiB"] for r in lin], width=0.4, label="peak GiB")
ax.set_xticks([j + 0.2 for j in range(3)], ["naive", "minite\nfused", "Liger\nfused"], fontsize=8)
ax.set_title("linear + CE, N = 8192, C = 768, V = 50304, H100", fontsize=9)
ax.legend()
plt.tight_layout()
plt.show()
for r in ce:
    if r["impl"] == "minite triton":
        print(f"V={r['V']} {r['mode']:>7}: {r['ms']:.3f} ms, {r['pct_peak']:3.0f} % of HBM peak, "
              f"{r['speedup_vs_eager']:.1f}x eager")
for r in lin:
    print(f"{r['impl']:>26}: {r['ms']:5.2f} ms, peak {r['peak_GiB']:.2f} GiB")

# %% [markdown]
# What the numbers say, plainly:
#
# * **The CE kernel is good at the padded vocabulary:** V = 50304, forward 0.32 ms (77 % of the HBM peak),
#   forward+backward 0.89 ms (83 %), 7.8× eager, 1.31× `torch.compile` (1.17 ms) and 1.5× Liger-Kernel (1.35 ms,
#   eager timer).
# * **The unpadded vocabulary costs a lot:** at V = 50257 the same kernel's forward+backward takes 1.22 ms, 60 % of
#   peak: 1.37× the time for 0.1 % fewer bytes (still 1.24× faster than `torch.compile`'s 1.51 ms there). A row of
#   50257 bf16 values is 100,514 bytes, not a multiple of 16: most rows start misaligned and cannot be read with
#   aligned 128-bit loads (§8). The day's first run had it worse, 1.70 ms.
# * **Fused linear-CE: faster than Liger, not as lean.** minite's takes 8.94 ms and 0.47 GiB; Liger's 11.80 ms and
#   0.10 GiB; naive 14.02 ms and 7.71 GiB (all eager timer). So minite is **1.32× faster than Liger but uses 4.9× its
#   memory**: the fp32 dW and its temporaries (§6). Liger's small chunks (~128 rows) also mean many small matmuls,
#   which is part of why it is slower. (The day's first run measured minite at 6.30 ms and Liger at 14.30: timings
#   of this host-synchronising path moved a lot between runs.)

# %% [markdown]
# ## 8. The padded vocabulary: 50257 → 50304
#
# GPT-2's tokenizer has 50257 tokens, a number with no useful factors ($50257 = 29 \cdot 1733$). nanoGPT pads it
# to **50304 = 64 · 786** and Karpathy measured a ~25 % faster training step. Why:
#
# * **Tiles.** A GEMM kernel computes the $(N, V)$ output in tiles of e.g. $128 \times 128$ or $128 \times 256$.
#   50257 columns need $\lceil 50257/128 \rceil = 393$ column tiles, the last one 81/128 full, and the kernel must
#   mask the ragged edge, or a slower generic kernel is picked.
# * **Alignment.** A row of the logits (or of the transposed LM-head weight) in bf16 is $50257 \cdot 2 = 100514$
#   bytes: not a multiple of 16, so every other row starts misaligned, and vectorised 128-bit loads, TMA (Hopper's
#   tensor memory accelerator needs 16-byte aligned strides) and the fastest cuBLAS kernels are off the table.
#   $50304 \cdot 2 = 100608 = 16 \cdot 6288$. The CE numbers of §7 show the same effect on a memory-bound kernel.
# * **Cost of padding.** 47 extra rows of $W$ ($0.09\,\%$ more parameters). They are never targets: the model
#   learns to push their logits down, and the cross-entropy handles them like any other class. At sampling time
#   minite crops the logits to the real vocabulary (`gpt.py`).

# %%
for V in (50257, 50304):
    print(f"V={V}: V % 64 = {V % 64:2d}, bf16 row bytes {2 * V} (% 16 = {2 * V % 16:2d}), "
          f"128-wide tiles {-(-V // 128)}, last tile {V % 128 or 128}/128 full")
if torch.cuda.is_available():
    from triton.testing import do_bench
    xh = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16)
    for V in (50257, 50304):
        W = torch.randn(V, 768, device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: xh @ W.t())
        print(f"LM head (8192 x 768) @ (768 x {V}): {ms:.3f} ms, {2 * 8192 * 768 * V / ms / 1e9:.0f} TFLOP/s")
else:
    print("no CUDA device: matmul timing skipped")

# %% [markdown]
# ## 9. Where it runs in the GPT
#
# `minite/models/gpt.py` pads the vocabulary (`GPTConfig.padded_vocab_size`, a multiple of `vocab_multiple = 64`)
# and computes the training loss with this chapter's op on the flattened logits:
#
# ```python
# logits = F.linear(x, self.wte.weight)                                    # (B, T, V_pad), tied head
# loss = cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), backend=self.backend)  # fp32
# ```
#
# When the logits themselves are not needed, `minite.ops.linear_cross_entropy(x.view(B * T, C), wte.weight,
# targets.view(-1))` (or the module `minite.nn.LinearCrossEntropy`) gives the same loss and gradients without
# ever holding the $(B\cdot T, V)$ tensor.
