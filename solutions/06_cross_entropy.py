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
# # 06 — Cross-entropy: exercises
#
# Three graded tasks: the online-logsumexp loss kernel, the gradient $\mathrm{softmax} - \mathrm{onehot}$, and the
# chunk loop of the fused linear + cross-entropy. See `notebooks/06_cross_entropy.ipynb` for the derivations.
#
# $\ell_i = \mathrm{lse}(x_i) - x_{i,t_i}$, $\;\nabla_{x_i}\ell_i = \mathrm{softmax}(x_i) - \mathrm{onehot}(t_i)$.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect
import matplotlib.pyplot as plt
import torch.nn.functional as F
from minite._triton import triton, tl
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %%
from minite.kernels.cross_entropy import cross_entropy_ref, linear_cross_entropy_ref


# %% [markdown]
# ## Task 1 — the loss kernel with an online logsumexp
#
# One program per row. Loop over the row in blocks of `BLOCK_SIZE` (`for start in range(0, V, BLOCK_SIZE)`),
# keeping a running max `m` and a running sum `s` of $e^{x - m}$; masked lanes load `-inf`. Then
# $\mathrm{lse} = m + \log s$, load the target logit with one scalar load, and store `lse - x_t` into `Loss_ptr`
# — or `0.0` when the target is `ignore_index`. Upcast every load to `tl.float32` at once.

# %% minite={"task": "online logsumexp loss kernel"}
@triton.jit
def my_ce_fwd_kernel(X_ptr, X_row_stride, T_ptr, Loss_ptr, V, ignore_index, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    X_ptr += row * X_row_stride
    t = tl.load(T_ptr + row)
    cols = tl.arange(0, BLOCK_SIZE)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_SIZE):
        mask = start + cols < V
        x = tl.load(X_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = t != ignore_index
    x_t = tl.load(X_ptr + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(Loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
    ### END SOLUTION


def my_ce_rows(logits, target, ignore_index=-100, block=64):
    N, V = logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    my_ce_fwd_kernel[(N,)](logits, logits.stride(0), target, loss, V, ignore_index, BLOCK_SIZE=block)
    return loss


# %% minite={"check": "online logsumexp loss kernel"} tags=["nbval-check-output"]
# CHECK: online logsumexp loss kernel
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for V in (37, 300):  # one block, and five blocks of 64 with a ragged end
        x = (4 * torch.randn(6, V, generator=gen)).to(dtype).to(DEVICE)
        x[0, 5] = 60.0  # a large logit: the running max must rescale the sum
        t = torch.randint(0, V, (6,), generator=gen).to(DEVICE)
        t[2] = -100
        expected = cross_entropy_ref(x, t, reduction="none")
        assert_close(my_ce_rows(x, t), expected, name=f"row losses {dtype} V={V}", atol=1e-4, rtol=1e-4)
print("PASS: online logsumexp loss kernel")


# %% [markdown]
# ## Task 2 — the gradient: softmax minus one-hot
#
# Write `ce_grad(logits, target, ignore_index)` returning $\partial L/\partial\,\mathrm{logits}$ for the **mean**
# reduction, in fp32: $(\mathrm{softmax}(x) - \mathrm{onehot}(t)) / n_{valid}$ on valid rows, $0$ on rows whose
# target is `ignore_index`. No autograd.

# %% minite={"task": "gradient softmax - one_hot"}
def ce_grad(logits, target, ignore_index=-100):
    ### BEGIN SOLUTION
    valid = target != ignore_index
    p = torch.softmax(logits.float(), dim=-1)
    p[torch.arange(len(target))[valid], target[valid]] -= 1.0
    p[~valid] = 0.0
    return p / valid.sum().clamp(min=1)
    ### END SOLUTION


# %% minite={"check": "gradient softmax - one_hot"} tags=["nbval-check-output"]
# CHECK: gradient softmax - one_hot
gen = torch.Generator().manual_seed(1)
x = torch.randn(7, 23, generator=gen, requires_grad=True)
t = torch.randint(0, 23, (7,), generator=gen)
t[[1, 4]] = -100
F.cross_entropy(x, t).backward()
assert_close(ce_grad(x.detach(), t), x.grad, name="ce_grad")
print("PASS: gradient softmax - one_hot")


# %% [markdown]
# ## Task 3 — the chunk loop of the fused linear + cross-entropy
#
# `chunk_loss_and_grad(logits, target, n_valid)` (given) returns the summed loss of a chunk of rows and
# $\partial L/\partial\,\mathrm{logits}$ for the mean over all `n_valid` rows. Write the loop over row chunks:
# for each chunk compute `logits = x_c @ w.T` (`(n, V)`), call the helper, add the loss, write
# $dx_c = \mathrm{dlogits}\,W$ and accumulate $dW \mathrel{+}= \mathrm{dlogits}^\top x_c$. Return `(loss, dx, dw)`.

# %% minite={"task": "fused linear-CE chunk loop"}
def chunk_loss_and_grad(logits, target, n_valid):
    """Sum of the chunk's row losses and dlogits of the mean loss, (n, V) fp32."""
    z = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(z, target, reduction="sum") / n_valid
    (dz,) = torch.autograd.grad(loss, z)
    return loss.detach() * n_valid, dz


def my_linear_ce(x, w, target, chunk_size=4):
    N, C = x.shape
    n_valid = (target != -100).sum()
    loss = torch.zeros((), dtype=torch.float32)
    dx = torch.empty(N, C, dtype=torch.float32)
    dw = torch.zeros(w.shape, dtype=torch.float32)
    ### BEGIN SOLUTION
    for s in range(0, N, chunk_size):
        xc, tc = x[s:s + chunk_size].float(), target[s:s + chunk_size]
        logits = xc @ w.float().t()
        loss_c, dlogits = chunk_loss_and_grad(logits, tc, n_valid)
        loss += loss_c
        dx[s:s + chunk_size] = dlogits @ w.float()
        dw += dlogits.t() @ xc
    ### END SOLUTION
    return loss / n_valid, dx, dw


# %% minite={"check": "fused linear-CE chunk loop"} tags=["nbval-check-output"]
# CHECK: fused linear-CE chunk loop
gen = torch.Generator().manual_seed(2)
x = torch.randn(11, 8, generator=gen, requires_grad=True)
w = torch.randn(29, 8, generator=gen, requires_grad=True)
t = torch.randint(0, 29, (11,), generator=gen)
t[5] = -100
linear_cross_entropy_ref(x, w, t).backward()
loss, dx, dw = my_linear_ce(x.detach(), w.detach(), t, chunk_size=4)
assert_close(loss, linear_cross_entropy_ref(x, w, t).detach(), name="loss")
assert_close(dx, x.grad, name="dx")
assert_close(dw, w.grad, name="dW")
print("PASS: fused linear-CE chunk loop")
