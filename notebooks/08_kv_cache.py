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
# # 08 — The KV cache and decoding: bytes per token, why decode is memory bound, and split-KV (flash-decoding)
#
# A GPT generates one token at a time. Without a cache, step $t$ runs the whole model over all $t$ tokens of the
# context to get one new row of logits: the work per token grows with $t$, and a sequence of $T$ tokens costs
# $O(T^2)$ projections. But with causal attention the keys and values of past tokens **never change**: each layer
# can store them once. That store is the **KV cache**; with it a step pushes one token through the projections
# and MLPs and attends over the cached keys. This chapter sizes the cache for real models, shows why decoding is
# limited by memory bandwidth rather than FLOPs, builds a KV cache (checked against minite's `KVCache`), and writes
# the split-KV decode kernel and its merge that keep a GPU busy when the batch is small.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import glob, json, math
import matplotlib.pyplot as plt
from minite._triton import triton, tl
from minite.testing import assert_close, dtype_tols
from minite.kernels.decode import decode_attention, decode_attention_ref, lse_merge_ref, num_splits_heuristic
from minite.layers.kv_cache import KVCache
from minite.models.gpt import GPT, GPTConfig
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# %% [markdown]
# ## 1. Bytes per cached token
#
# Every layer stores one key and one value vector per kv head: $2 \cdot L \cdot KVH \cdot D$ numbers per token.
# Multi-head attention has $KVH = H$; grouped-query attention (GQA, Ainslie et al. 2023) shares each kv head
# among $H/KVH$ query heads; multi-query attention (MQA, Shazeer 2019) keeps a single one. The published
# configurations:

# %% tags=["nbval-check-output"]
# CHECK: cache bytes per token
models = {  # name: (layers L, kv heads KVH, head dim D, query heads H, kind)
    "GPT-2 small": (12, 12, 64, 12, "MHA"),
    "Llama-2-7B": (32, 32, 128, 32, "MHA"),
    "Llama-2-70B": (80, 8, 128, 64, "GQA"),
    "Llama-3-8B": (32, 8, 128, 32, "GQA"),
    "Mistral-7B": (32, 8, 128, 32, "GQA"),
    "Falcon-7B": (32, 1, 64, 71, "MQA"),
}
per_token = {n: 2 * L * kvh * d * 2 for n, (L, kvh, d, h, kind) in models.items()}  # bf16: 2 bytes
for n, b in per_token.items():
    L, kvh, d, h, kind = models[n]
    print(f"{n:12s} {kind}  L={L:2d} H={h:2d} KVH={kvh:2d} D={d:3d}: {b / 1024:6.0f} KiB/token, "
          f"{b * 8192 / 2**30:5.2f} GiB for one 8k-token sequence")
assert per_token["Llama-2-7B"] == 4 * per_token["Llama-3-8B"] == 512 * 1024
print("PASS: cache bytes per token")

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(7, 3.4))
colors = {"MHA": "C3", "GQA": "C0", "MQA": "C2"}
ax.bar(list(per_token), [b / 1024 for b in per_token.values()], color=[colors[models[n][4]] for n in per_token])
for kind, c in colors.items():
    ax.bar(0, 0, color=c, label=kind)
ax.set(yscale="log", ylabel="KiB per token (bf16)", title="KV-cache bytes per token: 2 · L · KVH · D · 2 B")
ax.legend(); plt.xticks(rotation=20)
plt.show()

# %% [markdown]
# Llama-2-70B serves 64 query heads from 8 kv heads: its cache per token is smaller than Llama-2-7B's although
# the model is 10× larger. At batch 32 × 8k tokens Llama-2-7B's cache is 128 GiB — more than an H100 holds —
# which is the practical reason GQA replaced MHA.
#
# ## 2. Why decoding is memory bound
#
# One decode step of a batch of $B$ sequences at context $t$ reads every weight once ($2P$ bytes in bf16) and
# every cached key and value ($B \cdot t \cdot$ bytes per token), and does about $2P$ FLOPs per sequence for the
# matmuls plus $4 \cdot L \cdot H \cdot D \cdot t$ for attention. Per byte of cache read, attention does ~1 FLOP
# per query head sharing it ($H/KVH$ with GQA); an H100 needs ~295 FLOPs per byte (989 TFLOP/s / 3.35 TB/s) to be
# compute bound. So a decode step costs the time to **read** the weights and the cache:

# %%
P, L, kvh, d, h = 8.0e9, 32, 8, 128, 32  # Llama-3-8B
for B, t in ((1, 1024), (1, 8192), (32, 8192)):
    read = 2 * P + B * t * 2 * L * kvh * d * 2  # bytes per step
    flops = B * (2 * P + 4 * L * h * d * t)
    print(f"B={B:2d} t={t:5d}: {read / 1e9:5.1f} GB read, {flops / 1e12:5.2f} TFLOP -> memory time "
          f"{read / 3.35e12 * 1e3:5.2f} ms, compute time {flops / 989e12 * 1e3:5.3f} ms, "
          f"<= {B / (read / 3.35e12):6.0f} tokens/s")

# %% [markdown]
# Batching amortises the weights but not the cache (each sequence reads its own): at long context the cache read
# dominates, and smaller caches (GQA, MQA, quantised caches) translate directly into tokens/s.
#
# ## 3. The cache in minite
#
# `minite.layers.kv_cache.KVCache` preallocates, per layer, `k` and `v` of shape $(B, KVH, T_{max}, D)$ and keeps
# per-sequence `lengths`. `CausalSelfAttention.forward(x, kv_cache, layer)` takes only the **new** tokens, rotates
# them by RoPE at their real positions (`lengths[b] + t`, not 0: a key rotated at the wrong angle would not
# match the keys cached earlier), writes k/v there and attends over the cache. `GPT.forward(idx, kv_cache=...)`
# advances the lengths once all layers have written. A prefill is chapter 07's kernel with $T_q < T_k$ and the
# bottom-right causal mask; a one-token step is the decode kernel below.

# %% [markdown]
# The cache itself is a few lines: two preallocated tensors per layer, and each sequence's length on the host, so
# a write knows its positions without reading the device. Every layer of one step writes at the same positions;
# only then do the lengths move (`advance`): a right-padded prefill advances each sequence by its own real length.

# %% tags=["nbval-check-output"]
class LessonCache:
    def __init__(self, n_layer, B, KVH, T_max, D):
        self.k = [torch.zeros(B, KVH, T_max, D, device=DEVICE) for _ in range(n_layer)]  # (B, KVH, T_max, D)
        self.v = [torch.zeros(B, KVH, T_max, D, device=DEVICE) for _ in range(n_layer)]
        self.lengths = [0] * B  # host copy: a write needs no device read
        self.T_max = T_max

    def write(self, layer, k, v):  # k, v: (B, KVH, T, D), the new tokens of every sequence
        T = k.shape[2]
        assert max(self.lengths) + T <= self.T_max, "cache overflow"
        for b, p in enumerate(self.lengths):
            self.k[layer][b, :, p:p + T] = k[b]
            self.v[layer][b, :, p:p + T] = v[b]

    def advance(self, counts):  # once per step, after every layer wrote
        self.lengths = [p + n for p, n in zip(self.lengths, counts)]


# CHECK: the lesson's cache holds what minite's KVCache holds after a ragged prefill and two steps
mine, ref = LessonCache(2, 2, 2, 16, 8), KVCache(2, 2, 2, 16, 8, device=DEVICE)
g = torch.Generator().manual_seed(0)
for T, counts in ((5, [5, 3]), (1, [1, 1]), (1, [1, 1])):  # a right-padded prefill (3 real tokens), then 2 steps
    for layer in range(2):
        k, v = (torch.randn(2, 2, T, 8, generator=g).to(DEVICE) for _ in range(2))
        mine.write(layer, k, v)
        ref.write(layer, k, v)
    mine.advance(counts)
    ref.advance(counts)
assert mine.lengths == ref.host_lengths == ref.lengths.tolist() == [7, 5]
for layer in range(2):
    for b, n in enumerate(mine.lengths):  # the real entries; past them each cache holds what was overwritten last
        assert torch.equal(mine.k[layer][b, :, :n], ref.k[layer][b, :, :n])
        assert torch.equal(mine.v[layer][b, :, :n], ref.v[layer][b, :, :n])
print("PASS: the lesson's cache equals minite's KVCache (ragged prefill, then one token a step)")

# %% tags=["nbval-check-output"]
# CHECK: cached decoding equals recomputation
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)).to(DEVICE).eval()
idx = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
cache = KVCache.for_model(model, batch_size=2)
with torch.no_grad():
    logits, _ = model(idx, kv_cache=cache)  # prefill: 6 tokens
    for step in range(3):
        full, _ = model(idx)  # recompute everything
        assert_close(logits, full, name=f"step {step}", atol=1e-4, rtol=1e-4)
        nxt = full[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
        logits, _ = model(nxt, kv_cache=cache)  # one token
print(cache)
print("PASS: cached logits equal full recomputation at every step")

# %% [markdown]
# Prompts of different lengths share one batch: right-pad them, prefill with `lengths=[...]` (the cache advances
# each sequence by its real length, the logits are taken at each sequence's last real token), then every step
# writes each sequence's token at its own position; the padding's keys lie beyond the lengths and are
# overwritten. `tests/layers/test_kv_cache.py` checks that batch against each prompt run alone, step by step.
#
# ## 4. Split-KV: keeping the GPU busy at batch 1
#
# Chapter 07's grid is (query tiles) × B × H. At decode there is one query per sequence, so B × KVH programs (the
# query heads of a group ride along) — 8 programs for Llama-3-8B at batch 1, on a GPU with 132 SMs. Each would
# stream an 8k-token cache alone while 124 SMs idle. **Flash-decoding** (Dao et al. 2023) also splits the keys
# into $S$ chunks: $B \cdot KVH \cdot S$ programs each compute a partial attention over their chunk and write its
# output $O_s$ and log-sum-exp $L_s$; a second, tiny kernel merges them. The merge is exact (chapter 07's LSE):
# $$m = \max_s L_s,\qquad L = m + \log \sum_s e^{L_s - m},\qquad O = \sum_s e^{L_s - L}\, O_s .$$
#
# How many splits? FlashAttention's heuristic looks at **wave efficiency**: $n$ programs on $N_{SM}$ SMs run in
# $\lceil n / N_{SM} \rceil$ waves, the last one partly idle; efficiency $= (n/N_{SM}) / \lceil n/N_{SM} \rceil$.
# It takes the smallest $S$ within 85 % of the best efficiency (fewer splits, less merging), and no split at all
# once $B \cdot KVH$ fills 80 % of the SMs. minite computes the SM count once per device, never per call.

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(6, 3.2))
for n in (8, 32, 96):
    S = range(1, 65)
    ax.plot(S, [(n * s / 132) / math.ceil(n * s / 132) for s in S], label=f"B·KVH = {n}: heuristic S = "
            f"{num_splits_heuristic(n, 132, 256)}")
ax.set(xlabel="splits S", ylabel="wave efficiency", title="132 SMs (H100)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ### The partial kernel
#
# Program `(b·KVH + g, s)` owns kv head $g$ of sequence $b$ and key chunk $s$. The $G = H/KVH$ query heads of the
# group are the rows of one `(BLOCK_G, D)` tile, so each K/V block is loaded **once** for the whole group and
# multiplied by one `tl.dot`: the cache is read once per step whatever $G$ is. `BLOCK_G` pads $G$ up to 16, the
# smallest `tl.dot` the GPU compiles (padding rows are masked on load and store). The body is chapter 07's online
# softmax; the output is normalised per chunk, with its LSE in natural log.

# %%
@triton.jit
def decode_partial_kernel(Q, K, V, LEN, O_PART, L_PART, H, KVH, T_MAX, CHUNK, qk_scale, S,
                          GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    bg = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    b, g = bg // KVH, bg % KVH
    n_keys = tl.load(LEN + b)
    rows = tl.arange(0, BLOCK_G)
    heads = g * GROUP + rows  # the query heads that read kv head g
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (b * H + heads[:, None]) * D + offs_d[None, :], mask=rows[:, None] < GROUP, other=0.0)
    base = (b * KVH + g) * T_MAX * D
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, n_keys)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + base + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < hi, other=0.0)
        v = tl.load(V + base + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < hi, other=0.0)
        sc = tl.where(cols[None, :] < hi, tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale,
                      float("-inf"))  # (BLOCK_G, BLOCK_N); "ieee": exact fp32 products, not the GPU's default TF32
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0  # a chunk past this sequence's length: no key, LSE -inf (its weight in the merge is 0)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    part = (b * H + heads) * S + s  # (B, H, S) partials
    tl.store(O_PART + part[:, None] * D + offs_d[None, :], out, mask=rows[:, None] < GROUP)
    tl.store(L_PART + part, lse, mask=rows < GROUP)


def decode_split(q, k_cache, v_cache, lengths, S, BLOCK_N=32):
    """q (B, H, D), caches (B, KVH, T_max, D), lengths (B,) -> partial O (B, H, S, D) and LSE (B, H, S)."""
    B, H, D = q.shape
    KVH, T_max = k_cache.shape[1], k_cache.shape[2]
    chunk = triton.cdiv(triton.cdiv(T_max, S), BLOCK_N) * BLOCK_N  # whole key blocks per chunk
    o_part = torch.empty(B, H, S, D, device=q.device)
    l_part = torch.empty(B, H, S, device=q.device)
    decode_partial_kernel[(B * KVH, S)](q, k_cache, v_cache, lengths.to(torch.int32), o_part, l_part, H, KVH,
                                        T_max, chunk, 1.4426950408889634 / math.sqrt(D), S, GROUP=H // KVH, D=D,
                                        BLOCK_G=max(16, triton.next_power_of_2(H // KVH)), BLOCK_N=BLOCK_N)
    return o_part, l_part


# %% tags=["nbval-check-output"]
# CHECK: lesson split-KV decode
q = randn(3, 8, 32, seed=1)
kc, vc = randn(3, 2, 200, 32, seed=2), randn(3, 2, 200, 32, seed=3)
lengths = torch.tensor([200, 57, 1], device=DEVICE)
o_part, l_part = decode_split(q, kc, vc, lengths, S=4)
def merge(o_part, l_part):  # (..., S, D), (..., S) -> (..., D), (...): chapter 07's LSE rule, S chunks at once
    m = l_part.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # every chunk empty: no -inf - -inf
    w = torch.exp(l_part - m)  # each chunk's weight, <= 1
    tot = w.sum(-1, keepdim=True)
    return (w[..., None] * o_part).sum(-2) / torch.where(tot == 0, 1.0, tot), (m + torch.log(tot)).squeeze(-1)


o, lse = merge(o_part, l_part)  # the merge, in PyTorch here
ref_o, ref_lse = lse_merge_ref(o_part, l_part)
assert_close(o, ref_o, name="merge vs minite's lse_merge_ref")
assert_close(lse, ref_lse, name="merged LSE vs minite's")
assert_close(o, decode_attention_ref(q, kc, vc, lengths), name="split-KV vs reference")
assert_close(o, decode_attention(q, kc, vc, lengths, backend="triton"), name="vs minite's decode kernel")
print("chunk LSEs of sequence 1, head 0:", [round(x, 3) for x in l_part[1, 0].tolist()])
print("PASS: 4 chunks merged with their LSEs equal attention over the whole cache")

# %% [markdown]
# The chunks are 64 keys wide (whole key blocks). Sequence 1 holds 57 keys, all in chunk 0: chunks 1–3 hold none
# of them, report LSE $= -\infty$ and weigh nothing in the merge. minite's `decode_attention` is this kernel plus the merge as a second Triton kernel,
# head dims padded to a power of two, bf16 upcast on the interpreter, and the split count from the heuristic, for
# contexts past `SINGLE_PASS_MAX_LEN` (512) keys. Up to there it runs one pass ($S = 1$): the partial kernel writes
# the output itself and no merge runs, since one program streams a short context in about the time the merge
# kernel's launch would cost.
#
# ## 5. Measured: tokens/s with and without the cache
#
# `python benchmarks/bench_attention.py --decode` times one generated token after a context of $L$ tokens for a
# 4-layer, 256-wide GPT at batch 1: recomputing the context (no cache) against one cached step. On this course's
# CPU (a shared 2-core EPYC, one thread, numbers noisy) it was measured; a GPU run adds its own file, for a
# 12-layer, 768-wide GPT, with two more series: the step of section 7 as one CUDA graph, and the same model
# written in plain PyTorch and compiled the same way (its peer).

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(6, 3.6))
for path in sorted(glob.glob("../benchmarks/results/decode_*.json")):
    res = json.load(open(path))
    for impl, style in (("no cache", "o--"), ("kv cache", "o-"), ("kv cache + CUDA graph", "s-"),
                        ("plain torch, reduce-overhead", "x:")):
        rs = [r for r in res["results"] if r["impl"].removeprefix("minite ") == impl]
        ax.plot([r["L"] for r in rs], [r["tokens_per_s"] for r in rs], style, label=f"{impl} — {res['device']}")
ax.set(xscale="log", yscale="log", xlabel="context length L", ylabel="tokens/s", title="decode, batch 1")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# Without the cache the time per token grows linearly with $L$ (the whole context goes through the model
# again); with it the step stays nearly flat at these sizes, where the projections and Python overhead dominate
# and reading $L$ cached keys is cheap. Section 2's bandwidth bound is what a batch-1 step *could* reach on a GPU;
# the recorded GPU run below shows how far a small model's step is from it.
#
# **Recorded on a GPU.** An **NVIDIA H200** ran `bench_attention.py --decode` on 2026-11-28 (torch 2.11, triton
# 3.6) for the GPU default model, a 12-layer, 768-wide GPT with 12 query and 4 key/value heads (75.7M parameters,
# bf16), after $L = 256$ tokens. `benchmarks/results/decode_nvidia-h200.json` holds its three rows, made from that
# run's log (the plain-PyTorch peer series did not exist yet). Beside them: section 2's roofline, the bytes one
# cached step must read (151.4 MB of weights and 3.1 MB of cache) over the H200's 4.8 TB/s.

# %% tags=["nbval-ignore-output"]
from minite.recorded import recorded_for

found = recorded_for("decode")  # (file, JSON) of this GPU, else of the H200; None where nothing is recorded
gpu = found and found[1]
if gpu is None:
    print("No GPU decode result recorded: run `python benchmarks/bench_attention.py --decode` on a GPU.")
else:
    L_rec = max(r["L"] for r in gpu["results"])
    rows = [r for r in gpu["results"] if r["L"] == L_rec]
    cached = next(r for r in rows if r.get("bytes_per_token"))
    roof = gpu["hbm_bytes_per_s"] / cached["bytes_per_token"] if "hbm_bytes_per_s" in gpu else None
    names = [r["impl"].removeprefix("minite ") for r in rows] + (["HBM roofline"] if roof else [])
    vals = [r["tokens_per_s"] for r in rows] + ([roof] if roof else [])
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.bar(range(len(vals)), vals, color=[f"C{i}" for i in range(len(rows))] + ["gray"] * bool(roof))
    ax.set_xticks(range(len(vals)), [n.replace(" + ", "\n+ ") for n in names], fontsize=8)
    ax.set(yscale="log", ylabel="tokens/s (log)", title=f"batch-1 decode after L={L_rec} — {gpu['device']}")
    plt.show()
    for n, v, r in zip(names, vals, rows + [{"bytes_per_token": 1}]):  # no cache reads more: no share of it
        print(f"{n:28} {v:9.1f} tok/s" + (f"  ({100 * v / roof:.1f}% of the roofline)" if roof and r.get(
            "bytes_per_token") else ""))

# %% [markdown]
# **Where minite lost on the H200 (2026-11-28), and why.** Two things, and neither is attention's arithmetic.
# *Eager, the cache was slower than no cache* (41.7 against 47.8 tokens/s): each layer built the decode lengths
# as a host list and copied them to the GPU, and a host-to-device copy of pageable memory synchronises the stream:
# 12 syncs a token, on top of ~100 µs of Python per minite op. At batch 1 and $L = 256$ the uncached forward's
# extra FLOPs cost less than those stalls. *As one CUDA graph, the step ran 1688 tokens/s, 5.4 % of the roofline*
# (~31k tokens/s): a dispatch count of that step gave 244 GPU kernels a token, each a few microseconds however
# little it reads, so the step was bound by kernel latency, not by bandwidth (the 49 GEMVs alone read the weights at
# about 0.7 TB/s in an H100 profile). gpt-fast (PyTorch's compact reference decoder) writes its step in plain torch
# ops for that reason: Inductor fuses everything between the GEMVs.
#
# **Changed since, not measured yet** (section 7 and the decode kernel of section 4): the cached layer reads the
# cache's device lengths (no host copy, no sync); `decode_step` writes the norms with their residual adds, RoPE
# with the cache write and SwiGLU in torch ops for Inductor to fuse; the decode kernel runs one pass with no merge
# up to 512 keys. Inductor's graph of a 12-layer step now makes 110 launches (135 before; the measured step's
# eager dispatch count was 244). Expected, not
# measured: the eager cached step faster than no cache again, and the graph at roughly 2.5–3k tokens/s (110
# kernels at ~3.3 µs), still under a tenth of the roofline; closer needs faster GEMVs (Inductor's
# `coordinate_descent_tuning`, as gpt-fast sets) and fusing the norm and SwiGLU into them. Until a GPU run records
# a new `decode_<device>.json`, the plot shows the old step.
#
# ## 6. Where it runs
#
# `GPT.generate(idx, n, use_cache=True)` prefills once, then feeds one token per step; when the context reaches
# `block_size` it crops and prefills again, so it produces exactly the tokens of the uncached loop (a test
# checks this). `python -m minite.sample --ckpt out/ckpt.pt` uses it; `--no_cache` turns it off for comparison.

# %%
out = model.generate(idx[:1, :4], 4, temperature=0)
same = model.generate(idx[:1, :4], 4, temperature=0, use_cache=False)
print(out.tolist()[0], "cached == uncached:", torch.equal(out, same))
assert torch.equal(out, same), "the cached generation must produce exactly the uncached tokens"

# %% [markdown]
# ## 7. One graph a step
#
# At batch 1 a small GPT's step is not bound by memory either, but by the host: each of the ~20 kernels of a
# block sits behind Python (argument checks, an autograd Function, Triton's launcher), which costs more than the
# kernel itself (on an H100: 2.1 ms of GPU work for 4 tokens, 47 ms of host time). A **CUDA graph** records the
# step's kernels once and replays them with one launch, so the host cost disappears. A replay runs the same
# kernels on the same addresses, so the step must not depend on any value the host reads:
#
# - the cache is preallocated and written in place (`KVCache` already is);
# - positions come from the device tensor `cache.lengths`: RoPE gathers its cos/sin rows by position, k/v are
#   stored at `[b, :, lengths[b]]` by an index, the decode kernel reads each length itself;
# - the step moves `lengths` on by one in place; the host's copy (overflow checks, when to crop) moves outside.
#
# `minite.decoding.decode_step` is that step. Below it matches the ordinary cached forward, and
# `torch.compile(fullgraph=True)` traces it as **one** graph for every position: no recompilation as the positions
# move, no host read (either would break capture). `Decoder(model, compile="reduce-overhead")` adds the CUDA graph
# on a GPU (`python -m minite.sample --compile reduce-overhead`, and a third series in the benchmark above).
#
# Inside the graph the number of kernels is what bounds a batch-1 step (each costs a few microseconds however
# little it reads). So `decode_step` writes the norms with their residual adds, RoPE with the cache write, and
# SwiGLU in torch ops, which Inductor fuses (a minite op is a kernel of its own and a fusion barrier), and keeps
# minite's decode kernel: at 12 layers, 110 launches a token as Inductor builds the graph (a test counts them).

# %% tags=["nbval-check-output"]
# CHECK: the graph-capturable step
from torch._dynamo.testing import CompileCounterWithBackend

import minite
from minite.decoding import Decoder, decode_step

prompt = idx[:, :6]
cache, ref_cache = KVCache.for_model(model, batch_size=2), KVCache.for_model(model, batch_size=2)
with torch.no_grad():
    model(prompt, kv_cache=cache)
    model(prompt, kv_cache=ref_cache)
    tok = prompt[:, -1:]
    for step in range(3):
        assert_close(decode_step(model, tok, cache), model(tok, kv_cache=ref_cache)[0], name=f"step {step}")
        cache.host_lengths = list(ref_cache.host_lengths)  # what Decoder does on the host
# torch.compile traces real Triton only: on the CPU (the interpreter) the trace runs on the PyTorch reference ops
counter = CompileCounterWithBackend("aot_eager")
torch._dynamo.reset()
with minite.use_backend("triton" if DEVICE == "cuda" else "torch"):
    fast = model.generate(prompt, 10, temperature=0, decoder=Decoder(model, compile="default", backend=counter))
    assert torch.equal(fast, model.generate(prompt, 10, temperature=0)) and counter.frame_count == 1
print(f"compiled graphs for 10 decode steps: {counter.frame_count}")
print("PASS: the device-position step equals the cached forward, as one graph for every step")

