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
# # 00 — Triton from zero: exercises
#
# Four graded tasks, four kernels the lesson did **not** write. In each task cell, replace the lines
#
# ```python
#     ### BEGIN YOUR CODE
#     raise NotImplementedError()
#     ### END YOUR CODE
# ```
#
# with your code (keep the two marker lines), run the cell, then run the check cell right after it. The check
# cells are graded: `python -m minite.grading grade exercises/00_triton_from_zero_exercise.ipynb` reruns the
# notebook with pristine check cells and prints `score: k/4`. Without a GPU, kernels run on the Triton interpreter, so
# `print(...)` and `breakpoint()` work inside them (lesson section 9). Use GPU-legal code: no Python control flow
# on tensor values, `tl.constexpr` block sizes, masks on every ragged edge, fp32 arithmetic after each load.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
from minite._triton import triton, tl
from minite.testing import check_op
from minite.kernels.softmax import softmax_ref
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %% [markdown]
# ## Task 1: a tiled 2-D transpose (whole kernel)
#
# Write `transpose_kernel` so that `Y = X.T` for an `(M, N)` input `X` and an `(N, M)` output `Y`, with any
# strides (`X` may be a non-contiguous view). The launch is a **2-D grid**: the program with
# `tl.program_id(0) = i`, `tl.program_id(1) = j` moves the `(BLOCK_M, BLOCK_N)` tile of `X` whose top-left element
# is `X[i * BLOCK_M, j * BLOCK_N]`. Build the 2-D offsets by broadcasting a column against a row, mask both
# ragged edges, and store the tile transposed (`tl.trans`, or transposed pointer arithmetic).

# %% minite={"task": "transpose_kernel"}
@triton.jit
def transpose_kernel(X_ptr, Y_ptr, M, N, stride_xm, stride_xn, stride_ym, stride_yn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # (BLOCK_M,) rows of X
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # (BLOCK_N,) cols of X
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)                  # (BLOCK_M, BLOCK_N)
    tile = tl.load(X_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
    # Y[n, m] = X[m, n]: same tile, pointers with the roles of the two strides of Y swapped
    tl.store(Y_ptr + offs_n[None, :] * stride_ym + offs_m[:, None] * stride_yn,
             tile, mask=mask)
    ### END SOLUTION


def transpose(x, BLOCK_M=16, BLOCK_N=32):
    M, N = x.shape
    y = torch.empty(N, M, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    transpose_kernel[grid](x, y, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return y


# %% minite={"check": "transpose_kernel"} tags=["nbval-check-output"]
# CHECK: transpose_kernel
g = torch.Generator().manual_seed(0)
for (M, N), dtype in [((1, 1), torch.float32), ((16, 32), torch.float32), ((37, 50), torch.float32),
                      ((20, 70), torch.float16)]:
    x = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    assert torch.equal(transpose(x), x.t()), f"transpose of {(M, N)} {dtype} is wrong"
    assert torch.equal(transpose(x, BLOCK_M=32, BLOCK_N=16), x.t()), f"transpose of {(M, N)} with 32x16 tiles"
base = torch.randn(40, 60, generator=g).to(DEVICE)
for view in (base[3:30:2, 5:50], base.t()[7:40, :33]):                  # strided views: no .contiguous() allowed
    assert torch.equal(transpose(view), view.t()), f"strided view {tuple(view.shape)} strides {view.stride()}"
print("PASS: transpose_kernel")


# %% [markdown]
# ## Task 2: log-softmax forward (whole kernel)
#
# Cross-entropy (chapter 06) needs $\log \operatorname{softmax}(x)$, not the softmax. Write a kernel that writes
# `log_softmax` of each row, one program per row, the whole row in one block (`BLOCK_SIZE >= n_cols`), rows at
# `X_ptr + row * X_row_stride` and `Y_ptr + row * Y_row_stride`, computed in fp32 and stored in `Y`'s type.
# Work out the formula yourself; it must hold where `log(softmax(x))` fails: rows of values $\pm 10^4$, whose
# smallest probabilities underflow to 0 in fp32 but whose log-probabilities are finite. A $-\infty$ entry gives
# $-\infty$ (and no NaN anywhere else in its row).

# %% minite={"task": "log_softmax_kernel"}
@triton.jit
def log_softmax_kernel(X_ptr, Y_ptr, X_row_stride, Y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    r = tl.program_id(0).to(tl.int64)
    X_ptr += r * X_row_stride
    Y_ptr += r * Y_row_stride
    j = tl.arange(0, BLOCK_SIZE)
    inside = j < n_cols
    v = tl.load(X_ptr + j, mask=inside, other=-float("inf")).to(tl.float32)
    shifted = v - tl.max(v, axis=0)                            # <= 0, the max lane is 0
    log_z = tl.log(tl.sum(tl.exp(shifted), axis=0))            # log of a sum in [1, n_cols]: never log(0)
    tl.store(Y_ptr + j, (shifted - log_z).to(Y_ptr.dtype.element_ty), mask=inside)
    ### END SOLUTION


def log_softmax(x):
    N, C = x.shape
    y = torch.empty(N, C, device=x.device, dtype=x.dtype)
    log_softmax_kernel[(N,)](x, y, x.stride(0), y.stride(0), C, BLOCK_SIZE=triton.next_power_of_2(C))
    return y


# %% minite={"check": "log_softmax_kernel"} tags=["nbval-check-output"]
# CHECK: log_softmax_kernel
def log_softmax_ref(x):
    return torch.log_softmax(x.float(), dim=-1).to(x.dtype)


g = torch.Generator().manual_seed(0)
for (N, C), dtype in [((1, 1), torch.float32), ((7, 33), torch.float32), ((5, 1000), torch.float16),
                      ((4, 100), torch.bfloat16)]:
    x = (3 * torch.randn(N, C, generator=g)).to(dtype).to(DEVICE)
    assert check_op("log_softmax", log_softmax, log_softmax_ref, x, grad=False)
    wide = torch.nn.functional.pad(x, (0, 5))                          # (N, C + 5): a view with row stride C + 5
    assert check_op("log_softmax, row stride C+5", lambda t: log_softmax(wide[:, :C]), log_softmax_ref, x, grad=False)
x = (1e4 * torch.randn(3, 50, generator=g)).to(DEVICE)                 # softmax underflows to 0 here
x[:, :5] = float("-inf")
y = log_softmax(x)
assert torch.isfinite(y[:, 5:]).all(), "log-probabilities of finite inputs must be finite (no log(0))"
assert (y[:, :5] == -float("inf")).all() and not y.isnan().any(), "-inf inputs give -inf, and no NaN anywhere"
assert check_op("log_softmax, 1e4 and -inf", log_softmax, log_softmax_ref, x, grad=False)
print("PASS: log_softmax_kernel")


# %% [markdown]
# ## Task 3: online softmax for long rows (whole kernel)
#
# Rows are longer than one block: walk each row in blocks of `BLOCK_SIZE` columns with the **online**
# recurrence of lesson section 8: one sweep that keeps the running max `m` and the running sum `d` of
# $e^{x - m}$, then one sweep that writes $y$. So that the check can see the recurrence at work, after
# processing block `b` of row `row` store the running statistics **as they are at that moment**:
# `Stats_ptr + (row * n_blocks + b) * 2` ← `m`, and `+ 1` ← `d` (fp32, `n_blocks = cdiv(n_cols, BLOCK_SIZE)`).
# A kernel that first finds the max of the whole row and then sums cannot produce these, and fails.
#
# Corner cases the check feeds you: rows whose first blocks are entirely $-\infty$ (while they are, `m` is
# $-\infty$ and `d` is 0, and nothing may become NaN), and rows whose max rises in every block.

# %% minite={"task": "online_softmax_kernel"}
@triton.jit
def online_softmax_kernel(X_ptr, Y_ptr, Stats_ptr, row_stride, n_cols, n_blocks, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    X_ptr += row * row_stride
    Y_ptr += row * row_stride
    cols = tl.arange(0, BLOCK_SIZE)
    m = tl.full([], -float("inf"), tl.float32)
    d = tl.full([], 0.0, tl.float32)
    for b in range(0, n_blocks):
        start = b * BLOCK_SIZE
        mask = start + cols < n_cols
        x = tl.load(X_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)      # all -inf so far: any finite shift is exact
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
        tl.store(Stats_ptr + (row * n_blocks + b) * 2, m)
        tl.store(Stats_ptr + (row * n_blocks + b) * 2 + 1, d)
    for b in range(0, n_blocks):
        start = b * BLOCK_SIZE
        mask = start + cols < n_cols
        x = tl.load(X_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(Y_ptr + start + cols, (tl.exp(x - m) / d).to(Y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


def online_softmax(x, BLOCK_SIZE=16):
    """Softmax of a contiguous (N, C) tensor; returns (y, stats of shape (N, n_blocks, 2))."""
    N, C = x.shape
    n_blocks = triton.cdiv(C, BLOCK_SIZE)
    y = torch.empty_like(x)
    stats = torch.full((N, n_blocks, 2), float("nan"), device=x.device)
    online_softmax_kernel[(N,)](x, y, stats, x.stride(0), C, n_blocks, BLOCK_SIZE=BLOCK_SIZE)
    return y, stats


# %% minite={"check": "online_softmax_kernel"} tags=["nbval-check-output"]
# CHECK: online_softmax_kernel
def running_stats(x, block):
    """(N, n_blocks, 2): the max and the sum of exp(x - max) of the first b + 1 blocks of each row."""
    out = []
    for end in range(block, x.shape[1] + block, block):
        pre = x[:, :end].double()
        m = pre.amax(-1)
        safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        out.append(torch.stack([m, torch.exp(pre - safe[:, None]).sum(-1)], -1))
    return torch.stack(out, 1).float()


g = torch.Generator().manual_seed(0)
for (N, C), dtype, block in [((6, 70), torch.float32, 16), ((3, 64), torch.float16, 16),
                             ((3, 100), torch.bfloat16, 32)]:
    x = 4 * torch.randn(N, C, generator=g)
    x[1, :40] = float("-inf")                                         # its first blocks are all -inf
    x[2] = torch.linspace(-3, 30, C)                                  # the max rises in every block
    x = x.to(dtype).to(DEVICE)
    y, stats = online_softmax(x, BLOCK_SIZE=block)
    assert check_op(f"online softmax, {triton.cdiv(C, block)} blocks per row", lambda t: online_softmax(t, block)[0],
                    softmax_ref, x, grad=False)
    want = running_stats(x.float().cpu(), block)
    got = stats.cpu()
    assert torch.equal(got[..., 0], want[..., 0]), "running max after each block is wrong (is the kernel online?)"
    assert torch.allclose(got[..., 1], want[..., 1], rtol=1e-4), \
        "running sum after each block is wrong: it must be the sum of exp(x - running max) over the blocks seen"
print("PASS: online_softmax_kernel")


# %% [markdown]
# ## Task 4: a grouped-order matmul with a fused bias + ReLU epilogue (whole kernel)
#
# Write `matmul_bias_relu_kernel`: $C = \operatorname{relu}(A B + \text{bias})$ for $A$ `(M, K)`, $B$ `(K, N)`,
# `bias` `(N,)` added to every row, any strides, one program per `(BLOCK_M, BLOCK_N)` tile of $C$ on a 1-D grid,
# an fp32 accumulator, and the bias and ReLU applied in registers before the single store (the **epilogue**: no
# second pass over $C$).
#
# The tiles must be visited in the **grouped order** of lesson section 10: tile rows are cut into bands of
# `GROUP_M` (the last band may be shorter); the band holding tile row 0 goes first, and inside a band the tiles go
# column by column, and inside a column top to bottom. Derive `pid_m`, `pid_n` from `tl.program_id(0)` yourself.
# So that the check can see your order, each program also stores its tile coordinates: `pid_m` at
# `Order_ptr + 2 * pid`, `pid_n` at `Order_ptr + 2 * pid + 1` (int32).

# %% minite={"task": "matmul_bias_relu_kernel"}
@triton.jit
def matmul_bias_relu_kernel(A_ptr, B_ptr, Bias_ptr, C_ptr, Order_ptr, M, N, K,
                            stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_band = GROUP_M * num_pid_n
    first_m = (pid // per_band) * GROUP_M
    band_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_band) % band_rows           # down the column inside the band ...
    pid_n = (pid % per_band) // band_rows                    # ... then the next column
    tl.store(Order_ptr + 2 * pid, pid_m)
    tl.store(Order_ptr + 2 * pid + 1, pid_n)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a_tile = tl.load(A_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_tile = tl.load(B_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a_tile, b_tile, input_precision="tf32")   # fp32 tiles: TF32 on a GPU (see the check)
    # epilogue, still in registers: bias broadcast over rows, then ReLU, then one store
    bias = tl.load(Bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = tl.maximum(acc + bias[None, :], 0.0)
    tl.store(C_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, out.to(C_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
    ### END SOLUTION


def matmul_bias_relu(a, b, bias, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2):
    """relu(a @ b + bias); returns (c, order) with order[pid] = (pid_m, pid_n) of the tile program pid made."""
    (M, K), (_, N) = a.shape, b.shape
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    n_tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    order = torch.full((n_tiles, 2), -1, dtype=torch.int32, device=a.device)
    matmul_bias_relu_kernel[(n_tiles,)](a, b, bias, c, order, M, N, K, a.stride(0), a.stride(1), b.stride(0),
                                        b.stride(1), c.stride(0), c.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                        BLOCK_K=BLOCK_K, GROUP_M=GROUP_M)
    return c, order


# %% minite={"check": "matmul_bias_relu_kernel"} tags=["nbval-check-output"]
# CHECK: matmul_bias_relu_kernel
def matmul_bias_relu_ref(a, b, bias):
    return torch.relu(a.float() @ b.float() + bias.float()).to(a.dtype)


def grouped_order(num_m, num_n, group):
    """The spec, as a sort: band of the tile row first, then the column, then the row."""
    tiles = [(i, j) for i in range(num_m) for j in range(num_n)]
    return sorted(tiles, key=lambda t: (t[0] // group, t[1], t[0]))


# a GPU runs tl.dot on fp32 tiles in TF32 (10-bit mantissa inputs): looser tolerances there
TF32 = dict(atol=5e-2, rtol=1e-2) if DEVICE == "cuda" else {}
g = torch.Generator().manual_seed(0)
cases = [((16, 16, 32), torch.float32, 1), ((70, 40, 50), torch.float32, 2), ((90, 33, 64), torch.float16, 4),
         ((50, 50, 45), torch.float32, 3)]
for (M, N, K), dtype, group in cases:
    a = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)                 # B = w.t(): a strided operand
    bias = torch.randn(N, generator=g).to(dtype).to(DEVICE)
    c, order = matmul_bias_relu(a, w.t(), bias, GROUP_M=group)
    assert check_op(f"relu(a @ b + bias) {M}x{K}x{N}", lambda *t: matmul_bias_relu(*t, GROUP_M=group)[0],
                    matmul_bias_relu_ref, a, w.t(), bias, grad=False, **(TF32 if dtype == torch.float32 else {}))
    want = grouped_order(triton.cdiv(M, 16), triton.cdiv(N, 16), group)
    got = [tuple(p) for p in order.cpu().tolist()]
    assert got == want, f"tile order for {M}x{N}, GROUP_M={group}: got {got[:6]}..., want {want[:6]}..."
print("PASS: matmul_bias_relu_kernel")
