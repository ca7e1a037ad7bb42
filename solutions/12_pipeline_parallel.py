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
# 3. **The interleaved 1F1B schedule** (Megatron-LM): each rank holds several chunks of layers, which divides the
#    bubble by the number of chunks.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect, itertools
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
# ## Task 3 — the interleaved 1F1B schedule
#
# Narayanan et al. (2021, section 2.2) cut the model into $p \cdot v$ chunks of consecutive layers and give rank
# $d$ of $p$ the $v$ chunks $d,\ d + p,\ \dots,\ d + (v-1)p$: a micro-batch then passes through every rank $v$
# times. Call chunk `c` of rank `d` (0 ≤ c < v) the **virtual stage** $s = c \cdot p + d$. Its dependencies:
#
# * the forward of micro-batch $i$ on virtual stage $s > 0$ needs the forward of $i$ on $s - 1$ (on rank
#   $(s-1) \bmod p$);
# * the backward of $i$ on $s < pv - 1$ needs the backward of $i$ on $s + 1$; on the last virtual stage it needs
#   only its own forward.
#
# Write `interleaved_1f1b(p, v, m, rank)`: the steps rank `rank` runs for one optimizer step, in order, each a tuple
# `("F", c, i)` or `("B", c, i)` of plain `int`s (chunk `c` of this rank, micro-batch `i`), every forward and every
# backward of the $v$ chunks × $m$ micro-batches exactly once. `m` is a multiple of `p`. When every rank runs its
# list in order, a step starting as soon as its rank is free and its dependency has finished, with a chunk's forward
# taking $1/v$ time units and its backward $2/v$ (a whole stage's work split into $v$ chunks) and messages taking
# no time:
#
# * no rank ever waits forever, and the step ends at $3m + 3(p-1)/v$: the bubble of chapter 12's 1F1B, divided by $v$;
# * no rank holds more than $pv + p - 1$ chunk forwards whose backward has not run yet (AFAB order would hold all
#   $mv$).
#
# Megatron-LM's order meets both: forwards run through the micro-batches in groups of $p$ (the group through
# chunk 0, then the same group through chunk 1, …), backwards through the same groups with the chunks in reverse
# order; each rank runs some forwards first (a warm-up: how many, for rank $d$, is yours to work out), then
# alternates one forward and one backward, then runs the backwards left. Any order that meets the two properties is
# accepted.

# %% minite={"task": "interleaved_1f1b"}
def interleaved_1f1b(p, v, m, rank):
    ### BEGIN SOLUTION
    total = m * v

    def chunk_mb(k, backward):  # the k-th forward (or backward) of this rank: (chunk, micro-batch)
        c = (k % (p * v)) // p
        return (v - 1 - c if backward else c), (k // (p * v)) * p + k % p

    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)  # until the first backward can arrive
    order = [("F", *chunk_mb(k, False)) for k in range(warm)]
    nf, nb = warm, 0
    while nf < total:
        order += [("F", *chunk_mb(nf, False)), ("B", *chunk_mb(nb, True))]
        nf, nb = nf + 1, nb + 1
    return order + [("B", *chunk_mb(k, True)) for k in range(nb, total)]
    ### END SOLUTION

# %% minite={"check": "interleaved_1f1b"} tags=["nbval-check-output"]
# CHECK: interleaved_1f1b
def simulate_chunks(orders, p, v):
    """Run every rank's order (times in units of 1/v); (end of the step x v, the most chunk forwards held per
    rank) or (-1, [...]) when the ranks wait for each other forever."""
    done, free, pos, live, held = {}, [0] * p, [0] * p, [0] * p, [0] * p
    while any(pos[d] < len(orders[d]) for d in range(p)):
        moved = False
        for d in range(p):
            if pos[d] == len(orders[d]):
                continue
            kind, c, i = orders[d][pos[d]]
            s = c * p + d
            dep = ("F", s - 1, i) if kind == "F" else ("B", s + 1, i) if s < p * v - 1 else ("F", s, i)
            if dep in done or (kind == "F" and s == 0):
                start = max(free[d], done.get(dep, 0))
                done[(kind, s, i)] = free[d] = start + (1 if kind == "F" else 2)
                live[d] += 1 if kind == "F" else -1
                held[d] = max(held[d], live[d])
                pos[d] += 1
                moved = True
        if not moved:
            return -1, held
    return max(free), held


for p, v, m in ((2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 3, 6), (3, 2, 6), (4, 2, 4), (3, 3, 9)):
    orders = [list(interleaved_1f1b(p, v, m, d)) for d in range(p)]
    for o in orders:
        assert sorted(o) == sorted((k, c, i) for k in "FB" for c in range(v) for i in range(m)), (p, v, m, o)
        assert all(type(c) is int and type(i) is int for _, c, i in o)
    end, held = simulate_chunks(orders, p, v)
    print(f"p={p} v={v} m={m}: the step ends at {end}/{v}, chunk forwards held per rank {held}")
    assert end == 3 * m * v + 3 * (p - 1), (p, v, m, end)  # 3m + 3(p-1)/v, times v
    assert max(held) <= p * v + p - 1, (p, v, m, held)
print("PASS: interleaved_1f1b")
