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
# cross-entropy. With GPT-2's tokenizer $V = 50257$ (we pad it to **50304**, §9). It is the biggest activation of
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
import inspect
import matplotlib.pyplot as plt
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


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
# $n_{valid}$, so each row's gradient is $(p - \mathrm{onehot}(t)) / n_{valid}$. `"none"` returns the $(N,)$ vector.
#
# **Label smoothing** $\varepsilon$ (Szegedy et al. 2016): the target distribution is
# $(1-\varepsilon)\,\mathrm{onehot}(t) + \varepsilon/V$, so
# $\ell = (1-\varepsilon)(\mathrm{lse} - x_t) + \varepsilon\,(\mathrm{lse} - \overline{x})$
# with $\overline x$ the row mean,
# and $\nabla_x\ell = p - (1-\varepsilon)\,\mathrm{onehot}(t) - \varepsilon/V$.
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

x = 30 * torch.randn(50304, dtype=torch.float64)
print("online:", round(online_lse(x).item(), 9), " torch.logsumexp:", round(torch.logsumexp(x, 0).item(), 9))
print("naive log(sum(exp(x))) in fp32 for x ~ 1e4:", torch.log(torch.exp(torch.tensor([1e4, 0.0])).sum()).item())

# %% [markdown]
# ## 2. Naive PyTorch, memory passes and peak memory counted
#
# `F.cross_entropy(logits.float(), t)` is `log_softmax` + `nll_loss`. We count the bytes each aten op moves
# (forward + backward) on the `meta` device at the real size, and the **peak** bytes alive at once.

# %%
# Counts bytes each aten op reads and writes (chapter 00 builds this counter; it lives in minite.bytecount).
from minite.bytecount import CountBytes, PeakBytes

# %% tags=["nbval-ignore-output"]
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
# ## 3. The Triton kernels
#
# One program per row. The forward loops over the vocabulary in blocks (online logsumexp), loads the target
# logit with one scalar load, and writes the row loss and its $\mathrm{lse}$ (both fp32, whatever the logits'
# dtype). The backward recomputes $p = e^{x - \mathrm{lse}}$ block by block and writes
# $g\,(p - \mathrm{onehot})$ in the logits' dtype. The loss is fp32 even for bf16 logits: the sum of 8192 row
# losses in bf16 (8 mantissa bits) would be off in the second digit.

# %%
from minite.kernels import cross_entropy as ce
print(inspect.getsource(ce._ce_fwd_kernel.fn))
print(inspect.getsource(ce._ce_bwd_kernel.fn))

# %% [markdown]
# ## 4. Checks: kernel vs reference (loss and dlogits), reference vs `F.cross_entropy`, gradcheck

# %% tags=["nbval-check-output"]
# CHECK: cross-entropy kernel vs reference
from minite.kernels.cross_entropy import cross_entropy, cross_entropy_ref
fused = lambda x, t, **kw: cross_entropy(x, t, backend="triton", **kw)
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for N, V in ((5, 37), (2, 50304)):
        x = (3 * torch.randn(N, V, generator=gen)).to(dtype).to(DEVICE)
        t = torch.randint(0, V, (N,), generator=gen).to(DEVICE)
        t[1] = -100  # an ignored row
        assert check_op("cross_entropy", fused, cross_entropy_ref, x, t)
        assert fused(x, t).dtype == torch.float32
x = torch.randn(6, 11, generator=gen)
t = torch.tensor([0, 3, 10, -1, 5, 3])
for red in ("mean", "sum", "none"):
    for ls in (0.0, 0.1):
        kw = dict(ignore_index=-1, reduction=red, label_smoothing=ls)
        assert_close(cross_entropy_ref(x, t, **kw), F.cross_entropy(x, t, **kw), name=f"ref {red} {ls}")
        assert check_op(f"cross_entropy {red} eps={ls}", fused, cross_entropy_ref, x.to(DEVICE), t.to(DEVICE), **kw)
x64 = torch.randn(3, 7, dtype=torch.float64, device=DEVICE, requires_grad=True)
t64 = torch.tensor([0, -100, 6], device=DEVICE)
assert torch.autograd.gradcheck(lambda z: fused(z, t64, label_smoothing=0.1), (x64,))
print("PASS: reference == F.cross_entropy; fp64 gradcheck")

# %% tags=["nbval-check-output"]
# CHECK: gradient is softmax minus one-hot
x = torch.randn(4, 9, dtype=torch.float64, device=DEVICE, requires_grad=True)
t = torch.tensor([2, -100, 8, 0], device=DEVICE)
fused(x, t).backward()  # mean over the 3 valid rows
expected = (torch.softmax(x.detach(), -1) - F.one_hot(t.clamp(min=0), 9)) / 3
expected[1] = 0.0
assert_close(x.grad, expected, name="dlogits")
print("PASS: dlogits = (softmax - one_hot) / n_valid, 0 on the ignored row")

# %% [markdown]
# ## 5. The fused linear + cross-entropy: never hold the $(N, V)$ logits
#
# Even with a perfect kernel, `logits = x @ W.T` is an $(N, V)$ tensor, and its gradient another. But the
# gradient of the loss w.r.t. the logits is known **as soon as the forward has seen a row** — $p - \mathrm{onehot}$
# needs nothing from later rows. So process `chunk_size` rows at a time, inside the forward:
#
# 1. `logits = x_c @ W.T` — $(n, V)$, the only vocabulary-sized tensor alive;
# 2. the CE kernels compute the rows' loss and overwrite `logits` **in place** with $\partial L/\partial\,\mathrm{logits}$
#    (scaled by $1/n_{valid}$ for the mean);
# 3. fold it in at once: $dx_c = \mathrm{dlogits}\,W$ $(n, C)$ and
#    $dW \mathrel{+}= \mathrm{dlogits}^\top x_c$ $(V, C)$, accumulated in fp32.
#
# The `autograd.Function` saves $dx$ and $dW$; its backward only multiplies them by the upstream scalar. The cost:
# the gradients are computed even when no backward follows (use the plain path for evaluation), and `"none"`
# reduction is not possible.

# %%
print(inspect.getsource(ce.linear_cross_entropy_fwd))

# %% tags=["nbval-check-output"]
# CHECK: linear cross-entropy vs naive
from minite.ops import linear_cross_entropy
from minite.kernels.cross_entropy import linear_cross_entropy_ref
gen = torch.Generator().manual_seed(1)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(13, 16, generator=gen).to(dtype).to(DEVICE)
    w = (0.3 * torch.randn(37, 16, generator=gen)).to(dtype).to(DEVICE)
    t = torch.randint(0, 37, (13,), generator=gen).to(DEVICE)
    t[3] = -100
    for backend in ("triton", "torch"):
        f = lambda x, w, t, **kw: linear_cross_entropy(x, w, t, chunk_size=5, backend=backend, **kw)
        assert check_op(f"linear_ce {backend}", f, linear_cross_entropy_ref, x, w, t)  # loss, dx, dW

# %% [markdown]
# ## 6. Peak memory: counted at GPT-2 size, naive vs fused
#
# `PeakBytes` on the `meta` device runs the real shapes without allocating anything. The fused path is counted on
# its **reference chunk step** (torch ops on the $(n, V)$ tile, `backend="torch"`); the Triton step works in place
# and allocates less, so this is an upper bound for it. $C = 768$, bf16.

# %% tags=["nbval-check-output"]
# CHECK: peak memory 3x below naive at B*T=8192, V=50304
from minite.ops import linear_cross_entropy
from minite.kernels.cross_entropy import linear_cross_entropy_ref

def peak(fn, N, C=768, V=50304):
    x = torch.empty(N, C, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(V, C, device="meta", dtype=torch.bfloat16, requires_grad=True)
    t = torch.zeros(N, device="meta", dtype=torch.long)
    with PeakBytes() as pb:
        fn(x, w, t).backward()
    return pb.peak

rows = [1024, 2048, 4096, 8192]
naive = [peak(linear_cross_entropy_ref, n) for n in rows]
chunked = [peak(lambda x, w, t: linear_cross_entropy(x, w, t, chunk_size=1024, backend="torch"), n) for n in rows]
for n, a, b in zip(rows, naive, chunked):
    print(f"N={n:5d}: naive {a / 2**30:5.2f} GiB   fused {b / 2**30:5.2f} GiB   ratio {a / b:4.1f}x")
assert naive[-1] >= 3 * chunked[-1]
print("PASS: fused linear-CE peak >= 3x below naive at N=8192, V=50304")

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(rows, [a / 2**30 for a in naive], "o-", label="naive: x @ W.T, F.cross_entropy")
ax.plot(rows, [b / 2**30 for b in chunked], "o-", label="fused linear-CE (chunk 1024)")
ax.set_xlabel("rows N = B*T"); ax.set_ylabel("peak GiB (fwd + bwd)"); ax.set_title("V = 50304, C = 768, bf16")
ax.legend()
plt.show()

# %% tags=["nbval-ignore-output"]
if torch.cuda.is_available():  # the same comparison, measured by the CUDA caching allocator
    def cuda_peak(fn, N=8192, C=768, V=50304):
        x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(V, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, V, (N,), device="cuda")
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x, w, t).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    a = cuda_peak(linear_cross_entropy_ref)
    b = cuda_peak(lambda x, w, t: linear_cross_entropy(x, w, t, backend="triton"))
    print(f"measured on {torch.cuda.get_device_name()}: naive {a / 2**30:.2f} GiB, fused {b / 2**30:.2f} GiB, "
          f"{a / b:.1f}x less")
else:
    print("no CUDA device: measured GPU peak skipped (counted above)")

# %% [markdown]
# ## 7. GPU benchmark (runs only when a CUDA device is present)
#
# `benchmarks/bench_cross_entropy.py` prints the full table (forward and forward+backward ms, GB/s, % of peak vs
# torch eager, `torch.compile`, Liger-Kernel when installed, and the fused linear-CE peak memory). Short version:

# %% tags=["nbval-ignore-output"]
if torch.cuda.is_available():
    from triton.testing import do_bench
    x = torch.randn(8192, 50304, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 50304, (8192,), device="cuda")
    ms_f = do_bench(lambda: fused(x, t)); ms_e = do_bench(lambda: F.cross_entropy(x.float(), t))
    print(f"forward: fused {ms_f:.2f} ms ({x.numel() * 2 / ms_f / 1e6:.0f} GB/s), eager {ms_e:.2f} ms")
else:
    print("no CUDA device: benchmark skipped")

# %% [markdown]
# ## 8. The padded vocabulary: 50257 → 50304
#
# GPT-2's tokenizer has 50257 tokens, a number with no useful factors ($50257 = 29 \cdot 1733$). nanoGPT pads it
# to **50304 = 64 · 786** and Karpathy measured a ~25 % faster training step. Why:
#
# * **Tiles.** A GEMM kernel computes the $(N, V)$ output in tiles of e.g. $128 \times 128$ or $128 \times 256$.
#   50257 columns need $\lceil 50257/128 \rceil = 393$ column tiles, the last one 81/128 full, and — worse — the
#   kernel must mask the ragged edge in *every* tile row, or a slower generic kernel is picked.
# * **Alignment.** A row of the LM-head weight in bf16 is $50257 \cdot 2 = 100514$ bytes for the transposed
#   layout: not a multiple of 16 bytes, so vectorised 128-bit loads, TMA (Hopper's tensor memory accelerator needs
#   16-byte aligned strides) and the fastest cuBLAS kernels are off the table. $50304 \cdot 2 = 100608 = 16 \cdot 6288$.
# * **Cost of padding.** 47 extra rows of $W$ ($0.09\,\%$ more parameters). They are never targets: the model
#   learns to push their logits down, and the cross-entropy handles them like any other class. At sampling time
#   minite crops the logits to the real vocabulary (`gpt.py`).

# %% tags=["nbval-ignore-output"]
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
