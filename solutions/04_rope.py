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
# # 04 — RoPE, the interleaved layout: exercises
#
# The lesson (`notebooks/04_rope.ipynb`) rotated the **halves** pairs $(x_i, x_{i+D/2})$ (GPT-NeoX, Hugging Face
# Llama). The RoFormer paper, GPT-J and Meta's original Llama checkpoints rotate **neighbours** instead: pair $i$ is
# $(x_{2i}, x_{2i+1})$, turned by the same angle $t\,\theta_i$, $\theta_i = \text{base}^{-2i/D}$. Here you write that
# layout's kernel and convert a checkpoint from one layout to the other.
#
# Three graded tasks. Write your code between `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the
# `raise NotImplementedError()` line), run the cell, then the `# CHECK` cell after it (do not edit check cells).
# Task 1 is a whole Triton kernel: only the signature and the spec are given.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
from minite.kernels.rope import rope_cos_sin, rope_ref
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %%
def randn(*shape, seed, dtype=torch.float32):
    """Seeded CPU draw, then cast and move to DEVICE (the same numbers on every machine)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def interleaved_ref(x, cos, sin):
    """The spec, with complex numbers: pair i = x[..., 2i] + j x[..., 2i+1], multiplied by cos + j sin of row t.
    x (B, H, T, D), cos/sin (T, D/2) -> x's shape and dtype (computed in fp64)."""
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())   # (B, H, T, D/2)
    y = torch.view_as_real(z * torch.complex(cos.double(), sin.double()))               # (B, H, T, D/2, 2)
    return y.reshape(x.shape).to(x.dtype)


# %% [markdown]
# ## Task 1 — the interleaved rotation kernel, forward and backward (whole kernel)
#
# Spec. The grid has one program per token, `pid = b * T + t`. Program `pid` rotates all `H` head vectors of token
# `(b, t)`: element `d` of head `h` is at `X_ptr + b * stride_b + h * stride_h + t * stride_t + d` (the last dim is
# contiguous); `Y_ptr` has the same strides. `HALF = D / 2`; pair `i` is `(x[2i], x[2i+1])`, rotated by the angle
# whose cos and sin are `Cos_ptr[t * HALF + i]` and `Sin_ptr[t * HALF + i]` (contiguous (T, HALF) fp32). `SIGN = +1`
# rotates by the angle, `SIGN = -1` by its negative (the given autograd Function uses it for the backward).
# `BLOCK_H` and `BLOCK_HALF` are powers of two ≥ `H` and `HALF`. Inputs are fp32, fp16 or bf16: compute in fp32,
# store in `Y`'s dtype. Load cos/sin once per program.

# %% minite={"task": "rope_interleaved_kernel"}
@triton.jit
def rope_interleaved_kernel(X_ptr, Y_ptr, Cos_ptr, Sin_ptr, T, H, stride_b, stride_h, stride_t,
                            HALF: tl.constexpr, SIGN: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_HALF: tl.constexpr):
    ### BEGIN SOLUTION
    tok = tl.program_id(0).to(tl.int64)
    base = (tok // T) * stride_b + (tok % T) * stride_t
    hh = tl.arange(0, BLOCK_H)[:, None]
    pair = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (hh < H) & (pair < HALF)
    c = tl.load(Cos_ptr + (tok % T) * HALF + pair, mask=pair < HALF, other=0.0)
    s = SIGN * tl.load(Sin_ptr + (tok % T) * HALF + pair, mask=pair < HALF, other=0.0)
    even = base + hh * stride_h + 2 * pair          # offsets of x[2i]; x[2i+1] is the next element
    a = tl.load(X_ptr + even, mask=ok, other=0.0).to(tl.float32)
    bb = tl.load(X_ptr + even + 1, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y_ptr + even, (a * c - bb * s).to(Y_ptr.dtype.element_ty), mask=ok)
    tl.store(Y_ptr + even + 1, (a * s + bb * c).to(Y_ptr.dtype.element_ty), mask=ok)
    ### END SOLUTION


def _launch(x, cos, sin, sign):
    """Given: x (B, H, T, D) -> rotated copy (contiguous)."""
    x = x.contiguous()
    B, H, T, D = x.shape
    y = torch.empty_like(x)
    rope_interleaved_kernel[(B * T,)](x, y, cos.contiguous(), sin.contiguous(), T, H,
                                      x.stride(0), x.stride(1), x.stride(2), HALF=D // 2, SIGN=sign,
                                      BLOCK_H=triton.next_power_of_2(H), BLOCK_HALF=triton.next_power_of_2(D // 2))
    return y


class InterleavedRoPE(torch.autograd.Function):
    """Given: forward = your kernel with SIGN=+1, backward = the same kernel with SIGN=-1."""
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, -1), None, None


# %% minite={"check": "rope_interleaved_kernel"} tags=["nbval-check-output"]
# CHECK: rope_interleaved_kernel
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for k, (B, H, T, D) in enumerate(((1, 3, 5, 6), (2, 2, 4, 16), (1, 5, 3, 10))):
        cos, sin = (c.to(DEVICE) for c in rope_cos_sin(T, D, offset=3 + k))
        x = randn(B, H, T, D, seed=10 + k, dtype=dtype)
        ok &= check_op("interleaved rope fwd+bwd", lambda x: InterleavedRoPE.apply(x, cos, sin),
                       lambda x: interleaved_ref(x, cos, sin), x)
assert ok
print("PASS: rope_interleaved_kernel")


# %% [markdown]
# ## Task 2 — the permutation between the two layouts
#
# Both layouts rotate the same kind of pairs by the same angles; only *which* head dims form pair $i$ differs. So
# there is a permutation `perm` of the D head dims that turns one into the other. Write `halves_permutation(D)`:
# a LongTensor `perm` of length D (a permutation of `0 .. D-1`) such that, for every x of shape (..., T, D),
#
# `rope_ref(x[..., perm], cos, sin) == interleaved_ref(x, cos, sin)[..., perm]`
#
# (halves RoPE applied to the permuted vector equals the permuted interleaved RoPE), and therefore attention
# scores $q\cdot k$ computed with interleaved RoPE on (q, k) equal those with halves RoPE on (q[perm], k[perm]).

# %% minite={"task": "halves_permutation"}
def halves_permutation(D):
    ### BEGIN SOLUTION
    return torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    ### END SOLUTION


# %% minite={"check": "halves_permutation"} tags=["nbval-check-output"]
# CHECK: halves_permutation
for k, D in enumerate((2, 8, 64)):
    perm = halves_permutation(D)
    assert perm.dtype == torch.int64 and sorted(perm.tolist()) == list(range(D)), "not a permutation of 0..D-1"
    perm = perm.to(DEVICE)
    cos, sin = (c.to(DEVICE) for c in rope_cos_sin(6, D))
    q, kk = randn(1, 1, 6, D, seed=20 + k, dtype=torch.float64), randn(1, 1, 6, D, seed=30 + k, dtype=torch.float64)
    assert_close(rope_ref(q[..., perm], cos, sin), interleaved_ref(q, cos, sin)[..., perm], name="rotated vectors")
    s_inter = interleaved_ref(q, cos, sin)[0, 0] @ interleaved_ref(kk, cos, sin)[0, 0].T
    s_halves = rope_ref(q[..., perm], cos, sin)[0, 0] @ rope_ref(kk[..., perm], cos, sin)[0, 0].T
    assert_close(s_halves, s_inter, name="attention scores")
print("PASS: halves_permutation")


# %% [markdown]
# ## Task 3 — convert a checkpoint's query projection
#
# A checkpoint trained with interleaved RoPE has a query projection `w_q` of shape `(n_heads * D, C)`: rows
# `h * D .. h * D + D - 1` produce head `h`. Write `to_halves_layout(w_q, n_heads)` returning the weight that, used
# in a model with **halves** RoPE, gives the same attention scores for every input (apply the same function to
# `w_k`). Do not modify `w_q` in place.

# %% minite={"task": "to_halves_layout"}
def to_halves_layout(w_q, n_heads):
    ### BEGIN SOLUTION
    D = w_q.shape[0] // n_heads
    order = halves_permutation(D).to(w_q.device)
    return w_q.view(n_heads, D, -1)[:, order].reshape(w_q.shape)
    ### END SOLUTION


# %% minite={"check": "to_halves_layout"} tags=["nbval-check-output"]
# CHECK: to_halves_layout
H, D, C, T = 3, 8, 5, 7
w_q, w_k = randn(H * D, C, seed=40, dtype=torch.float64), randn(H * D, C, seed=41, dtype=torch.float64)
x = randn(T, C, seed=42, dtype=torch.float64)
w_q0 = w_q.clone()
cos, sin = (c.to(DEVICE) for c in rope_cos_sin(T, D))
heads = lambda w: (x @ w.T).view(T, H, D).transpose(0, 1)[None]           # (1, H, T, D)
s_inter = interleaved_ref(heads(w_q), cos, sin) @ interleaved_ref(heads(w_k), cos, sin).transpose(-1, -2)
wq2, wk2 = to_halves_layout(w_q, H), to_halves_layout(w_k, H)
assert wq2.shape == w_q.shape and torch.equal(w_q, w_q0), "shape changed or w_q modified in place"
s_halves = rope_ref(heads(wq2), cos, sin) @ rope_ref(heads(wk2), cos, sin).transpose(-1, -2)
assert_close(s_halves, s_inter, name="scores (1, H, T, T)")
print("PASS: to_halves_layout")
