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
# # 01 · Floating point from the bits — exercises
#
# Four graded tasks on what the lesson did not write. In each task cell, replace
#
# ```python
#     ### BEGIN YOUR CODE
#     raise NotImplementedError()
#     ### END YOUR CODE
# ```
#
# with your code (keep the marker lines), run the cell, then the check cell below it. Grade with
# `python -m minite.grading grade exercises/01_floating_point_exercise.ipynb`.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
from minite._triton import triton, tl
from minite.formats.specs import BF16, decode
from minite.formats import DynamicLossScaler
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)
torch.set_num_threads(1)                      # tiny shapes: threads only add overhead


# %% [markdown]
# ## Task 1 — decode an FP16 bit pattern by hand
#
# FP16 is the IEEE format with 1 sign bit, 5 exponent bits and 10 mantissa bits. Return the Python float that
# the 16-bit pattern `bits` (0 ≤ bits < 65536) stands for: normal numbers, subnormals, ±0, ±inf and NaN, using
# lesson section 1. Use only integer operations and powers of two (`2.0 ** k`): no torch, numpy or `struct`.

# %% minite={"task": "decode_fp16"}
def decode_fp16(bits: int) -> float:
    ### BEGIN SOLUTION
    s, e, m = bits >> 15, (bits >> 10) & 0x1F, bits & 0x3FF
    if e == 0x1F:
        v = float("inf") if m == 0 else float("nan")
    elif e == 0:
        v = 2.0 ** -14 * (m / 1024)
    else:
        v = 2.0 ** (e - 15) * (1 + m / 1024)
    return -v if s else v
    ### END SOLUTION


# %% minite={"check": "decode_fp16"} tags=["nbval-check-output"]
# CHECK: decode_fp16
patterns = torch.arange(1 << 16, dtype=torch.int32)
want = patterns.to(torch.int16).view(torch.float16).float().tolist()
bad = [p for p, w in zip(range(1 << 16), want)
       if not ((math.isnan(w) and math.isnan(decode_fp16(p))) or (decode_fp16(p) == w
               and math.copysign(1, decode_fp16(p)) == math.copysign(1, w)))]
assert not bad, f"{len(bad)} patterns wrong, e.g. {hex(bad[0])}: got {decode_fp16(bad[0])}"
print("PASS: decode_fp16 on all 65536 patterns")


# %% [markdown]
# ## Task 2 — stochastic rounding to BF16 (a whole Triton kernel)
#
# Round-to-nearest is biased when the same small value is added again and again (lesson section 5: the FP16 sum
# stalls at 256). **Stochastic rounding** rounds $x$ to one of its two BF16 neighbours at random, the upper one
# (in magnitude) with probability $(|x| - \text{lower}) / (\text{upper} - \text{lower})$, so each rounding is
# exact *on average*. Write the kernel:
#
# * `X_ptr`: `N` fp32 values (finite, $|x| \le 10^{38}$); `R_ptr`: `N` int32 random numbers, uniform on
#   $[0, 2^{16})$, one per value; `Y_ptr`: `N` int32 BF16 bit patterns (the low 16 bits; $0 \le y < 2^{16}$).
# * `y` must be the pattern of the lower or the upper neighbour (of `x` itself when `x` is a BF16 value), and the
#   rounding must be exact in distribution: for a fixed `x`, over all $2^{16}$ values of `r`, the share that
#   round up must equal the probability above **exactly**.
#
# Work out, from the layout of FP32 and BF16, an integer-only way to do this. One block of `BLOCK_SIZE` values per
# program.

# %% minite={"task": "stochastic_round_bf16"}
@triton.jit
def sr_bf16_kernel(X_ptr, R_ptr, Y_ptr, N, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    u = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    r = tl.load(R_ptr + offs, mask=mask, other=0)
    # the low 16 bits are the dropped fraction of a BF16 quantum (sign-magnitude: same for negative x);
    # adding r in [0, 2^16) carries into bit 16 with probability low / 2^16
    tl.store(Y_ptr + offs, ((u + r) >> 16) & 0xFFFF, mask=mask)
    ### END SOLUTION


def sr_bf16(x, r, block=16384):
    y = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    sr_bf16_kernel[(triton.cdiv(x.numel(), block),)](x, r, y, x.numel(), BLOCK_SIZE=block)
    return y


# %% minite={"check": "stochastic_round_bf16"} tags=["nbval-check-output"]
# CHECK: stochastic_round_bf16
g = torch.Generator().manual_seed(0)
xs = torch.randn(40, generator=g) * torch.exp2(torch.randint(-130, 120, (40,), generator=g).float())
xs = torch.cat([xs, torch.tensor([0.0, 1.0, -2.5, 0.1, -0.1, 1e-40, 3e38 / 4, 1 + 2 ** -8])])   # exact, tie, tiny
n_r = 1 << 16
x = xs.repeat_interleave(n_r).contiguous()                         # every x with every r
r = torch.arange(n_r, dtype=torch.int32).repeat(len(xs))
y = sr_bf16(x.to(DEVICE), r.to(DEVICE)).cpu().view(len(xs), n_r)
assert y.dtype == torch.int32 and int(y.min()) >= 0 and int(y.max()) < (1 << 16), "patterns must be 16-bit"
vals = decode(y.flatten(), BF16).view(len(xs), n_r).double()
for i, xv in enumerate(xs.double().tolist()):
    got = vals[i].unique()
    near = torch.tensor([xv]).to(torch.bfloat16)                   # the nearest BF16 value ...
    if near.double().item() == xv:
        lower = upper = xv
    else:                                                           # ... and its neighbour on the other side of x
        outward = abs(near.double().item()) < abs(xv)
        to = torch.tensor([math.copysign(math.inf, xv) if outward else 0.0], dtype=torch.bfloat16)
        lower, upper = sorted((near.double().item(), torch.nextafter(near, to).double().item()), key=abs)
    assert all(float(v) in (lower, upper) for v in got), f"x = {xv!r}: results {got.tolist()} not in {lower, upper}"
    n_up = int((vals[i] != lower).sum()) if upper != lower else 0
    p_up = 0.0 if upper == lower else (abs(xv) - abs(lower)) / (abs(upper) - abs(lower))
    assert n_up == round(p_up * n_r) and abs(n_up - p_up * n_r) < 1e-6, \
        f"x = {xv!r}: {n_up} of {n_r} values of r round up, the probability says {p_up * n_r:.2f}"
print(f"PASS: stochastic_round_bf16 exact in distribution on {len(xs)} values x {n_r} random draws")


# %% [markdown]
# ## Task 3 — a compensated FP16 sum
#
# Keep the FP16 accumulator of lesson section 5, but lose nothing: write `kahan_sum_fp16(values)` that adds the
# elements of a 1-D FP16 tensor **in order, in one pass, with every operation on FP16 tensors** (no `.item()`,
# no Python floats, no other dtype: the check watches every operation), carrying a second FP16 number that
# remembers the low-order part each addition rounded away, and feeding it back into the next addition. Return a
# 0-d FP16 tensor within one FP16 quantum of the exact sum, where the plain running sum is off by hundreds.

# %% minite={"task": "kahan_sum_fp16"}
def kahan_sum_fp16(values: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    s = torch.zeros((), dtype=torch.float16)
    comp = torch.zeros((), dtype=torch.float16)          # what the last addition rounded away, negated
    for v in values:
        y = v - comp
        t = s + y
        comp = (t - s) - y
        s = t
    return s
    ### END SOLUTION


# %% minite={"check": "kahan_sum_fp16"} tags=["nbval-check-output"]
# CHECK: kahan_sum_fp16
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class OnlyFP16(TorchDispatchMode):
    """Records every aten op whose floating outputs are not fp16, and every read of a value into Python."""
    def __init__(self):
        super().__init__()
        self.bad = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in ("_local_scalar_dense", "item") or any(
                isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float16
                for t in tree_flatten(out)[0]):
            self.bad.append(name)
        return out


g = torch.Generator().manual_seed(0)
cases = {"3000 x 0.1": torch.full((3000,), 0.1, dtype=torch.float16),
         "uniform [0, 0.2)": (0.2 * torch.rand(3000, generator=g)).half(),
         "200 then 2000 small": torch.cat([torch.tensor([200.0]), 0.05 * torch.rand(2000, generator=g)]).half()}
for name, vals in cases.items():
    with OnlyFP16() as mode:
        got = kahan_sum_fp16(vals)
    assert not mode.bad, f"{name}: operations outside fp16 or reads into Python: {sorted(set(mode.bad))}"
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float16 and got.dim() == 0, "return a 0-d fp16 tensor"
    exact = vals.double().sum()
    quantum = 2.0 ** (math.floor(math.log2(abs(exact.item()))) - 10)
    assert abs(got.double() - exact) <= quantum, f"{name}: {got.item()} vs exact {exact.item():.4f} (quantum {quantum})"
print("PASS: kahan_sum_fp16 within one fp16 quantum of the exact sum, fp16 operations only")


# %% [markdown]
# ## Task 4 — the dynamic loss-scale update rule
#
# Given this step's verdict `found_inf`, return the new `(scale, growth_tracker, hysteresis_tracker)` of a dynamic
# loss scaler with Megatron-LM's hysteresis. The rules, as Megatron and `minite.formats.DynamicLossScaler` apply
# them after every step:
#
# * an overflow resets the run of clean steps, and uses up one unit of hysteresis; only when the hysteresis is
#   used up does the scale back off (by `backoff_factor`, never below `min_scale`);
# * a clean step extends the run; a run of `growth_interval` clean steps grows the scale by `growth_factor`,
#   starts a new run and restores the full hysteresis.

# %% minite={"task": "update_scale"}
def update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, *, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=1, min_scale=1.0):
    ### BEGIN SOLUTION
    if found_inf:
        growth_tracker = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0:
            scale = max(scale * backoff_factor, min_scale)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            scale, growth_tracker, hysteresis_tracker = scale * growth_factor, 0, hysteresis
    return scale, growth_tracker, hysteresis_tracker
    ### END SOLUTION


# %% minite={"check": "update_scale"} tags=["nbval-check-output"]
# CHECK: update_scale
import random
rng = random.Random(0)
for cfg in [dict(growth_interval=3), dict(growth_interval=5, hysteresis=2, min_scale=4.0),
            dict(growth_interval=2, growth_factor=4.0, backoff_factor=0.25, hysteresis=3)]:
    ref = DynamicLossScaler(init_scale=256.0, **cfg)
    state = (256.0, 0, cfg.get("hysteresis", 1))
    for step in range(200):
        bad = rng.random() < 0.3
        p = torch.nn.Parameter(torch.zeros(1)); p.grad = torch.tensor([float("inf") if bad else 1.0])
        ref.step(torch.optim.SGD([p], lr=0.1)); ref.update()
        state = update_scale(*state, bad, **cfg)
        sd = ref.state_dict()
        assert state == (sd["scale"], sd["growth_tracker"], sd["hysteresis_tracker"]), (cfg, step, state, sd)
print("PASS: update_scale matches DynamicLossScaler on 600 random steps")
