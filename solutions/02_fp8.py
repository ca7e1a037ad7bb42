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
# # 02 — FP8: graded exercises
#
# Three tasks on what the lesson did not write. In each task cell, replace
#
# ```python
#     ### BEGIN YOUR CODE
#     raise NotImplementedError()
#     ### END YOUR CODE
# ```
#
# with your code (keep the marker lines), run the cell, then run the check cell right after it. Grade with
# `python -m minite.grading grade exercises/02_fp8_exercise.ipynb`.
#
# 1. the **delayed-scaling update**: roll the amax history, compute the next scale, keep the old one when the amax
#    is 0 or not finite;
# 2. the **FP8 quantize kernel** (a whole kernel): per-tensor scale, saturate, encode with `encode_bits_tl`, and
#    the block's partial amax, in one pass;
# 3. a **block-scaled FP8 GEMM** (a whole kernel): one scale per 1 × 32 slice of the activation and per 32 × 32
#    block of the weight, applied at each promotion, the recipe DeepSeek-V3 trains with.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
from minite._triton import triton, tl
from minite.formats import DelayedScaling, quantize
from minite.testing import assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %% [markdown]
# ## Task 1 — delayed scaling
#
# `amax_history` is a 1-D fp32 tensor, newest first. One step: roll it by one (the oldest entry falls off the
# end), put this step's `amax` in slot 0, reduce it (`"max"`: the max over the history; `"most_recent"`: slot 0),
# and return `(new_history, new_scale)`: the scale that maps the reduced amax onto the format's largest value
# `fp8_max`, with `margin` powers of two of headroom (lesson section 4), except that the previous `scale` is kept
# where the reduced amax is 0 or not finite. Use tensor ops only (no `.item()`): on a GPU this runs every step
# without synchronising with the host.

# %% minite={"task": "delayed_scaling_update"}
def delayed_scaling_update(amax_history, scale, amax, *, fp8_max, margin=0, algo="max"):
    """One delayed-scaling step: returns (new amax history, new scale)."""
    ### BEGIN SOLUTION
    hist = torch.roll(amax_history, 1)
    hist[0] = amax
    amax_r = hist.max() if algo == "max" else hist[0]
    new_scale = fp8_max / amax_r / 2.0 ** margin
    ok = (amax_r > 0) & torch.isfinite(amax_r)
    return hist, torch.where(ok, new_scale, scale)
    ### END SOLUTION


# %% minite={"check": "delayed_scaling_update"} tags=["nbval-check-output"]
# CHECK: delayed_scaling_update
amaxes = [1.0, 2.0, 8.0, 4.0, 0.0, 1.0, float("inf"), 1.0, 1.0, 1.0, 0.5]
for algo, margin, f8 in (("max", 0, torch.float8_e4m3fn), ("most_recent", 1, torch.float8_e5m2)):
    r = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=margin)
    st = r.new_state(f8)
    hist, scale = torch.zeros(3), torch.ones(())
    for a in amaxes:
        r.update(st, torch.tensor(a))
        hist, scale = delayed_scaling_update(hist, scale, torch.tensor(a), fp8_max=st.fp8_max, margin=margin, algo=algo)
        assert torch.equal(hist, st.amax_history), f"history {hist.tolist()} != {st.amax_history.tolist()}"
        assert torch.allclose(scale, st.scale, rtol=1e-6), f"scale {scale.item()} != {st.scale.item()} (amax {a})"
    print(f"PASS: delayed_scaling_update [{algo}, margin {margin}]")
assert len(amaxes) == 11

# %% [markdown]
# ## Task 2 — the FP8 quantize kernel
#
# One program handles `BLOCK_SIZE` consecutive elements of the flattened input. It must
#
# 1. load its block (masked, `other=0.0`) and convert it to fp32 at once;
# 2. store the block's `max(|x|)` to `Amax_ptr + pid` (the launcher reduces these partial maxima);
# 3. multiply by the per-tensor scale (an fp32 scalar at `Scale_ptr`);
# 4. encode to fp8 bits with chapter 01's `encode_bits_tl(x, EXP_BITS, MAN_BITS, SATURATE, FN)` — saturating, so
#    overflow becomes ±max like the clamp of the reference — and store them as `tl.uint8`.
#
# Nothing but the signature is given; the launcher is below it. Compare with `minite/formats/fp8.py` only after
# trying.

# %%
from minite.formats.specs import encode_bits_tl
FORMATS = {torch.float8_e4m3fn: (4, 3, True), torch.float8_e5m2: (5, 2, False)}   # (EXP_BITS, MAN_BITS, FN)

def my_quantize(x, scale, fp8_dtype, BLOCK_SIZE=256):
    """Launch quantize_kernel: returns (fp8 data shaped like x, amax)."""
    E, M, FN = FORMATS[fp8_dtype]
    x = x.contiguous()
    n = x.numel()
    grid = triton.cdiv(n, BLOCK_SIZE)
    bits = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    partial = torch.empty(grid, dtype=torch.float32, device=x.device)
    scale_t = torch.tensor([float(scale)], dtype=torch.float32, device=x.device)
    quantize_kernel[(grid,)](x, scale_t, bits, partial, n, EXP_BITS=E, MAN_BITS=M, FN=FN, BLOCK_SIZE=BLOCK_SIZE)
    return bits.view(fp8_dtype), partial.max()


# %% minite={"task": "quantize_kernel"}
@triton.jit
def quantize_kernel(X_ptr, Scale_ptr, Y_ptr, Amax_ptr, N, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr,
                    FN: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Amax_ptr + pid, tl.max(tl.abs(x), axis=0))
    y = x * tl.load(Scale_ptr)
    bits = encode_bits_tl(y, EXP_BITS, MAN_BITS, True, FN)
    tl.store(Y_ptr + offs, bits.to(tl.uint8), mask=mask)
    ### END SOLUTION


# %% minite={"check": "quantize_kernel"} tags=["nbval-check-output"]
# CHECK: quantize_kernel
g = torch.Generator().manual_seed(5)
for dtype in (torch.float32, torch.bfloat16):
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = (torch.randn(9, 131, generator=g) * torch.logspace(-6, 4, 131)).to(dtype)
        x[0, :2] = torch.tensor([-float("inf"), 0.0]).to(dtype)
        x = x.to(DEVICE)
        for scale in (1.0, 13.0):
            data, amax = my_quantize(x, scale, f8)
            want = quantize(x, scale, fp8_dtype=f8, backend="torch")
            diff = (data.view(torch.uint8) != want.data.view(torch.uint8)).sum().item()
            assert data.dtype == f8 and diff == 0, f"{diff} fp8 patterns differ ({dtype}, {f8}, scale {scale})"
            assert torch.equal(amax, want.amax), f"amax {amax.item()} != {want.amax.item()}"
        print(f"PASS: quantize_kernel [{str(dtype)[6:]} -> {str(f8)[6:]}]")


# %% [markdown]
# ## Task 3 — a block-scaled FP8 GEMM (a whole kernel)
#
# One scale per tensor fails when parts of a tensor differ in size by orders of magnitude (outlier tokens or
# channels): the largest part sets the amax, and the rest is pushed into the subnormals or flushed to 0.
# DeepSeek-V3 scales finer: the activation $A$ `(M, K)` gets one scale
# per **1 × G slice** of a row, the weight $B$ `(K, N)` one per **G × G block**, with $G$ = 128 on the GPU
# (32 here, so that the shapes stay small). `quantize_tiles` below produces the fp8 data and the per-tile
# `scale_inv` (a tile's real value is `data * scale_inv`).
#
# Write `block_scaled_matmul_kernel`: $C = \hat A \hat B$ in fp32, where $\hat A$, $\hat B$ are the dequantized
# operands, **without dequantizing the tiles before `tl.dot`** (the operands of `tl.dot` are the raw fp8 tiles).
# One program per `(BLOCK_M, BLOCK_N)` tile of C (row-major order is fine), `BLOCK_K == G` (one K step per scale
# group), masks on ragged M and N (K is a multiple of G). `SA_ptr` is `(M, K // G)` and `SB_ptr` `(K // G, cdiv(N, G))`,
# both contiguous fp32; work out where in the K loop each scale has to be applied. This is also the promotion of
# lesson section 5: each group's product leaves the tensor core before it is scaled.

# %%
def quantize_tiles(x, tile_rows, tile_cols, fp8_dtype=torch.float8_e4m3fn):
    """Per-tile current scaling of a 2-D tensor: (fp8 data, scale_inv of shape (cdiv(R, tr), cdiv(C, tc)))."""
    R, C = x.shape
    fp8_max = torch.finfo(fp8_dtype).max
    pad = torch.nn.functional.pad(x.float(), (0, -C % tile_cols, 0, -R % tile_rows))
    tiles = pad.view(pad.shape[0] // tile_rows, tile_rows, pad.shape[1] // tile_cols, tile_cols)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)                          # (tiles down, tiles across)
    scale = fp8_max / amax
    data = (tiles * scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    data = data.view(pad.shape)[:R, :C].contiguous()
    return data, (1.0 / scale).contiguous()


def dequantize_tiles(data, scale_inv, tile_rows, tile_cols):
    s = scale_inv.repeat_interleave(tile_rows, 0).repeat_interleave(tile_cols, 1)[:data.shape[0], :data.shape[1]]
    return data.float() * s


# %% minite={"task": "block_scaled_matmul_kernel"}
@triton.jit
def block_scaled_matmul_kernel(A_ptr, B_ptr, C_ptr, SA_ptr, SB_ptr, M, N, K,
                               stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    ### BEGIN SOLUTION
    tiles_n = tl.cdiv(N, BLOCK_N)
    tm = tl.program_id(0) // tiles_n
    tn = tl.program_id(0) % tiles_n
    rows = tm.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tn.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    n_groups = K // G
    n_col_blocks = tl.cdiv(N, G)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for grp in range(0, n_groups):
        ks = grp * G + tl.arange(0, G)                                          # this scale group's K range
        qa = tl.load(A_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
        qb = tl.load(B_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=col_ok[None, :], other=0.0)
        raw = tl.dot(qa, qb, input_precision="ieee")             # fp8 x fp8, one group of K (precision: fp32 tiles)
        sa = tl.load(SA_ptr + rows * n_groups + grp, mask=row_ok, other=0.0)     # (BLOCK_M,) one per row slice
        sb = tl.load(SB_ptr + grp * n_col_blocks + cols // G, mask=col_ok, other=0.0)   # (BLOCK_N,) per block
        out += raw * (sa[:, None] * sb[None, :])                                # promote, with the group's scales
    tl.store(C_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, out.to(C_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
    ### END SOLUTION


def block_scaled_matmul(a_data, sa, b_data, sb, G=32, BLOCK_M=16, BLOCK_N=16):
    (M, K), (_, N) = a_data.shape, b_data.shape
    assert K % G == 0, f"K={K} must be a multiple of G={G}"
    c = torch.empty(M, N, device=a_data.device, dtype=torch.float32)
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
    block_scaled_matmul_kernel[grid](a_data, b_data, c, sa, sb, M, N, K, a_data.stride(0), a_data.stride(1),
                                     b_data.stride(0), b_data.stride(1), c.stride(0), c.stride(1),
                                     BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, G=G)
    return c


# %% minite={"check": "block_scaled_matmul_kernel"} tags=["nbval-check-output"]
# CHECK: block_scaled_matmul_kernel
from minite.testing import fp8_dot_tolerance
G = 32
g = torch.Generator().manual_seed(6)
for M, K, N in ((16, 32, 48), (33, 96, 40), (20, 64, 70)):
    x = torch.randn(M, K, generator=g) * 10.0 ** (-3 * (torch.arange(M) % 3))[:, None]   # rows 1, 1e-3, 1e-6
    w = torch.randn(K, N, generator=g) * 10.0 ** (-3 * (torch.arange(N) // G))  # each 32 columns 1000x smaller
    a_data, sa = quantize_tiles(x, 1, G)                                   # (M, K), (M, K // G)
    b_data, sb = quantize_tiles(w, G, G)                                   # (K, N), (K // G, cdiv(N, G))
    got = block_scaled_matmul(a_data.to(DEVICE), sa.to(DEVICE), b_data.to(DEVICE), sb.to(DEVICE), G=G).cpu()
    a_hat, b_hat = dequantize_tiles(a_data, sa, 1, G), dequantize_tiles(b_data, sb, G, G)
    want = a_hat @ b_hat
    # on a GPU, + the fp8 tensor cores' ~14-bit accumulator within each group of G (lesson section 5); 0 on the CPU
    tol = fp8_dot_tolerance(a_hat, b_hat, device=DEVICE, atol=1e-3, rtol=1e-4, promote_every=G)
    assert_close(got, want, name=f"block-scaled GEMM {M}x{K}x{N}", **tol)
    exact = x.double() @ w.double()
    per_tensor = (quantize(x, backend="torch").dequantize(torch.float32) @
                  quantize(w, backend="torch").dequantize(torch.float32)).double()
    def worst(c):                                              # the worst relative error of a row or a column
        e = c.double() - exact
        return max((e.norm(dim=0) / exact.norm(dim=0)).max().item(),
                   (e.norm(dim=1) / exact.norm(dim=1)).max().item())
    err_block, err_tensor = worst(got), worst(per_tensor)
    assert err_block < 0.5 * err_tensor, \
        f"block scaling should beat per-tensor scaling: {err_block:.3g} vs {err_tensor:.3g}"
print("PASS: block_scaled_matmul_kernel")
