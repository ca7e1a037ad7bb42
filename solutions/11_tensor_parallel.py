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
# Two graded tasks, both run on 2 real ranks: the check cell writes your task cell to a file and launches
# `torchrun --nproc-per-node 2 -m minite.parallel.workers TASK`, which imports it on every rank, runs it on that
# rank's data and compares with the dense computation from the same seed. Fill in each region between
# `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the `raise NotImplementedError()`), run the cell, then its
# check cell. Inside a task cell you may use `torch` and `torch.distributed as dist` (imported in the grader's file)
# and define any helper you need (an `autograd.Function`, for instance). An answer sets no attributes (`ctx.x = ...`
# included).
#
# 1. **The vocab-parallel embedding**: token rows split over the ranks, forward and backward.
# 2. **A whole sequence-parallel region**: the reduce-scatter after a row-parallel linear, an RMSNorm on each
#    rank's sequence chunk, and the all-gather before the next column-parallel linear, with the right gradients.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import linecache
import torch.distributed as dist
from minite.parallel.workers.grade import run_graded
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


def cell_source(fn):
    """The whole task cell `fn` was defined in, as run (inspect cannot fetch a class defined in a notebook cell)."""
    return "".join(linecache.getlines(fn.__code__.co_filename))


# %% [markdown]
# ## Task 1 — the vocab-parallel embedding
#
# `vocab_parallel_embedding(tokens, weight_local, vocab_start, group)`: the embedding table $(V, C)$ is split by
# rows over the ranks of `group`; this rank holds `weight_local`, the rows `[vocab_start, vocab_start + V/W)`.
# `tokens` $(B, T)$ holds *global* token ids, the same on every rank. Return the full $(B, T, C)$ embedding,
# the same tensor on every rank, such that when every rank calls `y.backward(dy)` with the same `dy` (every rank
# continues with its own copy of `y`), `weight_local.grad` is exactly this rank's slice of the dense table's
# gradient. A rank can look up only the tokens it owns: decide what it writes for the others, how the ranks'
# results combine, and what that combination's backward must be.

# %% minite={"task": "vocab_parallel_embedding"}
### BEGIN SOLUTION
class _SumAcrossRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # every rank already holds the whole dL/dy


def vocab_parallel_embedding(tokens, weight_local, vocab_start, group):
    rows = weight_local.shape[0]
    mine = (tokens >= vocab_start) & (tokens < vocab_start + rows)
    local = torch.where(mine, tokens - vocab_start, torch.zeros_like(tokens))
    y = torch.nn.functional.embedding(local, weight_local) * mine[..., None]  # zeros for tokens I do not own
    return _SumAcrossRanks.apply(y, group)
### END SOLUTION

# %% minite={"check": "vocab_parallel_embedding"} tags=["nbval-check-output"]
# CHECK: vocab_parallel_embedding
ok, msg = run_graded(cell_source(vocab_parallel_embedding), "vocab_parallel_embedding", world=2)
print(msg)
assert ok
print("PASS: vocab_parallel_embedding")

# %% [markdown]
# ## Task 2 — the sequence-parallel region around a norm
#
# Under sequence parallelism a block's norm sits between two collectives. Write
# `sp_rmsnorm(partial, weight, group)`:
# * `partial` $(B, T, C)$ is this rank's partial sum from a row-parallel linear: the true activation is
#   $z = \sum_r \text{partial}_r$. Reduce-scatter it **along the sequence** (dim 1; $W$ divides $T$), so that this
#   rank holds only its chunk of $z$, $(B, T/W, C)$, rank $r$ the $r$-th chunk;
# * apply RMSNorm **to that chunk only**: $x / \sqrt{\mathrm{mean}(x^2) + 10^{-6}} \cdot w$ over the last dim, with
#   `weight` $w$ $(C,)$ replicated on every rank;
# * all-gather the normalised chunks along the sequence and return the full $(B, T, C)$, the input of the next
#   column-parallel linear, on every rank.
#
# Gradients: every rank's next column linear sends back a *different* `dy` (its own columns' contribution), so
# every rank calls `y.backward(dy_r)` with its own `dy_r`. Afterwards `partial.grad` must be, on every rank,
# $\partial L/\partial z$ for $L$'s true upstream gradient $\sum_r dy_r$, and `weight.grad` must be the whole
# dense gradient of $w$ on every rank (it is replicated: it must stay identical everywhere). Work out the backward
# of each collective, and what each rank's norm alone cannot give the weight.
#
# An answer sets no attributes (`ctx.group = group` included): an `autograd.Function` defined *inside*
# `sp_rmsnorm` sees `group` from the enclosing function.

# %% minite={"task": "sp_rmsnorm"}
### BEGIN SOLUTION
def sp_rmsnorm(partial, weight, group):
    W, r = dist.get_world_size(group), dist.get_rank(group)

    def reduce_scatter(x):  # reduce_scatter_tensor cuts dim 0 (here the batch): all-reduce, keep my sequence chunk
        full = x.contiguous().clone()
        dist.all_reduce(full, group=group)
        return full.chunk(W, dim=1)[r].contiguous()

    def all_gather(x):
        parts = [torch.empty_like(x) for _ in range(W)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    def all_reduce(x):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    class ScatterSeq(torch.autograd.Function):  # forward: reduce-scatter / backward: all-gather
        @staticmethod
        def forward(ctx, x):
            return reduce_scatter(x)

        @staticmethod
        def backward(ctx, grad):
            return all_gather(grad)

    class GatherSeq(torch.autograd.Function):  # forward: all-gather / backward: reduce-scatter
        @staticmethod
        def forward(ctx, x):
            return all_gather(x)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter(grad)

    class SumGrad(torch.autograd.Function):  # forward: identity / backward: all-reduce (the replicated weight)
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, grad):
            return all_reduce(grad)

    x = ScatterSeq.apply(partial)  # (B, T/W, C): my chunk of the sum
    w = SumGrad.apply(weight)  # my tokens give only part of dL/dw
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return GatherSeq.apply(y)  # (B, T, C) on every rank
### END SOLUTION

# %% minite={"check": "sp_rmsnorm"} tags=["nbval-check-output"]
# CHECK: sp_rmsnorm
ok, msg = run_graded(cell_source(sp_rmsnorm), "sp_rmsnorm", world=2)
print(msg)
assert ok
print("PASS: sp_rmsnorm")
