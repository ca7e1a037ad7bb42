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
# # 11 — Tensor parallelism: exercises
#
# Two graded tasks. Fill in each region between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the
# `raise NotImplementedError()`), run the cell, then its check cell.
#
# 1. **A row-parallel linear with the right gradients, graded on 2 real ranks** (the check cell writes your code to
#    a file and launches `torchrun --nproc-per-node 2 -m minite.parallel.workers row_parallel_linear`, which
#    imports it on every rank).
# 2. **A whole Triton kernel from a spec**: the per-row statistics one rank contributes to a vocab-parallel
#    cross-entropy.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import torch.distributed as dist
from minite._triton import triton, tl
from minite.parallel.workers.grade import run_graded
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## Task 1 — the row-parallel linear, forward and backward
#
# `row_parallel_linear(x_local, w_local, group)`: the input's last dimension and the weight's columns are split
# over the ranks of `group` (`None`: one process). `x_local` is (..., in/W), `w_local` is (out, in/W). Return
# $y = x W^\top$ — the same full (..., out) tensor on every rank — such that autograd gives each rank the correct
# `x_local.grad` and `w_local.grad` (the slices of the dense layer's gradients) when every rank calls
# `y.backward(dy)` with the same `dy`. Work out what the backward of the sum over ranks is; define whatever helper
# you need (an `autograd.Function`, for instance) inside this cell. `torch` and `torch.distributed as dist` are
# imported in the grader's file.

# %% minite={"task": "row_parallel_linear"}
### BEGIN SOLUTION
class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        y = y.clone()
        if group is not None:
            dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None  # every rank already holds the full dL/dy


def row_parallel_linear(x_local, w_local, group):
    return _SumOverRanks.apply(x_local @ w_local.t(), group)
### END SOLUTION

# %% minite={"check": "row_parallel_linear"} tags=["nbval-check-output"]
# CHECK: row_parallel_linear
import linecache  # the whole task cell, as run (inspect cannot fetch a class defined in a notebook cell)
src = "".join(linecache.getlines(row_parallel_linear.__code__.co_filename))
ok, msg = run_graded(src, "row_parallel_linear", world=2)
print(msg)
assert ok
print("PASS: row_parallel_linear")

# %% [markdown]
# ## Task 2 — one rank's share of a vocab-parallel cross-entropy, as a Triton kernel
#
# Write `shard_stats_kernel` from this spec; nothing else is given. `X` is this rank's (N, Vs) slice of the logits
# (row stride `stride`, fp32 or bf16; compute in fp32), covering the global vocabulary ids `[start, start + Vs)`.
# `T` holds the N *global* target ids. One program per row, looping over the row in blocks of `BLOCK` columns.
# Write, per row: `Mx` = the row's maximum over this shard, `S` = $\sum_v e^{x_v - Mx}$ over this shard, and `Xt` =
# the target's logit if this shard owns the target, else 0.0. With these three numbers from every rank (one
# all-reduce each, as the lesson shows) the loss needs no gathered logits.

# %% minite={"task": "shard_stats_kernel"}
@triton.jit
def shard_stats_kernel(X, stride, T, Mx, S, Xt, Vs, start, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    X += row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for c0 in range(0, Vs, BLOCK):
        mask = c0 + cols < Vs
        x = tl.load(X + c0 + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    t = tl.load(T + row) - start
    own = (t >= 0) & (t < Vs)
    xt = tl.load(X + tl.where(own, t, 0), mask=own, other=0.0).to(tl.float32)
    tl.store(Mx + row, m)
    tl.store(S + row, s)
    tl.store(Xt + row, tl.where(own, xt, 0.0))
    ### END SOLUTION

# %% minite={"check": "shard_stats_kernel"} tags=["nbval-check-output"]
# CHECK: shard_stats_kernel
gen = torch.Generator().manual_seed(4)
worst = 0.0
for N, V, W, dtype in ((5, 100, 2, torch.float32), (3, 96, 4, torch.bfloat16)):
    logits = (torch.randn(N, V, generator=gen) * 4).to(dtype)
    target = torch.randint(0, V, (N,), generator=gen)
    stats = []
    for r, sh in enumerate(logits.chunk(W, dim=1)):
        sh = sh.to(DEVICE)
        out = [torch.empty(N, device=DEVICE) for _ in range(3)]
        shard_stats_kernel[(N,)](sh, sh.stride(0), target.to(DEVICE), *out, sh.shape[1], r * (V // W), BLOCK=16)
        stats.append([o.cpu() for o in out])
    M = torch.stack([s[0] for s in stats]).max(0).values
    lse = M + torch.log(sum(s[1] * torch.exp(s[0] - M) for s in stats))
    loss = lse - sum(s[2] for s in stats)
    ref = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
    worst = max(worst, float((loss - ref).abs().max()))
print(f"per-row loss from the shards' statistics vs F.cross_entropy: {'below 1e-4' if worst < 1e-4 else worst}")
assert worst < 1e-4
print("PASS: shard_stats_kernel")
