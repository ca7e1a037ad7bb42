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
# Two tasks. Fill in the code between the markers, run the cell, then run the check cell right after it.
#
# 1. the **delayed-scaling update**: roll the amax history, compute the next scale, keep the old one when the amax
#    is 0 or not finite;
# 2. the body of the **FP8 quantize kernel**: per-tensor scale, saturate, encode with `encode_bits_tl`, and the
#    block's partial amax.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import inspect, math
import matplotlib.pyplot as plt
import minite
from minite._triton import triton, tl
from minite.formats import (E4M3, E5M2, BF16, Format, DelayedScaling, CurrentScaling, fp8_autocast,
                            Float8Tensor, quantize, dequantize)
from minite.testing import check_op, assert_close
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)


# %% [markdown]
# ## Task 1 — delayed scaling
#
# `amax_history` is a 1-D fp32 tensor, newest first. One step: roll it by one (the oldest entry falls off the
# end), put this step's `amax` in slot 0, reduce it (`"max"`: the max over the history; `"most_recent"`: slot 0),
# and return `(new_history, new_scale)` with
#
# $$\text{new\_scale} = \frac{\text{fp8\_max}}{\text{amax}_r}\,2^{-\text{margin}},$$
#
# except that the previous `scale` is kept where $\text{amax}_r$ is 0 or not finite. Use tensor ops only (no
# `.item()`): on a GPU this runs every step without synchronising with the host.

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
# The launcher is given; compare with `minite/formats/fp8.py` only after trying.

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
        for scale in (1.0, 13.0):
            data, amax = my_quantize(x, scale, f8)
            want = quantize(x, scale, fp8_dtype=f8, backend="torch")
            diff = (data.view(torch.uint8) != want.data.view(torch.uint8)).sum().item()
            assert data.dtype == f8 and diff == 0, f"{diff} fp8 patterns differ ({dtype}, {f8}, scale {scale})"
            assert torch.equal(amax, want.amax), f"amax {amax.item()} != {want.amax.item()}"
        print(f"PASS: quantize_kernel [{str(dtype)[6:]} -> {str(f8)[6:]}]")
