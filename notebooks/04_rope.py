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
# # 04 — RoPE: rotary position embeddings as one fused kernel
#
# Attention scores $q_m \cdot k_n$ know nothing about *where* tokens are. **RoPE** (Su, Lu, Pan, Murtadha, Wen &
# Liu, *RoFormer: Enhanced Transformer with Rotary Position Embedding*, 2021,
# [arXiv:2104.09864](https://arxiv.org/abs/2104.09864)) rotates each query and key by an angle proportional to its
# position, so that the score depends on the positions only through their **difference** $m-n$. Llama, Mistral,
# Qwen, GPT-NeoX and our GPT all use it.
#
# **Traffic arithmetic.** RoPE touches q and k once per layer, forward and backward. With B = 8, T = 2,048, 32 heads
# of D = 128 in bf16, q is 8·2,048·32·128·2 B = 128 MiB, k as much. A rotation is 6 flops per pair: pure bandwidth.
# Written as eager PyTorch (`x1*cos - x2*sin`, `x1*sin + x2*cos`, `cat`, casts), every operator reads and writes a
# full tensor; a fused kernel reads q once and writes it once: 256 MiB / 3.35 TB/s ≈ 80 µs per tensor, and the
# eager version moves about twelve times that (counted in section 3).

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect, math
import matplotlib.pyplot as plt
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
from minite.kernels.rope import rope_cos_sin, rope_ref
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. The math: a rotation in the complex plane
#
# Split a head vector $x \in \mathbb{R}^D$ into $D/2$ pairs and read pair $i$ as one complex number. We use the
# **halves** pairing of GPT-NeoX and Hugging Face Llama, $z_i = x_i + \mathrm{j}\,x_{i+D/2}$ (the paper and Meta's
# original Llama pair neighbours $(x_{2i}, x_{2i+1})$; the two differ by a fixed permutation of the head dims, which
# the projection weights absorb, so they train identically, and halves give two contiguous loads). With
#
# $$\theta_i = \text{base}^{-2i/D},\qquad i = 0, \dots, D/2-1 \qquad (\text{base} = 10{,}000)$$
#
# the embedding of $x$ at position $t$ is $z_i \mapsto z_i\, e^{\mathrm{j} t \theta_i}$. Written in reals, each pair
# is turned by the 2 × 2 rotation matrix:
#
# $$\begin{pmatrix} y_i \\ y_{i+D/2} \end{pmatrix} =
# \begin{pmatrix} \cos t\theta_i & -\sin t\theta_i \\ \sin t\theta_i & \cos t\theta_i \end{pmatrix}
# \begin{pmatrix} x_i \\ x_{i+D/2} \end{pmatrix}$$
#
# The frequencies go geometrically from 1 radian per token ($i = 0$) down to $1/\text{base}$: fast pairs tell nearby
# tokens apart, slow pairs carry long-range position.
#
# **Relative positions.** For real vectors, $q \cdot k = \mathrm{Re}\sum_i z^q_i\, \overline{z^k_i}$. Rotating $q$ to
# position $m$ and $k$ to position $n$:
#
# $$\langle R_m q, R_n k\rangle
# = \mathrm{Re}\sum_i z^q_i e^{\mathrm{j} m\theta_i}\, \overline{z^k_i e^{\mathrm{j} n\theta_i}}
# = \mathrm{Re}\sum_i z^q_i\, \overline{z^k_i}\; e^{\mathrm{j}(m-n)\theta_i}$$
#
# The absolute positions cancel; only $m - n$ is left. That is the whole point of RoPE.
#
# **Backward.** $y = R_t x$ with $R_t$ block-diagonal and orthogonal, so
# $\frac{\partial L}{\partial x} = R_t^\top \frac{\partial L}{\partial y} = R_{-t}\, \frac{\partial L}{\partial y}$:
# rotate the gradient back. $\cos(-a) = \cos a$ and $\sin(-a) = -\sin a$, so the backward is **the forward kernel
# with sin negated**. Nothing is saved for backward but the cos/sin cache, which exists anyway.
#
# ## 2. The cos/sin cache
#
# $\cos t\theta_i$ and $\sin t\theta_i$ depend only on $(t, i)$: compute them once for $t < T_\max$, a (T, D/2) table,
# and slice it. A decode step at position 700 just uses row 700 (`rope_cos_sin(..., offset=700)` or
# `RotaryEmbedding.forward(x, offset=700)`). minite builds the angles $t\theta_i$ in fp64 and rounds cos/sin once to
# fp32: at $t = 10^5$ the angle of the fastest pair is $10^5$ rad, where an fp32 angle keeps only ~2 decimals.

# %%
print(inspect.getsource(rope_cos_sin))
cos, sin = rope_cos_sin(8, 6)
print("cos/sin shapes:", tuple(cos.shape), tuple(sin.shape), cos.dtype)
c_off, _ = rope_cos_sin(3, 6, offset=5)
print("offset 5 == rows 5..7 of the full cache:", torch.equal(c_off, cos[5:8]))


# %% [markdown]
# Check the real-arithmetic reference against the complex formula (an independent implementation with
# `torch.view_as_complex`), and the relative-position property numerically: the score of a query at $m$ and a key at
# $n$ is the same for every pair with the same $m - n$.

# %%
def complex_rope(x, positions, base=10000.0):
    """Independent formula with complex numbers: pair i is z_i = x[i] + j x[i + D/2] (halves layout);
    multiply by exp(j * t * theta_i), theta_i = base^(-2i/D). x (..., T, D) -> (..., T, D), fp64."""
    D = x.shape[-1]
    z = torch.view_as_complex(torch.stack(x.double().chunk(2, dim=-1), dim=-1).contiguous())  # (..., T, D/2)
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angle = positions.double()[:, None] * theta[None, :]  # (T, D/2)
    y = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle))  # (..., T, D/2, 2)
    return torch.cat([y[..., 0], y[..., 1]], dim=-1)


# %% tags=["nbval-check-output"]
x = torch.randn(2, 3, 10, 16, dtype=torch.float64)
cos, sin = rope_cos_sin(10, 16, offset=4)
assert_close(rope_ref(x, cos, sin), complex_rope(x, torch.arange(4, 14)), atol=1e-6, rtol=1e-6, name="complex")
print("PASS: rope_ref == complex rotation")

D = 16
q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
cos, sin = rope_cos_sin(64, D)
rq = rope_ref(q.expand(1, 1, 64, D), cos, sin)[0, 0]  # (64, D): q placed at every position
rk = rope_ref(k.expand(1, 1, 64, D), cos, sin)[0, 0]
score = rq @ rk.T  # score[m, n] = <R_m q, R_n k>
for m, n in [(3, 1), (10, 8), (60, 58), (5, 5), (40, 40), (9, 30), (33, 54)]:
    print(f"m={m:2d} n={n:2d} m-n={m - n:3d}: score {score[m, n].item():+.4f}")

# %% [markdown]
# ## 3. Naive PyTorch, and how many bytes it moves
#
# As in chapter 03, a `TorchDispatchMode` on the `meta` device lists every aten operator (forward and autograd's
# backward) and the bytes it reads and writes.

# %%
from minite.bytecount import CountBytes  # built in chapter 00; logs each aten op's bytes read and written

def naive_rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)              # upcast: read bf16, write fp32 (views for the halves)
    y1 = x1 * cos - x2 * sin                         # 3 ops, each writes a half-size fp32 tensor
    y2 = x1 * sin + x2 * cos                         # 3 more
    return torch.cat([y1, y2], dim=-1).to(x.dtype)   # cat (read + write), downcast (read + write)

B, H, T, D = 8, 32, 2048, 128
q = torch.empty(B, H, T, D, dtype=torch.bfloat16, device="meta", requires_grad=True)   # (B, H, T, D)
cos = torch.empty(T, D // 2, device="meta")
sin = torch.empty(T, D // 2, device="meta")
with CountBytes() as fwd:
    y = naive_rope(q, cos, sin)
with CountBytes() as bwd:
    y.backward(torch.empty_like(y))
n = q.numel()
for name, cb in (("forward", fwd), ("backward", bwd)):
    print(f"{name}: {len(cb.ops)} aten ops, {cb.total() / 2**20:.0f} MiB = {cb.total() / n:.1f} bytes per element")
    print("   ", ", ".join(op for op, r, w in cb.ops if r + w > T * D * 4))
print(f"fused kernel: 4 bytes per element forward, 4 backward (+ {2 * T * D // 2 * 4 / 2**20:.1f} MiB of cos/sin)")
naive_mib = [fwd.total() / 2**20, bwd.total() / 2**20]
fused_mib = [(4 * n + 2 * T * D // 2 * 4) / 2**20] * 2

# %% [markdown]
# ## 4. The fused kernel
#
# `minite/kernels/rope.py` launches one program per **(b, t)**, that is, per token:
#
# * it loads row $t$ of cos and sin **once** (D/2 values each) and reuses them for all H heads;
# * it loads the two halves of all heads as (BLOCK_H, BLOCK_HALF) tiles, does the complex multiply written out in
#   reals, and stores both halves, rounding once from fp32;
# * the tensor's **strides** are kernel arguments, so (B, H, T, D) (`layout="bhtd"`, SDPA's layout) and (B, T, H, D)
#   (`layout="bthd"`, what a `qkv` projection produces before the transpose) are one code path, and a
#   non-contiguous view such as `qkv.view(B, T, 3, H, D)[:, :, 0]` is read in place, without a copy;
# * `SIGN` is a constexpr: `+1` forward, `-1` backward (the inverse rotation).
#
# One launch per tensor (q, then k). Liger-Kernel fuses q and k into one launch (the program also loops over k's
# KVH heads): same bytes, one launch fewer. Offsets are handled by the caller's slice of the cache: the kernel reads
# row $t$ of whatever (T, D/2) cos/sin it is given.

# %%
from minite.kernels import rope as R
print(inspect.getsource(R._rope_kernel.fn))

# %% [markdown]
# ## 5. Checks: kernel vs reference, both layouts, forward and backward
#
# `check_op` compares the output and the input gradient (the backward kernel: the same kernel with `SIGN = -1`).
# D = 6 has an odd D/2 = 3 and H = 3 is not a power of two: the masks are exercised.

# %% tags=["nbval-check-output"]
from minite.ops import rope
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for (B, H, T, D) in ((1, 3, 5, 6), (2, 4, 8, 16)):
        cos, sin = rope_cos_sin(T, D, offset=2)
        x = torch.randn(B, H, T, D).to(dtype)                                # (B, H, T, D)
        assert check_op("rope bhtd", lambda x: rope(x, cos, sin, backend="triton"),
                        lambda x: rope_ref(x, cos, sin), x)
        xt = x.transpose(1, 2).contiguous()                                  # (B, T, H, D)
        assert check_op("rope bthd", lambda x: rope(x, cos, sin, layout="bthd", backend="triton"),
                        lambda x: rope_ref(x.transpose(1, 2), cos, sin).transpose(1, 2), xt)

# %% tags=["nbval-check-output"]
from minite.nn import RotaryEmbedding
x = torch.randn(2, 4, 12, 8)
cos, sin = rope_cos_sin(12, 8)
y = R.rope_fwd(x, cos, sin)
assert_close(R.rope_bwd(y, cos, sin), x, name="inverse")
print("PASS: backward kernel (sin negated) undoes the forward")
rot = RotaryEmbedding(8, 64, backend="triton")
full = rot(x)                                 # positions 0..11
step = rot(x[:, :, 9:10], offset=9)           # one decode step at position 9, as the KV cache will call it
assert_close(step, full[:, :, 9:10], name="offset")
print("PASS: a decode step at offset 9 equals row 9 of the full sequence")
qkv = torch.randn(2, 12, 3 * 4 * 8)                                # (B, T, 3*H*D) out of a projection
q = qkv.view(2, 12, 3, 4, 8)[:, :, 0].transpose(1, 2)              # (B, H, T, D) strided view
assert_close(rope(q, cos, sin, backend="triton"), rope_ref(q, cos, sin), name="strided")
print("PASS: strided q straight from the qkv projection (no copy)")

# %% [markdown]
# ## 6. Plots: the cache, the relative-distance decay, the bytes
#
# Left: the cos cache, fast pairs (small $i$) oscillate along positions, slow ones barely turn. Middle: for
# $q = k = \mathbf 1$ the score $\langle R_m q, R_n k\rangle = 2\sum_i \cos((m-n)\theta_i)$ decays (while
# oscillating) with distance, the long-term decay property of the RoFormer paper. Right: bytes moved for q of
# shape (8, 32, 2048, 128) in bf16.

# %%
cos, sin = rope_cos_sin(256, 64)
dist = torch.arange(0, 2048)
theta = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
decay = 2 * torch.cos(dist[:, None].double() * theta[None, :]).sum(-1)
fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
axes[0].imshow(cos.T, aspect="auto", cmap="RdBu")
axes[0].set_xlabel("position t")
axes[0].set_ylabel("pair i")
axes[0].set_title("cos(t * theta_i), D = 64")
axes[1].plot(dist, decay)
axes[1].set_xscale("symlog")
axes[1].set_xlabel("m - n")
axes[1].set_title("score of q = k = 1 vs distance")
axes[2].bar([0, 1], naive_mib, width=0.35, label="eager PyTorch")
axes[2].bar([0.35, 1.35], fused_mib, width=0.35, label="fused kernel")
axes[2].set_xticks([0.175, 1.175], ["forward", "backward"])
axes[2].set_ylabel("MiB moved")
axes[2].set_title("RoPE on q (8, 32, 2048, 128) bf16")
axes[2].set_ylim(0, 1.35 * max(naive_mib))
axes[2].legend(loc="upper center", ncol=2, fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 7. GPU benchmark (runs only when a CUDA device is present)
#
# `benchmarks/bench_rope.py` is the full version (both layouts, forward and forward+backward, vs eager and
# `torch.compile`, Liger-Kernel when installed, JSON in `benchmarks/results/`). A short version:

# %%
if torch.cuda.is_available():
    from triton.testing import do_bench
    B, H, T = 8, 32, 2048
    for D in (64, 128):
        x = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope_cos_sin(T, D, device="cuda")
        ms_fused = do_bench(lambda: rope(x, cos, sin, backend="triton"))
        ms_eager = do_bench(lambda: naive_rope(x, cos, sin))
        gbs = 2 * x.numel() * x.element_size() / (ms_fused * 1e-3) / 1e9
        print(f"D={D}: fused {ms_fused * 1e3:.0f} us ({gbs:.0f} GB/s, {gbs / 3350:.0%} of H100 peak), "
              f"eager {ms_eager * 1e3:.0f} us")
else:
    print("No CUDA device here: the kernel above ran on the Triton CPU interpreter (correct, not fast).")

# %% [markdown]
# ## 8. Where it runs in the GPT
#
# Every block of `minite/models/gpt.py` holds a `CausalSelfAttention` (`minite/layers/attention.py`) which projects
# q, k, v with one matmul, views them as (B, H, T, D) (strided views, no copy: the kernel reads them in place),
# rotates q and k (never v) with the first T rows of its cos/sin tables, then calls attention. The tables are
# non-persistent buffers: rebuilt from (head_dim, max_seq_len, base), never saved in a checkpoint, and they follow
# the model to its device. The KV-cache chapter decodes one token at a time and uses the rows at `offset` = the
# number of tokens already cached (`RotaryEmbedding.forward(x, offset)` does that slicing).

# %%
import pathlib, re, minite
for rel in ("models/gpt.py", "layers/attention.py"):
    path = pathlib.Path(minite.__file__).parent / rel
    lines = path.read_text().splitlines() if path.exists() else []
    calls = re.compile(r"\b(rope|rope_cos_sin|RotaryEmbedding)\(")
    hits = [f"{rel}:{i}: {ln.strip()}" for i, ln in enumerate(lines, 1) if calls.search(ln)]
    print("\n".join(hits or [f"minite/{rel}: (no direct RoPE call)"]))
print(RotaryEmbedding(64, 1024), "state_dict keys:", list(RotaryEmbedding(64, 1024).state_dict()))
