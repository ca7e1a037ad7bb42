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
# # 14 — Graduation: exercises
#
# Four graded tasks, each a piece the lesson used but did not write. Fill in each region between
# `### BEGIN YOUR CODE` and `### END YOUR CODE` (delete the `raise NotImplementedError()`), run the cell, then its
# check cell.
#
# 1. **A whole Triton kernel from a spec**: the mixed-precision AdamW step of an fp16 run (unscale, update the fp32
#    master weights, write the 16-bit copy the model computes with), and its launcher.
# 2. **The layout check**: every reason a parallel layout cannot work, with its numbers.
# 3. **Resharding the fused QKV weight** from one tensor-parallel degree to another, without a dense copy on disk.
# 4. **Utilisation with recompute**: MFU and HFU.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import math
from minite._triton import triton, tl
from minite.testing import check_op
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## Task 1 — the fused mixed-precision AdamW step
#
# In an fp16 run (`--precision fp16`) the loss is multiplied by a scale $S$ before the backward, so the gradients
# that arrive are $S$ times too large and stored in fp16; the optimizer keeps fp32 **master** weights and moments,
# and the model computes with a 16-bit copy of the weights. Write `amp_adamw_kernel` from this spec; nothing else
# is given.
#
# * One program per `BLOCK` consecutive elements of flat, contiguous tensors of `n` elements; mask the tail.
# * Inputs: `G` (scaled gradients, fp16), `P` (fp32 master weights), `M`, `V` (fp32 first and second moments),
#   `Q` (the 16-bit model copy, fp16), and the scalars `inv_scale` ($1/S$), `lr`, `beta1`, `beta2`, `eps`, `wd`,
#   `bc1` $= 1 - \beta_1^t$, `bc2` $= 1 - \beta_2^t$ for step $t$.
# * In place: `P`, `M`, `V` get exactly what `torch.optim.AdamW` (decoupled weight decay `wd` on every element,
#   `amsgrad=False`) computes for fp32 parameters whose gradient is the *unscaled* gradient (in fp32); `Q` gets the
#   new `P` rounded to fp16.
#
# Then write the launcher `amp_adamw_(p, g, m, v, q, *, step, lr, betas, eps, weight_decay, inv_scale)`: it checks
# that the five tensors have the same number of elements (a `ValueError` naming the sizes otherwise), launches the
# kernel with `BLOCK = 256` and returns nothing. (The caller skips the step when a gradient is not finite.)

# %% minite={"task": "amp_adamw_kernel"}
@triton.jit
def amp_adamw_kernel(G, P, M, V, Q, n, inv_scale, lr, beta1, beta2, eps, wd, bc1, bc2, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    live = offs < n
    grad = tl.load(G + offs, mask=live, other=0.0).to(tl.float32) * inv_scale
    w = tl.load(P + offs, mask=live, other=0.0)
    m1 = tl.load(M + offs, mask=live, other=0.0)
    m2 = tl.load(V + offs, mask=live, other=0.0)
    w = w * (1.0 - lr * wd)  # decoupled decay first, as torch does
    m1 = beta1 * m1 + (1.0 - beta1) * grad
    m2 = beta2 * m2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(m2) / tl.sqrt(bc2) + eps
    w = w - (lr / bc1) * (m1 / denom)
    tl.store(P + offs, w, mask=live)
    tl.store(M + offs, m1, mask=live)
    tl.store(V + offs, m2, mask=live)
    tl.store(Q + offs, w.to(Q.dtype.element_ty), mask=live)
    ### END SOLUTION


def amp_adamw_(p, g, m, v, q, *, step, lr, betas, eps, weight_decay, inv_scale):
    ### BEGIN SOLUTION
    sizes = [t.numel() for t in (p, g, m, v, q)]
    if len(set(sizes)) != 1:
        raise ValueError(f"amp_adamw_: p, g, m, v, q must have the same number of elements, got {sizes}")
    b1, b2 = betas
    n = sizes[0]
    amp_adamw_kernel[(triton.cdiv(n, 256),)](g, p, m, v, q, n, inv_scale, lr, b1, b2, eps, weight_decay,
                                             1.0 - b1**step, 1.0 - b2**step, BLOCK=256)
    ### END SOLUTION

# %% minite={"check": "amp_adamw_kernel"} tags=["nbval-check-output"]
# CHECK: amp_adamw_kernel
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def fused(p0, grads, scale):
    p, q = p0.clone().to(DEVICE), p0.half().to(DEVICE)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        amp_adamw_(p, (g * scale).half().to(DEVICE), m, v, q, step=t, inv_scale=1.0 / scale, **HP)
    return p.cpu(), m.cpu(), v.cpu(), q.cpu()


def torch_adamw(p0, grads, scale):
    w = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([w], **HP)
    for g in grads:
        w.grad = (g * scale).half().float() / scale  # what the fp16 gradient holds, unscaled
        opt.step()
    st = opt.state[w]
    return w.detach(), st["exp_avg"], st["exp_avg_sq"], w.detach().half()


gen = torch.Generator().manual_seed(5)
for n, steps in ((1000, 1), (37, 3), (513, 2)):
    p0 = torch.randn(n, generator=gen)
    grads = torch.randn(steps, n, generator=gen)
    assert check_op(f"amp_adamw_kernel n={n} steps={steps}", fused, torch_adamw, p0, grads, 1024.0, grad=False)
try:
    amp_adamw_(torch.zeros(4), torch.zeros(4).half(), torch.zeros(4), torch.zeros(5), torch.zeros(4).half(),
               step=1, inv_scale=1.0, **HP)
    raised = False
except ValueError:
    raised = True
assert raised
print("PASS: amp_adamw_kernel")

# %% [markdown]
# ## Task 2 — every reason a layout cannot work
#
# `layout_errors(world, *, dp, tp, pp, cp, n_head, n_layer, T, batch)` returns a dict `{rule: message}` with one
# entry per rule the layout breaks (an empty dict when it can run). The rules, by name:
#
# * `"world"`: the degrees must use exactly the `world` processes;
# * `"heads"`: tensor parallelism splits attention by heads;
# * `"layers"`: every pipeline stage needs at least one layer;
# * `"sequence"`: context parallelism (when `cp > 1`) cuts each sequence of `T` tokens into `2 cp` load-balanced
#   chunks;
# * `"batch"`: `batch` is the global batch, split evenly over the data-parallel ranks.
#
# Each message must contain the numbers involved (as decimal integers): for `"world"` the world size and the
# product of the degrees, for `"heads"` `n_head` and `tp`, for `"layers"` `pp` and `n_layer`, for `"sequence"`
# `T` and `2 cp`, for `"batch"` `batch` and `dp`.

# %% minite={"task": "layout_errors"}
def layout_errors(world, *, dp, tp, pp, cp, n_head, n_layer, T, batch):
    ### BEGIN SOLUTION
    found = {}
    used = dp * tp * pp * cp
    if used != world:
        found["world"] = f"dp*tp*pp*cp = {used} processes, but the world has {world}"
    if n_head % tp:
        found["heads"] = f"tp={tp} does not divide n_head={n_head}"
    if pp > n_layer:
        found["layers"] = f"pp={pp} stages for n_layer={n_layer} layers"
    if cp > 1 and T % (2 * cp):
        found["sequence"] = f"T={T} tokens do not split into 2*cp={2 * cp} chunks"
    if batch % dp:
        found["batch"] = f"global batch {batch} does not split over dp={dp}"
    return found
    ### END SOLUTION

# %% minite={"check": "layout_errors"} tags=["nbval-check-output"]
# CHECK: layout_errors
CASES = [  # (world, dp, tp, pp, cp, n_head, n_layer, T, batch)
    (4, 2, 2, 1, 1, 4, 4, 64, 8), (8, 2, 2, 2, 1, 12, 6, 128, 16), (8, 2, 2, 1, 2, 4, 4, 64, 8),
    (8, 2, 3, 1, 1, 4, 4, 64, 8), (4, 1, 1, 4, 1, 4, 2, 64, 8), (4, 1, 1, 1, 4, 4, 4, 60, 8),
    (6, 3, 2, 1, 1, 4, 4, 64, 8), (16, 2, 8, 2, 1, 12, 1, 100, 9), (2, 1, 1, 1, 2, 8, 8, 6, 5),
    (4, 4, 1, 1, 1, 4, 4, 63, 8)]
RULES = ("world", "heads", "layers", "sequence", "batch")
NEEDS = {"world": lambda w, dp, tp, pp, cp, h, L, T, b: (w, dp * tp * pp * cp), "heads": lambda w, dp, tp, pp, cp, h, L, T, b: (h, tp),
         "layers": lambda w, dp, tp, pp, cp, h, L, T, b: (pp, L), "sequence": lambda w, dp, tp, pp, cp, h, L, T, b: (T, 2 * cp),
         "batch": lambda w, dp, tp, pp, cp, h, L, T, b: (b, dp)}


def broken_rules(cases):  # (len(cases), 5): 1.0 where the case breaks the rule
    out = []
    for case in cases.tolist():
        w, dp, tp, pp, cp, h, L, T, b = case
        errs = layout_errors(w, dp=dp, tp=tp, pp=pp, cp=cp, n_head=h, n_layer=L, T=T, batch=b)
        out.append([float(r in errs) for r in RULES])
    return torch.tensor(out)


# the reference run records the solution's answers; yours are compared with them
assert check_op("layout_errors", broken_rules, broken_rules, torch.tensor(CASES), grad=False)
mentions = []
for case in CASES:
    w, dp, tp, pp, cp, h, L, T, b = case
    errs = layout_errors(w, dp=dp, tp=tp, pp=pp, cp=cp, n_head=h, n_layer=L, T=T, batch=b)
    print(case, "->", sorted(errs))
    mentions += [rule in NEEDS and all(str(x) in msg for x in NEEDS[rule](*case)) for rule, msg in errs.items()]
assert all(mentions)
print("PASS: layout_errors")

# %% [markdown]
# ## Task 3 — re-cut the fused QKV weight for a new tensor-parallel degree
#
# Under tensor parallelism, rank $r$ of $t$ holds the rows of the fused QKV weight (dense shape
# $((H + 2\,KVH)\,D, C)$: the $H$ query heads' rows, then the $KVH$ key heads', then the $KVH$ value heads', $D$ rows
# per head) that its heads need: its $H/t$ query heads $[rH/t, (r+1)H/t)$, then its $KVH/t$ key heads, then the
# same value heads, concatenated in that order. A checkpoint written by a run of degree $t$ (a list of $t$ such
# shards) is to be resumed at degree $t'$.
#
# `reshard_qkv(shards, n_head, n_kv_head, head_dim, new_tp)` returns the list of `new_tp` shards of degree `new_tp`,
# in the same layout. Both the old degree (`len(shards)`) and `new_tp` must divide `n_head` and `n_kv_head`
# (replicated kv heads are out of scope): raise a `ValueError` naming the numbers otherwise.

# %% minite={"task": "reshard_qkv"}
def reshard_qkv(shards, n_head, n_kv_head, head_dim, new_tp):
    ### BEGIN SOLUTION
    old_tp = len(shards)
    for deg in (old_tp, new_tp):
        if deg < 1 or n_head % deg or n_kv_head % deg:
            raise ValueError(f"tp={deg} must divide n_head={n_head} and n_kv_head={n_kv_head}")
    sizes = [n_head * head_dim // old_tp, n_kv_head * head_dim // old_tp, n_kv_head * head_dim // old_tp]
    parts = [s.split(sizes, dim=0) for s in shards]  # per old rank: (q, k, v) rows
    whole = [torch.cat([pr[i] for pr in parts], dim=0) for i in range(3)]  # dense q, k, v row blocks
    cut = [w.chunk(new_tp, dim=0) for w in whole]
    return [torch.cat([cut[0][r], cut[1][r], cut[2][r]], dim=0) for r in range(new_tp)]
    ### END SOLUTION

# %% minite={"check": "reshard_qkv"} tags=["nbval-check-output"]
# CHECK: reshard_qkv
def by_rows(dense, H, KVH, D, tp):  # the chapter-11 cut, from the dense weight
    out = []
    for r in range(tp):
        q = torch.arange(r * H // tp * D, (r + 1) * H // tp * D)
        kv = torch.arange(r * KVH // tp * D, (r + 1) * KVH // tp * D)
        out.append(dense[torch.cat([q, H * D + kv, (H + KVH) * D + kv])])
    return out


gen = torch.Generator().manual_seed(6)
for H, KVH, D, C, old, new in ((8, 4, 4, 6, 2, 4), (8, 4, 4, 6, 4, 2), (6, 2, 3, 5, 2, 1), (4, 4, 2, 3, 1, 4)):
    dense = torch.randn((H + 2 * KVH) * D, C, generator=gen)
    assert check_op(f"reshard_qkv {old}->{new}", lambda *s: tuple(reshard_qkv(list(s), H, KVH, D, new)),
                    lambda *s: tuple(by_rows(dense, H, KVH, D, new)), *by_rows(dense, H, KVH, D, old), grad=False)
try:
    reshard_qkv(by_rows(torch.zeros(32, 2), 8, 4, 2, 2), 8, 4, 2, 3)
    raised = False
except ValueError:
    raised = True
assert raised
print("PASS: reshard_qkv")

# %% [markdown]
# ## Task 4 — model FLOPs vs hardware FLOPs
#
# MFU counts the FLOPs the *model* needs per token (the lesson's count, $6N + 12LCT$, PaLM appendix B); **HFU**
# (hardware FLOPs utilisation) counts what the hardware actually executes, recompute included. With
# `--train.recompute=full`, every transformer block's forward runs a second time during the backward (the
# embedding and the LM head are not recomputed); with minite's `selective`, GEMM and attention outputs are kept and
# only elementwise ops re-run: count those as 0 FLOPs; `none` recomputes nothing.
#
# `utilization(tokens_per_s, *, n_params, n_block_params, n_layer, n_embd, T, peak_flops, recompute)` returns
# `(mfu, hfu)` as fractions. `n_params` counts every parameter once (the tied embedding once), `n_block_params`
# those inside the transformer blocks. Unknown `recompute` values raise a `ValueError`.

# %% minite={"task": "utilization"}
def utilization(tokens_per_s, *, n_params, n_block_params, n_layer, n_embd, T, peak_flops, recompute):
    ### BEGIN SOLUTION
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: expected none, selective or full")
    attn = n_layer * n_embd * T  # the weight-free matmuls, per token per unit
    needed = 6 * n_params + 12 * attn
    again = 2 * n_block_params + 4 * attn if recompute == "full" else 0  # one more forward of the blocks
    return tokens_per_s * needed / peak_flops, tokens_per_s * (needed + again) / peak_flops
    ### END SOLUTION

# %% minite={"check": "utilization"} tags=["nbval-check-output"]
# CHECK: utilization
CASES4 = [(180e3, 124e6, 85e6, 12, 768, 1024, 989e12), (2.5e3, 7e9, 6.5e9, 32, 4096, 4096, 989e12),
          (9e3, 0.9e6, 0.8e6, 4, 128, 128, 1e12)]
MODES = ("none", "selective", "full")


def all_utilization(cases):  # (cases, modes, 2): (mfu, hfu)
    return torch.tensor([[utilization(tps, n_params=N, n_block_params=Nb, n_layer=int(L), n_embd=int(C), T=int(T),
                                      peak_flops=peak, recompute=mode) for mode in MODES]
                         for tps, N, Nb, L, C, T, peak in cases.tolist()], dtype=torch.float64)


# the reference run records the solution's answers; yours are compared with them
assert check_op("utilization", all_utilization, all_utilization, torch.tensor(CASES4, dtype=torch.float64),
                grad=False)
for mode in MODES:
    mfu, hfu = utilization(180e3, n_params=124e6, n_block_params=85e6, n_layer=12, n_embd=768, T=1024,
                           peak_flops=989e12, recompute=mode)
    print(f"GPT-2 124M, an example input of 180k tokens/s on an H100, recompute {mode:9s}: MFU {mfu:.1%}, HFU {hfu:.1%}")
try:
    utilization(1.0, n_params=1, n_block_params=1, n_layer=1, n_embd=1, T=1, peak_flops=1.0, recompute="some")
    raised = False
except ValueError:
    raised = True
assert raised
print("PASS: utilization")
