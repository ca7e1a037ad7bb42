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
# # 06 — Cross-entropy variants: exercises
#
# The lesson (`notebooks/06_cross_entropy.ipynb`) built the plain cross-entropy, $\ell = \mathrm{lse}(x) - x_t$ with
# $\nabla_x\ell = \mathrm{softmax}(x) - \mathrm{onehot}(t)$, its kernels, and the chunked linear-CE. Real training
# recipes change the loss a little, and each change has its own gradient to derive:
#
# * **label smoothing** (Szegedy et al. 2016, `F.cross_entropy(..., label_smoothing=eps)`): the target distribution
#   is $(1-\varepsilon)\,\mathrm{onehot}(t) + \varepsilon/V$ instead of the one-hot;
# * **z-loss** (PaLM, Chowdhery et al. 2022, [arXiv:2204.02311](https://arxiv.org/abs/2204.02311)): add
#   $z\cdot\mathrm{lse}(x)^2$ to each row's loss, which keeps the softmax normaliser near 1 and the logits from
#   drifting (PaLM uses $z = 10^{-4}$);
# * **vocabulary-parallel CE** (Megatron-LM): the logits of a row are split over GPUs by vocabulary range, and no GPU
#   may gather a whole row.
#
# Three graded tasks. Write your code between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the
# `raise NotImplementedError()` line), run the cell, then the `# CHECK` cell after it (do not edit check cells).
# Task 2 is a whole Triton kernel: only the signature and the spec are given.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %%
def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    """Seeded CPU draw, then cast and move to DEVICE (the same numbers on every machine)."""
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(DEVICE)


def targets(N, V, seed, ignored=()):
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed))
    t[list(ignored)] = -100
    return t.to(DEVICE)


# %% [markdown]
# ## Task 1 — the gradient of the label-smoothed loss
#
# Derive $\partial L/\partial x$ for `F.cross_entropy(x, t, label_smoothing=eps, ignore_index=-100)` with the
# default `"mean"` reduction (over the rows whose target is not ignored), then implement it in plain PyTorch,
# **without autograd**. Return an fp32 (N, V) tensor, zero on ignored rows.

# %% minite={"task": "label_smoothing_grad"}
def label_smoothing_grad(logits, target, eps, ignore_index=-100):
    ### BEGIN SOLUTION
    keep = target != ignore_index
    V = logits.shape[-1]
    grad = torch.softmax(logits.float(), dim=-1) - eps / V
    rows = torch.arange(len(target), device=logits.device)[keep]
    grad[rows, target[keep]] -= 1.0 - eps
    grad[~keep] = 0.0
    return grad / keep.sum().clamp(min=1)
    ### END SOLUTION


# %% minite={"check": "label_smoothing_grad"} tags=["nbval-check-output"]
# CHECK: label_smoothing_grad
for k, (N, V, eps) in enumerate(((7, 23, 0.1), (5, 64, 0.3), (4, 9, 0.0))):
    x = randn(N, V, seed=k, scale=3.0).requires_grad_()
    t = targets(N, V, seed=10 + k, ignored=(1,))
    F.cross_entropy(x, t, label_smoothing=eps).backward()
    got = label_smoothing_grad(x.detach(), t, eps)
    assert got.dtype == torch.float32 and got.shape == x.shape, (got.dtype, got.shape)
    assert_close(got, x.grad, name=f"dlogits eps={eps}")
print("PASS: label_smoothing_grad")


# %% [markdown]
# ## Task 2 — cross-entropy with z-loss, loss and gradient in one kernel (whole kernel)
#
# Spec. One program per row of the (N, V) logits (row `r` starts at `X_ptr + r * x_stride`, columns contiguous;
# fp32, fp16 or bf16; compute in fp32). With $\mathrm{lse}$ the row's logsumexp and $t$ = `T_ptr[r]`, the row loss is
#
# $$\ell = \mathrm{lse}(x) - x_t + z\,\mathrm{lse}(x)^2 \qquad (z = \texttt{z\_coef}),$$
#
# or 0 when $t$ = `ignore_index`. Store it (fp32) to `Loss_ptr[r]`. Then **overwrite the row of X in place** with
# `grad_scale` × $\partial\ell/\partial x$ (all zeros on an ignored row), in X's dtype: the launcher passes
# `grad_scale` $= 1/n_{valid}$, so this is the gradient of the mean loss. The row must be streamed in blocks of
# `BLOCK` columns (V may be far larger than `BLOCK`, and is not a multiple of it); nothing may overflow for logits of
# a few hundred. As in Liger-Kernel's CE, the gradient is computed in the forward, so the backward only scales it.

# %% minite={"task": "zloss_ce_kernel"}
@triton.jit
def zloss_ce_kernel(X_ptr, x_stride, T_ptr, Loss_ptr, V, ignore_index, z_coef, grad_scale, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    r = tl.program_id(0).to(tl.int64)
    X_ptr += r * x_stride
    offs = tl.arange(0, BLOCK)
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.full((), 0.0, tl.float32)
    for lo in range(0, V, BLOCK):
        vals = tl.load(X_ptr + lo + offs, mask=lo + offs < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(vals, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(vals - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    tgt = tl.load(T_ptr + r)
    keep = tgt != ignore_index
    x_t = tl.load(X_ptr + tl.where(keep, tgt, 0), mask=keep, other=0.0).to(tl.float32)
    tl.store(Loss_ptr + r, tl.where(keep, lse - x_t + z_coef * lse * lse, 0.0))
    scale = tl.where(keep, grad_scale, 0.0)
    for lo in range(0, V, BLOCK):
        inside = lo + offs < V
        vals = tl.load(X_ptr + lo + offs, mask=inside, other=0.0).to(tl.float32)
        grad = tl.exp(vals - lse) * (1.0 + 2.0 * z_coef * lse) - tl.where(lo + offs == tgt, 1.0, 0.0)
        tl.store(X_ptr + lo + offs, (scale * grad).to(X_ptr.dtype.element_ty), mask=inside)
    ### END SOLUTION


class ZLossCE(torch.autograd.Function):
    """Given: runs your kernel on a copy of the logits in the forward; the backward scales the saved gradient."""
    @staticmethod
    def forward(ctx, logits, target, z_coef, block):
        N, V = logits.shape
        n_valid = int((target != -100).sum())
        work = logits.detach().clone()                      # becomes dlogits, in place
        rows = torch.empty(N, dtype=torch.float32, device=logits.device)
        zloss_ce_kernel[(N,)](work, work.stride(0), target, rows, V, -100, z_coef, 1.0 / max(n_valid, 1),
                              BLOCK=block)
        ctx.save_for_backward(work)
        return rows.sum() / max(n_valid, 1)

    @staticmethod
    def backward(ctx, dloss):
        (dlogits,) = ctx.saved_tensors
        return dlogits * dloss.to(dlogits.dtype), None, None, None


def zloss_ce_ref(logits, target, z_coef, block=None):
    """The spec in PyTorch (fp32): mean over valid rows of lse - x_t + z * lse^2."""
    x = logits.float()
    keep = target != -100
    lse = torch.logsumexp(x, dim=-1)
    x_t = x.gather(1, torch.where(keep, target, 0)[:, None]).squeeze(1)
    return torch.where(keep, lse - x_t + z_coef * lse * lse, 0.0).sum() / keep.sum()


# %% minite={"check": "zloss_ce_kernel"} tags=["nbval-check-output"]
# CHECK: zloss_ce_kernel
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for k, (N, V, block, z) in enumerate(((5, 37, 64, 1e-2), (4, 300, 64, 1e-4), (3, 1000, 128, 0.0))):
        x = randn(N, V, seed=20 + k, dtype=dtype, scale=4.0)
        x[0, V - 3] = 200.0                                  # a large logit in the last block
        t = targets(N, V, seed=30 + k, ignored=(1,))
        ok &= check_op(f"z-loss CE, z={z}", lambda x, t: ZLossCE.apply(x, t, z, block),
                       lambda x, t: zloss_ce_ref(x, t, z), x, t)
assert ok
print("PASS: zloss_ce_kernel")


# %% [markdown]
# ## Task 3 — vocabulary-parallel cross-entropy
#
# In Megatron-LM's tensor parallelism the LM head is split by **vocabulary**: GPU $k$ holds the logits of columns
# $[o_k, o_k + V_k)$ for every row, and no GPU ever holds a whole row. `shards` is that list of (N, V_k) tensors
# (fp32, fp16 or bf16), in vocabulary order. Write `vocab_parallel_ce(shards, target)` returning the (N,) fp32 per-row
# losses $\mathrm{lse}(x) - x_t$ (0 where `target == -100`), exactly as if the shards were concatenated, but:
#
# * each shard may only be reduced along **its own** columns, into (N,)-sized statistics (think: computed on its own
#   GPU), and the statistics are then combined (think: an all-reduce of (N,) vectors);
# * never build a tensor wider than one shard (the check watches every op's output size);
# * stay exact for logits of several hundred (no overflow).

# %% minite={"task": "vocab_parallel_ce"}
def vocab_parallel_ce(shards, target, ignore_index=-100):
    ### BEGIN SOLUTION
    maxes = [s.float().amax(dim=-1) for s in shards]          # per-shard (N,)
    m = torch.stack(maxes).amax(dim=0)                          # "all-reduce max"
    total = sum(torch.exp(s.float() - m[:, None]).sum(dim=-1) for s in shards)   # "all-reduce sum"
    lse = m + torch.log(total)
    x_t = torch.zeros_like(lse)
    start = 0
    for s in shards:
        mine = (target >= start) & (target < start + s.shape[1])
        idx = torch.where(mine, target - start, 0)
        x_t += torch.where(mine, s.float().gather(1, idx[:, None]).squeeze(1), 0.0)   # "all-reduce sum"
        start += s.shape[1]
    return torch.where(target != ignore_index, lse - x_t, 0.0)
    ### END SOLUTION


# %% minite={"check": "vocab_parallel_ce"} tags=["nbval-check-output"]
# CHECK: vocab_parallel_ce
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Widest(TorchDispatchMode):
    """Records the most elements any op inside the block produced."""
    most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and not func.is_view:
                self.most = max(self.most, o.numel())
        return out


for k, (widths, dtype) in enumerate((((10, 10, 10, 7), torch.float32), ((50, 3), torch.float16),
                                      ((1, 20, 13), torch.bfloat16))):
    N, V = 6, sum(widths)
    logits = randn(N, V, seed=40 + k, scale=5.0, dtype=dtype)
    logits[2, V - 1] = 400.0                                     # overflow trap
    t = targets(N, V, seed=50 + k, ignored=(4,))
    t[0] = V - 1                                                 # a target in the last shard
    shards = list(logits.split(list(widths), dim=1))
    with Widest() as watch:
        got = vocab_parallel_ce(shards, t)
    assert watch.most <= N * max(widths), f"an op produced {watch.most} elements: wider than one shard"
    expected = F.cross_entropy(logits.float(), t, reduction="none")
    assert got.dtype == torch.float32 and got.shape == (N,), (got.dtype, got.shape)
    assert_close(got, expected, name=f"row losses, {dtype} shards {widths}", atol=1e-4, rtol=1e-5)
print("PASS: vocab_parallel_ce")
