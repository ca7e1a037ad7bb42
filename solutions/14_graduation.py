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
# # 14 — Graduation: exercises
#
# Four graded tasks on choosing and running a layout, none of them written in the lesson. Fill in each region between
# `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the `raise NotImplementedError()`), run the cell, then its
# check cell.
#
# 1. **A layout planner**: the memory one rank needs under a dp × tp × pp × cp layout, and the layout a cluster
#    should run.
# 2. **The layout check**: every reason a parallel layout cannot work, with its numbers.
# 3. **Resharding the fused QKV weight** from one tensor-parallel degree to another, without a dense copy on disk.
# 4. **Utilisation with recompute**: MFU and HFU.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
from minite.testing import check_op
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## Task 1 — plan the layout: memory per rank, then the best layout that fits
#
# A mixed-precision run with AdamW keeps, per parameter, a bf16 weight (2 bytes), a bf16 gradient (2 bytes), and
# the optimizer's fp32 master weight and two fp32 moments (12 bytes). Under ZeRO-1 (`zero=True`) those 12 bytes are
# sharded over the `dp` data-parallel ranks; the weight and its gradient are not. Tensor and pipeline parallelism
# split the parameters themselves: a rank holds $1/(tp \cdot pp)$ of them (count every parameter that way, the
# embedding included).
#
# Activations: chapter 11's count (Korthikanti et al. 2022, flash attention, no $s^2$ term) is $34\,s\,b\,h$ bytes
# per layer for $s$ tokens, micro-batch $b$ and width $h$, divided by $tp$ with sequence parallelism (assume it on).
# Context parallelism gives each rank $s = T/cp$ tokens. The pipeline runs 1F1B with at least `pp` micro-batches,
# and you are asked for the worst rank, the first stage: work out how many micro-batches of activations it holds at
# once (chapter 12), each for its `n_layer / pp` layers.
#
# 1. `memory_per_rank(dp, tp, pp, cp, *, n_params, n_layer, n_embd, T, micro_batch, zero)` returns those bytes (a
#    float): parameter-related bytes plus the first stage's activations. Nothing else counts (no buffers, no
#    temporaries, no fragmentation).
# 2. `plan_layout(world, mem_bytes, *, n_params, n_layer, n_head, n_embd, T, micro_batch, gpus_per_node)` returns
#    the layout `(dp, tp, pp, cp)` to run, or `None` when none fits. A layout is allowed when
#    `dp * tp * pp * cp == world`, `tp` divides `n_head` and stays inside one node (`tp <= gpus_per_node`), `pp`
#    divides `n_layer`, `cp == 1` or `T` splits into `2 cp` chunks, and `memory_per_rank(..., zero=True)` is at
#    most `mem_bytes`. Among the allowed layouts pick the one with the **largest dp** (the cheapest communication),
#    then the **smallest pp** (the smallest bubble), then the **smallest cp**; `tp` is then what the world leaves.

# %% minite={"task": "plan_layout"}
def memory_per_rank(dp, tp, pp, cp, *, n_params, n_layer, n_embd, T, micro_batch, zero):
    ### BEGIN SOLUTION
    shard = n_params / (tp * pp)  # the parameters this rank holds
    states = 12 / dp if zero else 12  # fp32 master + two fp32 moments; ZeRO-1 shards them over dp
    # 1F1B: the first stage holds pp micro-batches of n_layer / pp layers each, n_layer layers' worth in all
    act = 34 * (T / cp) * micro_batch * n_embd / tp * n_layer
    return shard * (2 + 2 + states) + act
    ### END SOLUTION


def plan_layout(world, mem_bytes, *, n_params, n_layer, n_head, n_embd, T, micro_batch, gpus_per_node):
    ### BEGIN SOLUTION
    best = None
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            for cp in range(1, world // (tp * pp) + 1):
                if world % (tp * pp * cp) or tp > gpus_per_node or n_head % tp or n_layer % pp:
                    continue
                if cp > 1 and T % (2 * cp):
                    continue
                dp = world // (tp * pp * cp)
                need = memory_per_rank(dp, tp, pp, cp, n_params=n_params, n_layer=n_layer, n_embd=n_embd, T=T,
                                       micro_batch=micro_batch, zero=True)
                if need <= mem_bytes and (best is None or (-dp, pp, cp) < best[0]):
                    best = ((-dp, pp, cp), (dp, tp, pp, cp))
    return None if best is None else best[1]
    ### END SOLUTION

# %% minite={"check": "plan_layout"} tags=["nbval-check-output"]
# CHECK: plan_layout
M7 = dict(n_params=6.7e9, n_layer=32, n_embd=4096, T=4096, micro_batch=1)  # a 7B Llama shape
LAYOUTS = [(1, 1, 1, 1, True), (2, 2, 1, 1, True), (1, 8, 2, 1, True), (4, 2, 2, 1, True), (2, 2, 1, 4, True),
           (4, 2, 2, 1, False)]
# bytes, worked out by hand from the spec: e.g. one process holds 16 bytes x 6.7e9 parameters = 107.2 GB, plus
# 34 x 4096 x 4096 x 32 = 18.25 GB of activations
WANT_BYTES = [1.25454e11, 4.26268e10, 8.9817e9, 2.08518e10, 3.57817e10, 3.59268e10]


def memories(cases):
    return torch.tensor([memory_per_rank(*c[:4], **M7, zero=bool(c[4])) for c in cases.tolist()],
                        dtype=torch.float64)


assert check_op("memory_per_rank", memories, lambda cases: torch.tensor(WANT_BYTES, dtype=torch.float64),
                torch.tensor(LAYOUTS), grad=False, rtol=1e-5, atol=0.0)
H7 = dict(n_params=6.7e9, n_layer=32, n_head=32, n_embd=4096, T=4096, micro_batch=1)
H70 = dict(n_params=70e9, n_layer=80, n_head=64, n_embd=8192, T=4096, micro_batch=1)  # a 70B Llama shape
CLUSTERS = [  # (world, bytes per GPU, model, the layout that the rules pick; (0, 0, 0, 0): none fits)
    (16, 80e9, H7, (16, 1, 1, 1)), (8, 40e9, H7, (4, 2, 1, 1)), (64, 80e9, H70, (8, 8, 1, 1)),
    (32, 48e9, H70, (1, 8, 4, 1)), (64, 48e9, H70, (4, 8, 2, 1)), (16, 80e9, {**H7, "T": 131072}, (1, 8, 1, 2)),
    (16, 80e9, H70, (0, 0, 0, 0))]


def plans(index):
    return torch.tensor([plan_layout(w, mem, **m, gpus_per_node=8) or (0, 0, 0, 0)
                         for w, mem, m, _ in (CLUSTERS[i] for i in index.tolist())], dtype=torch.float32)


assert check_op("plan_layout", plans, lambda index: torch.tensor([c[3] for c in CLUSTERS], dtype=torch.float32),
                torch.arange(len(CLUSTERS)), grad=False)
for w, mem, m, want in CLUSTERS:
    got = plan_layout(w, mem, **m, gpus_per_node=8)
    print(f"{w:3} GPUs of {mem / 1e9:.0f} GB, {m['n_params'] / 1e9:.1f}B parameters, T={m['T']:6}: "
          f"(dp, tp, pp, cp) = {got}")
print("PASS: plan_layout")

# %% [markdown]
# ## Task 2 — every reason a layout cannot work
#
# `layout_errors(world, *, dp, tp, pp, cp, n_head, n_layer, T, batch)` returns a dict `{rule: message}` with one
# entry per rule the layout breaks (an empty dict when it can run). The rules, by name:
#
# * `"world"`: the degrees must use exactly the `world` processes;
# * `"heads"`: tensor parallelism splits attention by heads;
# * `"layers"`: every pipeline stage needs at least one layer;
# * `"sequence"`: context parallelism (when `cp > 1`) cuts each sequence of `T` tokens into `2 cp` load-balanced
#   chunks;
# * `"batch"`: `batch` is the global batch, split evenly over the data-parallel ranks.
#
# Each message must contain the numbers involved (as decimal integers): for `"world"` the world size and the
# product of the degrees, for `"heads"` `n_head` and `tp`, for `"layers"` `pp` and `n_layer`, for `"sequence"`
# `T` and `2 cp`, for `"batch"` `batch` and `dp`.

# %% minite={"task": "layout_errors"}
def layout_errors(world, *, dp, tp, pp, cp, n_head, n_layer, T, batch):
    ### BEGIN SOLUTION
    found = {}
    used = dp * tp * pp * cp
    if used != world:
        found["world"] = f"dp*tp*pp*cp = {used} processes, but the world has {world}"
    if n_head % tp:
        found["heads"] = f"tp={tp} does not divide n_head={n_head}"
    if pp > n_layer:
        found["layers"] = f"pp={pp} stages for n_layer={n_layer} layers"
    if cp > 1 and T % (2 * cp):
        found["sequence"] = f"T={T} tokens do not split into 2*cp={2 * cp} chunks"
    if batch % dp:
        found["batch"] = f"global batch {batch} does not split over dp={dp}"
    return found
    ### END SOLUTION

# %% minite={"check": "layout_errors"} tags=["nbval-check-output"]
# CHECK: layout_errors
CASES = [  # (world, dp, tp, pp, cp, n_head, n_layer, T, batch)
    (4, 2, 2, 1, 1, 4, 4, 64, 8), (8, 2, 2, 2, 1, 12, 6, 128, 16), (8, 2, 2, 1, 2, 4, 4, 64, 8),
    (8, 2, 3, 1, 1, 4, 4, 64, 8), (4, 1, 1, 4, 1, 4, 2, 64, 8), (4, 1, 1, 1, 4, 4, 4, 60, 8),
    (6, 3, 2, 1, 1, 4, 4, 64, 8), (16, 2, 8, 2, 1, 12, 1, 100, 9), (2, 1, 1, 1, 2, 8, 8, 6, 5),
    (4, 4, 1, 1, 1, 4, 4, 63, 8)]
RULES = ("world", "heads", "layers", "sequence", "batch")
NEEDS = {"world": lambda w, dp, tp, pp, cp, h, L, T, b: (w, dp * tp * pp * cp), "heads": lambda w, dp, tp, pp, cp, h, L, T, b: (h, tp),
         "layers": lambda w, dp, tp, pp, cp, h, L, T, b: (pp, L), "sequence": lambda w, dp, tp, pp, cp, h, L, T, b: (T, 2 * cp),
         "batch": lambda w, dp, tp, pp, cp, h, L, T, b: (b, dp)}


def broken_rules(cases):  # (len(cases), 5): 1.0 where the case breaks the rule
    out = []
    for case in cases.tolist():
        w, dp, tp, pp, cp, h, L, T, b = case
        errs = layout_errors(w, dp=dp, tp=tp, pp=pp, cp=cp, n_head=h, n_layer=L, T=T, batch=b)
        out.append([float(r in errs) for r in RULES])
    return torch.tensor(out)


# worked out by hand from the rules, one row per case: (world, heads, layers, sequence, batch)
BROKEN = [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0],
          [0, 0, 0, 0, 1], [1, 1, 1, 0, 1], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]]
assert check_op("layout_errors", broken_rules, lambda cases: torch.tensor(BROKEN, dtype=torch.float32),
                torch.tensor(CASES), grad=False)
mentions = []
for case in CASES:
    w, dp, tp, pp, cp, h, L, T, b = case
    errs = layout_errors(w, dp=dp, tp=tp, pp=pp, cp=cp, n_head=h, n_layer=L, T=T, batch=b)
    print(case, "->", sorted(errs))
    mentions += [rule in NEEDS and all(str(x) in msg for x in NEEDS[rule](*case)) for rule, msg in errs.items()]
assert all(mentions)
print("PASS: layout_errors")

# %% [markdown]
# ## Task 3 — re-cut the fused QKV weight for a new tensor-parallel degree
#
# Under tensor parallelism, rank $r$ of $t$ holds the rows of the fused QKV weight (dense shape
# $((H + 2\,KVH)\,D, C)$: the $H$ query heads' rows, then the $KVH$ key heads', then the $KVH$ value heads', $D$ rows
# per head) that its heads need: its $H/t$ query heads $[rH/t, (r+1)H/t)$, then its $KVH/t$ key heads, then the
# same value heads, concatenated in that order. A checkpoint written by a run of degree $t$ (a list of $t$ such
# shards) is to be resumed at degree $t'$.
#
# `reshard_qkv(shards, n_head, n_kv_head, head_dim, new_tp)` returns the list of `new_tp` shards of degree `new_tp`,
# in the same layout. Both the old degree (`len(shards)`) and `new_tp` must divide `n_head` and `n_kv_head`
# (replicated kv heads are out of scope): raise a `ValueError` naming the numbers otherwise.

# %% minite={"task": "reshard_qkv"}
def reshard_qkv(shards, n_head, n_kv_head, head_dim, new_tp):
    ### BEGIN SOLUTION
    old_tp = len(shards)
    for deg in (old_tp, new_tp):
        if deg < 1 or n_head % deg or n_kv_head % deg:
            raise ValueError(f"tp={deg} must divide n_head={n_head} and n_kv_head={n_kv_head}")
    sizes = [n_head * head_dim // old_tp, n_kv_head * head_dim // old_tp, n_kv_head * head_dim // old_tp]
    parts = [s.split(sizes, dim=0) for s in shards]  # per old rank: (q, k, v) rows
    whole = [torch.cat([pr[i] for pr in parts], dim=0) for i in range(3)]  # dense q, k, v row blocks
    cut = [w.chunk(new_tp, dim=0) for w in whole]
    return [torch.cat([cut[0][r], cut[1][r], cut[2][r]], dim=0) for r in range(new_tp)]
    ### END SOLUTION

# %% minite={"check": "reshard_qkv"} tags=["nbval-check-output"]
# CHECK: reshard_qkv
def by_rows(dense, H, KVH, D, tp):  # the chapter-11 cut, from the dense weight
    out = []
    for r in range(tp):
        q = torch.arange(r * H // tp * D, (r + 1) * H // tp * D)
        kv = torch.arange(r * KVH // tp * D, (r + 1) * KVH // tp * D)
        out.append(dense[torch.cat([q, H * D + kv, (H + KVH) * D + kv])])
    return out


gen = torch.Generator().manual_seed(6)
for H, KVH, D, C, old, new in ((8, 4, 4, 6, 2, 4), (8, 4, 4, 6, 4, 2), (6, 2, 3, 5, 2, 1), (4, 4, 2, 3, 1, 4)):
    dense = torch.randn((H + 2 * KVH) * D, C, generator=gen)
    assert check_op(f"reshard_qkv {old}->{new}", lambda *s: tuple(reshard_qkv(list(s), H, KVH, D, new)),
                    lambda *s: tuple(by_rows(dense, H, KVH, D, new)), *by_rows(dense, H, KVH, D, old), grad=False)
try:
    reshard_qkv(by_rows(torch.zeros(32, 2), 8, 4, 2, 2), 8, 4, 2, 3)
    raised = False
except ValueError:
    raised = True
assert raised
print("PASS: reshard_qkv")

# %% [markdown]
# ## Task 4 — model FLOPs vs hardware FLOPs
#
# MFU counts the FLOPs the *model* needs per token (the lesson's count, $6N + 12LCT$, PaLM appendix B); **HFU**
# (hardware FLOPs utilisation) counts what the hardware actually executes, recompute included. With
# `--train.recompute=full`, every transformer block's forward runs a second time during the backward (the
# embedding and the LM head are not recomputed); with minite's `selective`, GEMM and attention outputs are kept and
# only elementwise ops re-run: count those as 0 FLOPs; `none` recomputes nothing.
#
# `utilization(tokens_per_s, *, n_params, n_block_params, n_layer, n_embd, T, peak_flops, recompute)` returns
# `(mfu, hfu)` as fractions. `n_params` counts every parameter once (the tied embedding once), `n_block_params`
# those inside the transformer blocks. Unknown `recompute` values raise a `ValueError`.

# %% minite={"task": "utilization"}
def utilization(tokens_per_s, *, n_params, n_block_params, n_layer, n_embd, T, peak_flops, recompute):
    ### BEGIN SOLUTION
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: expected none, selective or full")
    attn = n_layer * n_embd * T  # the weight-free matmuls, per token per unit
    needed = 6 * n_params + 12 * attn
    again = 2 * n_block_params + 4 * attn if recompute == "full" else 0  # one more forward of the blocks
    return tokens_per_s * needed / peak_flops, tokens_per_s * (needed + again) / peak_flops
    ### END SOLUTION

# %% minite={"check": "utilization"} tags=["nbval-check-output"]
# CHECK: utilization
CASES4 = [(180e3, 124e6, 85e6, 12, 768, 1024, 989e12), (2.5e3, 7e9, 6.5e9, 32, 4096, 4096, 989e12),
          (9e3, 0.9e6, 0.8e6, 4, 128, 128, 1e12)]
MODES = ("none", "selective", "full")


def all_utilization(cases):  # (cases, modes, 2): (mfu, hfu)
    return torch.tensor([[utilization(tps, n_params=N, n_block_params=Nb, n_layer=int(L), n_embd=int(C), T=int(T),
                                      peak_flops=peak, recompute=mode) for mode in MODES]
                         for tps, N, Nb, L, C, T, peak in cases.tolist()], dtype=torch.float64)


# (mfu, hfu) for none, selective, full, worked out by hand from PaLM's count (6 significant digits)
WANT4 = [[(0.156021, 0.156021), (0.156021, 0.156021), (0.156021, 0.193831)],
         [(0.122453, 0.122453), (0.122453, 0.122453), (0.122453, 0.160743)],
         [(0.0556779, 0.0556779), (0.0556779, 0.0556779), (0.0556779, 0.0724372)]]
assert check_op("utilization", all_utilization, lambda cases: torch.tensor(WANT4, dtype=torch.float64),
                torch.tensor(CASES4, dtype=torch.float64), grad=False, rtol=1e-5, atol=0.0)
for mode in MODES:
    mfu, hfu = utilization(180e3, n_params=124e6, n_block_params=85e6, n_layer=12, n_embd=768, T=1024,
                           peak_flops=989e12, recompute=mode)
    print(f"GPT-2 124M, an example input of 180k tokens/s on an H100, recompute {mode:9s}: MFU {mfu:.1%}, HFU {hfu:.1%}")
try:
    utilization(1.0, n_params=1, n_block_params=1, n_layer=1, n_embd=1, T=1, peak_flops=1.0, recompute="some")
    raised = False
except ValueError:
    raised = True
assert raised
print("PASS: utilization")
