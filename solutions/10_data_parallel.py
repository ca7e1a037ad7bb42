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
# # 10 — Data parallelism: exercises
#
# Two graded tasks. Fill in each region between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the
# `raise NotImplementedError()`), run the cell, then run its check cell.
#
# 1. **A sharded optimizer step, graded on 2 real ranks.** The check cell writes your function to a file and
#    launches `torchrun --nproc-per-node 2 -m minite.parallel.workers sharded_sgd_step`, which imports it on every
#    rank.
# 2. **A whole Triton kernel from a spec**: the AdamW update of a distributed optimizer's flat shard.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect
import torch.distributed as dist
from minite._triton import triton, tl
from minite.parallel.workers.grade import run_graded
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## Task 1 — reduce-scatter, step my shard, all-gather
#
# `sharded_sgd_step(flat_param, flat_grad, group, lr)` is called on every rank of `group` (`None` means a single
# process). Every rank passes the same `flat_param` (1-D, fp32, its length divisible by the world size $W$) and its
# own `flat_grad` (the gradient of its slice of the batch). Afterwards every rank's `flat_param` must hold
# `flat_param - lr * (mean over ranks of flat_grad)`, **in place** — and no rank may compute the update for more
# than its own $1/W$ of the elements (rank $r$ owns the $r$-th contiguous chunk). Use `torch.distributed`'s
# `reduce_scatter_tensor` and `all_gather_into_tensor` (both work on gloo, which carries out the reduce-scatter as
# an all-reduce: twice the bytes, the same result), with `group=group`.

# %% minite={"task": "sharded_sgd_step"}
def sharded_sgd_step(flat_param, flat_grad, group, lr):
    ### BEGIN SOLUTION
    W = 1 if group is None else dist.get_world_size(group)
    r = 0 if group is None else dist.get_rank(group)
    n = flat_param.numel() // W
    shard = torch.empty(n, dtype=flat_grad.dtype)
    if W > 1:
        dist.reduce_scatter_tensor(shard, flat_grad.contiguous(), group=group)
    else:
        shard.copy_(flat_grad)
    mine = flat_param[r * n:(r + 1) * n] - lr * (shard / W)
    if W > 1:
        dist.all_gather_into_tensor(flat_param, mine.contiguous(), group=group)
    else:
        flat_param.copy_(mine)
    ### END SOLUTION

# %% minite={"check": "sharded_sgd_step"} tags=["nbval-check-output"]
# CHECK: sharded_sgd_step
ok, msg = run_graded(inspect.getsource(sharded_sgd_step), "sharded_sgd_step", world=2)
print(msg)
assert ok
print("PASS: sharded_sgd_step")

# %% [markdown]
# ## Task 2 — the AdamW kernel of a flat shard
#
# Write `adamw_shard_kernel` and nothing else is given: one program per `BLOCK` elements of the flat shard, in
# place, fp32. Inputs: `P` (parameters), `G` (gradients), `M`, `V` (AdamW's first and second moments), `D` (the
# decay mask: 1.0 where weight decay applies, 0.0 on norm gains and padding), `n` (elements), and the scalars `lr`,
# `beta1`, `beta2`, `eps`, `wd`, `bc1 = 1 - beta1**t`, `bc2 = 1 - beta2**t` for step `t`. It must produce exactly
# what `torch.optim.AdamW` (decoupled weight decay, `amsgrad=False`) produces for these elements. Mask the tail.

# %% minite={"task": "adamw_shard_kernel"}
@triton.jit
def adamw_shard_kernel(P, G, M, V, D, n, lr, beta1, beta2, eps, wd, bc1, bc2, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    d = tl.load(D + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * wd * d)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / tl.sqrt(bc2) + eps)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    ### END SOLUTION

# %% minite={"check": "adamw_shard_kernel"} tags=["nbval-check-output"]
# CHECK: adamw_shard_kernel
gen = torch.Generator().manual_seed(3)
n, BLOCK = 1000, 256
p0 = torch.randn(n, generator=gen)
dmask = (torch.rand(n, generator=gen) > 0.3).float()
ref_p = [torch.nn.Parameter(p0[dmask == 1].clone()), torch.nn.Parameter(p0[dmask == 0].clone())]
opt = torch.optim.AdamW([{"params": [ref_p[0]], "weight_decay": 0.1}, {"params": [ref_p[1]], "weight_decay": 0.0}],
                        lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
P, M, V = p0.clone().to(DEVICE), torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
worst = 0.0
for t in range(1, 4):
    grad = torch.randn(n, generator=gen)
    ref_p[0].grad, ref_p[1].grad = grad[dmask == 1].clone(), grad[dmask == 0].clone()
    opt.step()
    adamw_shard_kernel[(triton.cdiv(n, BLOCK),)](P, grad.to(DEVICE), M, V, dmask.to(DEVICE), n, 1e-2, 0.9, 0.95, 1e-8,
                                                 0.1, 1 - 0.9**t, 1 - 0.95**t, BLOCK=BLOCK)
    want = torch.empty(n)
    want[dmask == 1], want[dmask == 0] = ref_p[0].detach(), ref_p[1].detach()
    worst = max(worst, float((P.cpu() - want).abs().max()))
print(f"max |kernel - torch.optim.AdamW| over 3 steps: {'below 1e-6' if worst < 1e-6 else worst}")
assert worst < 1e-6
print("PASS: adamw_shard_kernel")
