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
# # 09 — LoRA: exercises
#
# Four graded tasks. Write your code between `### BEGIN YOUR CODE` and `### END YOUR CODE` (replace the
# `raise NotImplementedError()`), run the cell, then the `# CHECK` cell after it. The lesson
# (`notebooks/09_lora.ipynb`) built the fused forward; here you derive and write what it left out.
# Reference: Hu et al., *LoRA* (2021), [arXiv:2106.09685](https://arxiv.org/abs/2106.09685).
#
# Notation: $x$ $(N, K)$, frozen $W$ $(O, K)$, $A$ $(r, K)$, $B$ $(O, r)$, $s = \alpha/r$,
# $y = xW^\top + s\,(xA^\top)B^\top$, and $dy = \partial L/\partial y$ $(N, O)$.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %%
from minite.kernels.lora import lora_linear_ref
from minite.layers.lora import LoRAConfig, LoRALinear, merge_lora


def operands(N, K, O, r, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(sc * torch.randn(*sh, generator=g)).to(dtype).to(DEVICE)
            for sh, sc in (((N, K), 1.0), ((O, K), 0.2), ((r, K), 0.2), ((O, r), 0.2), ((N, O), 1.0))]


# %% [markdown]
# ## Task 1 — the backward, by hand
#
# Write `lora_grads(x, W, A, B, dy, s)` returning `(dx, dA, dB)`: the gradients of $L$ with respect to $x$, $A$ and
# $B$ given $dy$, with matrix products only (no autograd). $W$ is frozen: no $dW$. Derive them first: introduce
# $g = xA^\top$ and apply the rule for $Y = XM^\top$ twice. Compute in fp32 and return each gradient in the dtype of
# its input.

# %% minite={"task": "lora_grads"}
def lora_grads(x, W, A, B, dy, s):
    ### BEGIN SOLUTION
    x32, W32, A32, B32, dy32 = (t.float() for t in (x, W, A, B, dy))
    g = x32 @ A32.t()                      # (N, r)
    dg = s * dy32 @ B32                    # (N, r)
    dx = dy32 @ W32 + dg @ A32             # (N, K)
    dA = dg.t() @ x32                      # (r, K)
    dB = s * dy32.t() @ g                  # (O, r)
    return dx.to(x.dtype), dA.to(A.dtype), dB.to(B.dtype)
    ### END SOLUTION


# %% minite={"check": "lora_grads"} tags=["nbval-check-output"]
# CHECK: lora_grads
ok = True
for r, (N, K, O) in ((1, (7, 13, 9)), (8, (33, 40, 24))):
    x, W, A, B, dy = operands(N, K, O, r, torch.float64, seed=r)
    xs, As, Bs = (t.clone().requires_grad_(True) for t in (x, A, B))
    lora_linear_ref(xs, W, As, Bs, 3.0).backward(dy)
    got = lora_grads(x, W, A, B, dy, 3.0)
    for name, a, b in zip(("dx", "dA", "dB"), got, (xs.grad, As.grad, Bs.grad)):
        assert_close(a.double(), b, name=name, atol=1e-5, rtol=1e-5)  # fp32 compute vs fp64 autograd
x, W, A, B, dy = operands(5, 6, 7, 2, torch.float16)
assert [t.dtype for t in lora_grads(x, W, A, B, dy, 1.0)] == [torch.float16] * 3
print("PASS: lora_grads")

# %% [markdown]
# ## Task 2 — the $dA$ / $dB$ kernel (a whole Triton kernel from a spec)
#
# The backward's first kernel (minite's) has already produced, in fp32, $g = xA^\top$ `(N, R)` and
# $dg = \partial L/\partial g$ `(N, R)` (the scale $s$ is inside $dg$). Write **one** kernel that computes both small
# gradients of Task 1 from `X (N, K)`, `DY (N, O)`, `G` and `DG`:
# * `DA (R, K)` and `DB (O, R)`, stored in their tensors' dtype; accumulate in fp32.
# * Grid `(cdiv(K, BLOCK_N) + cdiv(O, BLOCK_N),)`: program `p < cdiv(K, BLOCK_N)` owns the columns
#   `p*BLOCK_N ...` of `DA`; program `p` beyond that owns rows `(p - cdiv(K, BLOCK_N))*BLOCK_N ...` of `DB`. Each
#   loops over the `N` rows in steps of `BLOCK_M`.
# * All tensors contiguous. `R` may be 1: `BLOCK_R >= 16` is the padded rank, and every `tl.dot` dimension must be
#   ≥ 16 (a GPU's rule). Use masks with `other=0.0` on every load; upcast every tile to fp32 before `tl.dot`, and
#   pass `input_precision="ieee"` (exact fp32 products: a GPU's default for fp32 tiles is TF32, ~1e-3 relative error).

# %% minite={"task": "lora_dadb_kernel"}
@triton.jit
def lora_dadb_kernel(X, DY, G, DG, DA, DB, N, K, O, R, s,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    ### BEGIN SOLUTION
    pid = tl.program_id(0).to(tl.int64)
    n_a = tl.cdiv(K, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    if pid < n_a:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        da = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for m0 in range(0, N, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            dg_t = tl.load(DG + rows[None, :] * R + rr[:, None], mask=(rr[:, None] < R) & (rows[None, :] < N),
                           other=0.0)
            x = tl.load(X + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                        other=0.0).to(tl.float32)
            da = tl.dot(dg_t, x, da, input_precision="ieee")
        tl.store(DA + rr[:, None] * K + cols[None, :], da.to(DA.dtype.element_ty),
                 mask=(rr[:, None] < R) & (cols[None, :] < K))
    else:
        outs = (pid - n_a) * BLOCK_N + tl.arange(0, BLOCK_N)
        db = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for m0 in range(0, N, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            dy_t = tl.load(DY + rows[None, :] * O + outs[:, None], mask=(outs[:, None] < O) & (rows[None, :] < N),
                           other=0.0).to(tl.float32)
            gg = tl.load(G + rows[:, None] * R + rr[None, :], mask=(rows[:, None] < N) & (rr[None, :] < R),
                         other=0.0)
            db = tl.dot(dy_t, gg, db, input_precision="ieee")
        tl.store(DB + outs[:, None] * R + rr[None, :], (s * db).to(DB.dtype.element_ty),
                 mask=(outs[:, None] < O) & (rr[None, :] < R))
    ### END SOLUTION


def my_dadb(x, dy, g, dg, A, B, s, BLOCK_M=16, BLOCK_N=16):
    (N, K), (O, R) = x.shape, B.shape
    dA, dB = torch.empty_like(A), torch.empty_like(B)
    grid = (triton.cdiv(K, BLOCK_N) + triton.cdiv(O, BLOCK_N),)
    lora_dadb_kernel[grid](x, dy, g, dg, dA, dB, N, K, O, R, s, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                           BLOCK_R=max(16, triton.next_power_of_2(R)))
    return dA, dB


# %% minite={"check": "lora_dadb_kernel"} tags=["nbval-check-output"]
# CHECK: lora_dadb_kernel
ok = True
for dtype in (torch.float32, torch.float16):
    for r in (1, 4, 16, 64):
        x, W, A, B, dy = operands(37, 45, 51, r, dtype, seed=r)
        s = 16 / r
        g = x.float() @ A.float().t()
        dg = s * dy.float() @ B.float()
        exp_dA, exp_dB = (dg.t() @ x.float()).to(dtype), (s * dy.float().t() @ g).to(dtype)
        dA, dB = my_dadb(x, dy, g, dg, A, B, s)
        for name, a, e in (("dA", dA, exp_dA), ("dB", dB, exp_dB)):
            try:  # sums of 37 products: the tolerance scales with the result's size
                assert_close(a, e, name=f"{name} r={r} {dtype}", atol=2e-3 * e.abs().max().item() + 1e-5)
            except AssertionError as err:
                print("FAIL:", err)
                ok = False
assert ok
print("PASS: lora_dadb_kernel")

# %% [markdown]
# ## Task 3 — a merge kernel (a whole Triton kernel from a spec)
#
# Write `lora_merge_kernel` computing `OUT = W + s · B @ A` for `W (O, K)`, `A (R, K)`, `B (O, R)`, `OUT (O, K)`, all
# contiguous and of one dtype (fp32 or fp16): the merge `merge_lora` does, as one tiled kernel.
# * Grid `(cdiv(O, BLOCK_O), cdiv(K, BLOCK_K))`, one `(BLOCK_O, BLOCK_K)` tile of `OUT` per program.
# * Compute in fp32, round once to `OUT`'s dtype (adding in fp16 first would round twice). Exact fp32 products:
#   `tl.dot(..., input_precision="ieee")` (a GPU's default for fp32 tiles, TF32, fails the fp32 check).
# * `BLOCK_R >= 16` is the padded rank: every `tl.dot` dimension ≥ 16, masks with `other=0.0`.

# %% minite={"task": "lora_merge_kernel"}
@triton.jit
def lora_merge_kernel(W, A, B, OUT, O, K, R, s,
                      BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    ### BEGIN SOLUTION
    po = tl.program_id(0).to(tl.int64)
    pk = tl.program_id(1).to(tl.int64)
    ro = po * BLOCK_O + tl.arange(0, BLOCK_O)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    b = tl.load(B + ro[:, None] * R + rr[None, :], mask=(ro[:, None] < O) & (rr[None, :] < R), other=0.0)
    a = tl.load(A + rr[:, None] * K + rk[None, :], mask=(rr[:, None] < R) & (rk[None, :] < K), other=0.0)
    ba = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")  # (BLOCK_O, BLOCK_K)
    mask = (ro[:, None] < O) & (rk[None, :] < K)
    w = tl.load(W + ro[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + ro[:, None] * K + rk[None, :], (w + s * ba).to(OUT.dtype.element_ty), mask=mask)
    ### END SOLUTION


def my_merge(W, A, B, s, BLOCK_O=16, BLOCK_K=16):
    (O, K), R = W.shape, A.shape[0]
    out = torch.empty_like(W)
    lora_merge_kernel[(triton.cdiv(O, BLOCK_O), triton.cdiv(K, BLOCK_K))](
        W, A, B, out, O, K, R, s, BLOCK_O=BLOCK_O, BLOCK_K=BLOCK_K, BLOCK_R=max(16, triton.next_power_of_2(R)))
    return out


# %% minite={"check": "lora_merge_kernel"} tags=["nbval-check-output"]
# CHECK: lora_merge_kernel
ok = True
for dtype in (torch.float32, torch.float16):
    for r in (1, 4, 16, 64):
        _, W, A, B, _ = operands(1, 45, 51, r, dtype, seed=r)
        ok &= check_op(f"merge r={r}", lambda W, A, B: my_merge(W, A, B, 16 / r),
                       lambda W, A, B: (W.float() + (16 / r) * B.float() @ A.float()).to(dtype), W, A, B, grad=False)
# the same weight minite's merge_lora writes into a LoRALinear
lin = torch.nn.Linear(45, 51, bias=False)
layer = LoRALinear.from_linear(lin, LoRAConfig(r=4, alpha=8), backend="torch").to(DEVICE)
with torch.no_grad():
    layer.lora_B.copy_(torch.randn(51, 4, generator=torch.Generator().manual_seed(0)))
mine = my_merge(layer.weight.detach(), layer.lora_A.detach(), layer.lora_B.detach(), layer.scaling)
merge_lora(layer)
assert_close(mine, layer.weight.detach(), name="my_merge vs merge_lora")
assert ok
print("PASS: lora_merge_kernel")

# %% [markdown]
# ## Task 4 — extract a LoRA from a full fine-tune
#
# A full fine-tune gave you $\Delta W = W_{\text{ft}} - W$ $(O, K)$. Write `extract_lora(delta_w, r, alpha)` returning
# `(A, B)`, of shapes `(r, K)` and `(O, r)`, such that $\frac{\alpha}{r} B A$ is the **best** rank-$r$ approximation
# of $\Delta W$ in the Frobenius norm (the tool `mergekit-extract-lora` does this for large models). Work in fp32
# or better and return tensors of `delta_w`'s dtype.

# %% minite={"task": "extract_lora"}
def extract_lora(delta_w, r, alpha):
    ### BEGIN SOLUTION
    U, S, Vh = torch.linalg.svd(delta_w.double(), full_matrices=False)
    s = alpha / r
    root = S[:r].sqrt()
    B = U[:, :r] * root / s          # (O, r); the 1/s undoes the scale the layer applies
    A = root[:, None] * Vh[:r]       # (r, K)
    return A.to(delta_w.dtype), B.to(delta_w.dtype)
    ### END SOLUTION


# %% minite={"check": "extract_lora"} tags=["nbval-check-output"]
# CHECK: extract_lora
g = torch.Generator().manual_seed(0)
O, K = 40, 30
low = torch.randn(O, 5, generator=g, dtype=torch.float64) @ torch.randn(5, K, generator=g, dtype=torch.float64)
dW = low + 0.05 * torch.randn(O, K, generator=g, dtype=torch.float64)   # rank 5 plus a little noise
for r, alpha in ((5, 10.0), (2, 16.0)):
    A, B = extract_lora(dW, r, alpha)
    assert A.shape == (r, K) and B.shape == (O, r) and A.dtype == torch.float64
    err = torch.linalg.norm(dW - (alpha / r) * B @ A)
    best = torch.linalg.svdvals(dW)[r:].square().sum().sqrt()           # Eckart-Young: nothing does better
    assert abs(err - best) < 1e-9 * best, (r, float(err), float(best))
A, B = extract_lora(dW.float(), 5, 10.0)   # as a LoRALinear on top of W: W + the rank-5 truncation of dW
layer = LoRALinear.from_linear(torch.nn.Linear(K, O, bias=False), LoRAConfig(r=5, alpha=10.0), backend="torch")
U, S, Vh = torch.linalg.svd(dW, full_matrices=False)
with torch.no_grad():
    layer.lora_A.copy_(A), layer.lora_B.copy_(B)
    W = layer.weight.detach().clone()
    x = torch.randn(3, K, generator=g)
    assert_close(layer(x), x @ (W + ((U[:, :5] * S[:5]) @ Vh[:5]).float()).t(), name="LoRALinear(extracted)",
                 atol=1e-4)
assert extract_lora(dW.half(), 2, 4.0)[0].dtype == torch.float16
print("PASS: extract_lora")
