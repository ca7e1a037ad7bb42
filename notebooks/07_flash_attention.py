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
# # 07 — Flash attention: the online softmax, FlashAttention-2 in Triton, its backward, GQA and packed batches
#
# Attention is $O = \mathrm{softmax}(QK^\top s + M)\,V$ with $s = 1/\sqrt{D}$ and $M$ the causal mask. Written
# the obvious way it builds the $T\times T$ score matrix $S$ and the probabilities $P$ in HBM: for one layer of a
# 7B-class model at $T = 8192$ ($H = 32$ heads, bf16) that is $32 \cdot 8192^2 \cdot 2$ B $= 4.3$ GB **per
# sequence**, written and read back several times (scores, softmax, dropout, the backward), while the inputs and
# the output are $4 \cdot 8192 \cdot 4096 \cdot 2$ B $= 268$ MB together. FlashAttention (Dao et al. 2022,
# [arXiv:2205.14135](https://arxiv.org/abs/2205.14135); FA2: [arXiv:2307.08691](https://arxiv.org/abs/2307.08691))
# never writes $S$ or $P$: it tiles $Q$, streams $K$ and $V$ through on-chip memory, and keeps a softmax that can
# be updated one key block at a time. This chapter builds that kernel, its backward, grouped-query attention, and
# the packed (variable-length) layout Transformer Engine uses.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
import matplotlib.pyplot as plt
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import assert_close, dtype_tols
from minite.kernels.attention import attention, attention_ref, attention_varlen
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# %% [markdown]
# ## 1. Naive attention, and what it costs in memory
#
# The reference: scores, mask, softmax, weighted sum. $S$ and $P$ are $(B, H, T, T)$.

# %%
def naive_attention(q, k, v, causal=True):
    T, D = q.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (B, H, T, T): the matrix flash attention never stores
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v  # (B, H, T, D)


# %% [markdown]
# Memory of one layer's attention for one sequence, $H = 32$, $D = 128$, bf16. Naive keeps $S$ and $P$ for the
# backward ($2\,H T^2$ elements; PyTorch's eager math path keeps more); flash keeps $O$ and the row log-sum-exp
# $L$ ($H T D + H T$ elements, the LSE in fp32). Both need $Q, K, V$.

# %% tags=["nbval-ignore-output"]
H, D, elt = 32, 128, 2
Ts = [2 ** i for i in range(9, 18)]
naive_gb = [(2 * H * T * T * elt) / 1e9 for T in Ts]
flash_gb = [(H * T * D * elt + H * T * 4) / 1e9 for T in Ts]
fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(Ts, naive_gb, "o-", label="naive: S and P, (H, T, T) each")
ax.plot(Ts, flash_gb, "o-", label="flash: O and LSE, (H, T, D) + (H, T)")
ax.axhline(80, color="gray", ls="--", label="H100 memory, 80 GB")
ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="GB per layer per sequence",
       title="attention activation memory, H=32, D=128, bf16")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# At $T = 128$k the naive matrices would be 2.2 TB; flash keeps 1 GB. The curve is quadratic against linear.
#
# ## 2. The IO argument
#
# The GPU has ~80 GB of HBM at 3.35 TB/s, and per SM ~228 KB of shared memory (SRAM) at >10× that bandwidth.
# Standard attention reads and writes $\Theta(T D + T^2)$ elements of HBM per head: the $T^2$ term is $S$ and $P$
# going out and coming back. For $T = 8192$, $D = 128$ that term is 64× the $TD$ one, and at ~1 FLOP per byte of
# it the softmax is memory bound however fast the tensor cores are. FlashAttention computes the same result with
# $\Theta(T^2 D^2 / M)$ HBM accesses for an SRAM of $M$ elements: each $Q$ tile is read once, each $K, V$ tile
# once per $Q$ tile, and nothing of size $T^2$ is ever written. The FLOPs do not change (a little more in the
# backward, which recomputes $P$); the bytes drop from quadratic to what the tiles need. That is the whole trick,
# and it needs one piece of math: a softmax that does not need the whole row at once.
#
# ## 3. The online softmax
#
# For one query row with scores $s_1, \dots, s_T$ and values $v_j$:
# $$o = \frac{\sum_j e^{s_j - m}\, v_j}{\sum_j e^{s_j - m}}, \qquad m = \max_j s_j$$
# ($m$ only keeps the exponentials $\le 1$; any constant gives the same $o$). Split the keys into blocks. After
# the blocks $1..b$ keep three numbers per row: the running max $m_b$, the running sum
# $\ell_b = \sum_{j \le b} e^{s_j - m_b}$, and the unnormalised accumulator $a_b = \sum_{j \le b} e^{s_j - m_b} v_j$.
# A new block with scores $s^{(b+1)}$ gives $m_{b+1} = \max(m_b, \max s^{(b+1)})$, and everything summed under
# the old max is **rescaled** by $\alpha = e^{m_b - m_{b+1}} \le 1$:
# $$\ell_{b+1} = \alpha\,\ell_b + \sum_{j \in b+1} e^{s_j - m_{b+1}}, \qquad
#   a_{b+1} = \alpha\, a_b + \sum_{j \in b+1} e^{s_j - m_{b+1}}\, v_j .$$
# At the end $o = a / \ell$, and the log-sum-exp of the row is $L = m + \log \ell$. $L$ is all the backward needs
# to recompute any $P_{ij} = e^{s_{ij} - L_i}$, and it is what lets two partial attentions be merged
# (chapter 08's split-KV decode, chapter 13's ring attention).
#
# The same in PyTorch, one key block at a time:

# %%
def online_softmax_attention(q, k, v, block=16):
    """q (M, D), k/v (N, D): softmax(q k^T / sqrt(D)) v, streaming k/v in blocks. Returns (o, lse)."""
    M, D = q.shape
    m = torch.full((M,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(M, dtype=torch.float64)
    acc = torch.zeros(M, D, dtype=torch.float64)
    for n0 in range(0, k.shape[0], block):
        s = q @ k[n0:n0 + block].T / math.sqrt(D)  # (M, block): one tile of S, never the whole row
        m_new = torch.maximum(m, s.max(1).values)
        alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
        p = torch.exp(s - m_new[:, None])
        l = alpha * l + p.sum(1)
        acc = alpha[:, None] * acc + p @ v[n0:n0 + block]
        m = m_new
    return acc / l[:, None], m + torch.log(l)


# %% tags=["nbval-check-output"]
# CHECK: online softmax
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(n, 32, generator=g, dtype=torch.float64) for n in (5, 70, 70))
o, lse = online_softmax_attention(q, k, v)
s = q @ k.T / math.sqrt(32)
assert_close(o, s.softmax(-1) @ v, name="online softmax out")
assert_close(lse, torch.logsumexp(s, -1), name="lse")
print("PASS: online softmax over 5 key blocks equals the softmax over the whole row")

# %% [markdown]
# ## 4. The FlashAttention-2 forward in Triton
#
# FA2's choices (over FA1): the **outer loop is over query tiles** — one program per (query tile, batch·head), so
# no two programs write the same output and the loop over keys stays inside a program; the division by $\ell$
# happens once at the end; the LSE is stored for the backward.
#
# Three details of the kernel below:
# * **exp2**: the GPU's special-function unit computes $2^x$; $e^x = 2^{x \log_2 e}$. Folding $\log_2 e$ into the
#   softmax scale (`qk_scale = scale * log2(e)`) turns every `exp` into an `exp2` for free. $m$ and $\ell$ then
#   live in log2 units; the LSE is converted back to natural log on store (the Triton tutorial stores log2: keep
#   one base, or merges across kernels go wrong).
# * **causal block skipping**: query tile $[m_0, m_0 + \text{BLOCK\_M})$ sees keys $j \le i$, so key blocks from
#   $m_0 + \text{BLOCK\_M}$ on are entirely masked: the loop stops there. Half the work of a causal layer vanishes.
# * **GPU-legal tiles**: every `tl.dot` dimension must be $\ge 16$ on the GPU (the interpreter accepts less).
#   Here `BLOCK_M`, `BLOCK_N` $\ge 16$ and `D` is a power of two $\ge 16$.
# * **fp32 means fp32**: on a GPU, `tl.dot` of fp32 tiles defaults to TF32 (inputs rounded to 10 mantissa bits,
#   errors ~1e-3), which no fp32 check at 1e-5 survives; `input_precision="ieee"` keeps the products exact (fp16
#   and bf16 tiles are unaffected). The interpreter never rounds to TF32, so only a GPU would show the difference.

# %%
@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE, T, qk_scale, CAUSAL: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)  # query tile
    bh = tl.program_id(1).to(tl.int64)     # (batch, head): q, k, v, o are contiguous (B*H, T, D)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    base = bh * T * D
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T  # causal: skip the blocks right of the diagonal
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + offs_n
        k = tl.load(K + base + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < T, other=0.0)
        v = tl.load(V + base + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < T, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        keep = cols[None, :] < T
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every row sees key 0, so m_new is finite from the first block
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty), mask=offs_m[:, None] < T)
    tl.store(LSE + bh * T + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=offs_m < T)  # log2 -> ln


def flash_fwd(q, k, v, causal=True, BLOCK_M=64, BLOCK_N=32):
    B, H, T, D = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, BLOCK_M), B * H)
    flash_fwd_kernel[grid](q, k, v, o, lse, T, 1.4426950408889634 / math.sqrt(D), CAUSAL=causal, D=D,
                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return o, lse


# %% tags=["nbval-check-output"]
# CHECK: lesson flash forward vs naive and vs minite
ok = True
for T, causal, dtype in ((7, True, torch.float32), (100, True, torch.float16), (65, False, torch.float32)):
    q, k, v = (randn(2, 2, T, 32, seed=s, dtype=dtype) for s in (1, 2, 3))
    o, lse = flash_fwd(q, k, v, causal)
    assert_close(o, naive_attention(q.float(), k.float(), v.float(), causal).to(dtype), name=f"vs naive T={T}")
    o_m, lse_m = attention(q, k, v, causal=causal, return_lse=True, backend="triton")
    assert_close(o, o_m, name="vs minite"); assert_close(lse, lse_m, name="lse vs minite")
print("PASS: lesson flash forward vs naive and vs minite")

# %% [markdown]
# How much work did causal block skipping save? Count the key blocks each query tile visits:

# %% tags=["nbval-check-output"]
# CHECK: causal block skipping visits about half the grid
for T in (512, 2048, 8192):
    n_m, n_n = T // 64, T // 32
    full = n_m * n_n
    causal = sum(min(n_n, ((i + 1) * 64 + 31) // 32) for i in range(n_m))
    print(f"T={T:5d}: {causal}/{full} key blocks visited = {causal / full:.3f} of the full grid")
    assert 0.5 < causal / full <= 0.5 + 1 / n_m  # half, plus the diagonal blocks
print("PASS: a causal layer visits half the key blocks, plus the diagonal")

# %% [markdown]
# `minite.kernels.attention` is this kernel grown up: head dims that are not powers of two (padded and masked),
# GQA, $T_q \neq T_k$ with the causal mask aligned bottom-right (query $i$ sees keys $j \le i + T_k - T_q$: the
# last query sees every key, which is what a KV-cache prefill needs), rows that see no key (LSE $=-\infty$, output
# 0, never NaN: `m_new` can be $-\infty$ there, and $-\infty - (-\infty)$ is NaN), the packed layout, and bf16
# upcast to fp32 at load under the interpreter (its bf16 arithmetic is wrong; TRITON_ON_CPU.md). Three more
# things in it matter for speed on a GPU:
#
# * **Two key loops, not one.** The lesson's loop masks every block. minite's `_key_ranges` splits a query tile's
#   keys in two, as the Triton tutorial's `_attn_fwd_inner` does with its `STAGE` argument (Triton,
#   `python/tutorials/06-fused-attention.py`): blocks that every row of the tile sees in full run in a **main loop**
#   with no mask at all, and only the diagonal blocks (causal) and the ragged tail ($T$ not a multiple of
#   `BLOCK_N`) run in a **masked loop**. The same body (`_fwd_loop`) is compiled twice, `MASKED` a constexpr. The
#   masked loop is also the only place that cleans non-finite keys/values (a masked key has $p = 0$, and $0 \cdot
#   \mathrm{NaN} = \mathrm{NaN}$ in $PV$): done in every block, that scrub made sm_90 move $K$ and $V$ through
#   registers on every block instead of feeding the tensor cores from shared memory. With
#   `BLOCK_M = 128, BLOCK_N = 64`, each query tile has exactly two masked blocks (counted below).
# * **Strides.** Every tensor is read through its own (batch, head, token) strides, $D$ with stride 1: a contiguous
#   $(B, H, T, D)$ tensor, a $(B, H, T, D)$ **view** of $(B, T, H, D)$ memory, and the packed thd layout (batch
#   stride 0) are one code path, and no launcher copies. The output is stored in $q$'s memory order.
# * **The fused qkv path.** The GPT's projection writes $(B, T, (H + 2\,KVH) D)$: per token, $H$ query heads, then
#   $KVH$ key and $KVH$ value heads. `attention_qkv` rotates $q$ and $k$ with RoPE (chapter 04's kernel, one
#   launch for both), reads $v$ where it lies, and writes $o$ as $(B, T, H, D)$, whose $(B, T, H D)$ view feeds the
#   output projection. Its backward writes $dq, dk, dv$ into one $d(qkv)$ buffer and un-rotates $dq, dk$ there in
#   place: no transpose, no `contiguous()`, no concatenation of three gradients (on an H200 the GPT-2 124M step
#   spent 2.85 ms of its 40.7 ms in those copies before this path existed).
#
# Each of the three, checked: the main/masked split over a causal $T = 4096$ layer, a strided view read in place,
# and `attention_qkv` (forward and $d(qkv)$) against RoPE followed by the reference attention.

# %% tags=["nbval-check-output"]
# CHECK: split loops, strided views, the fused qkv path
from minite.kernels.attention import attention_qkv
from minite.kernels.rope import rope_ref

BM, BN, T = 128, 64, 4096  # the GPU forward tile at D = 128
main = masked = 0
for m0 in range(0, T, BM):
    full, hi = min(T // BN * BN, (m0 + 1) // BN * BN), min(T, m0 + BM)  # _key_ranges, T_q = T_k
    main, masked = main + full // BN, masked + (hi - full) // BN
print(f"T={T}: {main} unmasked key blocks, {masked} masked ({masked / (main + masked):.1%})")
assert masked == 2 * (T // BM)  # two diagonal blocks per query tile, nothing else

B_, T_, H_, KVH_, D_ = 2, 37, 4, 2, 16
x = randn(B_, T_, H_ + 2 * KVH_, D_, seed=20)  # (B, T, heads, D), as a qkv projection writes it
q, k, v = (t.transpose(1, 2) for t in x.split([H_, KVH_, KVH_], 2))  # (B, heads, T, D) views, not copies
o = attention(q, k, v, backend="triton")
assert_close(o, attention_ref(q.contiguous(), k.contiguous(), v.contiguous()), name="strided views")
assert o.stride(1) < o.stride(2), "o is stored in q's memory order: heads inside tokens"

qkv = randn(B_, T_, (H_ + 2 * KVH_) * D_, seed=21).requires_grad_()
pos_, dim_ = (torch.arange(n, dtype=torch.float64, device=DEVICE) for n in (T_, D_ // 2))
ang = pos_[:, None] * 10000.0 ** (-2 * dim_ / D_)  # (T, D/2): RoPE's angles
cos, sin = (f(ang).float() for f in (torch.cos, torch.sin))
got = attention_qkv(qkv, cos, sin, H_, KVH_, backend="triton")  # (B, T, H, D)
qkv64 = qkv.detach().double().requires_grad_()
xs = qkv64.view(B_, T_, H_ + 2 * KVH_, D_)
qr, kr = (rope_ref(t, cos.double(), sin.double(), layout="bthd") for t in (xs[:, :, :H_], xs[:, :, H_:H_ + KVH_]))
want = attention_ref(qr.transpose(1, 2), kr.transpose(1, 2), xs[:, :, H_ + KVH_:].transpose(1, 2)).transpose(1, 2)
assert_close(got, want.float(), name="attention_qkv forward")
g_out = randn(B_, T_, H_, D_, seed=22)
(dgot,), (dwant,) = torch.autograd.grad(got, qkv, g_out), torch.autograd.grad(want, qkv64, g_out.double())
assert_close(dgot, dwant.float(), name="d(qkv)")
print("PASS: two masked blocks per query tile; views read in place; attention_qkv's forward and d(qkv) are exact")
#
# ## 5. The backward, derived
#
# Forward per head: $S = QK^\top s$, $P = \mathrm{softmax}_{\text{rows}}(S)$, $O = PV$. Given $dO$:
# * $O = PV$ gives $dV = P^\top dO$ and $dP = dO\,V^\top$.
# * Softmax, row $i$: $P_{ij} = e^{S_{ij}} / \sum_k e^{S_{ik}}$, so $\partial P_{ij}/\partial S_{ik} =
#   P_{ij}(\delta_{jk} - P_{ik})$ and $dS_{ik} = \sum_j dP_{ij} P_{ij}(\delta_{jk} - P_{ik}) =
#   P_{ik}\,(dP_{ik} - \sum_j P_{ij} dP_{ij})$.
# * The row sum is cheap: $\sum_j P_{ij} dP_{ij} = \sum_j P_{ij} (dO_i \cdot V_j) = dO_i \cdot O_i$. Call it
#   $\Delta_i = \mathrm{rowsum}(dO \circ O)$: a $(T,)$ vector from two $(T, D)$ tensors, computed once.
# * So $dS = P \circ (dP - \Delta)$, and through $S = QK^\top s$: $dQ = dS\,K\,s$, $dK = dS^\top Q\, s$.
#
# $P$ is not stored: it is **recomputed** tile by tile as $P_{ij} = e^{S_{ij} - L_i}$ from the saved LSE. $dV$ and
# $dK$ are sums over query rows, $dQ$ a sum over key columns, so a tiling that owns one of them makes the other a
# sum over programs. Three answers are in use:
# * **FA2's CUDA kernel** runs one program (thread block) per key tile: it accumulates its $dK, dV$ over all query
#   tiles in registers and, for each query tile, **`atomicAdd`s** its share of $dQ$ into an fp32 buffer
#   (`dq_accum`); a small second kernel scales that buffer and casts it to $dQ$'s type (`flash_bwd_kernel.h`,
#   `compute_dq_dk_dv_seqk_parallel`; the FA2 paper, §3.1). One pass over $S$, but the float additions arrive in
#   an order that changes from run to run, so $dQ$ is not bitwise reproducible (FA2's "deterministic" mode gives
#   each program its own buffer instead).
# * **The Triton tutorial** (`06-fused-attention.py`) launches one kernel whose programs each compute $dK, dV$ of a
#   key tile and then $dQ$ of a query tile: no atomics, $P$ recomputed twice.
# * **minite** launches **two kernels**: one program per key tile accumulates $dK, dV$ over the query tiles that
#   see it, then one program per query tile accumulates $dQ$ over the key tiles it sees. Each output has exactly
#   one writer: no atomics, the same bits on every run. The price: the $dQ$ kernel recomputes $S$ and $dP$, so
#   each (query tile, key tile) pair costs 7 tile matmuls instead of FA2's 5 (the forward costs 2). Determinism,
#   and kernels simple enough to read, are worth that here; the exercise writes FA2's one-kernel variant with the
#   atomic $dQ$.
#
# The math in PyTorch first (full matrices, to check the derivation):

# %%
def attention_bwd_from_lse(q, k, v, o, lse, do, causal=True):
    T, D = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(D)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse[..., None])  # recomputed from the LSE
    delta = (do * o).sum(-1, keepdim=True)  # (B, H, T, 1)
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - delta)
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


# %% tags=["nbval-check-output"]
# CHECK: backward derivation
g = torch.Generator().manual_seed(1)
q, k, v, do = (torch.randn(1, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(4))
qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
o = naive_attention(qa, ka, va)
o.backward(do)
lse = torch.logsumexp((q @ k.transpose(-1, -2) / 4).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1),
                                                                    float("-inf")), -1)
for name, got, want in zip(("dq", "dk", "dv"), attention_bwd_from_lse(q, k, v, o.detach(), lse, do),
                           (qa.grad, ka.grad, va.grad)):
    assert_close(got, want, name=name)
print("PASS: dQ, dK, dV from the LSE equal autograd")

# %% [markdown]
# ### The two backward kernels in Triton
#
# Both recompute a tile of $P$ from the LSE exactly as the forward made it: scores in log2 units
# (`qk_scale` $= s\log_2 e$) and the natural-log LSE converted with one multiply by $\log_2 e$. $\Delta$ is one
# $(B, H, T)$ tensor computed before either kernel (here in PyTorch; minite has a tiny kernel for it).
#
# minite's two backward kernels split their loops as its forward does: the dQ kernel walks the same main and
# masked key ranges, and the dK/dV kernel three query ranges (the causal diagonal, masked; the queries that see
# every key of the block, unmasked; the ragged tail, masked). They write through strides too, so
# `attention_qkv`'s backward hands them slices of its $d(qkv)$ buffer. The lesson's kernels below keep one masked
# loop each: the algorithm is the same.
#
# **dK, dV**: grid `(cdiv(T, BLOCK_N), B*H)`. The program owns `BLOCK_N` keys, keeps their $K, V$ rows and its
# $dK, dV$ accumulators on chip, and visits every query tile that can see its keys. With the causal mask query
# $i$ sees key $j$ iff $j \le i$, so query tiles that end before the first key of the block are skipped.

# %%
@triton.jit
def flash_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, T, qk_scale, sm_scale, CAUSAL: tl.constexpr,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0).to(tl.int64)  # key tile: this program's rows of dK and dV
    bh = tl.program_id(1).to(tl.int64)     # (batch, head); every tensor is contiguous (B*H, T, D)
    base = bh * T * D
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    key_ok = keys[:, None] < T
    k = tl.load(K + base + keys[:, None] * D + dims[None, :], mask=key_ok, other=0.0)
    v = tl.load(V + base + keys[:, None] * D + dims[None, :], mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    first = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0  # earlier query tiles see none of our keys
    for m0 in range(first, T, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        q = tl.load(Q + base + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + base + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
        lse2 = tl.load(LSE + bh * T + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # ln -> log2
        delta = tl.load(DELTA + bh * T + rows, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        visible = row_ok[:, None] & (keys[None, :] < T)
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)  # P, recomputed (where, not *: no inf * 0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")  # dV += P^T dO
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")                # dP = dO V^T
        ds = p * (dp - delta[:, None])                                        # dS = P (dP - Delta)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")    # dK += dS^T Q (scale below)
    tl.store(DK + base + keys[:, None] * D + dims[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + base + keys[:, None] * D + dims[None, :], dv.to(DV.dtype.element_ty), mask=key_ok)


# %% [markdown]
# **dQ**: the forward's grid, `(cdiv(T, BLOCK_M), B*H)`. The program owns `BLOCK_M` query rows, keeps $Q$, $dO$,
# their LSE and $\Delta$ on chip, and walks the key tiles left of the diagonal, as the forward does. It recomputes
# $S$ and $dP$ the first kernel already computed: that is the price of having no atomics.

# %%
@triton.jit
def flash_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, T, qk_scale, sm_scale, CAUSAL: tl.constexpr,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)  # query tile: this program's rows of dQ
    bh = tl.program_id(1).to(tl.int64)
    base = bh * T * D
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    row_ok = rows < T
    q = tl.load(Q + base + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + base + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + bh * T + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * T + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    last = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T  # key tiles right of the diagonal: skipped
    for n0 in range(0, last, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + base + keys[:, None] * D + dims[None, :], mask=keys[:, None] < T, other=0.0)
        v = tl.load(V + base + keys[:, None] * D + dims[None, :], mask=keys[:, None] < T, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = row_ok[:, None] & (keys[None, :] < T)
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")  # dQ += dS K (scale below)
    tl.store(DQ + base + rows[:, None] * D + dims[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


def flash_bwd(q, k, v, o, lse, do, causal=True, BLOCK_M=32, BLOCK_N=16):
    """The lesson's backward: Delta, then the dK/dV kernel, then the dQ kernel. -> dq, dk, dv."""
    B, H, T, D = q.shape
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    delta = (do.float() * o.float()).sum(-1)  # (B, H, T) fp32: rowsum(dO * O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = 1 / math.sqrt(D)
    args = (T, scale * 1.4426950408889634, scale)
    flash_bwd_dkdv_kernel[(triton.cdiv(T, BLOCK_N), B * H)](q, k, v, do, lse, delta, dk, dv, *args, CAUSAL=causal,
                                                            D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    flash_bwd_dq_kernel[(triton.cdiv(T, BLOCK_M), B * H)](q, k, v, do, lse, delta, dq, *args, CAUSAL=causal, D=D,
                                                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return dq, dk, dv


# %% [markdown]
# Checked against autograd through the reference attention in fp64, and against minite's own two kernels (the
# same algorithm, grown to GQA, padded head dims and packed batches), at odd lengths, causal or not, fp32 and fp16:

# %% tags=["nbval-check-output"]
# CHECK: lesson backward kernels vs autograd and vs minite
for T, causal, dtype in ((7, True, torch.float32), (45, True, torch.float16), (40, False, torch.float32)):
    q, k, v, do = (randn(1, 2, T, 16, seed=s, dtype=dtype) for s in (4, 5, 6, 7))
    o, lse = flash_fwd(q, k, v, causal)
    mine = flash_bwd(q, k, v, o, lse, do, causal)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_ref(q64, k64, v64, causal), (q64, k64, v64), do.double())
    qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
    theirs = torch.autograd.grad(attention(qm, km, vm, causal=causal, backend="triton"), (qm, km, vm), do)
    tol = {} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for name, a, b, c in zip(("dq", "dk", "dv"), mine, want, theirs):
        assert_close(a, b.to(dtype), name=f"{name} vs autograd T={T} causal={causal}", **tol)
        assert_close(a, c, name=f"{name} vs minite T={T}", **tol)
print("PASS: the lesson's dK/dV and dQ kernels equal autograd and minite's backward")

# %% [markdown]
# ## 6. Grouped-query attention
#
# With GQA (Ainslie et al. 2023) $H$ query heads share $KVH < H$ key/value heads: query head $h$ reads kv head
# $h \,//\, (H/KVH)$. MQA is $KVH = 1$. The forward just indexes the right kv head (no `repeat_interleave` copy);
# in the backward, a kv head received contributions from $H/KVH$ query heads, so its $dK, dV$ are the **sum over
# the group**. minite's dK/dV program for kv head $g$ loops over the group's query heads and sums, still without
# atomics.

# %% tags=["nbval-check-output"]
# CHECK: gqa gradients are group sums
q = randn(1, 8, 33, 16, seed=8).requires_grad_()
k, v = (randn(1, 2, 33, 16, seed=s).requires_grad_() for s in (9, 10))
dq, dk, dv = torch.autograd.grad(attention(q, k, v, backend="triton"), (q, k, v), torch.ones_like(q))
kr, vr = (t.detach().repeat_interleave(4, 1).requires_grad_() for t in (k, v))  # (1, 8, 33, 16): one per q head
_, dkr, dvr = torch.autograd.grad(attention(q, kr, vr, backend="triton"), (q, kr, vr), torch.ones_like(q))
assert_close(dk, dkr.view(1, 2, 4, 33, 16).sum(2), name="dk = sum over the group")
assert_close(dv, dvr.view(1, 2, 4, 33, 16).sum(2), name="dv")
print("PASS: GQA dK/dV equal the per-head gradients summed over each group of 4")

# %% [markdown]
# ## 7. Numerics, and which kernel PyTorch's SDPA runs
#
# **Pre-scaled q.** In fp16, $QK^\top$ of unscaled vectors can exceed fp16's largest value, 65504, before the
# $1/\sqrt{D}$ brings it back: one row of 128 entries of 30 already gives $30 \cdot 30 \cdot 128 = 115200$.
# Scaling $q$ first (or folding the scale into the kernel, as here, in fp32 after an fp32-accumulating `tl.dot`)
# keeps the intermediate in range:

# %% tags=["nbval-check-output"]
# CHECK: prescaled q
q = torch.full((1, 128), 30.0, dtype=torch.float16)
k = torch.full((1, 128), 30.0, dtype=torch.float16)
late = (q @ k.T) / math.sqrt(128)        # 115200 overflows fp16 before the scale
early = (q / math.sqrt(128)) @ k.T       # 10184: in range (10182.3 exactly; fp16 steps by 8 here)
print(f"scale after the matmul: {late.item()}, before: {early.item():.0f}")
assert torch.isinf(late).all() and torch.isfinite(early).all()
print("PASS: pre-scaling q keeps fp16 scores finite")

# %% [markdown]
# **SDPA's kernels.** `F.scaled_dot_product_attention` dispatches to one of several implementations, tried in
# priority order, each with requirements (force one with `torch.nn.attention.sdpa_kernel(SDPBackend.X)`):
#
# | backend | what it is | requires |
# |---|---|---|
# | `FLASH_ATTENTION` | FlashAttention-2 (Tri Dao's CUDA kernels) | CUDA sm80+, fp16/bf16, head dim ≤ 256, no arbitrary mask |
# | `CUDNN_ATTENTION` | cuDNN's fused flash attention (fastest on H100 in recent releases) | CUDA sm80+ (best sm90), fp16/bf16, recent cuDNN |
# | `EFFICIENT_ATTENTION` | xFormers' memory-efficient kernel | CUDA, fp32 too, additive masks allowed |
# | `MATH` | the naive formula in ATen ops, $S$ and $P$ in memory | anything (the CPU fallback, fp64, odd masks) |
#
# On this CPU only the math path (and a CPU flash variant) exist; on an H100 a bf16 causal call runs flash or
# cuDNN. minite's `"torch"` backend is that SDPA call, and the GPT test compares 3 training steps of it against
# the Triton kernel.

# %% tags=["nbval-ignore-output"]
import warnings
from torch.nn.attention import SDPBackend, sdpa_kernel
q, k, v = (randn(1, 4, 64, 64, seed=s, dtype=torch.float16 if DEVICE == "cuda" else torch.float32) for s in (1, 2, 3))
ref = naive_attention(q.float(), k.float(), v.float())
for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
    try:
        with sdpa_kernel(b), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason a backend is refused comes as a warning, then an error
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        print(f"{b.name:20s} ran on {DEVICE}, max |err| vs fp32 naive {(o.float() - ref).abs().max().item():.1e}")
    except RuntimeError as e:
        print(f"{b.name:20s} refused on {DEVICE}: {str(e).splitlines()[0][:70]}")
#
# ## 8. Layouts: bshd, sbhd, thd — and packing instead of padding
#
# Transformer Engine names its attention layouts by letters: **bshd** (batch, sequence, heads, dim: what a
# `(B, T, C)` projection reshapes to), **sbhd** (sequence first: Megatron's layout, convenient for sequence
# parallelism), and **thd** (tokens, heads, dim: all sequences of the batch **packed** end to end, with
# `cu_seqlens` marking where each starts). minite's dense kernels take bhsd like SDPA; `attention_varlen` takes
# thd. With documents of different lengths, padding to the longest wastes work; packing computes exactly the
# tokens there are:

# %% tags=["nbval-ignore-output"]
_ = torch.manual_seed(0)
lens = (torch.distributions.Exponential(1 / 600.0).sample((256,)) + 16).clamp(max=4096).long()  # documents
batches = lens.view(32, 8)  # 32 batches of 8 documents
pad_tok = (batches.max(1).values * 8).sum().item()
pack_tok = lens.sum().item()
pad_att = (batches.max(1).values.double() ** 2 * 8).sum().item()
pack_att = (lens.double() ** 2).sum().item()
fig, ax = plt.subplots(figsize=(6, 3.4))
ax.bar(["tokens\npadded", "tokens\npacked", "attention\npadded", "attention\npacked"],
       [1, pack_tok / pad_tok, 1, pack_att / pad_att], color=["C1", "C0", "C1", "C0"])
ax.set(ylabel="work relative to padding", title="256 documents, exponential lengths (mean ~600), batches of 8")
plt.show()
print(f"packing computes {pack_tok / pad_tok:.0%} of the padded tokens and {pack_att / pad_att:.0%} of the "
      "padded attention FLOPs")

# %% tags=["nbval-check-output"]
# CHECK: varlen equals per-sequence attention
lens = [5, 33, 1, 17]
cu = torch.tensor([0, 5, 38, 39, 56], dtype=torch.int32, device=DEVICE)
q = randn(56, 4, 32, seed=11); k = randn(56, 2, 32, seed=12); v = randn(56, 2, 32, seed=13)  # thd, GQA 2
o = attention_varlen(q, k, v, cu, max(lens), backend="triton")
for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
    per_seq = attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), backend="triton")  # (1, H, T_b, D)
    assert_close(o[a:b], per_seq[0].transpose(0, 1), name=f"sequence {a}:{b}")
print("PASS: one packed launch equals four per-sequence launches, nothing computed across documents")

# %% [markdown]
# ## 9. GPU numbers
#
# `benchmarks/bench_attention.py` measures forward and forward+backward TFLOP/s against SDPA's FlashAttention-2
# and cuDNN backends in the same process, and writes `benchmarks/results/attention_<device>.json`. The cell below
# plots the file recorded on this notebook's GPU, or on a CPU the newest GPU run recorded: an **NVIDIA H200** on
# 2026-11-28 (torch 2.11, triton 3.6, CUDA-graph timer), $D = 128$, $T = 4096$, $B = 4$, $H = 16$, bf16. (An
# earlier H100 run reached only $D = 64$, $T = 1024$ before its timer crashed:
# `benchmarks/results/logs_h100/final_bench_attention.log`.)

# %% tags=["nbval-ignore-output"]
from minite.recorded import recorded_for

found = recorded_for("attention")  # (file, JSON) of this GPU, else of the H200; None where nothing is recorded
res = found and found[1]
if res is None:
    print("No GPU result recorded for this chapter: run `python benchmarks/bench_attention.py` on a GPU.")
else:
    D_rec, T_rec = max((r["D"], r["T"]) for r in res["results"])
    rows = [(r["impl"], r["causal"], r["mode"], r["TFLOPs"]) for r in res["results"]
            if (r["D"], r["T"]) == (D_rec, T_rec)]
    groups = [(c, m) for c in (False, True) for m in ("fwd", "fwd+bwd")]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for i, impl in enumerate(["minite triton", "sdpa flash", "sdpa cudnn"]):
        vals = [next((t for n, c, m, t in rows if n == impl and c == cg and m == mg), 0.0) for cg, mg in groups]
        ax.bar([j + 0.27 * (i - 1) for j in range(len(groups))], vals, width=0.27, label=impl, color=f"C{i}")
    ax.set_xticks(range(len(groups)), [f"{'causal' if c else 'not causal'}\n{m}" for c, m in groups])
    ax.set(ylabel="TFLOP/s", title=f"attention, D={D_rec}, T={T_rec}, {res['dtype']} — {res['device']}")
    ax.legend(fontsize=8)
    plt.show()
    for n, c, m, t in rows:
        print(f"{n:14} {'causal' if c else 'full':6} {m:8} {t:6.1f} TFLOP/s")

# %% [markdown]
# **Where minite lost on the H200 (2026-11-28), and why.** Not causal, minite's forward (436 TFLOP/s) beat
# SDPA's FlashAttention-2 (354) and reached two thirds of cuDNN (662). Everywhere else it lost: the causal forward
# 250 against flash's 306 and cuDNN's 583; forward+backward **170 against 308 and 531** (not causal) and **126
# against 270 and 474** (causal): about half of FlashAttention-2, a quarter to a third of cuDNN. The backward is
# where it lost most (10.1 ms against flash's 4.7 ms, not causal). Compiling those kernels for sm_90 as the GPU's
# JIT does, and reading the generated code, gave the reasons:
#
# * the dQ kernel at $D = 128$ used 32-row query tiles, fewer than the 64 rows a Hopper warpgroup MMA (`wgmma`)
#   needs, so all three of its dots fell back to the older `mma.sync`;
# * the dK/dV kernel put 64 keys on 8 warps: both warpgroups computed the same tile of $S^\top$ and $dP^\top$;
# * causal mode cleaned non-finite keys inside the loop on every block, which moved $K$ and $V$ from shared memory
#   through registers on every block (and made the GPT's $D = 64$ forward spill 44 bytes a thread), and evaluated
#   the mask on every block: the causal forward took 87 % of the non-causal time for half the work;
# * two backward kernels with no atomics cost 7 tile matmuls per (query, key) tile pair, FA2's one kernel 5
#   (section 5): 1.4× the MMA work, by design;
# * cuDNN goes further than FA2 on Hopper: TMA loads and warp-specialised producer/consumer warpgroups
#   (FlashAttention-3's design, [arXiv:2407.08608](https://arxiv.org/abs/2407.08608)), which this kernel does not
#   use.
#
# **Changed since, not measured yet.** The kernels above were changed after that run, guided by those compiles:
# the split main/masked loops (the scrub and the mask on the diagonal and tail blocks only), per-kernel GPU tiles
# (forward 128 queries × 128 keys at $D = 64$, 128 × 64 at $D = 128$; dQ 128 queries; dK/dV 128 keys × 32 queries;
# every dot at least 64 rows a warpgroup, so `wgmma` and no replicated warpgroup, none spilling in the sm_90
# compile), and the strided reads and fused-qkv path of section 4. What they should reach, as estimated from
# those compiles and not measured: a causal forward near the non-causal one's efficiency (~400 TFLOP/s), a backward
# 1.6–2× faster, so forward+backward near FlashAttention-2's, still below cuDNN; and the GPT-2 step's 2.85 ms of
# layout copies gone. Until a GPU run records a new `attention_<device>.json`, the plot above shows the old
# kernels.

# %% [markdown]
# **Which kernel `backend="auto"` runs on a GPU.** A record like the one above decides it. On a CUDA device, `auto`
# runs minite's attention where the recorded benchmark of the device's family (hopper: H100, H200, ...) shows it at
# least as fast as the peer, and PyTorch's SDPA where it does not. "As fast" is the geometric mean, over the
# recorded shapes, of the best SDPA backend's forward+backward time ÷ minite's (a training step runs both), so the
# comparison is against cuDNN where cuDNN was fastest, not only FlashAttention-2. With the H200 record above that is
# about 0.3: `auto` trains the GPT on SDPA on a Hopper GPU until a new `attention_<device>.json` shows the changed
# kernels at 1 or above; then `python tools/derive_choices.py` moves the op back. The table ships in the package
# (`minite/choices.py`, written from `benchmarks/results/` by that tool; a test keeps the two equal). A GPU family
# with no record keeps minite's kernel, and `--model.backend=triton` forces it whatever the record says: that is
# how the kernel of this chapter is trained on, and measured, on a GPU where it loses. On the CPU nothing changes.
# Chapter 14 shows the rule for every op, and `python -m minite.train` prints the outcome in its first lines.

# %%
from minite import choices
for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA L4"):
    who, why = choices.choose("attention", gpu, compiling=True)
    print(f"{gpu:22s} auto runs {'SDPA' if who == 'peer' else 'minite'}: {why}")
rec = choices.TABLE.get("hopper", {}).get("attention")
if rec:  # the rule on this record: SDPA exactly when minite's mean ratio is below 1
    assert (choices.choose("attention", "NVIDIA H200")[0] == "peer") == (rec["eager"]["ratio"] < 1)
assert choices.choose("attention", "NVIDIA L4")[0] == "minite"  # no record for its family

# %% [markdown]
# ## 10. Where it runs in the GPT
#
# `minite/layers/attention.py`, `CausalSelfAttention.forward`: one projection writes q, k, v side by side, and
# `attention_qkv(qkv, cos, sin, H, KVH, causal=True, backend=self.backend)` applies RoPE and the kernel of this
# chapter to views of it (section 4) on the Triton backend, RoPE and SDPA on the torch backend (on a GPU, `auto`
# takes the one the record of section 9 shows faster; on the CPU, Triton under the interpreter);
# with a KV cache the layer takes the split q, k, v path of chapter 08. `python -m minite.train --model.backend=triton` trains on it; a test
# checks its first 3 losses against the SDPA run. Chapter 08 adds the KV cache and a decode kernel built on the
# same online softmax; chapter 13 splits the keys over GPUs and merges the partial results with the LSE.

# %%
from minite.nn import CausalSelfAttention
layer = CausalSelfAttention(64, 4, 2, max_seq_len=32, backend="triton").to(DEVICE)
x = randn(2, 32, 64, seed=14)
print(layer, tuple(layer(x).shape))
