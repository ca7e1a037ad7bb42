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
# Two graded tasks. Fill in each region between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the
# `raise NotImplementedError()`), run the cell, then run its check cell. (The lesson wrote the 1F1B order itself.)
#
# 1. **Stages balanced by measured time**: where to cut a model into $p$ contiguous stages when what you know is
#    each layer's measured time, the first stage's embedding and the last stage's head and loss.
# 2. **The interleaved 1F1B schedule** (Megatron-LM): each rank holds several chunks of layers, which divides the
#    bubble by the number of chunks.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import itertools
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## Task 1 — stages balanced by measured time
#
# Lesson 12 balanced the stages by parameter count, and its measured timelines showed why that is not enough: the
# embedding on stage 0 is a table lookup, the tied head on the last stage a $V \times C$ GEMM and the loss. What
# sets a pipeline's pace is its slowest stage's time per micro-batch (in the steady state of 1F1B every stage
# runs one forward and one backward per slot). So balance what you measured.
#
# `balanced_cuts(layer_ms, p, first_ms, last_ms)` gets each layer's measured forward + backward time in order
# (positive floats, `len(layer_ms) >= p`), the extra time of the first stage (the embedding) and of the last stage
# (norm, head and loss), and returns the `p - 1` cut indices `0 < c_1 < ... < c_{p-1} < len(layer_ms)`: stage 0
# runs layers `[0, c_1)` plus `first_ms`, stage $k$ runs `[c_k, c_{k+1})`, the last stage `[c_{p-1}, n)` plus
# `last_ms` (with `p = 1` the one stage pays both). Every stage holds at least one layer, and the slowest stage's
# time must be as small as possible (any cutting that reaches it is accepted). It must run in polynomial time in
# the number of layers and stages.

# %% minite={"task": "balanced_cuts"}
def balanced_cuts(layer_ms, p, first_ms, last_ms):
    ### BEGIN SOLUTION
    n = len(layer_ms)
    pre = [0.0]
    for t in layer_ms:
        pre.append(pre[-1] + t)

    def stage_ms(k, i, j):  # stage k runs layers i..j-1
        return pre[j] - pre[i] + (first_ms if k == 0 else 0.0) + (last_ms if k == p - 1 else 0.0)

    best = {0: (0.0, [])}  # layers taken by the stages so far -> (their slowest time, their end indices)
    for k in range(p):
        nxt = {}
        for i, (worst, ends) in best.items():
            for j in (range(i + 1, n - (p - 1 - k) + 1) if k < p - 1 else [n]):
                cand = (max(worst, stage_ms(k, i, j)), ends + [j])
                if j not in nxt or cand[0] < nxt[j][0]:
                    nxt[j] = cand
        best = nxt
    return best[n][1][:-1]
    ### END SOLUTION

# %% minite={"check": "balanced_cuts"} tags=["nbval-check-output"]
# CHECK: balanced_cuts
def slowest(ms, cuts, first, last):
    b = [0, *cuts, len(ms)]
    times = [sum(ms[b[k]:b[k + 1]]) for k in range(len(b) - 1)]
    times[0] += first
    times[-1] += last
    return max(times)


def check_cuts(ms, p, first, last):
    cuts = [int(c) for c in balanced_cuts(ms, p, first, last)]
    n = len(ms)
    assert len(cuts) == p - 1 and all(a < b for a, b in zip([0] + cuts, cuts + [n])), (ms, p, cuts)
    best = min(slowest(ms, c, first, last) for c in itertools.combinations(range(1, n), p - 1))  # every cutting
    got = slowest(ms, cuts, first, last)
    assert got <= best + 1e-9, (ms, p, first, last, cuts, got, best)
    return got, best


gen = torch.Generator().manual_seed(5)
for n, p in ((4, 4), (6, 2), (8, 3), (9, 4), (7, 5), (5, 1)):
    for _ in range(4):
        ms = [round(x, 1) for x in (torch.rand(n, generator=gen) * 9 + 1).tolist()]
        first, last = [round(x, 1) for x in (torch.rand(2, generator=gen) * 12).tolist()]
        check_cuts(ms, p, first, last)
# a 40-layer model, 4 stages: uniform layers, a cheap embedding, a head as costly as 6 layers
ms = [round(x, 2) for x in (2.0 + 0.2 * torch.rand(40, generator=gen)).tolist()]
got, best = check_cuts(ms, 4, 0.1, 12.5)
print(f"40 layers into 4 stages: slowest stage {got:.2f} ms, the best of all 9139 cuttings {best:.2f} ms")
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
# * no rank ever waits forever, and the step ends at $3m + 3(p-1)/v$: the bubble of lesson 12's 1F1B, divided by $v$;
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
