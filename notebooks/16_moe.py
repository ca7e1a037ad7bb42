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
# # 16 — Mixture of experts: routing, load balance, the grouped GEMM and expert parallelism
#
# A dense MLP spends its FLOPs on every token with every weight. A **mixture of experts** (MoE) layer keeps $E$
# MLPs ("experts") and a small **router** that sends each token to only $k$ of them. Parameters grow with $E$, FLOPs
# per token with $k$: DeepSeek-V3 holds 671B parameters but computes with 37B per token (256 routed experts, top 8,
# plus one shared expert); Mixtral 8x7B holds 47B and computes with 13B (8 experts, top 2).
#
# **The arithmetic of one layer.** Width $C$, expert hidden width $H$, SwiGLU experts ($3CH$ weights each):
#
# | | dense MLP (hidden $H$) | MoE, $E$ experts, top $k$ |
# |---|---|---|
# | weights | $3CH$ | $E \cdot 3CH$ (+ router $EC$) |
# | FLOPs per token | $6CH$ | $k \cdot 6CH$ (+ router $2EC$) |
# | bytes of weights read per step (bf16) | $6CH$ | $E \cdot 6CH$ when every expert gets a token |
#
# With $C = 4096$, $H = 14336$, $E = 8$ the experts are 1.4 B weights = 2.8 GB of bf16 per layer, all of which a
# step must read while each token touches only $k/E$ of it. So MoE is cheap in FLOPs and expensive in memory and
# communication: the rest of this chapter is about keeping the GPUs busy anyway: routing that spreads the load,
# one GEMM launch for all experts, and experts spread over ranks with an all-to-all.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math, tempfile
import matplotlib.pyplot as plt
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import assert_close, check_op
from minite.layers.moe import MoE, route, load_balance_loss, permute, unpermute, moe_ref, step_expert_bias
from minite.kernels.grouped_gemm import grouped_gemm, grouped_gemm_ref
from minite.models.gpt import GPT, GPTConfig
from minite.parallel.launch import torchrun, results
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)  # tiny shapes: on a busy 2-core machine a second thread makes them ~10x slower
_ = torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)  # every input below: drawn on the CPU from this, then moved to DEVICE

# %% [markdown]
# ## 1. Routing: softmax, top-k, renormalise
#
# The router is one matrix $W_r \in \mathbb{R}^{E\times C}$. For token $x$:
#
# $$p = \mathrm{softmax}(W_r x) \in \mathbb{R}^E,\qquad \mathcal{T} = \mathrm{topk}(p, k),\qquad
# y = \sum_{e\in\mathcal{T}} w_e\, \mathrm{FFN}_e(x),\quad w_e = \frac{p_e}{\sum_{j\in\mathcal{T}} p_j}.$$
#
# The top-k itself has no gradient; the router learns through the weights $w_e$ (renormalised over the chosen
# experts as Mixtral does; with $k = 1$ renormalising would make $w = 1$ and starve the router of gradient, so
# Switch keeps $w = p_e$). The router runs in fp32 even in a bf16 model: a softmax over $E$ logits is cheap, and
# rounding there changes *which* expert a token visits, not only a little of its value.

# %%
def naive_route(x, w_router, k):
    probs = torch.softmax(x.float() @ w_router.float().t(), dim=-1)  # (N, E)
    top_p, top_e = probs.topk(k, dim=-1)  # (N, k) each, largest first
    weights = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
    return weights, top_e, probs

x = torch.randn(6, 8, generator=gen)
w_router = torch.randn(4, 8, generator=gen)
weights, experts, probs = naive_route(x, w_router, 2)
print("experts per token:", experts.tolist())
print("their weights:    ", [[round(v, 3) for v in row] for row in weights.tolist()])
w2, e2, p2 = route(x @ w_router.t(), 2)  # minite.layers.moe.route
assert torch.equal(e2, experts)
assert_close(w2, weights, name="route weights")
print("PASS: the naive router and minite's agree")

# %% [markdown]
# ## 2. Load balance, and why it matters
#
# Nothing in the language-model loss asks the router to spread tokens. Early in training an expert that happens
# to be chosen a little more gets more gradient, becomes better, is chosen more: the router **collapses** onto a
# few experts. The other experts' weights are dead memory, and under expert parallelism (section 5) the ranks that
# hold the busy experts do all the work while the others wait.
#
# **Switch / GShard auxiliary loss.** With $f_i$ the fraction of the $Nk$ assignments routed to expert $i$ and
# $P_i = \frac1N\sum_t p_{t,i}$ the mean router probability of expert $i$:
#
# $$\mathcal{L}_{aux} = E \sum_{i=1}^{E} f_i\,P_i .$$
#
# $f$ comes from an argmax and has no gradient; the gradient flows through $P$, pushing probability away from the
# experts that received many tokens. At a uniform load $f_i = P_i = 1/E$ and $\mathcal{L}_{aux} = 1$. It is added
# to the loss with a small weight (0.01): large enough to balance, small enough not to fight the language model.
#
# **DeepSeek-V3's auxiliary-loss-free balancing** (DeepSeek-AI 2024, [arXiv:2412.19437](https://arxiv.org/abs/2412.19437),
# §2.1.2). A bias $b_i$ per expert is added to the scores *only to choose* the experts; the weights $w_e$ still come
# from the unbiased scores. After each step, $b_i \leftarrow b_i + \gamma\,\mathrm{sign}(\bar{c} - c_i)$ with $c_i$
# the tokens expert $i$ received: underloaded experts become more attractive, overloaded ones less. The bias gets no
# gradient. Two differences from the paper, stated plainly:
# * **V3's scores are sigmoids, not a softmax.** V3 computes each expert's affinity $s_{t,i} = \sigma(u_t^\top e_i)$,
#   adds $b_i$ to choose the top $k$, and normalises the chosen (unbiased) $s_{t,i}$ to sum to 1. minite keeps the
#   softmax router of section 1 and adds $b_i$ to the softmax probabilities $p_{t,i}$. The mechanism is the same
#   (a bias that moves the choice, not the weights); the scale differs: a softmax probability is about $1/E$ and a
#   sigmoid score does not shrink with $E$, so the same $\gamma$ pushes harder, relative to the scores, in minite's
#   router the more experts there are. Exercise 16 writes V3's sigmoid router.
# * **V3 is not free of a balance loss.** Besides the bias it keeps a *complementary sequence-wise* balance loss
#   (§2.1.2; the Switch loss computed per sequence, on the normalised sigmoid scores) with a tiny weight,
#   $\alpha = 10^{-4}$ (§4.2), "just to avoid extreme imbalance within any single sequence"; the exercise builds it.
#   What the bias removes is a balance loss large enough to pull against the language model.
#
# In minite the update is one explicit call next to the optimizer's step,
# `step_expert_bias(model)`: each training forward adds its counts to the layer's `routed`, and the call moves every
# bias by the load of the whole step (all its micro-batches) and empties `routed`. The bias never changes between a
# forward and its backward.

# %%
def naive_switch_loss(probs, experts):
    E = probs.shape[1]
    f = torch.bincount(experts.reshape(-1), minlength=E).float() / experts.numel()  # (E,) share of assignments
    return E * (f * probs.mean(0)).sum()

print(f"Switch loss of the 6 tokens above: {float(naive_switch_loss(probs, experts)):.4f}")
counts = torch.bincount(experts.reshape(-1), minlength=4)
assert_close(naive_switch_loss(probs, experts), load_balance_loss(probs, counts), name="Switch loss")
print("PASS: the Switch loss matches minite's")

# %% [markdown]
# **A real short run.** A 2-layer GPT whose MLPs are 8 experts (top 2), trained for 80 steps on a small text: no
# balancing, the Switch loss at the usual weight 0.01 and at 0.1, and the bias update ($\gamma = 0.01$). We record
# how many of the 2 x 512 assignments per step land on each expert of the first layer. The plot shows the largest
# load divided by the mean (1.0 = perfectly balanced).

# %%
words = "the king and queen of night shall speak to thee my lord what art thou sweet love".split()
text = "".join(" ".join(words[i] for i in torch.randint(0, len(words), (6,), generator=gen)) + ".\n"
               for _ in range(400))
vocab = sorted(set(text))
ids = torch.tensor([vocab.index(c) for c in text])

def short_run(balance, aux_weight=0.01, steps=80, B=16, T=32):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=len(vocab), block_size=T, n_layer=2, n_head=4, n_embd=32, mlp_hidden=64,
                    backend="torch", moe_num_experts=8, moe_top_k=2, moe_balance=balance, moe_aux_weight=aux_weight)
    model = GPT(cfg)
    for b in model.blocks:
        b.mlp.bias_rate = 0.01  # gamma: the lesson's run is short
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    loads, losses = [], []
    for _ in range(steps):
        start = torch.randint(0, len(ids) - T - 1, (B,), generator=g)
        xb = torch.stack([ids[s:s + T] for s in start])
        yb = torch.stack([ids[s + 1:s + T + 1] for s in start])
        loss = model(xb, yb)[1]
        loss.backward()
        opt.step()
        step_expert_bias(model)  # the "bias" balance's step (the other balances have none)
        opt.zero_grad(set_to_none=True)
        loads.append(model.blocks[0].mlp.load.float())
        losses.append(loss.item())
    return torch.stack(loads), losses

runs = {"none": short_run("none"), "aux 0.01": short_run("aux"), "aux 0.1": short_run("aux", 0.1),
        "bias": short_run("bias")}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4), layout="tight")
for name, (loads, losses) in runs.items():
    ax1.plot((loads.max(1).values / loads.mean(1)).tolist(), label=name)
last = {name: loads[-20:].mean(0) for name, (loads, _) in runs.items()}
for j, (name, lo) in enumerate(last.items()):
    ax2.bar(torch.arange(8) + 0.2 * (j - 1.5), lo.tolist(), width=0.2, label=name)
ax1.set(xlabel="step", ylabel="max load / mean load", title="layer 0: the busiest expert vs the mean")
ax2.set(xlabel="expert", ylabel="assignments per step", title="layer 0, mean load over the last 20 steps")
ax1.legend()
ax2.legend(ncol=2, fontsize=8)
plt.show()
for name, (loads, losses) in runs.items():
    print(f"{name:8s} max/mean load over the last 20 steps {float(last[name].max() / last[name].mean()):.2f}, "
          f"final train loss {sum(losses[-10:]) / 10:.3f}")
imbalance = {name: float(lo.max() / lo.mean()) for name, lo in last.items()}
assert imbalance["bias"] < 1.1 and imbalance["bias"] < min(v for n, v in imbalance.items() if n != "bias")

# %% [markdown]
# What this run shows (the numbers depend on the seed and the data; on the CPU they are deterministic): the bias
# update brings the busiest expert down fastest, and averaged over the last 20 steps its load is within a few
# percent of uniform, with no balance term in this run's loss (V3 would add its $10^{-4}$ sequence-wise one). The Switch loss at the usual weight 0.01 does little in 80 steps:
# it is a gentle force meant for runs of many thousands of steps; at 0.1 it balances better, but its gradient now
# competes with the language model's (a visibly higher training loss here).
# That trade-off is DeepSeek-V3's argument for the bias. With a capacity factor (section 3) the overflow of a busy
# expert is not computed at all: imbalance then costs quality, not only time.
#
# ## 3. Permute: sort the assignments by expert
#
# Each of the $N$ tokens has $k$ assignments, $Nk$ in all. To give each expert its rows as one contiguous block,
# sort the assignments by expert id (stably, so that within an expert the tokens keep their order). The sort gives
# `order` (which assignment each sorted row is) and, from the counts, `offsets` (where each expert's rows start).
# After the experts ran, the **inverse permutation** puts every output row back at its assignment, and each token
# sums its $k$ rows with its weights.
#
# **Capacity.** With a capacity factor $c$ an expert takes at most $\lceil c\,Nk/E\rceil$ assignments, the first
# ones in token order; the rest are **dropped** (the token's residual carries it through). Dropping keeps shapes
# static (GShard, Switch); *dropless* routing ($c = 0$ here) computes every assignment, which needs kernels that
# accept any number of rows per expert: the grouped GEMM of section 4. minite applies the limit in training only:
# in eval mode every assignment is kept. Otherwise a token's output would depend on the rest of the batch, and
# decoding with a KV cache ($N = B$ tokens a step) would drop other assignments than a forward over the whole
# context ($N = BT$), so the two would generate different text.

# %%
def naive_permute(x, experts, E):
    k = experts.shape[1]
    flat = experts.reshape(-1)  # (N*k,) assignment a = token * k + slot
    order = torch.argsort(flat, stable=True)  # (N*k,)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(flat, minlength=E).cumsum(0)])
    return x[order // k], order, offsets

def naive_unpermute(y_sorted, order, weights):
    N, k = weights.shape
    out = torch.zeros(N, y_sorted.shape[1])
    w = weights.reshape(-1)[order]  # the weight of each sorted row
    return out.index_add(0, order // k, y_sorted * w[:, None])  # each row added to its token

xs, order, offsets = naive_permute(x, experts, 4)
print("expert of each sorted row:", experts.reshape(-1)[order].tolist())
print("offsets:", offsets.tolist())
xs2, order2, offsets2 = permute(x, experts, 4)  # minite.layers.moe.permute
assert torch.equal(order2, order) and torch.equal(offsets2, offsets) and torch.equal(xs2, xs)
assert_close(naive_unpermute(xs, order, weights), unpermute(xs2, order2, weights), name="unpermute")
assert_close(naive_unpermute(xs, order, torch.full((6, 2), 0.5)), x, name="round trip")  # weights 1/k: x back
print("PASS: permute and unpermute match minite's, and the round trip gives x back")

# %% [markdown]
# ## 4. The grouped GEMM, built in cells
#
# Every expert multiplies its block of rows by its own weight matrix: $y_{o_e:o_{e+1}} = x_{o_e:o_{e+1}} W_e$.
# A Python loop of $E$ cuBLAS calls pays $E$ launches, and **it must read the offsets on the host** (a sync that
# stalls the GPU's queue) before it can slice. A grouped GEMM does all experts in **one launch** with the offsets on
# the device. The trick is a **tile table**: expert $e$ needs $\lceil m_e / B_M\rceil$ row tiles, and all of them
# fit in $\lceil M/B_M\rceil + E$ slots (each expert wastes at most one partial tile). With a few tensor ops on the
# device we write, for each slot, which expert it works for and its first row; the kernel reads its slot and runs
# an ordinary tiled matmul on those rows with that expert's weights. An empty expert simply owns no slot.

# %%
def my_tile_table(offsets, M, BM):
    E = offsets.numel() - 1
    tiles = (offsets.diff() + BM - 1) // BM  # (E,) row tiles per expert
    cum = tiles.cumsum(0)  # (E,)
    slots = torch.arange(triton.cdiv(M, BM) + E, device=offsets.device)
    expert = torch.searchsorted(cum, slots, right=True).clamp(max=E - 1)  # the expert of each slot
    first = offsets[expert] + (slots - (cum - tiles)[expert]) * BM  # its first row
    first = torch.where(slots < cum[-1], first, offsets[E])  # spare slots: past every row (all masked)
    return expert, first

@triton.jit
def my_grouped_gemm_kernel(X_ptr, W_ptr, Y_ptr, Expert_ptr, First_ptr, Offsets_ptr, N, K,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (slot, j): rows [first, first + BLOCK_M) of expert e, columns j * BLOCK_N ... of y (M, N)
    slot = tl.program_id(0)
    e = tl.load(Expert_ptr + slot).to(tl.int64)
    first = tl.load(First_ptr + slot).to(tl.int64)
    end = tl.load(Offsets_ptr + e + 1).to(tl.int64)  # this expert's rows end here
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(X_ptr + rows[:, None] * K + (k0 + ks)[None, :],  # x (M, K) contiguous
                    mask=(rows[:, None] < end) & ((k0 + ks)[None, :] < K), other=0.0)
        b = tl.load(W_ptr + e * K * N + (k0 + ks)[:, None] * N + cols[None, :],  # w (E, K, N) contiguous
                    mask=((k0 + ks)[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")  # exact fp32 products
    tl.store(Y_ptr + rows[:, None] * N + cols[None, :], acc.to(Y_ptr.dtype.element_ty),
             mask=(rows[:, None] < end) & (cols[None, :] < N))

def my_grouped_gemm(x, w, offsets, BM=16, BN=32, BK=32):
    M, K = x.shape
    N = w.shape[2]
    y = torch.zeros(M, N, dtype=x.dtype, device=x.device)  # rows past offsets[E] (dropped) stay 0
    expert, first = my_tile_table(offsets, M, BM)
    my_grouped_gemm_kernel[(expert.numel(), triton.cdiv(N, BN))](x, w.contiguous(), y, expert, first, offsets,
                                                                 N, K, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    return y

counts = [5, 0, 23, 1]  # uneven, one expert empty, then 3 dropped rows
offs = torch.tensor([0] + counts).cumsum(0).to(DEVICE)
xg = torch.randn(sum(counts) + 3, 40, generator=gen).to(DEVICE)
wg = torch.randn(4, 40, 24, generator=gen).to(DEVICE)
ok = check_op("my grouped GEMM vs the loop", my_grouped_gemm, grouped_gemm_ref, xg, wg, offs, grad=False)
ok &= check_op("my grouped GEMM vs minite's", my_grouped_gemm, lambda x, w, o: grouped_gemm(x, w, o), xg, wg, offs,
               grad=False)
assert ok

# %% [markdown]
# Tile sizes are $\ge 16$ in every `tl.dot` dimension, as a GPU requires. The backward is two more grouped
# products per expert: $dx_e = dy_e\,W_e^\top$ is the same kernel with $W$'s last two strides swapped, and
# $dW_e = x_e^\top dy_e$ reduces over the expert's rows, so one program owns a tile of $dW_e$ and walks down rows
# $o_e \dots o_{e+1}$ (an empty expert gets a zero gradient). `minite.kernels.grouped_gemm` has all three with
# `torch.autograd`; the MoE layer calls it, so the layer equals the loop over experts, gradients included:

# %%
moe = MoE(16, 32, num_experts=6, top_k=2, capacity_factor=1.0).to(DEVICE)
xm = torch.randn(2, 13, 16, generator=gen).to(DEVICE)  # 26 tokens
assert check_op("MoE layer (grouped GEMM) vs the loop over experts", lambda x: moe(x), lambda x: moe_ref(moe, x), xm)
print(f"tokens per expert {moe.load.tolist()}, dropped assignments {int(moe.dropped)} (capacity 1.0)")

# %% [markdown]
# **On a GPU.** `benchmarks/bench_grouped_gemm.py` times minite's grouped GEMM against a loop of cuBLAS GEMMs and
# PyTorch's own grouped GEMM, `torch._grouped_mm` (the peer: one launch, CUTLASS on sm_90), with 8 experts, 16384
# rows, $4096 \to 14336$, uneven routing (one expert empty), bf16, and writes
# `benchmarks/results/grouped_gemm_<device>.json`. The cell below plots the file recorded on this notebook's GPU,
# or on a CPU the newest GPU run recorded: an **NVIDIA H200** on 2026-11-28 (torch 2.11, triton 3.6, CUDA-graph timer).

# %% tags=["nbval-ignore-output"]
from minite.recorded import recorded_for

found = recorded_for("grouped_gemm")  # (file, JSON) of this GPU, else of the H200; None where nothing is recorded
rec = found and found[1]
if rec is None:
    print("No GPU result recorded for this chapter: run `python benchmarks/bench_grouped_gemm.py` on a GPU.")
else:
    impls = ["minite triton", "torch._grouped_mm", "torch loop"]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for j, impl in enumerate(impls):
        ms = [next((r["ms"] for r in rec["results"] if r["impl"] == impl and r["mode"] == m), 0.0)
              for m in ("fwd", "fwd+bwd")]
        ax.bar([i + 0.27 * (j - 1) for i in range(2)], ms, width=0.27, label=impl)
    r0 = rec["results"][0]
    ax.set_xticks(range(2), ["fwd", "fwd+bwd"])
    ax.set(ylabel="ms (lower is better)",
           title=f"grouped GEMM, E={r0['E']}, M={r0['M']}, {r0['K']}->{r0['N']} — {rec['device']}")
    ax.legend(fontsize=8)
    plt.show()
    for r in rec["results"]:
        print(f"{r['impl']:18} {r['mode']:8} {r['ms']:6.2f} ms {r['TFLOPs']:6.0f} TFLOP/s")

# %% [markdown]
# **Where minite lost on the H200 (2026-11-28), and why.** Forward, minite took 4.56 ms, the loop of cuBLAS calls
# 2.78 and `torch._grouped_mm` 3.40 (0.61× and 0.74× their speed); forward+backward 14.4 ms, faster than the loop
# (15.9) but 0.63× `_grouped_mm` (9.0). The kernel's code was not the problem (compiled for sm_90: `wgmma`, 121
# registers, no spills, a 3-stage pipeline); its **program order** was. The grid ran the row tiles fastest with no
# grouping, so each pass over one column block of $W$ streamed all of $x$ (128 MiB, more than the 50 MB L2): about
# 56 reads of $x$, ~7.5 GB ≈ 1.6 ms at 4.8 TB/s (an estimate from the compile, not a profile). The backward re-read
# $dy$ the same way, and zero-filled $y$ and $dW$ (~0.3 ms).
#
# **Changed since, not measured yet.** The kernels now run one 1-D grid in grouped order (the Triton matmul
# tutorial's `GROUP_M`: 8 row-tile slots, sorted by expert, sweep the columns together, so their rows of $x$ stay
# in L2; $dW$ expert by expert), on the tutorial's Hopper tile (128×256×64, 8 warps, 3 stages), and write every
# output element instead of zero-filling first. Expected from the byte count, not measured: the forward toward
# ~3 ms (the loop's 2.8, `_grouped_mm`'s 3.4) and forward+backward ~9–10 ms, about `_grouped_mm`'s. TMA
# descriptors per expert (Triton's grouped-GEMM tutorial) would be the next step. Until a GPU run records a new
# `grouped_gemm_<device>.json`, the plot shows the old kernel.
#
# ## 5. Expert parallelism: the all-to-all, simulated
#
# With $E$ experts over an `ep` group of $R$ ranks, rank $r$ holds experts $[rE/R, (r+1)E/R)$ and its own slice
# of the batch; everything else (attention, router, embeddings) is replicated as in data parallelism. A MoE layer
# on one rank:
# 1. route and permute its tokens: sorted by expert id, they are also sorted by destination rank;
# 2. **exchange the counts** (an all-to-all of $E$ integers): each rank learns how many rows it will receive from
#    every other rank, per local expert. These split sizes must go to the host: the one sync of the dispatch;
# 3. **dispatch**: an all-to-all of the rows, with those split sizes;
# 4. run the local experts (received rows re-sorted by local expert, one grouped GEMM);
# 5. **combine**: the all-to-all back, splits swapped; unpermute.
#
# Below, $R = 2$ "ranks" are list entries in this process, each with its own 7 tokens; the messages are tensors
# moved between lists. The combined result must equal what one process computes on all 14 tokens.

# %%
E, R = 4, 2
moe_sim = MoE(16, 32, num_experts=E, top_k=2, backend="torch")
tokens = [torch.randn(7, 16, generator=gen) for _ in range(R)]
El = E // R

def simulate_ep(moe, tokens):
    sent = [None] * R  # per source rank: (rows sorted by expert, order, offsets, weights)
    for r, xr in enumerate(tokens):
        w, e, _ = route(xr @ moe.router.weight.t(), moe.top_k)
        xs, order, offs = permute(xr, e, E)
        sent[r] = (xs, order, offs, w)
    counts = [s[2].diff() for s in sent]  # counts[src][expert]
    # dispatch: rank dst receives from every src the rows of its experts, source by source
    inbox = [[sent[src][0][int(sent[src][2][dst * El]):int(sent[src][2][(dst + 1) * El])] for src in range(R)]
             for dst in range(R)]
    outbox = []
    for dst in range(R):  # local experts of rank dst, one source block at a time (each sorted by local expert)
        outs = []
        for src in range(R):
            loc = counts[src][dst * El:(dst + 1) * El]
            loffs = torch.cat([torch.zeros(1, dtype=torch.long), loc.cumsum(0)])
            w1, w2 = moe.w_gate_up[dst * El:(dst + 1) * El], moe.w_down[dst * El:(dst + 1) * El]
            h = grouped_gemm_ref(inbox[dst][src], w1, loffs)
            gate, up = h.chunk(2, dim=-1)
            outs.append(grouped_gemm_ref(F.silu(gate) * up, w2, loffs))
        outbox.append(outs)
    # combine: the rows go back to their source, in the order they came; then unpermute
    return [unpermute(torch.cat([outbox[dst][src] for dst in range(R)]), sent[src][1], sent[src][3])
            for src in range(R)]

with torch.no_grad():
    simulated = torch.cat(simulate_ep(moe_sim, tokens))
    single = moe_sim(torch.cat(tokens))
assert_close(simulated, single, name="simulated expert parallelism vs one process")
print("PASS: 2 simulated ranks, 2 experts each, give the single-process MoE output")

# %% [markdown]
# ## 6. The same on real ranks, under torchrun
#
# `minite.parallel.expert` does this with `torch.distributed.all_to_all_single` (gloo on CPU, NCCL on GPUs; both
# support uneven split sizes), wrapped in an autograd Function whose backward is the all-to-all with the splits
# swapped (`comm.AllToAll`, in `minite/parallel/comm.py` beside every other collective). The MoE layer itself knows
# nothing of it: it hands its sorted rows to its *token exchange* (`moe.exchange`, one process by default), and
# `shard_experts` keeps each rank's experts and installs the all-to-all exchange, as torchtitan applies expert
# parallelism from outside the model. Gradients: the dense parameters are averaged over dp as in DDP; an expert's
# gradient on its owner already sums the contributions of every ep rank's tokens (the backward all-to-all brought
# them), so it is summed over the ranks holding the same experts and divided by dp. The check below (the workers
# of `minite/parallel/workers/moe.py`) runs at world 2 with ep = 2: loss, every gradient and the weights after 5
# AdamW steps against one process on the whole batch, for both balancing methods (the load the balancing sees is
# all-reduced over dp by the exchange, so every rank routes exactly as one process would). One pitfall it caught: a
# rank that receives no token must still run both backward all-to-alls, so even an empty grouped GEMM has to stay
# in the autograd graph.

# %%
out_dir = tempfile.mkdtemp()
res = torchrun(2, ["-m", "minite.parallel.workers", "ep", "ep_layouts", "--out", out_dir], timeout=240)
assert res.returncode == 0, res.stdout[-2000:]
rank0 = results(out_dir)[0]
for name in ("ep2_aux", "ep2_bias"):
    v = rank0[name]
    print(f"{name}: weights after 5 steps {v['max_err']:.1e}, loss {v['loss_err']:.1e}, grads {v['grad_err']:.1e}, "
          f"experts {v['experts']} on rank 0  {'ok' if v['ok'] else 'FAIL'}")
    assert v["ok"], f"{name}: expert parallelism differs from one process"
print("refused:", rank0["ep_layouts"]["messages"][0])
assert "ep=3" in rank0["ep_layouts"]["messages"][0], "a layout ep does not divide must be refused by name"

# %% [markdown]
# ## 7. Bytes per step: EP vs TP for the same parameters
#
# Take one MoE layer whose experts don't fit on one GPU, and $R$ ranks. Two ways to split it:
# * **Expert parallelism**: each rank holds $E/R$ whole experts. Per layer, forward and backward, the all-to-all
#   moves each token's $k$ copies out and back: $4 \cdot Nk\,C \cdot \frac{R-1}{R}$ values per rank per layer
#   (dispatch + combine, forward + backward), with $N$ the rank's tokens.
# * **Tensor parallelism** (chapter 11): each rank holds $1/R$ of *every* expert (columns of $W_{gate|up}$, rows of
#   $W_{down}$), every rank computes every token's experts, and each MoE layer all-reduces its output in the forward
#   and its input gradient in the backward: $2 \cdot 2(R-1)/R \cdot N_{tp} C$ values, where the tp group shares one
#   batch, $N_{tp} = RN$ tokens.
#
# Same weights per rank ($E \cdot 3CH / R$), but EP sends $k$ copies of the rank's own tokens while TP all-reduces
# the whole group's tokens: for $k < R$ EP moves fewer bytes, and its GEMMs stay whole ($C \times H$ per expert
# instead of $C \times H/R$ slivers). The catch is the balance: an EP rank waits for its busiest expert.

# %%
def ep_bytes(N, C, k, R, elt=2):
    return 4 * N * k * C * (R - 1) / R * elt

def tp_bytes(N, C, R, elt=2):
    return 2 * 2 * (R - 1) / R * (R * N) * C * elt

N_tok, C_model = 8192, 4096  # tokens per rank, model width (bf16)
print(f"{'R':>3} {'k':>2} {'EP MB/layer/step':>17} {'TP MB/layer/step':>17}")
for R_ in (2, 4, 8):
    for k_ in (1, 2, 8):
        print(f"{R_:>3} {k_:>2} {ep_bytes(N_tok, C_model, k_, R_) / 1e6:>17.0f} {tp_bytes(N_tok, C_model, R_) / 1e6:>17.0f}")
v = rank0["ep2_aux"]
n_local = 4 * 16  # the check's tiny GPT: 4 sequences of 16 tokens per rank
expect = 2 * ep_bytes(n_local, 32, 2, 2, elt=4) / 2  # 2 MoE layers; forward only (dispatch + combine), fp32
print(f"measured all-to-all bytes (forward, rank 0, 2 layers): {v['a2a_bytes']:,}; a perfectly even split would "
      f"send {expect:,.0f}")
assert 0 < v["a2a_bytes"] <= 2 * expect  # at most every copy to the other rank: twice the even split

# %% [markdown]
# The measured count differs from the even-split formula because the router's split is not even: a rank sends
# the rows of the tokens routed to the *other* rank's experts, and that share varies from layer to layer.
#
# ## 8. In the GPT
#
# ```
# python -m minite.train --model.moe.num_experts=8 --model.moe.top_k=2            # 8 experts, top 2, Switch loss
# python -m minite.train --model.moe.num_experts=8 --model.moe.balance=bias       # DeepSeek-V3's bias instead
# python -m minite.train --model.moe.num_experts=8 --model.moe.capacity_factor=1.25 --model.moe.shared_expert=True
# torchrun --nproc-per-node 4 -m minite.train --model.moe.num_experts=8 --parallel.dp=4 --parallel.ep=2
# torchrun --nproc-per-node 4 -m minite.train --model.moe.num_experts=8 --parallel.dp=2 --parallel.ep=2 --parallel.tp=2
# torchrun --nproc-per-node 4 -m minite.train --model.moe.num_experts=8 --parallel.pp=2 --parallel.dp=2 --parallel.ep=2
# torchrun --nproc-per-node 4 -m minite.train --model.moe.num_experts=8 --parallel.dp=2 --parallel.cp=2 --parallel.ep=2
# torchrun --nproc-per-node 4 -m minite.train --model.moe.num_experts=8 --parallel.dp=4 --parallel.ep=2 --parallel.zero=2
# ```
# Each line of `log.jsonl` then shows `moe_tokens_per_expert` (summed over the blocks), `moe_dropped` and
# `moe_balance_loss` ($E\sum f_i P_i$, 1.0 = uniform), all three for the whole global batch. Checkpoints hold the
# dense experts, whatever the layout, so a run resumes under any layout. Experts compose with every other dimension:
# - **tp**: attention is split as in chapter 11, while every tp rank keeps its whole share of the experts and runs
#   them on the same tokens (under `--parallel.sp` the sequence is gathered first), so expert gradients need no tp
#   reduction.
# - **cp**: only attention mixes tokens, so each cp rank routes its own $T/\mathrm{cp}$ tokens (to the experts of its
#   own ep group). The counts are summed over dp $\times$ cp, so both balancing schemes see the load of the whole
#   batch; an expert's gradient is summed over all its copies across dp and cp and divided by dp$\cdot$cp.
# - **pp**: a pipeline's $m$ micro-batches are gradient accumulation, so under `balance=aux` each stage adds its own
#   blocks' Switch loss to every micro-batch's backward, scaled by $1/m$: the balance loss is per micro-batch, as in
#   Megatron. Under `balance=bias` the micro-batches' loads add up and the bias moves once, at the optimizer step, by
#   the load summed over them, so every micro-batch routes with the same bias, exactly as one process on the whole
#   batch.
# - **ZeRO**: with ep, a rank's parameters fall into two ZeRO groups at the same stage, the dense ones sharded over dp
#   and averaged, its experts sharded over their edp replicas (summed, divided by dp: the owner already holds the sum
#   over the ep ranks' tokens). The clip norm adds both shards' squares over dp, each tp-replicated element once.
#
# A capacity limit caps each rank's own tokens (as under dp), so a run with `capacity_factor > 0` matches one process
# only when no expert overflows; dropless runs match it to rounding. Every layout is checked against one process
# (loss, every gradient, five AdamW steps, the checkpoint) by the test suite.
