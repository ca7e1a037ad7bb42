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
# # 08 — KV cache and decoding: exercises
#
# Three graded tasks. Write your code between `### BEGIN YOUR CODE` and `### END YOUR CODE` (replacing
# `raise NotImplementedError()`), run the cell, then the `# CHECK` cell after it. The lesson
# (`notebooks/08_kv_cache.ipynb`) sized caches, built the split-KV partial kernel and merged its chunks in
# PyTorch; here you size a deployment, write the merge as a Triton kernel, and write a cached generation loop.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
from minite._triton import triton, tl
from minite.testing import assert_close
from minite.kernels.attention import attention
from minite.layers.kv_cache import KVCache
from minite.models.gpt import GPT, GPTConfig
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# %% [markdown]
# ## Task 1 — how long a context fits?
#
# A GPU with `hbm_bytes` of memory serves a model of `n_params` parameters in bf16 (2 bytes each, weights only:
# ignore activations and workspace) to `batch` sequences at once, each with its KV cache in bf16. Return the
# longest context (tokens per sequence, an int, rounded down) whose caches fit next to the weights, or 0 if the
# weights alone do not fit.

# %% minite={"task": "max_context_tokens"}
def max_context_tokens(n_params, n_layer, n_kv_head, head_dim, batch, hbm_bytes):
    ### BEGIN SOLUTION
    free = hbm_bytes - 2 * n_params
    per_token = 2 * n_layer * n_kv_head * head_dim * 2  # k and v, every layer, bf16
    return max(0, int(free // (batch * per_token)))
    ### END SOLUTION


# %% minite={"check": "max_context_tokens"} tags=["nbval-check-output"]
# CHECK: max_context_tokens
got = [max_context_tokens(8.03e9, 32, 8, 128, 8, 80e9),   # Llama-3-8B, GQA
       max_context_tokens(6.74e9, 32, 32, 128, 8, 80e9),  # Llama-2-7B, MHA
       max_context_tokens(7.2e9, 32, 1, 64, 8, 80e9),     # Falcon-7B, MQA
       max_context_tokens(8.03e9, 32, 8, 128, 1, 16e9)]   # does not fit
print(got)
assert got == [60977, 15859, 1000976, 0]
print("PASS: max_context_tokens")

# %% [markdown]
# ## Task 2 — the LSE merge as a Triton kernel (a whole kernel from its spec)
#
# `O_PART` is a contiguous fp32 `(R, S, D)` tensor: row `r` (one (sequence, head) pair) has `S` partial attention
# outputs, each normalised over its own chunk of keys; `L_PART` is `(R, S)` fp32, the natural-log log-sum-exp of
# each chunk (`-inf` for a chunk that held no key). Write the merged output into `O` `(R, D)` (cast to its dtype)
# and the merged log-sum-exp into `LSE` `(R,)` fp32, such that the result equals attention over all the keys.
# A row whose chunks are all empty gets output 0 and LSE `-inf`, never NaN. Grid `(R,)`; `BLOCK_S`, `BLOCK_D` are
# powers of two $\ge$ S and D. Derive the merge from the definition of the LSE.

# %% minite={"task": "lse_merge_kernel"}
@triton.jit
def lse_merge_kernel(O_PART, L_PART, O, LSE, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    ### BEGIN SOLUTION
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(L_PART + r * S + offs_s, mask=offs_s < S, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all chunks empty
    w = tl.exp(lse - m)  # exp(L_s - m), 0 for empty chunks
    tot = tl.sum(w, 0)
    o = tl.load(O_PART + (r * S + offs_s[:, None]) * D + offs_d[None, :],
                mask=(offs_s[:, None] < S) & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(tot == 0.0, 1.0, tot)
    tl.store(O + r * D + offs_d, out.to(O.dtype.element_ty), mask=offs_d < D)
    tl.store(LSE + r, tl.where(tot == 0.0, float("-inf"), m + tl.log(tot)))
    ### END SOLUTION


def my_merge(o_part, l_part, dtype=torch.float32):
    R, S, D = o_part.shape
    o = torch.empty(R, D, device=o_part.device, dtype=dtype)
    lse = torch.empty(R, device=o_part.device)
    lse_merge_kernel[(R,)](o_part.contiguous(), l_part.contiguous(), o, lse, S, D,
                           BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_D=triton.next_power_of_2(D))
    return o, lse


# %% minite={"check": "lse_merge_kernel"} tags=["nbval-check-output"]
# CHECK: lse_merge_kernel
q = randn(2, 4, 1, 24, seed=1)  # (B, H, 1, D): one query per head
k, v = randn(2, 4, 90, 24, seed=2), randn(2, 4, 90, 24, seed=3)
edges = [0, 10, 10, 50, 90]  # chunk 1 is empty
parts = [attention(q, k[:, :, a:b], v[:, :, a:b], causal=False, return_lse=True) for a, b in zip(edges, edges[1:])]
o_part = torch.stack([p[0][:, :, 0] for p in parts], 2).reshape(8, 4, 24).float()  # (R, S, D)
l_part = torch.stack([p[1][:, :, 0] for p in parts], 2).reshape(8, 4)  # (R, S)
o, lse = my_merge(o_part, l_part)
o_full, lse_full = attention(q, k, v, causal=False, return_lse=True)
assert_close(o, o_full.reshape(8, 24), name="merged output")
assert_close(lse, lse_full.reshape(8), name="merged lse")
o0, l0 = my_merge(torch.zeros(3, 5, 24, device=DEVICE), torch.full((3, 5), float("-inf"), device=DEVICE), torch.float16)
assert torch.all(o0 == 0) and torch.all(l0 == float("-inf")) and o0.dtype == torch.float16
print("PASS: lse_merge_kernel")

# %% [markdown]
# ## Task 3 — greedy generation with the cache
#
# Write `generate_greedy(model, idx, n)`: append `n` greedily chosen tokens (argmax over the first
# `model.config.vocab_size` logits) to `idx` `(B, T)` using a `KVCache` — one forward over the prompt, then one
# forward of a single token per new token (`model(tokens, kv_cache=cache)` returns `(logits (B, 1, V_pad),
# None)`). Assume `T + n <= block_size`. Return `(B, T + n)`.

# %% minite={"task": "generate_greedy"}
@torch.no_grad()
def generate_greedy(model, idx, n):
    ### BEGIN SOLUTION
    cache = KVCache.for_model(model, idx.shape[0])
    logits, _ = model(idx, kv_cache=cache)
    for _ in range(n):
        nxt = logits[:, -1, :model.config.vocab_size].argmax(-1, keepdim=True)  # (B, 1)
        idx = torch.cat([idx, nxt], 1)
        logits, _ = model(nxt, kv_cache=cache)
    return idx
    ### END SOLUTION


# %% minite={"check": "generate_greedy"} tags=["nbval-check-output"]
# CHECK: generate_greedy
torch.manual_seed(0)
m = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, backend="torch"))
m = m.to(DEVICE).eval()
widths = []
h = m.wte.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1)).to(DEVICE)
got = generate_greedy(m, prompt, 6)
h.remove()
want = m.generate(prompt, 6, temperature=0, use_cache=False)
assert torch.equal(got, want), (got, want)
assert widths[0] == 5 and all(w == 1 for w in widths[1:]) and len(widths) in (6, 7), widths
print("PASS: generate_greedy")
