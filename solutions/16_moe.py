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
# # 16 — Mixture of experts: exercises
#
# The lesson (`notebooks/16_moe.ipynb`) built a softmax top-k router, the Switch balance loss, the permutation by
# `argsort`, and the forward grouped GEMM. Here you write the other half, as DeepSeek-V3 and the backward pass
# need it:
# 1. DeepSeek-V3's **sigmoid router** with a balancing bias;
# 2. its **sequence-wise balance loss**;
# 3. the **permutation without sorting** (a counting sort) and its inverse;
# 4. the **weight gradient of the grouped GEMM**, a whole Triton kernel from a spec.
#
# Write your code between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the `raise NotImplementedError()`
# line), run the cell, then the `# CHECK` cell after it (do not edit check cells).

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
from minite._triton import triton, tl
from minite.testing import check_op
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)  # tiny shapes: a second thread only slows them down on a busy machine
_ = torch.manual_seed(0)


# %%
def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    """Seeded CPU draw, then cast and move to DEVICE (the same numbers on every machine)."""
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(DEVICE)


def random_experts(N, k, E, seed):
    """(N, k) distinct expert ids per token, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(DEVICE)


# %% [markdown]
# ## Task 1 — DeepSeek-V3's router
#
# DeepSeek-V3 scores experts with a **sigmoid** instead of a softmax: $s_{t,i} = \sigma(\ell_{t,i})$ for token $t$
# and expert $i$ (each score on its own, no competition in the normalisation). The balancing bias $b_i$ is added
# only to *choose*: expert $i$ is among token $t$'s $k$ experts when $s_{t,i} + b_i$ is among the $k$ largest of
# its row. The gate weights use the unbiased scores of the chosen experts, normalised to sum to 1 over the $k$.
#
# Write `sigmoid_router(logits, bias, k)`: `logits` (N, E) float, `bias` (E,) -> `(weights, experts)`, both (N, k),
# experts ordered by biased score, largest first (what `torch.topk` returns); weights fp32, differentiable with
# respect to the logits.

# %% minite={"task": "sigmoid_router"}
def sigmoid_router(logits: torch.Tensor, bias: torch.Tensor, k: int):
    ### BEGIN SOLUTION
    scores = torch.sigmoid(logits.float())
    chosen = torch.topk(scores + bias.float(), k, dim=-1).indices
    picked = scores.gather(1, chosen)
    return picked / picked.sum(dim=-1, keepdim=True), chosen
    ### END SOLUTION


# %%
def loop_router(logits, bias, k):
    """The reference, one token at a time in plain Python."""
    weights, experts = [], []
    for row in logits.float().tolist():
        s = [1.0 / (1.0 + math.exp(-v)) for v in row]
        top = sorted(range(len(s)), key=lambda i: -(s[i] + float(bias[i])))[:k]
        total = sum(s[i] for i in top)
        weights.append([s[i] / total for i in top])
        experts.append(top)
    return torch.tensor(weights, device=logits.device), torch.tensor(experts, device=logits.device)


# %% minite={"check": "sigmoid_router"} tags=["nbval-check-output"]
# CHECK: sigmoid_router
ok = True
for seed, k in ((1, 1), (2, 2), (3, 4)):
    logits, bias = randn(9, 8, seed=seed, scale=2.0), randn(8, seed=seed + 10, scale=0.5)
    w, e = sigmoid_router(logits, bias, k)
    w_ref, e_ref = loop_router(logits, bias, k)
    assert torch.equal(e.cpu(), e_ref.cpu()), (e, e_ref)
    ok &= check_op(f"sigmoid router weights, k={k}", lambda x: sigmoid_router(x, bias, k)[0],
                   lambda x: torch.sigmoid(x).gather(1, e_ref) / torch.sigmoid(x).gather(1, e_ref).sum(-1, True),
                   logits)
assert ok
print("PASS: sigmoid_router")


# %% [markdown]
# ## Task 2 — the sequence-wise balance loss
#
# Besides the bias, DeepSeek-V3 keeps a tiny balance loss computed **per sequence** (so that no single sequence
# sends all its tokens to a few experts). For one sequence of $T$ tokens with sigmoid scores $s_{t,i}$ and chosen
# experts $\mathcal{T}_t$ ($k$ per token):
#
# $$f_i = \frac{E}{kT}\sum_{t=1}^{T} \mathbb{1}\big[i \in \mathcal{T}_t\big],\qquad
# s'_{t,i} = \frac{s_{t,i}}{\sum_{j=1}^{E} s_{t,j}},\qquad P_i = \frac1T\sum_{t=1}^{T} s'_{t,i},\qquad
# \mathcal{L} = \sum_{i=1}^{E} f_i\,P_i .$$
#
# Write `seq_balance_loss(scores, experts)`: `scores` (B, T, E) sigmoid scores, `experts` (B, T, k) ids -> the mean
# of $\mathcal{L}$ over the B sequences, a scalar, differentiable with respect to `scores` ($f$ carries no
# gradient). No Python loop over tokens or sequences.

# %% minite={"task": "seq_balance_loss"}
def seq_balance_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    B, T, E = scores.shape
    k = experts.shape[-1]
    hits = torch.zeros(B, E, device=scores.device).scatter_add_(
        1, experts.reshape(B, T * k), torch.ones(B, T * k, device=scores.device))
    f = hits * E / (k * T)
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (f * p).sum(-1).mean()
    ### END SOLUTION


# %% minite={"check": "seq_balance_loss"} tags=["nbval-check-output"]
# CHECK: seq_balance_loss
def loop_seq_loss(scores, experts):
    B, T, E = scores.shape
    k = experts.shape[-1]
    total = 0.0
    for b in range(B):
        norm = scores[b] / scores[b].sum(-1, keepdim=True)
        for i in range(E):
            f_i = E / (k * T) * float((experts[b] == i).sum())
            total = total + f_i * norm[:, i].mean()
    return total / B

ok = True
for seed, (B, T, E, k) in ((4, (2, 7, 6, 2)), (5, (3, 5, 8, 1)), (6, (1, 9, 4, 3))):
    scores = torch.sigmoid(randn(B, T, E, seed=seed, scale=2.0))
    experts = random_experts(B * T, k, E, seed).reshape(B, T, k)
    ok &= check_op(f"seq balance loss B={B} T={T} E={E} k={k}", lambda s: seq_balance_loss(s, experts),
                   lambda s: loop_seq_loss(s, experts), scores)
uniform = torch.full((1, 4, 4), 0.5, device=DEVICE)
spread = torch.tensor([[[0], [1], [2], [3]]], device=DEVICE)  # each expert once: the balanced optimum, L = 1
assert abs(float(seq_balance_loss(uniform, spread)) - 1.0) < 1e-6
assert ok
print("PASS: seq_balance_loss")


# %% [markdown]
# ## Task 3 — the permutation without sorting, and its inverse
#
# The lesson sorted the $Nk$ assignments by expert with `torch.argsort(..., stable=True)`. A sort is more than
# needed: the keys are small integers, so a **counting sort** does it in linear time (and is what MoE kernels do on
# the GPU). Assignment $a = t\cdot k + j$ (token $t$, slot $j$) goes to expert $e_a$. Its row in the sorted order
# is
#
# $$\mathrm{dest}_a = \mathrm{offsets}_{e_a} + \#\{a' < a : e_{a'} = e_a\},$$
#
# where offsets are the exclusive cumulative counts per expert. `dest` is the *inverse* of the stable argsort
# `order` (`dest[order[r]] = r`).
#
# Write `counting_permutation(experts, E)`: `experts` (N, k) -> `(dest (N*k,), offsets (E+1,))`, both int64,
# **without** `sort`, `argsort`, `topk` or a Python loop over assignments (counting with a one-hot matrix and
# cumulative sums is fine). Then `invert(dest)`: the permutation `order` with `order[dest[a]] = a`.

# %% minite={"task": "permutation"}
def counting_permutation(experts: torch.Tensor, E: int):
    ### BEGIN SOLUTION
    flat = experts.reshape(-1)
    onehot = torch.nn.functional.one_hot(flat, E)
    before = (onehot.cumsum(0) - onehot).gather(1, flat[:, None])[:, 0]
    counts = onehot.sum(0)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return offsets[flat] + before, offsets
    ### END SOLUTION


def invert(dest: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    order = torch.empty_like(dest)
    order[dest] = torch.arange(dest.numel(), device=dest.device)
    return order
    ### END SOLUTION


# %% minite={"check": "permutation"} tags=["nbval-check-output"]
# CHECK: permutation
for seed, (N, k, E) in ((7, (13, 2, 6)), (8, (5, 1, 8)), (9, (11, 3, 4))):
    experts = random_experts(N, k, E, seed)
    dest, offsets = counting_permutation(experts, E)
    order = invert(dest)
    want_order = torch.argsort(experts.reshape(-1), stable=True)
    assert torch.equal(order.cpu(), want_order.cpu()), (order, want_order)
    assert torch.equal(offsets.cpu(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                torch.bincount(experts.reshape(-1).cpu(), minlength=E).cumsum(0)]))
    x = randn(N, 3, seed=seed)
    xs = x[order // k]  # rows sorted by expert
    assert torch.equal(xs[dest].cpu(), x.repeat_interleave(k, 0).cpu())  # dest brings every row back
print("PASS: permutation")


# %% [markdown]
# ## Task 4 — the grouped GEMM's weight gradient (whole kernel)
#
# The forward of an expert projection is $y_e = x_e W_e$ for each expert's rows $x_e = x[o_e:o_{e+1}]$. Its weight
# gradient is one reduction per expert over that expert's rows: $dW_e = x_e^\top\,dy_e$, shape (K, N).
#
# Spec. `x` (M, K) and `dy` (M, N) are contiguous fp32 or fp16 tensors with rows sorted by expert; `Offsets`
# (E + 1,) int64 holds the boundaries $o_0 = 0 \le o_1 \le \dots \le o_E \le M$ (rows past $o_E$ belong to no expert).
# `DW` is a contiguous fp32 (E, K, N) tensor. The grid is `(E, cdiv(K, BLOCK_K), cdiv(N, BLOCK_N))`: program
# `(e, i, j)` computes rows `i * BLOCK_K ...` and columns `j * BLOCK_N ...` of $dW_e$, masked at K and N, walking
# down the expert's rows `BLOCK_M` at a time. An expert without rows gets zeros. Accumulate in fp32 with `tl.dot`
# (every block size is >= 16, as a GPU needs); don't multiply in fp16 on the CPU interpreter: convert tiles to fp32
# first.

# %% minite={"task": "grouped_gemm_dw_kernel"}
@triton.jit
def grouped_gemm_dw_kernel(X_ptr, DY_ptr, DW_ptr, Offsets_ptr, K, N,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ### BEGIN SOLUTION
    e = tl.program_id(0).to(tl.int64)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    nn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = tl.load(Offsets_ptr + e)
    hi = tl.load(Offsets_ptr + e + 1)
    total = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m in range(lo, hi, BLOCK_M):
        mm = m + tl.arange(0, BLOCK_M)
        live = mm < hi
        xt = tl.load(X_ptr + mm[None, :] * K + kk[:, None], mask=live[None, :] & (kk[:, None] < K), other=0.0)
        g = tl.load(DY_ptr + mm[:, None] * N + nn[None, :], mask=live[:, None] & (nn[None, :] < N), other=0.0)
        total = tl.dot(xt.to(tl.float32), g.to(tl.float32), total, input_precision="ieee")
    tl.store(DW_ptr + e * K * N + kk[:, None] * N + nn[None, :], total, mask=(kk[:, None] < K) & (nn[None, :] < N))
    ### END SOLUTION


def my_grouped_dw(x, dy, offsets, BM=16, BN=16, BK=32):
    """Launcher (given): x (M, K), dy (M, N), offsets (E + 1,) -> dW (E, K, N) fp32."""
    E, K, N = offsets.numel() - 1, x.shape[1], dy.shape[1]
    dw = torch.empty(E, K, N, dtype=torch.float32, device=x.device)
    grouped_gemm_dw_kernel[(E, triton.cdiv(K, BK), triton.cdiv(N, BN))](
        x.contiguous(), dy.contiguous(), dw, offsets, K, N, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    return dw


def loop_dw(x, dy, offsets):
    """The reference: one matmul per expert, in fp32."""
    o = offsets.tolist()
    return torch.stack([x[o[e]:o[e + 1]].float().t() @ dy[o[e]:o[e + 1]].float() for e in range(len(o) - 1)])


# %% minite={"check": "grouped_gemm_dw_kernel"} tags=["nbval-check-output"]
# CHECK: grouped_gemm_dw_kernel
ok = True
for dtype in (torch.float32, torch.float16):
    for seed, (counts, extra, K, N) in ((11, ([5, 0, 23, 1], 3, 40, 24)), (12, ([0, 40, 0], 0, 33, 17))):
        offsets = torch.tensor([0] + counts).cumsum(0).to(DEVICE)
        M = sum(counts) + extra
        x, dy = randn(M, K, seed=seed, dtype=dtype), randn(M, N, seed=seed + 1, dtype=dtype)
        ok &= check_op(f"grouped dW {counts}", my_grouped_dw, loop_dw, x, dy, offsets, grad=False,
                       atol=1e-4, rtol=1e-4)  # fp32 sums of up to 40 products, in another order
assert ok
print("PASS: grouped_gemm_dw_kernel")
