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
# # 05 — SwiGLU: a gated MLP, a derivative by hand, and a kernel that recomputes instead of storing
#
# The MLP of LLaMA-style GPTs (and of this course's `minite/models/gpt.py`) is a **gated linear unit** with a SiLU
# gate, introduced by Noam Shazeer in *GLU Variants Improve Transformer* (2020,
# [arXiv:2002.05202](https://arxiv.org/abs/2002.05202)):
#
# $$\mathrm{FFN}_{\mathrm{SwiGLU}}(x) = W_{down}\,\big(\mathrm{silu}(x W_{gate}) \odot x W_{up}\big),
# \qquad \mathrm{silu}(g) = g\,\sigma(g) = \frac{g}{1 + e^{-g}}.$$
#
# Shazeer found that GLU variants beat ReLU/GELU MLPs at equal parameter count (the hidden width shrinks to
# $\tfrac{8}{3}C$ so three matrices cost what two $4C$ ones did). The three matmuls are compute-bound and belong
# to cuBLAS. The part in the middle, $h = \mathrm{silu}(g)\odot u$, is **elementwise**: it does ~5 FLOPs per
# element and is limited purely by memory traffic. That is what we fuse.
#
# **Memory-traffic arithmetic.** A 7B-class layer: $C = 4096$, $H = 11008$, $N = B\cdot T = 8192$ tokens, bf16.
# One $(N, H)$ tensor is $8192 \cdot 11008 \cdot 2$ B $\approx 180$ MB.
#
# | | eager PyTorch `F.silu(g) * u` | fused kernel |
# |---|---|---|
# | forward | silu: read g, write s (2) · mul: read s, u, write h (3) → **5 passes** | read g, u, write h → **3** |
# | backward | mul': $du = dh\,s$, $ds = dh\,u$ (6) · silu': read ds, g, write dg (3) → **9** | dh, g, u → dg, du: **5** |
# | saved for backward | g, s, u → **3 tensors** | g, u → **2** (s is recomputed) |
#
# At 3.35 TB/s (H100) a pass over 180 MB takes ~54 µs, so fusing saves ~6 passes ≈ 0.3 ms per layer per step, and
# one (N, H) activation per layer: 180 MB × 32 layers ≈ 5.8 GB of activation memory.

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

# %% [markdown]
# ## 1. The math: forward, and the derivative of SiLU step by step
#
# Forward, elementwise: $s = \mathrm{silu}(g) = g\,\sigma(g)$, $\;h = s\,u$.
#
# **The sigmoid's derivative.** $\sigma(g) = (1+e^{-g})^{-1}$, so
# $$\sigma'(g) = \frac{e^{-g}}{(1+e^{-g})^2} = \underbrace{\frac{1}{1+e^{-g}}}_{\sigma(g)}\cdot
# \underbrace{\frac{e^{-g}}{1+e^{-g}}}_{1-\sigma(g)} = \sigma(g)\,\big(1-\sigma(g)\big).$$
#
# **SiLU's derivative** (product rule on $g\cdot\sigma(g)$):
# $$\mathrm{silu}'(g) = \sigma(g) + g\,\sigma(g)\big(1-\sigma(g)\big) = \sigma(g)\,\big(1 + g\,(1-\sigma(g))\big).$$
# It is $\tfrac12$ at $g=0$, tends to 1 for $g\to+\infty$ and to 0 for $g\to-\infty$, and dips slightly below 0 around
# $g \approx -2.4$ (SiLU is not monotone).
#
# **Backward of the gated product.** With upstream gradient $\bar h = \partial L/\partial h$:
# $$\bar u = \bar h \cdot \mathrm{silu}(g), \qquad
# \bar g = \bar h \cdot u \cdot \sigma(g)\,\big(1 + g\,(1-\sigma(g))\big).$$
# Both need only $g$, $u$ and $\bar h$: $\sigma(g)$ costs one `exp` to **recompute**, far cheaper than storing
# and re-reading an $(N, H)$ tensor. Numerically: for $g \ll 0$, $e^{-g}$ overflows to `inf` and
# $\sigma = 1/(1+\infty) = 0$: no NaN, so $1/(1+e^{-g})$ is safe as written.

# %% tags=["nbval-ignore-output"]
g = torch.linspace(-6, 6, 241, dtype=torch.float64, requires_grad=True)
(auto,) = torch.autograd.grad(F.silu(g).sum(), g)
g = g.detach()
sig = torch.sigmoid(g)
by_hand = sig * (1 + g * (1 - sig))
assert_close(by_hand, auto, name="silu'(g)")
print("silu'(0) =", round(float(by_hand[120]), 4), "| min silu' =", round(float(by_hand.min()), 4),
      "at g =", round(float(g[by_hand.argmin()]), 2))
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(g, F.silu(g), label="silu(g)")
ax.plot(g, by_hand, label="silu'(g) (by hand)")
ax.plot(g, sig, "--", label="sigmoid(g)")
ax.axhline(0, color="k", lw=0.5); ax.legend(); ax.set_xlabel("g"); ax.set_title("SiLU and its derivative")
plt.show()

# %% [markdown]
# ## 2. Naive PyTorch, and its memory passes counted
#
# Eager PyTorch runs each op as its own kernel and writes every intermediate to memory. Let us *count* what it
# moves, op by op, forward and backward, with a small `TorchDispatchMode` that logs each aten op's bytes read and
# written. It runs on the `meta` device, so a 7B-sized layer costs nothing here. We also count what autograd
# **saves** for the backward with `saved_tensors_hooks`.

# %%
# Counts bytes each aten op reads and writes (chapter 00 builds this counter; it lives in minite.bytecount).
from minite.bytecount import CountBytes, saved_bytes


# %% tags=["nbval-ignore-output"]
def naive_swiglu(gate, up):
    return F.silu(gate) * up

N, H = 8192, 11008
gm = torch.empty(N, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
um = torch.empty(N, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
one = N * H * 2  # bytes of one (N, H) bf16 tensor
dh = torch.empty(N, H, device="meta", dtype=torch.bfloat16)  # upstream gradient
with CountBytes() as cb:
    h = naive_swiglu(gm, um)
    h.backward(dh)
for name, r, w in cb.ops:
    print(f"{name:>22}: read {r / one:.0f} x (N,H), write {w / one:.0f} x (N,H)")
naive_passes = sum(r + w for _, r, w in cb.ops) / one
print(f"eager total: {naive_passes:.0f} passes of {one / 1e6:.0f} MB; fused: 3 (fwd) + 5 (bwd) = 8")
assert naive_passes == 14

# %% [markdown]
# The count confirms the table: 2 + 3 passes forward, 3 + 3 + 3 backward (`silu_backward` is already one fused
# aten kernel; the two `mul`s of the product's backward are not).
#
# ## 3. The Triton kernels
#
# `minite/kernels/swiglu.py` launches a 2-D grid: program `(row, j)` handles `BLOCK_SIZE` columns of one row.
# Rows may be *strided*: in the GPT, `gate` and `up` are the two halves of one `(N, 2H)` projection
# (`gate_up(x).split(H, -1)`), and the kernel reads them in place instead of copying them to contiguous tensors.
# Each value is loaded, upcast to fp32 at once, and the result is cast back on store.

# %%
from minite.kernels import swiglu as sw
print(inspect.getsource(sw._swiglu_fwd_kernel.fn))
print(inspect.getsource(sw._swiglu_bwd_kernel.fn))

# %% [markdown]
# The `autograd.Function` saves only the **inputs** — `ctx.save_for_backward(gate, up)` — and the backward kernel
# recomputes $\sigma(g)$:

# %%
print(inspect.getsource(sw.SwiGLUFunction))

# %% [markdown]
# ## 4. Checks against the reference (output and both input gradients), and fp64 gradcheck

# %% tags=["nbval-check-output"]
# CHECK: swiglu kernel vs reference
from minite.kernels.swiglu import swiglu, swiglu_ref
fused = lambda g, u: swiglu(g, u, backend="triton")
gen = torch.Generator().manual_seed(0)
ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for shape in ((5, 37), (4, 256)):
        gate = (3 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
        up = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        ok &= check_op("swiglu", fused, swiglu_ref, gate, up)
gate = torch.randn(3, 7, dtype=torch.float64, device=DEVICE, requires_grad=True)
up = torch.randn(3, 7, dtype=torch.float64, device=DEVICE, requires_grad=True)
assert torch.autograd.gradcheck(fused, (gate, up))
assert_close(swiglu_ref(gate, up), F.silu(gate) * up, name="reference vs F.silu * up")
assert ok
print("PASS: swiglu kernel vs reference, fp64 gradcheck, reference vs torch")

# %% [markdown]
# ## 5. Memory saved, measured
#
# On the CPU we count the bytes autograd saves; on a GPU we also read `torch.cuda.max_memory_allocated` around a
# forward (the saved tensors are what stays alive until the backward).

# %% tags=["nbval-check-output"]
# CHECK: swiglu saved bytes
N, H = 64, 512
gate = torch.randn(N, H, requires_grad=True)
up = torch.randn(N, H, requires_grad=True)
b_naive = saved_bytes(naive_swiglu, gate, up)
b_fused = saved_bytes(fused, gate, up)
print(f"saved for backward: eager {b_naive // (N * H * 4)} x (N,H), fused {b_fused // (N * H * 4)} x (N,H)")
assert b_naive == 3 * N * H * 4 and b_fused == 2 * N * H * 4
print("PASS: the fused SwiGLU keeps one (N, H) activation less")

# %% tags=["nbval-ignore-output"]
if torch.cuda.is_available():
    def fwd_peak(fn, N=8192, H=11008):
        g = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        u = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        h = fn(g, u)  # kept alive, like an activation waiting for its backward
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    for name, fn in (("eager", naive_swiglu), ("fused", fused)):
        held, peak = fwd_peak(fn)
        print(f"{name}: held after forward {held / 2**20:.0f} MiB, peak during forward {peak / 2**20:.0f} MiB")
else:
    print("no CUDA device: GPU memory measurement skipped (the counted bytes above are exact)")

# %% [markdown]
# ## 6. Plot: bytes moved and bytes kept, eager vs fused

# %%
hidden = [2048, 4096, 8192, 11008, 14336]
N = 8192
elt = 2  # bf16
traffic_eager = [14 * N * h * elt / 1e9 for h in hidden]  # 5 fwd + 9 bwd passes
traffic_fused = [8 * N * h * elt / 1e9 for h in hidden]   # 3 fwd + 5 bwd passes
kept_eager = [3 * N * h * elt / 1e9 for h in hidden]
kept_fused = [2 * N * h * elt / 1e9 for h in hidden]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
a1.plot(hidden, traffic_eager, "o-", label="eager F.silu(g) * u"); a1.plot(hidden, traffic_fused, "o-", label="fused")
a1.set_title("HBM traffic per layer, fwd + bwd (N = 8192, bf16)"); a1.set_xlabel("hidden H"); a1.set_ylabel("GB")
a2.plot(hidden, kept_eager, "o-", label="eager"); a2.plot(hidden, kept_fused, "o-", label="fused")
a2.set_title("saved for backward per layer"); a2.set_xlabel("hidden H"); a2.set_ylabel("GB")
a1.legend(); a2.legend()
plt.show()

# %% [markdown]
# ## 7. GPU benchmark (runs only when a CUDA device is present)
#
# The full table (forward, forward+backward, GB/s, % of peak, torch eager, `torch.compile`, Liger-Kernel when
# installed) is `benchmarks/bench_swiglu.py`. Here is the short version.

# %% tags=["nbval-ignore-output"]
if torch.cuda.is_available():
    from triton.testing import do_bench
    for H in (4096, 11008, 14336):
        g = torch.randn(8192, H, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(8192, H, device="cuda", dtype=torch.bfloat16)
        ms_f, ms_e = do_bench(lambda: fused(g, u)), do_bench(lambda: naive_swiglu(g, u))
        gbs = 3 * g.numel() * 2 / ms_f / 1e6  # fused moves 3 tensors
        print(f"H={H}: fused {ms_f:.3f} ms ({gbs:.0f} GB/s), eager {ms_e:.3f} ms, speed-up {ms_e / ms_f:.2f}x")
else:
    print("no CUDA device: benchmark skipped (see benchmarks/bench_swiglu.py)")

# %% [markdown]
# ## 8. Where it runs in the GPT
#
# `minite/models/gpt.py`, class `MLP`: one `Linear` computes gate and up together (`C -> 2H`, one matmul), `split`
# gives two strided views, and `minite.ops.swiglu` consumes them in place:
#
# ```python
# gate, up = self.gate_up(x).split(self.hidden, dim=-1)  # (B, T, hidden) each, strided views
# return self.dropout(self.down(swiglu(gate, up, backend=self.backend)))  # (B, T, C)
# ```
#
# The module `minite.nn.SwiGLU(dim, hidden)` packages the same thing with three separate `Linear`s:

# %%
from minite.nn import SwiGLU
mlp = SwiGLU(64, 176)
print(mlp)
x = torch.randn(2, 5, 64)
print(tuple(mlp(x).shape))

# %% [markdown]
# **Takeaways.** (1) An elementwise op is memory-bound: count passes, not FLOPs. (2) Derive the backward; it tells
# you what must be kept — here only the inputs. (3) *Recompute* cheap things (one `exp`) rather than store
# expensive ones (an $(N, H)$ tensor per layer).
