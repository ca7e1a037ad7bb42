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
# `raise NotImplementedError()`), run the cell, then run its check cell. (The lesson wrote the 1F1B order itself.)
#
# 1. **Stages balanced by measured time**: where to cut a model into $p$ contiguous stages when what you know is
#    each layer's measured time, the first stage's embedding and the last stage's head and loss.
# 2. **The interleaved 1F1B schedule** (Megatron-LM): each rank holds several chunks of layers, which divides the
#    bubble by the number of chunks.
# 3. **The ZB-H1 schedule** (zero bubble): each backward split into B and W, and the W's placed so that the
#    bubble is a third of 1F1B's at the same peak memory.

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
# ## Task 2 — the interleaved 1F1B schedule
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

# %% [markdown]
# ## Task 3 — the ZB-H1 schedule
#
# Lesson 12 (section 8) split each stage's backward in two: **B**, the gradient of the stage's input, which the
# previous stage waits for, and **W**, the weight gradients ($dW = dy^\top x$), which nothing waits for until the
# optimizer step. ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", section 2.1) uses that freedom to fill the
# bubble without holding more activations than 1F1B.
#
# Write `zbh1_ops(p, m, stage)`: the ops stage `stage` of `p` runs for `m` micro-batches (`m >= p >= 1`), in order,
# each a tuple `("F", i)`, `("B", i)` or `("W", i)` of a str and a plain `int`: the F, the B and the W of every
# micro-batch `0 .. m-1` exactly once, each B after its F, each W after its B. Run every stage's list in order, an op
# starting as soon as its stage is free and what it needs has arrived (F of micro-batch $i$ on stage $s > 0$: the F
# of $i$ on stage $s - 1$; B of $i$ on stage $s < p - 1$: the B of $i$ on stage $s + 1$; W: nothing from another
# stage), each stage receiving the messages from a neighbour in the order that neighbour sent them, with F, B and
# W taking one time unit each and messages none. Then:
#
# * no stage waits forever, and the step ends at $3m + p - 1$: each stage idles $p - 1$ units, the bubble
#   $(p-1)/(3m+p-1)$ (1F1B's is $(p-1)/(m+p-1)$);
# * no stage ever holds more than $p$ micro-batches whose F has run and whose W has not (1F1B's stage 0 holds $p$).
#
# Any order with these properties is accepted. Hints: start from 1F1B's warm-up and its alternation of one
# forward and one backward; a W placed right after every B keeps a bubble of $2(p-1)$ units.

# %% minite={"task": "zbh1_ops"}
def zbh1_ops(p, m, stage):
    ### BEGIN SOLUTION
    n_warm = min(p - 1 - stage, m)  # forwards before the first backward
    ops = [("F", j) for j in range(n_warm)]
    next_w = 0  # the oldest micro-batch whose B ran and whose W did not
    for k in range(m):  # the k-th B, after one more forward while there is one
        if n_warm + k < m:
            ops.append(("F", n_warm + k))
        ops.append(("B", k))
        if k >= stage:  # the W's of this stage's first `stage` B's wait for the end: those B's go upstream at once
            ops.append(("W", next_w))
            next_w += 1
    ops += [("W", j) for j in range(next_w, m)]
    return ops
    ### END SOLUTION

# %% minite={"check": "zbh1_ops"} tags=["nbval-check-output"]
# CHECK: zbh1_ops
def run_stages(plans, p):
    """Every stage's ops in order, one time unit each, messages free: (end of the step, the most micro-batches a
    stage holds between F and W), or (-1, None) when the stages wait for each other forever."""
    done, free, pos, live, held = {}, [0] * p, [0] * p, [0] * p, [0] * p
    while any(pos[s] < len(plans[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(plans[s]):
                continue
            kind, i = plans[s][pos[s]]
            dep = {"F": ("F", i, s - 1), "B": ("B", i, s + 1)}.get(kind)
            if dep and 0 <= dep[2] < p and dep not in done:
                continue
            done[(kind, i, s)] = free[s] = max(free[s], done.get(dep, 0)) + 1
            live[s] += {"F": 1, "B": 0, "W": -1}[kind]
            held[s] = max(held[s], live[s])
            pos[s] += 1
            moved = True
        if not moved:
            return -1, None
    return max(free), held


for p in range(1, 7):
    for m in range(p, 13):
        plans = [list(zbh1_ops(p, m, s)) for s in range(p)]
        for s, ops in enumerate(plans):
            assert sorted(ops) == sorted((k, i) for k in "FBW" for i in range(m)), (p, m, s, ops)
            assert all(type(i) is int for _, i in ops), (p, m, s, ops)
            at = {op: n for n, op in enumerate(ops)}
            assert all(at[("F", i)] < at[("B", i)] < at[("W", i)] for i in range(m)), (p, m, s, ops)
            if s > 0:  # stage s receives the activations in the order stage s - 1 sends them
                assert [i for k, i in ops if k == "F"] == [i for k, i in plans[s - 1] if k == "F"], (p, m, s)
                assert [i for k, i in ops if k == "B"] == [i for k, i in plans[s - 1] if k == "B"], (p, m, s)
        end, held = run_stages(plans, p)
        assert end == 3 * m + p - 1, (p, m, "the step ends at", end, "not", 3 * m + p - 1)
        assert max(held) <= p, (p, m, "micro-batches held per stage", held)
print("p=4, m=8, stage 3:", " ".join(f"{k}{i}" for k, i in zbh1_ops(4, 8, 3)))
print("PASS: zbh1_ops")
