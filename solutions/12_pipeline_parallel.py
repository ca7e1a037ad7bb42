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
# # 12 — Pipeline parallelism: exercises
#
# Three graded tasks. Fill in each region between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the
# `raise NotImplementedError()`), run the cell, then run its check cell.
#
# 1. **The 1F1B schedule, graded on 2 real ranks.** The check cell writes your function to a file and launches
#    `torchrun --nproc-per-node 2 -m minite.parallel.workers one_f_one_b`: every rank runs a real pipeline step with
#    your order and compares its loss and gradients with the dense GPT.
# 2. **Balanced stages**: where to cut a list of layer costs into $p$ contiguous stages.
# 3. **A whole Triton kernel from a spec**: accumulating a micro-batch's gradient into an fp32 main-gradient buffer.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect, itertools
from minite._triton import triton, tl
from minite.parallel.workers.grade import run_graded
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## Task 1 — the 1F1B step order
#
# `one_f_one_b(p, m, stage)` returns the list of steps stage `stage` (0 … p−1) of a `p`-stage pipeline runs for
# `m` micro-batches: `("F", i)` is the forward of micro-batch `i`, `("B", i)` its backward. The order is
# PipeDream-flush 1F1B:
#
# * warm-up: as many forwards as there are stages after this one, but never more than `m`;
# * steady state: alternately the next forward, then the oldest backward not yet run;
# * cool-down: the backwards that remain, in micro-batch order.
#
# Micro-batch numbers are plain Python `int`s, the list contains each forward and each backward once, and it must
# work for `m` smaller than `p`. The grader compares your order for every stage of many `(p, m)` with the
# expected one, then runs one real step with it on 2 ranks (`m = 6`).

# %% minite={"task": "one_f_one_b"}
def one_f_one_b(p, m, stage):
    ### BEGIN SOLUTION
    order, nf, nb = [], 0, 0
    while nf < min(p - stage - 1, m):
        order.append(("F", nf))
        nf += 1
    while nf < m:
        order += [("F", nf), ("B", nb)]
        nf, nb = nf + 1, nb + 1
    order += [("B", i) for i in range(nb, m)]
    return order
    ### END SOLUTION

# %% minite={"check": "one_f_one_b"} tags=["nbval-check-output"]
# CHECK: one_f_one_b
ok, msg = run_graded(inspect.getsource(one_f_one_b), "one_f_one_b", world=2)
print(msg)
assert ok
print("PASS: one_f_one_b")

# %% [markdown]
# ## Task 2 — balanced stages
#
# `balanced_cuts(costs, p)` gets the cost of each layer in order (a list of positive numbers, parameter counts
# for instance, `len(costs) >= p`) and returns the `p - 1` cut indices `0 < c_1 < ... < c_{p-1} < len(costs)`
# such that the stages `costs[0:c_1]`, `costs[c_1:c_2]`, …, `costs[c_{p-1}:]` are all non-empty and the largest
# stage sum is as small as possible. When several cuttings reach the same largest sum, any of them is accepted.
# It must run in polynomial time (the check uses 40 layers and 6 stages).

# %% minite={"task": "balanced_cuts"}
def balanced_cuts(costs, p):
    ### BEGIN SOLUTION
    n = len(costs)
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)

    def fits(limit):  # greedy: each stage takes layers while its sum stays <= limit; None if p stages are not enough
        cuts, cur = [], 0
        for j, c in enumerate(costs):
            if c > limit:
                return None
            if cur + c > limit:
                cuts.append(j)
                cur = 0
            cur += c
        return cuts if len(cuts) <= p - 1 else None

    sums = sorted({pre[j] - pre[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(sums) - 1
    while lo < hi:  # the smallest possible largest-stage sum is one of the contiguous sums
        mid = (lo + hi) // 2
        if fits(sums[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    cuts = fits(sums[lo])
    extra = [j for j in range(1, n) if j not in cuts]  # more stages than needed: split further (sums only shrink)
    return sorted(cuts + extra[:p - 1 - len(cuts)])
    ### END SOLUTION

# %% minite={"check": "balanced_cuts"} tags=["nbval-check-output"]
# CHECK: balanced_cuts
def largest(costs, cuts):
    b = [0, *cuts, len(costs)]
    return max(sum(costs[b[k]:b[k + 1]]) for k in range(len(b) - 1))

gen = torch.Generator().manual_seed(5)
for n, p in ((4, 4), (6, 2), (8, 3), (9, 4), (7, 5)):
    for _ in range(4):
        costs = torch.randint(1, 50, (n,), generator=gen).tolist()
        cuts = list(balanced_cuts(costs, p))
        assert len(cuts) == p - 1 and all(a < b for a, b in zip([0] + cuts, cuts + [n])), (costs, p, cuts)
        best = min(largest(costs, c) for c in itertools.combinations(range(1, n), p - 1))
        assert largest(costs, cuts) == best, (costs, p, cuts, best)
big = torch.randint(1, 1000, (40,), generator=gen).tolist()
cuts = list(balanced_cuts(big, 6))
assert len(cuts) == 5 and largest(big, cuts) <= max(max(big), sum(big) / 6 + max(big))
print("balanced_cuts: optimal on 20 random cases, 40 layers into 6 stages ok")
print("PASS: balanced_cuts")

# %% [markdown]
# ## Task 3 — the main-gradient accumulation kernel
#
# A pipeline stage runs `m` backwards per step (and `grad_accum` steps per update); mixed-precision training keeps
# each parameter's gradient in an fp32 *main-gradient* buffer and adds every micro-batch's contribution to it
# (Megatron's `main_grad`). Write `grad_accum_kernel(ACC, G, n, scale, BLOCK)`: one program per `BLOCK`
# consecutive elements of the flat buffers; `ACC` holds `n` fp32 numbers and is updated in place to
# `ACC + scale * G`, where `G` holds `n` gradients in fp32, fp16 or bf16 and the product is formed in fp32. The
# tail past `n` must not be read or written. Nothing else is given.

# %% minite={"task": "grad_accum_kernel"}
@triton.jit
def grad_accum_kernel(ACC, G, n, scale, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    start = tl.program_id(0).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    keep = idx < n
    grad = tl.load(G + idx, mask=keep, other=0.0).to(tl.float32)
    acc = tl.load(ACC + idx, mask=keep, other=0.0)
    tl.store(ACC + idx, acc + scale * grad, mask=keep)
    ### END SOLUTION

# %% minite={"check": "grad_accum_kernel"} tags=["nbval-check-output"]
# CHECK: grad_accum_kernel
gen = torch.Generator().manual_seed(9)
worst = 0.0
for n, dtype in ((1000, torch.float32), (777, torch.float16), (1025, torch.bfloat16)):
    acc0 = torch.randn(n + 7, generator=gen)  # 7 guard elements past n must stay untouched
    grads = [torch.randn(n, generator=gen).to(dtype) for _ in range(3)]
    acc = acc0.clone().to(DEVICE)
    want = acc0.clone()
    for gr in grads:
        grad_accum_kernel[(triton.cdiv(n, 256),)](acc, gr.to(DEVICE), n, 0.25, BLOCK=256)
        want[:n] += 0.25 * gr.float()
    worst = max(worst, float((acc.cpu() - want).abs().max()))
    assert torch.equal(acc.cpu()[n:], acc0[n:]), "wrote past n"
print(f"max |kernel - reference| over fp32/fp16/bf16 gradients: {'below 1e-6' if worst < 1e-6 else worst}")
assert worst < 1e-6
print("PASS: grad_accum_kernel")
