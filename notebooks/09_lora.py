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
# # 09 — LoRA: fine-tune a model by learning a low-rank update
#
# You have a trained GPT and a new text: Python's documentation instead of the code the model was trained on, your
# notes instead of Shakespeare. **Full fine-tuning** updates every weight, so it needs memory for every weight's
# gradient and optimizer state. **LoRA** (Hu et al. 2021, *LoRA: Low-Rank Adaptation of Large Language Models*,
# [arXiv:2106.09685](https://arxiv.org/abs/2106.09685)) freezes the model and learns, next to each weight matrix
# $W \in \mathbb{R}^{O\times K}$, a low-rank update
#
# $$W' = W + \Delta W, \qquad \Delta W = \frac{\alpha}{r}\,B A, \qquad
# A \in \mathbb{R}^{r\times K},\; B \in \mathbb{R}^{O\times r},\; r \ll \min(K, O).$$
#
# The layer computes $y = x W^\top + \frac{\alpha}{r}\,(x A^\top) B^\top$: two thin extra GEMMs. Only $A$ and $B$
# are trained: $r(K+O)$ numbers instead of $KO$: for a $4096\times4096$ projection at $r = 16$ that is
# 131k instead of 16.8M, **0.8 %**.
#
# This chapter: the memory arithmetic (why LoRA fits where full fine-tuning does not), the initialisation ($B=0$),
# LoRA in ten lines of PyTorch, a fused Triton kernel that reads $x$ once for both products, a real fine-tune of a
# small GPT with LoRA *and* with full fine-tuning on the same axes, the singular values of the full fine-tune's
# $\Delta W$ (why low rank is enough), and merging the adapter for inference. `minite.layers.lora` holds the
# library version, shaped like Hugging Face PEFT (`LoRAConfig`, `apply_lora`, `merge_lora`, ...).

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import contextlib, io, json, math, sysconfig, tempfile, time
from pathlib import Path
import matplotlib.pyplot as plt
import torch.nn.functional as F
from torch import nn
from minite._triton import triton, tl
from minite.testing import assert_close, check_op
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. Memory: full fine-tuning vs LoRA
#
# Mixed-precision training with AdamW keeps, per **trained** parameter (the ZeRO paper's accounting,
# Rajbhandari et al. 2019): the bf16 weight (2 B), its bf16 gradient (2 B), an fp32 master copy (4 B) and AdamW's
# two fp32 moments (4 + 4 B): **16 bytes**. A **frozen** parameter costs its bf16 weight only: **2 bytes**, no
# gradient, no optimizer state. (Activations come on top in both cases and depend on batch and sequence length; we
# leave them out.)
#
# The parameter count of a GPT with the course's architecture (GQA attention with a fused qkv projection, a SwiGLU
# MLP with a fused gate/up projection) follows from its shape. We check the formula on the real course GPT, then use
# it at LLaMA-2-7B and -70B shapes. LoRA adapts all linear layers of the blocks at $r=16$
# (`target_modules="all-linear"`).

# %%
from minite.models.gpt import GPT, GPTConfig
from minite.layers.lora import LoRAConfig, apply_lora, print_trainable_parameters


def block_linears(d, n_head, n_kv_head, hidden):
    """(in, out) of every linear layer of one block: qkv, proj, gate_up, down."""
    hd = d // n_head
    return [(d, (n_head + 2 * n_kv_head) * hd), (n_head * hd, d), (d, 2 * hidden), (hidden, d)]


def count(n_layer, d, n_head, n_kv_head, hidden, vocab, tied=True, r=16):
    lin = block_linears(d, n_head, n_kv_head, hidden)
    per_block = sum(k * o for k, o in lin) + 2 * d  # + two RMSNorm gains
    total = n_layer * per_block + vocab * d * (1 if tied else 2) + d  # embedding (+ untied head) + final norm
    lora = n_layer * sum(r * (k + o) for k, o in lin)
    return total, lora


course = GPTConfig(vocab_size=65, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=256)  # the cpu preset
m = GPT(course)
formula = count(4, 128, 4, 2, 256, course.padded_vocab_size)
with contextlib.redirect_stdout(io.StringIO()):
    real = print_trainable_parameters(apply_lora(m, LoRAConfig(r=16)))
assert formula == (real[1] - real[0], real[0]), (formula, real)  # the formula counts the real model
print("formula == minite's GPT + apply_lora: PASS")

shapes = {"course GPT (cpu preset)": formula,
          "7B (LLaMA-2-7B shape)": count(32, 4096, 32, 32, 11008, 32000, tied=False),
          "70B (LLaMA-2-70B shape)": count(80, 8192, 64, 8, 28672, 32000, tied=False)}
GB = 1e9
print(f"{'model':>24} {'params':>9} {'LoRA r=16':>10} {'full FT':>10} {'LoRA':>10} {'ratio':>6}")
for name, (n, n_lora) in shapes.items():
    full = 16 * n                    # every parameter trained
    lora = 2 * n + 16 * n_lora       # frozen bf16 base + trained adapters
    size = f"{n / 1e9:.2f}B" if n > 1e9 else f"{n / 1e6:.2f}M"
    mem = [f"{b / GB:.1f} GB" if b > GB else f"{b / 1e6:.1f} MB" for b in (full, lora)]
    print(f"{name:>24} {size:>9} {100 * n_lora / n:>9.2f}% {mem[0]:>10} {mem[1]:>10} {full / lora:>5.1f}x")

# %% [markdown]
# At 7B, full fine-tuning needs ~108 GB before a single activation: more than one 80 GB H100. LoRA needs ~14 GB,
# almost all of it the frozen bf16 weights: a 24 GB consumer GPU fits it. At 70B the gap is 1.1 TB (a multi-node
# job with ZeRO-3) against ~140 GB (two GPUs; QLoRA, which stores the frozen base in 4 bits, gets it onto one).
# The adapters themselves are 0.25-0.5 % of the parameters, and the file you share is that small too. (The course
# GPT is so narrow, 128 wide, that rank 16 is an eighth of it: LoRA's savings are a large-model effect.)
#
# ## 2. The math, and why $B$ starts at zero
#
# With $s = \alpha/r$ and $x$ of shape $(N, K)$:
# $$y = x W^\top + s\,(x A^\top)\,B^\top .$$
# PEFT (and minite) initialise $A$ like an `nn.Linear` weight (Kaiming-uniform) and $B = 0$. Two consequences:
# * $\Delta W = s B A = 0$ at step 0: **the adapted model is exactly the base model** before training. Fine-tuning
#   starts from what the base knows, not from a perturbed copy of it.
# * The gradient still flows. $\partial L/\partial B$ involves $x A^\top$, which is non-zero because $A$ is random. So
#   $B$ moves at the first step, and $A$ follows once $B \neq 0$. Had *both* been zero, both gradients would stay
#   zero forever: each factor's gradient goes through the other factor.
#
# Why a scale $s$ at all, and why $\alpha/r$? LoRA (Hu et al. 2021, §4.1) divides by $r$ so that, with $\alpha$
# fixed, trying another rank does not call for another learning rate; $\alpha$ is set once and not tuned. Count
# sizes, though, and $r$ is too much: with Kaiming-initialised $A$, $x A^\top$ has entries of a size that does not
# depend on $r$, and $(xA^\top)B^\top$ sums $r$ such terms. Terms of unrelated signs add up like a random walk,
# to about $\sqrt r$ times one term, not $r$ times. So $\alpha/r$ shrinks the adapter's output (and its gradients)
# like $1/\sqrt r$ as the rank grows, and large ranks learn slower than small ones. rsLoRA (Kalajdzievski 2023)
# proves that $\alpha/\sqrt r$ is the scale that keeps them stable in $r$ ("rank-stabilised"). minite, like PEFT,
# keeps $\alpha/r$ by default and offers $\alpha/\sqrt r$ as `LoRAConfig(use_rslora=True)`.
#
# Let us see both claims on one layer, with autograd.

# %%
K, O, r = 32, 24, 4
g = torch.Generator().manual_seed(0)
x, W = torch.randn(8, K, generator=g), torch.randn(O, K, generator=g) / K**0.5
for name, A0, B0 in (("A random, B = 0", torch.empty(r, K).uniform_(-K**-0.5, K**-0.5, generator=g),
                      torch.zeros(O, r)),
                     ("A = 0, B = 0", torch.zeros(r, K), torch.zeros(O, r))):
    A, B = A0.clone().requires_grad_(True), B0.clone().requires_grad_(True)
    y = x @ W.t() + 2.0 * (x @ A.t()) @ B.t()
    y.square().sum().backward()
    print(f"{name:>16}: y == base: {torch.equal(y.detach(), x @ W.t())}, |dA| = {A.grad.norm():.3f}, "
          f"|dB| = {B.grad.norm():.3f}")
    assert torch.equal(y.detach(), x @ W.t()) and A.grad.norm() == 0  # B = 0: the base, and no gradient to A
    assert (B.grad.norm() > 0) == (name == "A random, B = 0"), "B learns only when A is not zero"

# %% [markdown]
# ## 3. LoRA in ten lines of PyTorch
#
# A LoRA layer wraps a frozen linear layer. The whole idea:

# %%
class NaiveLoRA(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base, self.s = base, alpha / r
        base.weight.requires_grad_(False)                                          # frozen
        self.A = nn.Parameter(torch.empty(r, base.in_features))                    # (r, K)
        self.B = nn.Parameter(torch.zeros(base.out_features, r))                   # (O, r): zeros
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))                           # like nn.Linear's weight

    def forward(self, x):
        return self.base(x) + self.s * (x @ self.A.t()) @ self.B.t()


# %% [markdown]
# minite's `LoRALinear` is the same thing with what a library needs: it *is* a `minite.nn.Linear` (it takes over
# the base layer's weight Parameter, so the base's `state_dict` keys do not change and an FP8 base keeps working
# under `fp8_autocast`), it names its factors `lora_A` / `lora_B` like PEFT's checkpoints, it supports dropout on the
# adapter's input, merging, and the fused kernel of the next section. Same numbers:

# %%
from minite.layers.lora import LoRALinear

torch.manual_seed(0)
base = nn.Linear(48, 40, bias=False)
naive = NaiveLoRA(base, r=8, alpha=16)
lib = LoRALinear.from_linear(base, LoRAConfig(r=8, alpha=16), backend="torch")
with torch.no_grad():
    lib.lora_A.copy_(naive.A)
    naive.B.normal_(generator=torch.Generator().manual_seed(1))  # a trained-looking B
    lib.lora_B.copy_(naive.B)
x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2))
assert_close(lib(x), naive(x), name="LoRALinear vs NaiveLoRA")
print("PASS: minite LoRALinear == NaiveLoRA")

# %% [markdown]
# ## 4. A fused kernel: one pass over $x$
#
# **Memory traffic.** Unfused, a LoRA layer is three GEMMs and an add. For a 7B projection ($K = O = 4096$) on
# $N = 8192$ tokens in bf16, $x$ and $y$ are 64 MB each, $xA^\top$ is $N\cdot r$ (0.26 MB at $r=16$):
#
# | step | reads | writes |
# |---|---|---|
# | `x @ W.T` | x, W | y₀ |
# | `x @ A.T` | **x again**, A | g = xAᵀ (thin) |
# | `g @ B.T` | g, B | y₁ (**another N×O**) |
# | `y₀ + s·y₁` | y₀, y₁ | y |
#
# Against a single GEMM that reads $x$ and $W$ and writes $y$ once (~160 MB), that is five extra 64 MB passes ($x$
# again, $y_1$ written, $y_0$ and $y_1$ read, $y$ written): ~320 MB, ~95 µs per layer at 3.35 TB/s, while the base
# GEMM's 275 GFLOP take ~280 µs at 989 TFLOP/s. The
# fused kernel streams each tile of $x$ through registers **once** and feeds it to two `tl.dot`s: the $(N, O)$ tile of
# $xW^\top$ and the thin $(N, r)$ tile of $xA^\top$. After the $K$ loop, the epilogue adds $s\,(xA^\top)B^\top$ (one
# more small `tl.dot`) before the single store of $y$.
#
# **The price.** Each program owns a `(BLOCK_M, BLOCK_N)` tile of $y$ and needs the whole row block of $xA^\top$,
# so every column-tile program recomputes it: $O/\text{BLOCK\_N}$ copies of a GEMM of size $N\cdot K\cdot r$, i.e.
# extra work $r/\text{BLOCK\_N}$ relative to the base GEMM (12.5 % at $r=16$, BLOCK_N = 128). Fusing trades FLOPs
# for bytes: it pays for small $r$ only.
#
# **What minite does now, and why.** The kernel below is minite's first version, and on an H200 it lost to the
# three unfused GEMMs (section 8): the recomputation, and small 4-warp tiles with no L2-friendly program order.
# minite's `lora_linear` now keeps the bytes saving without the recomputation: a skinny kernel computes
# $g = xA^\top$ $(N, r)$ **once** (one more read of $x$: 64 MB, ~15 µs at H200 bandwidth), and then **one GEMM**
# computes $y = xW^\top + (s\,g)B^\top$: after its $K$ loop over $x$ and $W$, the adapter is one more $K$-step
# of width $r$ (padded to `BLOCK_R`) on the same accumulator, before the single store of $y$. That GEMM runs on the
# Triton matmul tutorial's Hopper tile (128×256×64, 8 warps, `GROUP_M = 8` grouped program order; Triton,
# `python/tutorials/03-matrix-multiplication.py`). Its floor is the merged layer's time (one GEMM of the same size),
# not the three GEMMs'. The lesson keeps the single-pass kernel because it shows the epilogue, the rank padding and
# the masking in one screen; the check below compares it with minite's two-kernel version.
#
# **Tiles must be GPU-legal.** Every `tl.dot` dimension must be ≥ 16 on a GPU. $r$ can be 1, 4 or 8, so the kernel
# pads the rank to `BLOCK_R = max(16, next_pow2(r))` *inside its tiles*: masked loads return zeros for the padded
# rank columns, and zeros add nothing.
#
# ### 4a. The forward kernel, step by step
# The $K$ loop loads three tiles: $x$ `(BLOCK_M, BLOCK_K)`, $W^\top$ `(BLOCK_K, BLOCK_N)` and $A^\top$
# `(BLOCK_K, BLOCK_R)`. Transposes are free: we index $W$ and $A$ with swapped strides.

# %%
@triton.jit
def fused_lora_fwd(X, W, A, B, Y, N, K, O, R, s,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    # all contiguous: X (N, K), W (O, K), A (R, K), B (O, R), Y (N, O)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # rows of x and y
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)          # output features
    offs_r = tl.arange(0, BLOCK_R)                            # rank, padded to >= 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)      # x W^T
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)       # x A^T
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + offs_m[:, None] * K + offs_k[None, :],
                    mask=(offs_m[:, None] < N) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        w_t = tl.load(W + offs_n[None, :] * K + offs_k[:, None],
                      mask=(offs_n[None, :] < O) & (offs_k[:, None] < K), other=0.0).to(tl.float32)
        a_t = tl.load(A + offs_r[None, :] * K + offs_k[:, None],
                      mask=(offs_r[None, :] < R) & (offs_k[:, None] < K), other=0.0).to(tl.float32)
        acc = tl.dot(x, w_t, acc, input_precision="ieee")  # the x tile is used twice while it sits in registers
        xa = tl.dot(x, a_t, xa, input_precision="ieee")    # "ieee": exact fp32 products (a GPU's default is TF32)
    b_t = tl.load(B + offs_n[None, :] * R + offs_r[:, None],
                  mask=(offs_r[:, None] < R) & (offs_n[None, :] < O), other=0.0).to(tl.float32)
    acc = tl.dot(xa * s, b_t, acc, input_precision="ieee")  # epilogue: + s (x A^T) B^T
    tl.store(Y + offs_m[:, None] * O + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=(offs_m[:, None] < N) & (offs_n[None, :] < O))


def my_lora_linear(x, W, A, B, s, blocks=(16, 16, 16)):
    N, K = x.shape
    O, R = B.shape
    y = torch.empty(N, O, dtype=x.dtype, device=x.device)
    BM, BN, BK = blocks
    grid = (triton.cdiv(N, BM), triton.cdiv(O, BN))
    fused_lora_fwd[grid](x, W, A, B, y, N, K, O, R, s, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                         BLOCK_R=max(16, triton.next_power_of_2(R)))
    return y


# %% [markdown]
# (This lesson version upcasts every tile to fp32 before `tl.dot`, which is always correct, also for bf16 on the
# CPU interpreter, and multiplies them with `input_precision="ieee"`: on a GPU, fp32 tiles otherwise go through
# TF32 (10 mantissa bits), whose error at rank 1 (scale 16) is above the check's 1e-2. The library kernel keeps
# fp16/bf16 tiles on a GPU for the tensor cores' 16-bit rate.)
#
# ### 4b. Check it: odd shapes, every rank, against the reference and against minite
# The shapes are odd on purpose (37 rows, 45 inputs, 51 outputs): every tile edge is ragged. The 16×16×16 tiles are
# what a GPU accepts, and they make several programs and several $K$ steps here too.

# %%
from minite.kernels.lora import lora_linear, lora_linear_ref

ok = True
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for r in (1, 4, 16, 64):
        g = torch.Generator().manual_seed(r)
        x = torch.randn(37, 45, generator=g).to(dtype).to(DEVICE)
        W, A, B = [(0.2 * torch.randn(*sh, generator=g)).to(dtype).to(DEVICE) for sh in ((51, 45), (r, 45), (51, r))]
        ok &= check_op(f"fused forward r={r}", lambda *t: my_lora_linear(*t, 16 / r), lambda *t: lora_linear_ref(
            *t, 16 / r), x, W, A, B, grad=False, atol=4e-2 if dtype == torch.bfloat16 else 1e-2)
        ok &= check_op(f"vs minite r={r}", lambda *t: my_lora_linear(*t, 16 / r), lambda *t: lora_linear(
            *t, scaling=16 / r), x, W, A, B, grad=False, atol=4e-2 if dtype == torch.bfloat16 else 1e-2)
assert ok

# %% [markdown]
# (The tolerance is absolute on outputs of size ~5: a couple of fp16 / bf16 ulps there.)
#
# ### 4c. The backward
# With $g = xA^\top$ saved by the forward (an $(N, r)$ fp32 tensor, small), the gradients of
# $y = xW^\top + s\,gB^\top$ are
# $$dg = s\,dy\,B, \qquad dx = dy\,W + dg\,A, \qquad dA = dg^\top x, \qquad dB = s\,dy^\top g .$$
# minite's `LoRALinearFunction` runs them on the forward's own kernels, three launches and a sum:
#
# | step | kernel | shape |
# |---|---|---|
# | $dg = s\,dy\,B$ | the skinny kernel (as $g = xA^\top$), on $dy$ and $B$ | $(N, r)$ |
# | $dx = dy\,W + dg\,A$ | the forward's GEMM with $W$ and $A$ read the other way round: base loop, then one $r$-step | $(N, K)$ |
# | $dA = dg^\top x$, $dB = s\,dy^\top g$ | one reduction kernel over the $N$ rows, launched for each | $(r, K)$, $(O, r)$ |
#
# The reduction kernel makes $r$ the narrow side of its tile and the wide side ($K$ or $O$) the side the tensor
# cores want at least 64 rows on; a reduction over $N = 8192$ rows with only $K/128$ output tiles would leave most
# of an H200's 132 SMs idle, so the rows are split into chunks, one program each, and the fp32 partial sums are
# added in PyTorch afterwards. $W$ is frozen: no $dW$ is computed, which saves a full $O\times K$ GEMM per layer:
# half of a linear layer's backward FLOPs ($dX$ and $dW$ are one GEMM each, of the forward's size), a third of its
# forward + backward. Deriving the backward, and writing a $dA/dB$ kernel, is the exercise. Here we check minite's
# against autograd, and that the backward really reuses $g$ and runs in the kernels just listed:

# %%
g = torch.Generator().manual_seed(0)
x = torch.randn(37, 45, generator=g).to(DEVICE)
W, A, B = [(0.2 * torch.randn(*sh, generator=g)).to(DEVICE) for sh in ((51, 45), (4, 45), (51, 4))]
W.requires_grad_(False)
assert check_op("minite fused LoRA fwd+bwd (x, A, B)", lambda x, A, B: lora_linear(x, W, A, B, scaling=4.0,
                backend="triton"), lambda x, A, B: lora_linear_ref(x, W, A, B, 4.0), x, A, B, atol=1e-4)
from minite.kernels.lora import lora_bwd, lora_fwd

dy = torch.randn(37, 51, generator=g).to(DEVICE)
y, g_saved = lora_fwd(x, W, A, B, 4.0)
assert_close(g_saved, x @ A.T, name="g = x A^T, saved by the forward")
dx, dA, dB = lora_bwd(dy, x, W, A, B, g_saved, 4.0)
dg = 4.0 * dy @ B
for name, got, want in (("dx = dy W + dg A", dx, dy @ W + dg @ A), ("dA = dg^T x", dA, dg.T @ x),
                        ("dB = s dy^T g", dB, 4.0 * dy.T @ g_saved)):
    assert_close(got, want, name=name)
print("PASS: the backward's three formulas, on the forward's saved g")

# %% [markdown]
# ## 5. A real fine-tune: LoRA and full fine-tuning on the same axes
#
# The base: a small GPT trained (here, in a few seconds) on Python **source code**, the `.py` files of the standard
# library of this very Python. The new text: Python's **documentation** (`pydoc_data.topics`, ~0.46M characters,
# also shipped with every Python; `--data pydoc-topics` on the CLI). Same language, different register: prose with
# code examples instead of code with comments. A byte-level tokenizer (256 ids) reads any text, so the base's
# vocabulary covers the new one.
#
# Everything goes through `minite.train.train`, exactly what `python -m minite.train` runs:
# ```
# python -m minite.train --data code.txt --data.tokenizer=byte --out_dir base ...
# python -m minite.train --init_from base/ckpt.pt --lora.r=8 --data pydoc-topics --out_dir lora
# python -m minite.train --init_from base/ckpt.pt --data pydoc-topics --out_dir full    # full fine-tune
# ```

# %%
from minite.config import make_config
from minite.train import train, load_checkpoint

WORK = Path(tempfile.mkdtemp(prefix="minite09_"))
stdlib = Path(sysconfig.get_paths()["stdlib"])
code = "".join(f.read_text(encoding="utf-8", errors="replace") for f in sorted(stdlib.glob("*.py")))[:400_000]
(WORK / "code.txt").write_text(code, encoding="utf-8")
TINY = {"model.n_layer": 2, "model.n_head": 4, "model.n_kv_head": 2, "model.n_embd": 64, "model.mlp_hidden": 128,
        "model.block_size": 64, "model.backend": "torch", "data.tokenizer": "byte", "data.data_dir": str(WORK / "data"),
        "train.batch_size": 16, "train.eval_iters": 6, "train.threads": 1, "train.progress": False,
        "train.sample_tokens": 0, "train.log_interval": 5}


def run(**over):
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as log:
        s = train(make_config("cpu", {**TINY, **over}))
    rows = [json.loads(r) for r in (Path(s["out_dir"]) / "log.jsonl").read_text().splitlines()]
    print(f"{Path(s['out_dir']).name:>5}: val {s['val_loss']:.3f} after {s['steps']} steps, "
          f"{time.perf_counter() - t0:.1f} s")
    return s, rows, log.getvalue()


base, base_rows, _ = run(**{"data.path": str(WORK / "code.txt"), "train.out_dir": str(WORK / "base"),
                            "train.max_iters": 200, "train.lr": 3e-3, "train.warmup_iters": 20,
                            "train.eval_interval": 200})
FT = {"train.init_from": str(WORK / "base" / "ckpt.pt"), "data.path": "pydoc-topics", "train.max_iters": 120,
      "train.warmup_iters": 10, "train.eval_interval": 30, "train.min_lr": 1e-4}
lora, lora_rows, lora_log = run(**FT, **{"lora.r": 8, "train.lr": 3e-3, "train.out_dir": str(WORK / "lora")})
full, full_rows, _ = run(**FT, **{"train.lr": 1e-3, "train.out_dir": str(WORK / "full")})
print(next(line for line in lora_log.splitlines() if "trainable params" in line).split(": ", 1)[1])

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for rows, name, c in ((lora_rows, "LoRA r=8 (lr 3e-3)", "C0"), (full_rows, "full fine-tune (lr 1e-3)", "C1")):
    ax.plot(*zip(*[(r["step"], r["loss"]) for r in rows if "loss" in r]), color=c, alpha=0.35, lw=1)
    ax.plot(*zip(*[(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]), "o-", color=c, label=name + ", val")
ax.axhline(lora_rows[0]["val_loss"], color="gray", ls=":", label="base model on the new text")
ax.set(xlabel="fine-tuning step", ylabel="cross-entropy (nats/byte)", title="Fine-tuning on pydoc topics "
       "(thin: train batches)")
ax.legend(), ax.grid(alpha=0.3)
plt.show()
print(f"val loss on the new text: base {lora_rows[0]['val_loss']:.3f} -> LoRA {lora['val_loss']:.3f}, "
      f"full fine-tune {full['val_loss']:.3f}")

# %% [markdown]
# Both beat the base quickly: most of what changes between code and documentation is *style* (long English
# sentences, fewer indentations and brackets), which a few directions in weight space capture. Full fine-tuning
# gets further in the same number of steps here: it has ~8× more trainable parameters and, in a model this small,
# rank 8 of a 64-wide layer is not a small fraction. On large models the gap closes (the LoRA paper matches full
# fine-tuning on GPT-3 175B with $r$ of 1 to 8).
#
# **Samples** from the same prompt and seed, before and after:

# %%
from minite.data import Tokenizer
from minite.layers.lora import load_lora


def model_from(ckpt, adapters=None):
    ck = load_checkpoint(ckpt)
    m = GPT(GPTConfig(**ck["config"]["model"]))
    m.load_state_dict(ck["model"])
    if adapters is not None:
        load_lora(m, load_checkpoint(adapters)["model"], config=LoRAConfig(r=8))
    return m.eval()


tok = Tokenizer("byte")
prompt = torch.tensor([tok.encode("The ")])
base_m, lora_m = model_from(WORK / "base" / "ckpt.pt"), model_from(WORK / "base" / "ckpt.pt", WORK / "lora" / "ckpt.pt")
for name, m in (("base", base_m), ("LoRA", lora_m)):
    out = m.generate(prompt, 160, temperature=0.8, generator=torch.Generator().manual_seed(1))
    print(f"--- {name} ---\n{tok.decode(out[0].tolist())}\n")
sizes = {p: (WORK / p / "ckpt.pt").stat().st_size for p in ("base", "lora", "full")}
print(f"checkpoint sizes: base {sizes['base'] / 1e3:.0f} kB, LoRA {sizes['lora'] / 1e3:.0f} kB (adapters + their "
      f"AdamW state), full fine-tune {sizes['full'] / 1e3:.0f} kB")

# %% [markdown]
# ## 6. Why low rank is enough: the singular values of a full fine-tune's $\Delta W$
#
# The LoRA paper's hypothesis: the *change* a fine-tune makes to a weight matrix has a low "intrinsic rank". We can
# look. The full fine-tune above changed every weight; $\Delta W = W_{\text{full}} - W_{\text{base}}$ is a dense
# matrix. Its singular values $\sigma_1 \ge \sigma_2 \ge \dots$ say how much of it each direction carries. For
# contrast: a random Gaussian matrix of the same shape and norm (what $\Delta W$ would look like if the fine-tune
# had changed weights in no particular direction).

# %%
wb, wf = load_checkpoint(WORK / "base" / "ckpt.pt")["model"], load_checkpoint(WORK / "full" / "ckpt.pt")["model"]
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for name in ("blocks.0.attn.qkv.weight", "blocks.1.attn.proj.weight", "blocks.0.mlp.gate_up.weight",
             "blocks.1.mlp.down.weight"):
    dW = (wf[name] - wb[name]).double()
    sv = torch.linalg.svdvals(dW)
    energy = (sv**2).cumsum(0) / (sv**2).sum()
    axes[0].semilogy(range(1, len(sv) + 1), sv / sv[0], label=name.removesuffix(".weight"))
    axes[1].plot(range(1, len(sv) + 1), energy, label=name.removesuffix(".weight"))
    print(f"{name:>28} {tuple(dW.shape)}: rank 8 holds {100 * energy[7]:.0f} % of ||dW||^2")
rnd = torch.randn(dW.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
sv = torch.linalg.svdvals(rnd)
print(f"{'random matrix':>28} {tuple(rnd.shape)}: rank 8 holds {100 * (sv[:8]**2).sum() / (sv**2).sum():.0f} %")
axes[0].semilogy(range(1, len(sv) + 1), sv / sv[0], "k--", label="random matrix, same shape")
axes[1].plot(range(1, len(sv) + 1), (sv**2).cumsum(0) / (sv**2).sum(), "k--", label="random matrix")
axes[0].set(xlabel="index i", ylabel="σ_i / σ_1", title="singular values of ΔW (full fine-tune)")
axes[1].set(xlabel="rank k", ylabel="fraction of ||ΔW||²", title="energy in the top k directions")
axes[1].axvline(8, color="gray", ls=":")
for a in axes:
    a.grid(alpha=0.3), a.legend(fontsize=7)
plt.show()

# %% [markdown]
# The spectrum of $\Delta W$ falls off much faster than the random matrix's: a handful of directions carry most of
# the change. A rank-8 adapter can represent those directions and nothing else. That is the bet LoRA makes, and
# why it loses little: the directions it cannot represent carry little of what fine-tuning wanted to change.
#
# ## 7. Merge for inference, and its cost
#
# After training, $W' = W + sBA$ can be computed **once** and stored in place of $W$: inference then runs exactly
# the base model's GEMMs, with no adapter overhead at all. `merge_lora(model)` does that for every adapted layer and
# `unmerge_lora(model)` subtracts it again, so one base can serve several adapters in turn.
#
# Costs:
# * **Merging**: one $(O, r)\times(r, K)$ product per layer, $2rKO$ FLOPs, once. For all of a 7B model's
#   projections at $r=16$: ~0.2 TFLOP, milliseconds on a GPU.
# * **Not merging**: each adapted layer adds $2Nr(K+O)$ FLOPs per forward (0.8 % of $2NKO$ at $K=O=4096$, $r=16$),
#   and, unfused, the extra memory passes of section 4. The FLOPs are nothing; the passes and the extra kernel
#   launches are what a small batch feels.
# * **Exactness**: the merged weight is rounded to $W$'s dtype. In bf16, $sBA$ entries smaller than half an ulp of
#   $W$ vanish on merge, and unmerging does not bring them back exactly. Merge in fp32 when it matters.

# %%
from minite.layers.lora import merge_lora, unmerge_lora

idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    before = lora_m(idx)[0]
    w0 = lora_m.blocks[0].attn.qkv.weight.clone()
    merge_lora(lora_m)
    merged = lora_m(idx)[0]
    print("merged model is a plain GPT forward:", all(m.merged for m in lora_m.modules() if isinstance(m, LoRALinear)))
    assert all(m.merged for m in lora_m.modules() if isinstance(m, LoRALinear)), "every adapter merged"
    assert_close(merged, before, name="merged logits", atol=1e-4)
    unmerge_lora(lora_m)
    assert_close(lora_m.blocks[0].attn.qkv.weight, w0, name="unmerged weight")
print("PASS: merged == adapter logits, unmerge restores W (fp32)")

lay = lora_m.blocks[0].attn.qkv  # the same round trip with a bf16 weight
w16, dW = lay.weight.detach().bfloat16(), lay.delta_weight()
back = ((w16.float() + dW).bfloat16().float() - dW).bfloat16()
print(f"bf16: |s B A| median {dW.abs().median():.1e} vs W's ulp median "
      f"{(w16.float().abs() * 2**-8).median():.1e}; round trip changes {(back != w16).float().mean() * 100:.0f} % "
      "of the weights by 1 ulp")

# %% [markdown]
# ## 8. Measured on a GPU
# `benchmarks/bench_lora.py` times minite's LoRA linear against the unfused three-GEMM version (its peer: what
# PEFT's `lora.Linear` runs), the base GEMM alone and the merged layer, at $N = 8192$ tokens, $K = O = 4096$, bf16,
# and writes `benchmarks/results/lora_<device>.json`. The cell below plots the file recorded on this notebook's GPU,
# or on a CPU the newest GPU run recorded: an **NVIDIA H200** on 2026-11-28 (torch 2.11, triton 3.6, CUDA-graph
# timer). On the CPU the kernels only run in the interpreter, where timings mean nothing.

# %% tags=["nbval-ignore-output"]
from minite.recorded import recorded_for

found = recorded_for("lora")  # (file, JSON) of this GPU, else of the H200; None where nothing is recorded
rec = found and found[1]
if rec is None:
    print("No GPU measurement recorded for this chapter: run `python benchmarks/bench_lora.py` on a GPU.")
else:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        rows = [r for r in rec["results"] if r["mode"] == mode]
        ranks = sorted({r["r"] for r in rows})
        impls = [i for i in ("base only", "merged", "unfused", "minite fused") if any(r["impl"] == i for r in rows)]
        for j, impl in enumerate(impls):
            ms = [next((r["ms"] for r in rows if r["impl"] == impl and r["r"] == rk), 0.0) for rk in ranks]
            ax.bar([i + 0.2 * (j - (len(impls) - 1) / 2) for i in range(len(ranks))], ms, width=0.2, label=impl)
        ax.set_xticks(range(len(ranks)), [f"r={rk}" for rk in ranks])
        ax.set(title=mode, ylabel="ms")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"LoRA linear, 8192 x 4096 -> 4096, bf16 — {rec['device']}")
    plt.show()
    for r in rec["results"]:
        print(f"{r['impl']:13} r={r['r']:3} {r['mode']:8} {r['ms']:.3f} ms")

# %% [markdown]
# **Where minite lost on the H200 (2026-11-28), and why.** Those numbers are the single-pass kernel of section 4a,
# and it lost everywhere: forward 0.78 ms against the unfused 0.48 ms at $r = 8$ (0.62×), 1.05 against 0.50 at
# $r = 64$ (0.47×); forward+backward 1.82 against 1.04 (0.57×) and 2.00 against 1.04 (0.52×). cuBLAS's base GEMM
# alone took 0.34 ms (799 TFLOP/s), the merged layer 0.37 ms: the two extra GEMMs and the add cost the unfused
# version only ~0.14 ms, far less than the kernel lost. Compiling it for sm_90 as the GPU's JIT does gave the
# reasons: a small tile (64×128×32 on 4 warps, one warpgroup: about half of cuBLAS's rate), $xA^\top$ recomputed by
# every one of the 32 column tiles (+12.5 % MMA work at $r \le 16$, +50 % at $r = 64$: the step from 0.78 to
# 1.05 ms), rows running fastest with no grouped order (each column pass re-reads $x$), and a $dA/dB$ kernel with a
# 16-row dot on the older `mma.sync` and 64 programs for 132 SMs.
#
# **Changed since, not measured yet.** minite's current kernels (sections 4 and 4c): $g$ computed once, the adapter
# as one extra $K$-step of a 128×256×64, 8-warp GEMM in grouped order (`m64n256k16` wgmma, no spills in the
# sm_90 compile), and the row-split $dA/dB$ reduction. Expected, not measured: the forward near the merged layer
# (~0.37–0.40 ms, i.e. about 1.2× faster than unfused) and forward+backward below the unfused 1.04 ms; at best
# LoRA then costs what the merged layer costs plus one pass over $x$. Until a GPU run records a new
# `lora_<device>.json`, the plot shows the old kernel.

# %% [markdown]
# ## 9. Where it is used
#
# * `minite.layers.lora`: `LoRAConfig(r, alpha, dropout, target_modules, use_rslora)`, `apply_lora`,
#   `merge_lora` / `unmerge_lora`, `lora_state_dict` / `save_lora` / `load_lora` (adapters only; a wrong base is an
#   error naming the keys and shapes), `print_trainable_parameters`. `target_modules` takes name suffixes
#   (`["qkv", "proj"]`), a regex, or `"all-linear"` (never the LM head).
# * `python -m minite.train --init_from out/ckpt.pt --lora.r=8 --data notes.txt` fine-tunes your Shakespeare GPT on
#   your text, saves adapters only, resumes exactly with `--resume`, and prints trainable vs total parameters.
#   A char-level base cannot read characters its training text did not have (a fine-tune cannot add embedding
#   rows): train the base with `--data.tokenizer=byte`, or drop/replace them with `--data.unknown_chars`.
# * Under `fp8_autocast` the frozen base runs its GEMMs in FP8 (chapter 02) and the adapter in bf16.
#
# **Exercises** (`exercises/09_lora_exercise.ipynb`): derive the backward, write the $dA/dB$ reduction kernel
# and a Triton merge kernel from their specs, and extract a LoRA from a full fine-tune.
