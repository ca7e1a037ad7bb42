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
# # 07 — Flash attention: exercises
#
# Three graded tasks. Write your code between `### BEGIN YOUR CODE` and `### END YOUR CODE` (replacing
# `raise NotImplementedError()`), run the cell, then the `# CHECK` cell after it. The lesson
# (`notebooks/07_flash_attention.ipynb`) built the forward kernel and the two-kernel backward; here you write the
# grouped-query reference, the packing of a padded batch, and FA2's one-kernel backward with an atomic dQ.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
from minite._triton import triton, tl
from minite.testing import assert_close
from minite.kernels.attention import attention, attention_ref, attention_varlen
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# %% [markdown]
# ## Task 1 — grouped-query attention without copying the kv heads
#
# `q` is `(B, H, T, D)`, `k` and `v` are `(B, KVH, T, D)` with `H % KVH == 0`; query head `h` uses kv head
# `h // (H // KVH)`. Write causal attention in plain PyTorch **without** `repeat_interleave`, `repeat` or `expand`
# of k/v: reshape the queries so that each kv head meets its group of query heads through broadcasting. Return
# `(B, H, T, D)` in q's dtype (computing in fp32 is fine).

# %% minite={"task": "gqa_reference"}
def gqa_attention(q, k, v):
    ### BEGIN SOLUTION
    B, H, T, D = q.shape
    KVH = k.shape[1]
    qg = q.float().view(B, KVH, H // KVH, T, D)  # (B, KVH, G, T, D): the group of kv head g is qg[:, g]
    s = qg @ k.float()[:, :, None].transpose(-1, -2) / math.sqrt(D)  # (B, KVH, G, T, T), k broadcast over G
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    o = s.softmax(-1) @ v.float()[:, :, None]  # (B, KVH, G, T, D)
    return o.reshape(B, H, T, D).to(q.dtype)
    ### END SOLUTION


# %% minite={"check": "gqa_reference"} tags=["nbval-check-output"]
# CHECK: gqa_reference
import inspect
src = inspect.getsource(gqa_attention)
assert not any(w in src for w in ("repeat_interleave", ".repeat(", ".expand(")), "no copies of the kv heads"
for H, KVH in ((4, 4), (8, 2), (6, 1)):
    q = randn(2, H, 11, 16, seed=1).cpu()
    k, v = randn(2, KVH, 11, 16, seed=2).cpu(), randn(2, KVH, 11, 16, seed=3).cpu()
    assert_close(gqa_attention(q, k, v), attention_ref(q, k, v), name=f"H={H} KVH={KVH}")
print("PASS: gqa_reference")

# %% [markdown]
# ## Task 2 — from a padded batch to the packed thd layout
#
# `x` is a right-padded batch `(B, T_max, H, D)` (bshd) and `lengths` a list of B valid lengths. Return
# `(packed, cu_seqlens, max_seqlen)`: `packed` is `(sum(lengths), H, D)` holding the valid tokens of sequence 0,
# then of sequence 1, ...; `cu_seqlens` an int32 tensor `[0, l0, l0 + l1, ...]` on x's device; `max_seqlen` an int.
# Then `attention_varlen` computes exactly the real tokens.

# %% minite={"task": "pack_thd"}
def pack_thd(x, lengths):
    ### BEGIN SOLUTION
    packed = torch.cat([x[b, :n] for b, n in enumerate(lengths)])  # (total, H, D)
    cu = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32).to(x.device)
    return packed, cu, max(lengths)
    ### END SOLUTION


# %% minite={"check": "pack_thd"} tags=["nbval-check-output"]
# CHECK: pack_thd
lengths = [3, 9, 1, 6]
x = randn(4, 9, 2, 16, seed=4)
packed, cu, mx = pack_thd(x, lengths)
assert packed.shape == (19, 2, 16) and cu.dtype == torch.int32 and cu.tolist() == [0, 3, 12, 13, 19] and mx == 9
assert torch.equal(packed[12], x[2, 0]) and torch.equal(packed[3:12], x[1])
o = attention_varlen(packed, packed, packed, cu, mx)
for b, n in enumerate(lengths):
    xb = x[b, :n].transpose(0, 1)[None]  # (1, H, n, D)
    assert_close(o[cu[b]:cu[b + 1]], attention(xb, xb, xb)[0].transpose(0, 1), name=f"sequence {b}")
print("PASS: pack_thd")

# %% [markdown]
# ## Task 3 — FA2's one-kernel backward, with dQ accumulated by atomics (a whole kernel from its spec)
#
# The lesson wrote minite's backward as two kernels, so that every output has one writer. FA2's CUDA kernel makes
# one pass instead: one program per key tile computes that tile's $dK$ and $dV$ **and**, for every query tile it
# visits, adds its share of $dQ$ into a shared fp32 buffer with atomic adds. Write `bwd_atomic_kernel`.
#
# Shapes: `Q, K, V, DO` are contiguous `(B*H, T, D)` (plain multi-head attention, `D` a power of two $\ge 16$);
# `LSE` and `DELTA` are contiguous `(B*H, T)` fp32: the forward's natural-log log-sum-exp per query row, and
# $\Delta = \mathrm{rowsum}(dO \circ O)$. `DK`, `DV` are `(B*H, T, D)` like `K`; `DQ` is `(B*H, T, D)` **fp32,
# zero-filled by the caller**. Grid `(cdiv(T, BLOCK_N), B*H)`: program `(j, bh)` owns keys `j*BLOCK_N ...` of head
# `bh`, loops over the query tiles that can see them (with `CAUSAL`, query $i$ sees key $j$ iff $j \le i$: skip the
# tiles that cannot), recomputes the probabilities from the LSE, writes its rows of $dK$ and $dV$ once, and adds
# (`tl.atomic_add`, masked to the real rows) this key tile's contribution to the rows of `DQ` it visited, already
# multiplied by the softmax scale `sm_scale` $= 1/\sqrt{D}$. Accumulate in fp32; every `tl.dot` operand at least
# 16 × 16 and every `tl.dot` with `input_precision="ieee"` (a GPU's default for fp32 tiles is TF32, whose ~1e-3
# error the fp32 check rejects). Derive the formulas from the lesson's section 5; the check compares all three
# gradients with autograd. (On the CPU interpreter programs run one after another, so a race would never show
# here: that is why the spec insists on `tl.atomic_add` rather than a load, add and store.)

# %% minite={"task": "bwd_atomic_kernel"}
@triton.jit
def bwd_atomic_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, T, sm_scale, CAUSAL: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    ### BEGIN SOLUTION
    pid_n = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * T * D
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    n_ok = offs_n[:, None] < T
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=n_ok, other=0.0).to(tl.float32)
    v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=n_ok, other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0  # earlier queries see none of these keys
    for m0 in range(start, T, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < T
        q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        lse = tl.load(LSE + bh * T + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(DELTA + bh * T + offs_m, mask=m_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision="ieee") * sm_scale  # (BLOCK_N, BLOCK_M) = S^T
        keep = (offs_n[:, None] < T) & m_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[:, None] <= offs_m[None, :])
        p_t = tl.where(keep, tl.exp(s_t - lse[None, :]), 0.0)
        dv += tl.dot(p_t, do, input_precision="ieee")
        ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision="ieee") - delta[None, :])
        dk += tl.dot(ds_t, q, input_precision="ieee")
        dq_part = tl.dot(tl.trans(ds_t), k, input_precision="ieee") * sm_scale  # (BLOCK_M, D): dS K, this tile's share
        tl.atomic_add(DQ + base + offs_m[:, None] * D + offs_d[None, :], dq_part, mask=m_ok[:, None])
    tl.store(DK + base + offs_n[:, None] * D + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=n_ok)
    ### END SOLUTION


def my_backward(q, k, v, do, causal, BLOCK_M=32, BLOCK_N=16):
    B, H, T, D = q.shape
    o, lse = attention(q, k, v, causal=causal, return_lse=True)  # minite's forward: O and the LSE
    delta = (do.float() * o.float()).sum(-1)  # (B, H, T)
    dq32 = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # the atomics' fp32 accumulator
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    bwd_atomic_kernel[(triton.cdiv(T, BLOCK_N), B * H)](q.contiguous(), k.contiguous(), v.contiguous(),
                                                        do.contiguous(), lse.contiguous(), delta.contiguous(), dq32,
                                                        dk, dv, T, 1 / math.sqrt(D), CAUSAL=causal, D=D,
                                                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return dq32.to(q.dtype), dk, dv  # FA2's second, tiny kernel: cast the fp32 dQ to the input's type


# %% minite={"check": "bwd_atomic_kernel"} tags=["nbval-check-output"]
# CHECK: bwd_atomic_kernel
for T, D, causal, dtype in ((7, 16, True, torch.float32), (50, 32, True, torch.float16), (40, 16, False, torch.float32)):
    q, k, v = (randn(1, 2, T, D, seed=s, dtype=dtype) for s in (5, 6, 7))
    do = randn(1, 2, T, D, seed=8, dtype=dtype)
    got = my_backward(q, k, v, do, causal)
    qa, ka, va = (t.double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_ref(qa, ka, va, causal), (qa, ka, va), do.double())
    # fp32: exact ("ieee") products, as the spec asks; TF32 products (a GPU's default) err by ~1e-3 and fail here
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(a, b.to(dtype), name=f"{name} T={T} causal={causal}", **tol)
print("PASS: bwd_atomic_kernel")
