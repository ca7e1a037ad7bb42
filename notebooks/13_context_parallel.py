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
# # 13 — Context parallelism: ring attention over the flash kernel
#
# Data, tensor and pipeline parallelism all keep the **whole sequence** on every rank. At long context that is the
# wall: the activations a transformer layer keeps for backward grow with the sequence length $s$. With the
# chapter-11 count (Korthikanti et al. 2022, with flash attention so no $s^2$ term), a layer of width $h$ keeps
# about $34\,s\,b\,h$ bytes in 16-bit: for $h = 4096$, $b = 1$ and $s = 128\text{k}$ that is **18 GB per layer**,
# before any weight. Tensor parallelism with SP divides this by $t$, but $t$ stops at the heads of one node.
#
# **Context parallelism (CP)** cuts the sequence itself over $cp$ ranks. Every op of the GPT except attention works
# token by token (embedding, norms, projections, MLP, the loss), so it runs unchanged on a rank's $T/cp$ tokens.
# Attention is the one place where tokens meet: each query needs every key before it. Transformer Engine's
# context parallelism offers four ways (the `cp_comm_type` argument of `DotProductAttention`, which Megatron-LM
# sets from its `--cp-comm-type` flag); this chapter builds the first three (section 7 the all-to-all), and minite's
# library has the fourth too (`--parallel.cp_mode=hybrid`):
#
# * **the ring** (`cp_comm_type="p2p"`): K/V blocks travel around the ranks, each step runs the chapter-07 flash
#   kernel on the block at hand, and the partial outputs are merged exactly by their **log-sum-exp**;
# * **all-gather K/V** (`cp_comm_type="all_gather"`): gather all keys once, reduce-scatter their gradients;
# * **all-to-all** (`cp_comm_type="a2a"`, DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all trades the
#   sequence shard for a head shard, so each rank runs ordinary attention over the *whole* sequence for $H/cp$ of
#   the heads, and a second all-to-all trades back; $cp$ must divide the number of heads;
# * **all-to-all inside, ring across** (`cp_comm_type="a2a+p2p"`, the hybrid of USP, Fang & Zhao 2024):
#   all-to-all inside a group of ranks (a node), the ring between groups.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import json, tempfile
import math
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from minite.ops import attention
from minite.kernels.attention import attention_bwd
from minite.parallel.launch import torchrun, results
from minite.parallel import context
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

for cp in (1, 2, 4, 8):
    gb = 34 * 131072 * 4096 / cp / 1e9
    print(f"cp={cp}: activations kept per layer at s=128k, h=4096: {gb:5.1f} GB per rank")

# %% [markdown]
# ## 1. Merging two partial attentions: the LSE rule
#
# Split the keys of one query row into two sets $A$ and $B$. The flash kernel run on $A$ alone returns
# $O_A = \sum_{j\in A} e^{s_j} v_j / Z_A$ and $\mathrm{LSE}_A = \log Z_A$ with $Z_A = \sum_{j\in A} e^{s_j}$ (this is
# what `return_lse=True` is for). The full softmax normaliser is $Z = Z_A + Z_B$, so
#
# $$\mathrm{LSE} = \log\left(e^{\mathrm{LSE}_A} + e^{\mathrm{LSE}_B}\right), \qquad
#   O = e^{\mathrm{LSE}_A - \mathrm{LSE}}\,O_A + e^{\mathrm{LSE}_B - \mathrm{LSE}}\,O_B .$$
#
# Exact, not an approximation: it is the online softmax of chapter 07 applied to two blocks. Two details matter:
# compute it in **fp32** (each part's $O$ arrives in the input precision, the weights must not), and a row that saw
# no key in a part has $\mathrm{LSE} = -\infty$ there: the weight must come out 0, not `NaN` from
# $-\infty - (-\infty)$. `torch.logaddexp` handles one $-\infty$; both being $-\infty$ needs a guard.

# %%
def merge(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a.float(), lse_b.float())  # (B, H, T)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # no key in either part: keep 0, not NaN
    w_a, w_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)  # in [0, 1]
    return w_a[..., None] * o_a.float() + w_b[..., None] * o_b.float(), lse

g = torch.Generator().manual_seed(1)
q, k, v = (torch.randn(1, 2, 24, 16, generator=g).to(DEVICE) for _ in range(3))
o_full, lse_full = attention(q, k, v, causal=False, return_lse=True)  # the chapter-07 kernel, all 24 keys
o_a, lse_a = attention(q, k[:, :, :10], v[:, :, :10], causal=False, return_lse=True)
o_b, lse_b = attention(q, k[:, :, 10:], v[:, :, 10:], causal=False, return_lse=True)
o_m, lse_m = merge(o_a, lse_a, o_b, lse_b)
err = max(float((o_m - o_full).abs().max()), float((lse_m - lse_full).abs().max()))
print(f"max |merged - one call| = {err:.1e}")
assert err < 1e-5
ninf = torch.full_like(lse_a, float("-inf"))
o_e, lse_e = merge(torch.zeros_like(o_a), ninf, torch.zeros_like(o_b), ninf)
assert not o_e.isnan().any() and (o_e == 0).all() and torch.isinf(lse_e).all()
print("PASS: the LSE merge equals one call over all keys, and rows with no key give 0 and -inf")

# %% [markdown]
# ## 2. The ring, simulated in one process
#
# Give rank $r$ the $r$-th contiguous chunk of the sequence: its queries $Q_r$ and its keys and values $K_r, V_r$.
# At step $i$ rank $r$ holds the block of rank $r - i$ (mod $cp$): it attends to it, merges, and passes it on to
# rank $r+1$. After $cp$ steps every query has met every key, and no rank ever held more than two blocks.
#
# Causal attention decides per block: the block of rank $r$ itself is the diagonal (a causal call); blocks of
# earlier ranks are entirely in the past (a **non-causal** call); blocks of later ranks are entirely in the future
# (skipped). Below, "ranks" are list entries and every step calls the chapter-07 kernel with `return_lse=True`.

# %%
def ring_simulated(q, k, v, cp, causal):
    """The forward ring: (O, LSE) of every rank, concatenated in rank order."""
    Q, K, V = q.chunk(cp, 2), k.chunk(cp, 2), v.chunk(cp, 2)  # rank r holds chunk r
    out, lses = [], []
    for r in range(cp):
        o = torch.zeros(Q[r].shape, device=q.device)
        lse = torch.full(Q[r].shape[:3], float("-inf"), device=q.device)
        for step in range(cp):
            src = (r - step) % cp  # the rank whose K/V block I hold at this step
            if causal and src > r:
                continue  # entirely in the future of my queries
            o_b, lse_b = attention(Q[r], K[src], V[src], causal=causal and src == r, return_lse=True)
            o, lse = merge(o, lse, o_b, lse_b)
        out.append(o)
        lses.append(lse)
    return torch.cat(out, 2), torch.cat(lses, 2)

q, k, v = (torch.randn(1, 2, 4 * 12, 16, generator=g).to(DEVICE) for _ in range(3))
for causal in (False, True):
    err = float((ring_simulated(q, k, v, 4, causal)[0] - attention(q, k, v, causal=causal)).abs().max())
    print(f"causal={causal}: max |ring over 4 ranks - one call| = {err:.1e}")
    assert err < 1e-5
print("PASS: the simulated ring equals the single-process kernel")

# %% [markdown]
# ## 3. Causal load balancing
#
# The simulation hides a problem: with contiguous chunks rank 0 computes one (causal) block and rank $cp-1$
# computes $cp$ of them. The ring moves at the pace of the slowest rank, so about half the machine idles.
#
# Two fixes are in use. **Striped attention** (Brandon et al. 2023) deals the tokens out one at a time: rank $r$
# holds tokens $r, r + cp, r + 2cp, \dots$, so every rank's tokens are spread evenly over the sequence (each block
# then needs a causal mask shifted by one token between ranks). The **zig-zag** layout (Megatron-LM's CP,
# Transformer Engine, also known from the ring-flash-attention code) is the one minite uses: cut the sequence into
# $2\,cp$ chunks and give rank $r$ chunks $r$ and $2cp-1-r$, one early, one late. Then every step costs the same
# on every rank:
# * step 0, my own block: a plain causal call on my tokens (their local order follows the global one);
# * a block from a lower rank $s < r$: both my chunks see its first chunk $s$ completely and its chunk $2cp-1-s$
#   not at all: **all my queries × the first half** of the block, non-causal;
# * a block from a higher rank $s > r$: only my late chunk sees it, completely: **my second half × all** of it.
#
# Each off-diagonal step is exactly half a block of work. The layout and the plan, as functions (`Tl` is a rank's
# number of tokens, two chunks of $T/2cp$):

# %%
def zigzag_positions(T, cp, rank):
    """The global positions of rank `rank`'s tokens: chunks rank and 2cp-1-rank of the 2cp chunks, in that order."""
    c = T // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def zigzag_plan(step, r, cp, Tl):
    """What rank r computes (causal) at ring step `step`, holding the block of rank (r - step) % cp:
    (my query rows, the block's key rows, causal mask?) as slices of the two ranks' Tl local tokens."""
    src, all_, h = (r - step) % cp, slice(0, Tl), Tl // 2
    if step == 0:
        return all_, all_, True  # my own block: local order follows global order
    return (all_, slice(0, h), False) if src < r else (slice(h, Tl), all_, False)


# %% tags=["nbval-check-output"]
# CHECK: the zig-zag plan
for cp_, T in ((2, 8), (2, 12), (3, 18), (4, 16), (4, 40)):
    pos = [zigzag_positions(T, cp_, r) for r in range(cp_)]
    assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(T))  # every token on exactly one rank
    work = []
    for r in range(cp_):
        assert torch.equal(pos[r], context.positions(T, cp_, r))  # minite's layout, used on real ranks
        done = 0
        for step in range(cp_):
            src = (r - step) % cp_
            visible = pos[r][:, None] >= pos[src][None, :]  # the causal mask between my tokens and the block's
            qs, ks_, causal = zigzag_plan(step, r, cp_, len(pos[r]))
            planned = torch.zeros_like(visible)
            planned[qs, ks_] = True
            if causal:
                planned &= torch.ones_like(visible).tril()
            assert torch.equal(planned, visible), (cp_, T, r, step)  # computes exactly the visible scores
            done += int(visible.sum())
        work.append(done)
    assert len(set(work)) == 1, (cp_, T, work)  # every rank computes the same number of scores
print("PASS: the zig-zag layout covers the sequence, its plan computes exactly the visible scores, and every "
      "rank does the same work")

# %% [markdown]
# The plot colours each visible (query chunk, key chunk) tile of the causal mask by the rank that computes it; a
# tile on the diagonal holds half a tile of visible scores, so it counts one half.

# %%
cp = 4
fig, axes = plt.subplots(1, 2, figsize=(9, 4), layout="tight")
for ax, balanced in zip(axes, (False, True)):
    n = 2 * cp  # draw in units of the 2cp chunks
    owner = torch.full((n, n), float("nan"))
    for r in range(cp):
        held = zigzag_positions(n, cp, r) if balanced else torch.arange(r * n // cp, (r + 1) * n // cp)
        for qc in held.tolist():  # the chunks rank r holds (chunk = one unit here)
            owner[qc, :qc + 1] = r
    ax.imshow(owner, cmap="tab10", vmin=0, vmax=9)
    work = [float((owner == r).sum()) - 0.5 * int((owner.diagonal() == r).sum()) for r in range(cp)]  # half diagonals
    ax.set(title=f"{'balanced' if balanced else 'contiguous'}: tiles per rank\n"
                 f"[{', '.join(f'{w:g}' for w in work)}], max/min {max(work) / min(work):.0f}x",
           xlabel=f"key chunk (T/{n} tokens each)", ylabel=f"query chunk (T/{n} tokens each)")
ax.legend(handles=[Patch(color=plt.get_cmap("tab10")(r / 9), label=f"computed by rank {r}") for r in range(cp)] +
          [Patch(facecolor="white", edgecolor="k", label="masked (future keys)")], loc="upper left",
          bbox_to_anchor=(1.02, 1), fontsize=8)
plt.show()

# %% [markdown]
# ## 4. The backward, and why the ring carries dK and dV home
#
# Chapter 07's backward needs, per query row, only the **final** $O$ and $\mathrm{LSE}$:
# $P_{ij} = e^{s_{ij} - \mathrm{LSE}_i}$ is then the true softmax probability, and $D_i = \sum_d dO_{id} O_{id}$ the
# true correction. So the backward of one block, given the final $O$ and LSE, yields *exactly* that block's share of
# $dQ$, $dK$ and $dV$, with no merge at all:
#
# * $dQ_r = \sum_{\text{blocks}} dS\,K\cdot\text{scale}$ accumulates on the rank that owns the queries;
# * $dK, dV$ of a block belong to the rank that owns that block. So the backward ring sends K/V around again, and a
#   **dK/dV accumulator travels with it**: each rank adds its share and passes it on; after $cp$ hops it is home.
#
# One block's backward is chapter 07's, written here in PyTorch for a block of $n_q$ query rows and $n_k$ keys
# ($S = QK^\top\cdot\text{scale}$, the causal mask applied to the diagonal block only):
#
# $$P = e^{S - \mathrm{LSE}},\quad dV \mathrel{+}= P^\top dO,\quad D = \mathrm{rowsum}(dO \circ O),\quad
#   dS = P \circ (dO\,V^\top - D),\quad dQ \mathrel{+}= dS\,K\cdot\text{scale},\quad
#   dK \mathrel{+}= dS^\top Q\cdot\text{scale}.$$
#
# The ring below simulates the ranks as list entries again. `carry[r]` is what rank $r$ holds at a step: a block's
# $K$, $V$, the $dK$/$dV$ accumulated for it so far, and whose block it is. After the compute, every rank passes
# its `carry` to rank $r+1$; after $cp$ steps each accumulator is back with its owner. The ranks hold contiguous
# chunks, as in section 2; `RingAttention` runs the same steps on the balanced plan of section 3 (half blocks off
# the diagonal), and section 5 checks it on real ranks.

# %%
def block_bwd(do, q, k, v, o, lse, causal, scale):
    """dq, dk, dv of one (query block, key block) pair, given the FINAL o and lse of the query rows."""
    s_ = q @ k.transpose(-1, -2) * scale  # (B, H, nq, nk)
    if causal:
        s_ = s_.masked_fill(torch.ones(s_.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p_ = torch.exp(s_ - lse[..., None])  # the true probabilities: lse is the final one
    dv = p_.transpose(-1, -2) @ do
    delta = (do * o).sum(-1, keepdim=True)  # (B, H, nq, 1)
    ds = p_ * (do @ v.transpose(-1, -2) - delta)
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


def ring_backward_simulated(do, q, k, v, o, lse, cp, causal):
    """dq, dk, dv of the whole sequence, computed by cp simulated ranks that each hold one contiguous chunk."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    Q, K, V, O, L, dO = (t.chunk(cp, 2) for t in (q, k, v, o, lse, do))
    dq = [torch.zeros_like(Q[r]) for r in range(cp)]  # stays on its rank
    carry = [(K[r], V[r], torch.zeros_like(K[r]), torch.zeros_like(V[r]), r) for r in range(cp)]
    for step in range(cp):
        for r in range(cp):
            k_b, v_b, dk_b, dv_b, src = carry[r]
            assert src == (r - step) % cp  # the block that left rank src `step` hops ago
            if causal and src > r:
                continue  # entirely in the future of my queries: nothing to add
            g_q, g_k, g_v = block_bwd(dO[r], Q[r], k_b, v_b, O[r], L[r], causal and src == r, scale)
            dq[r] += g_q
            carry[r] = (k_b, v_b, dk_b + g_k, dv_b + g_v, src)
        carry = [carry[(r - 1) % cp] for r in range(cp)]  # every rank sends to r + 1, receives from r - 1
    assert [c[4] for c in carry] == list(range(cp))  # after cp hops every accumulator is home
    return torch.cat(dq, 2), torch.cat([c[2] for c in carry], 2), torch.cat([c[3] for c in carry], 2)

# %% [markdown]
# Checked twice: the whole backward against autograd through plain PyTorch attention on the full sequence, and each
# block's gradients against minite's backward launcher (`minite.kernels.attention.attention_bwd`, the chapter-07
# kernel that `RingAttention` calls per block), given the same final $O$ and LSE.

# %%
q, k, v, do = (torch.randn(1, 2, 4 * 12, 16, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(4))
for causal in (False, True):
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    s_full = qa @ ka.transpose(-1, -2) / math.sqrt(16)
    if causal:
        s_full = s_full.masked_fill(torch.ones(48, 48, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    (torch.softmax(s_full, -1) @ va).backward(do)  # autograd on the full sequence, one process
    o, lse = ring_simulated(q.float(), k.float(), v.float(), 4, causal)
    got = ring_backward_simulated(do, q, k, v, o.double(), lse.double(), 4, causal)
    err = max(float((a - b.grad).abs().max()) for a, b in zip(got, (qa, ka, va)))
    print(f"causal={causal}: max |ring backward over 4 ranks - autograd| = {err:.1e}")
    assert err < 1e-4  # the forward ran in fp32 (the kernel), the backward in fp64
qb, kb, vb, dob = (t[:, :, :12].float() for t in (q, k, v, do))  # one diagonal block of 12 tokens
ob, lb = attention(qb, kb, vb, causal=True, return_lse=True)
mine = block_bwd(dob, qb, kb, vb, ob, lb, True, 1 / math.sqrt(16))
err = max(float((a - b).abs().max()) for a, b in zip(mine, attention_bwd(dob, qb, kb, vb, ob, lb, True)))
print(f"one causal block: max |block_bwd - minite's launcher| = {err:.1e}")
assert err < 1e-5
print("PASS: the backward ring equals autograd, block by block equal to minite's kernel")

# %% [markdown]
# `minite.parallel.context.RingAttention` is that (≈ 60 lines): an `autograd.Function` whose forward is the ring of
# section 2 with the balanced plan of section 3, and whose backward is the ring of this section. Each step posts the
# `isend` of the block it holds (and the `irecv` of the next) **before** computing, so the transfer runs while the
# kernel does (ordered `isend`/`irecv`; `batch_isend_irecv` hangs on gloo). The block calls go through the same
# `attention(..., return_lse=True)` and backward launcher as chapter 07.
#
# The all-gather variant (`AllGatherAttention`) gathers every rank's K/V once; with the balanced layout each of my
# two chunks attends to a **prefix** of the gathered sequence with a bottom-right causal mask (the chapter-07
# kernel's convention), and the backward reduce-scatters the full-length dK/dV back to the owners.
#
# ## 5. On real ranks: both variants against one process
#
# One `torchrun` launch, 2 ranks on gloo. Every rank compares its shard of the output, the LSE and the gradients of
# q, k and v with the single-process kernel's (fp32; causal balanced, causal contiguous and non-causal; GQA with 4
# query and 2 kv heads; 3 tokens per chunk, an odd count), then trains the GPT under CP for 5 AdamW steps next to
# the dense GPT from the same seed. (The test suite runs the same comparison through the Triton kernel, at world 2
# and 4: `tests/parallel/test_context.py`.)

# %%
out_dir = tempfile.mkdtemp()
# CPU workers over gloo; the launcher sets their environment (no interpreter on a GPU)
res = torchrun(2, ["-m", "minite.parallel.workers", "cp_attn", "cp_gpt", "cp_measure", "cp_ulysses", "--T", "256",
                   "--out", out_dir], timeout=240)  # cp_ulysses: the all-to-all of section 7
assert res.returncode == 0, res.stdout[-2000:]
rep = results(out_dir)
ring_checks = [n for n in rep[0] if n != "cp_measure" and "a2a" not in n]
print(f"{'check':34} {'max error (both ranks)':>24}")
for name in ring_checks:
    worst = max(rep[r][name]["max_err"] for r in rep)
    print(f"{name:34} {'below 1e-5' if worst < 1e-5 else f'{worst:.1e}':>24}  "
          f"{'ok' if all(rep[r][name]['ok'] for r in rep) else 'FAIL'}")
print("GPT under CP, losses of the 5 steps:", [round(x, 4) for x in rep[0]["gpt_ring_5_steps"]["losses"]])
assert all(rep[r][name]["ok"] and rep[r][name]["max_err"] < 1e-4 for r in rep for name in ring_checks)

# %% [markdown]
# ## 6. Measured: work per rank, bytes and peak memory
#
# The launch above also ran one causal forward + backward at $T = 256$ (4 heads of $D = 64$, batch 1) for each
# variant with and without load balancing, under `with trace.Recorder() as rec:` (`minite.parallel.trace`: the
# attention reports each block call and each wait of the ring only while a recorder is active). Per rank it
# recorded
# * the **score entries** its block calls computed (the work; the causal diagonal counts its visible half);
# * the bytes it **sent** (`comm.CommLog`, ring-algorithm bytes: gloo's reduce-scatter is really an all-reduce,
#   so we count rather than time), in units of one rank's K/V shard.
#
# Both are the same whichever attention backend runs the blocks, so that run used the fast PyTorch reference.

# %%
runs = ["ring_contiguous", "ring_balanced", "allgather_contiguous", "allgather_balanced"]
meas = {r: rep[r]["cp_measure"] for r in rep}
print(f"cp=2, T={meas[0]['T']}")
print(f"{'run':22}{'rank 0 work':>14}{'rank 1 work':>14}{'max/min':>9}{'sent / K-V shard':>18}")
for name in runs:
    w = [meas[r][name]["scores"] / 1e3 for r in range(2)]
    sent = meas[0][name]["bytes_sent"] / meas[0][name]["kv_shard_bytes"]
    print(f"{name:22}" + "".join(f"{x:>13.1f}k" for x in w) + f"{max(w) / min(w):>9.2f}{sent:>18.1f}")

# %% [markdown]
# **Overlap.** At each forward step the ring posts the `isend` of the block it holds and the `irecv` of the next
# *before* computing; after the compute it waits. The run recorded, per step of the balanced ring's forward, the
# seconds spent computing and the seconds still blocked on the transfer afterwards: what the overlap did not hide.
# (gloo moves the bytes on its own threads; on GPUs NCCL does it on a separate stream.) At this toy size a block's
# compute takes a few milliseconds, less than gloo needs to deliver the block (and the other rank to get there), so
# part of the transfer shows up as blocked time: overlap hides a transfer only when a step computes for longer than
# the transfer takes. The last step has nothing left to receive. Section 6's closing note says when that holds.

# %%
for r in range(2):
    steps = meas[r]["ring_balanced"]["steps"]
    print(f"rank {r}: " + ", ".join(f"step {i}: computed {c * 1e3:.1f} ms, then blocked {w * 1e3:.2f} ms"
                                    for i, (c, w) in enumerate(steps)))

# %% [markdown]
# Peak memory is the one number where the backend matters: the PyTorch reference materialises each block's score
# matrix, the flash kernel never does. So it was measured with the Triton kernel (on the interpreter, about 30 s a
# run, too slow for this notebook) at world 2 and 4, $T = 512$, and recorded in
# `benchmarks/results/cp_attention_cpu.json`: the bytes of every tensor created during the step
# (`minite.bytecount.PeakBytes`), the largest over the ranks, with the same work and byte counts as above.

# %%
rec = json.load(open("../benchmarks/results/cp_attention_cpu.json"))
r4 = rec["runs"]["cp4_T512"]
print(f"recorded on {rec['device']}, {rec['date']}")
for name in runs:
    w = [r4[r][name]["scores"] / 1e3 for r in sorted(r4)]
    print(f"cp=4 {name:22} work per rank " + " ".join(f"{x:6.1f}k" for x in w) + f"   max/min {max(w) / min(w):.2f}"
          f"   sent / shard {r4['0'][name]['bytes_sent'] / r4['0'][name]['kv_shard_bytes']:.1f}")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="tight")
for i, name in enumerate(("ring_contiguous", "ring_balanced")):
    axes[0].bar([r + 0.38 * i for r in range(4)], [r4[str(r)][name]["scores"] / 1e3 for r in range(4)], width=0.38,
                label=name.replace("ring_", ""))
axes[0].set(xlabel="rank", ylabel="score entries (thousands)", title="causal work per rank, cp=4, T=512",
            xticks=[r + 0.19 for r in range(4)], xticklabels=range(4))
axes[0].legend()
for name, c in (("ring_balanced", "tab:blue"), ("allgather_balanced", "tab:red")):
    peaks = [max(v[name]["peak_bytes"] for v in rec["runs"][f"cp{w}_T512"].values()) / 1e6 for w in (2, 4)]
    axes[1].plot([2, 4], peaks, "o-", color=c, label=name.replace("_balanced", ""))
    print(f"{name:20} peak per rank: cp=2 {peaks[0]:.2f} MB, cp=4 {peaks[1]:.2f} MB")
axes[1].set(xticks=[2, 4], xlabel="cp", ylabel="peak MB per rank", ylim=(0, None),
            title=f"fwd+bwd peak, T=512 (Triton kernel, {rec['date']})")
axes[1].legend()
plt.show()

# %% [markdown]
# What the numbers say:
# * **Load balancing**: contiguous shards give the last rank about $2cp-1$ times the work of rank 0 (3 at cp=2, 7 at
#   cp=4); the balanced layout gives every rank the same count, exactly.
# * **Bytes**: both variants send the same amount in the forward: $(cp-1)$ K/V shards per rank, for the ring as
#   $cp-1$ point-to-point messages, for the all-gather as one collective. In the backward the ring sends K/V around
#   again and its fp32 dK/dV accumulator makes one extra hop; the all-gather keeps the gathered K/V and
#   reduce-scatters dK/dV once.
# * **Memory**: the all-gather holds every rank's K/V (and the fp32 dK/dV of the whole sequence) at once, so its
#   peak stays near the full-sequence size however many ranks share the work; the ring holds a few blocks of
#   $T/cp$ tokens, so its peak halves when $cp$ doubles. That is why the ring wins at long context, and why
#   Megatron still offers the all-gather: one collective instead of $cp - 1$ dependent steps, simpler to overlap,
#   fine when K/V are small (GQA with few kv heads).
#
# On GPUs the ring's overlap is what makes it free: a step's transfer of K and V, $2\,b\,(T/cp)\,h_{kv}$ elements
# ($h_{kv}$ = kv heads × head size; 2 bytes each in bf16), must hide behind a step's attention FLOPs,
# $\approx 4\,b\,(T/cp)^2 h$ ($QK^\top$ and $PV$, 2 FLOPs per multiply-add; half that off the diagonal when
# balanced). FLOPs per byte sent are then about $(T/cp)\,h / h_{kv}$: the ratio grows with $T/cp$, so CP pays at
# long context, exactly where it is needed.

# %% [markdown]
# ## 7. Ulysses: trade the sequence for heads (all-to-all)
#
# The ring keeps every rank on its own tokens and moves the keys past them. DeepSpeed-Ulysses (Jacobs et al. 2023)
# moves the other way. Attention mixes tokens but never heads, so a rank that held **every token of some heads**
# could run ordinary attention on them, with no merge at all. One all-to-all gets it there: rank $r$ holds
# (B, H, T/cp, D), its tokens of every head; it cuts the heads into $cp$ groups and sends group $j$ to rank $j$, and
# receives from each rank $j$ rank $j$'s tokens of head group $r$. Concatenated in rank order that is
# (B, H/cp, T, D): the whole sequence of $H/cp$ heads. After attention, the **inverse** all-to-all (heads → seq)
# hands each rank its own tokens of every head again, for the output projection. The backward runs the same two
# exchanges the other way: the gradient of seq → heads is heads → seq of the gradient, and vice versa (both are
# permutations of the entries, and a permutation's transpose is its inverse).
#
# Simulated in one process, an all-to-all is a transpose of a list of lists: what rank $r$ sends to rank $j$ is
# what rank $j$ receives from rank $r$. The simulation also counts the bytes each rank sends to *other* ranks (its
# own piece stays where it is), for the comparison with the ring below.

# %%
SENT = {}  # rank -> bytes sent to other ranks by the all-to-alls below (reset it to count)


def all_to_all(sends):
    """The collective over simulated ranks: sends[r][j] is what rank r sends to rank j; returns recv with
    recv[r][j] = sends[j][r], what rank r received from rank j."""
    n = len(sends)
    for r in range(n):
        SENT[r] = SENT.get(r, 0) + sum(p.numel() * p.element_size() for j, p in enumerate(sends[r]) if j != r)
    return [[sends[j][r] for j in range(n)] for r in range(n)]


def seq_to_heads(xs):
    """xs[r] (B, H, T/n, D), rank r's tokens of every head -> rank r's (B, H/n, T, D): every rank's tokens, in rank
    order, of head group r (heads r*H/n .. (r+1)*H/n - 1)."""
    n = len(xs)
    assert xs[0].shape[1] % n == 0, f"{xs[0].shape[1]} heads do not split over {n} ranks"
    recv = all_to_all([x.chunk(n, dim=1) for x in xs])  # piece j of my tokens: head group j, for rank j
    return [torch.cat(pieces, dim=2) for pieces in recv]  # rank j's tokens of my heads, in rank order


def heads_to_seq(ys):
    """The inverse: ys[r] (B, H/n, T, D) -> rank r's (B, H, T/n, D), its own tokens of every head, in head order."""
    n = len(ys)
    recv = all_to_all([y.chunk(n, dim=2) for y in ys])  # piece j: rank j's tokens of my heads, back to rank j
    return [torch.cat(pieces, dim=1) for pieces in recv]  # head group j (from rank j) lands at heads j*H/n ..


# %% tags=["nbval-check-output"]
# CHECK: the all-to-all pair
for n, B, H, T, D in ((2, 2, 4, 6, 3), (3, 2, 6, 9, 2), (4, 3, 8, 8, 5)):
    x = torch.arange(B * H * T * D, dtype=torch.float32).view(B, H, T, D)  # every entry different
    xs = list(x.chunk(n, dim=2))  # rank r holds tokens r*T/n .. (r+1)*T/n - 1 of every head
    ys = seq_to_heads(xs)
    for r in range(n):
        assert torch.equal(ys[r], x.chunk(n, dim=1)[r]), (n, r)  # every token of head group r, in order
    assert all(torch.equal(a, b) for a, b in zip(heads_to_seq(ys), xs)), n  # exactly the inverse
print("PASS: seq->heads gives rank r every token of head group r, and heads->seq undoes it exactly")

# %% [markdown]
# The pair as autograd Functions (forward one way, backward the other), and Ulysses attention over simulated
# ranks: shard, seq → heads for q, k and v, the chapter-07 kernel on whole sequences, heads → seq for the output.
# Two details, both as in `minite.parallel.ulysses`:
# * **Layout.** The all-to-all gathers the tokens in *rank* order. With contiguous shards that is position order;
#   with the zig-zag shards of section 3 (what the GPT uses, so that the ring and the all-to-all share a layout)
#   it is not, so the gathered tokens are sorted into position order before the causal kernel and unsorted after.
#   Ulysses needs no load balancing of its own: every rank runs the full causal attention of $H/cp$ heads.
# * **GQA.** The kv heads are split like the query heads when $cp$ divides their number $H_{kv}$: query head $h$
#   reads kv head $h / (H/H_{kv})$, and both splits keep that pairing on one rank. With **fewer kv heads than
#   ranks** there is nothing to split: minite copies each kv head $cp/H_{kv}$ times first (`repeat_interleave`),
#   so rank $j$ receives the one copy its query heads read, and the copies' gradients are summed on the way back
#   (`repeat_interleave`'s backward). That needs $cp \bmod H_{kv} = 0$; any other count is refused by name, like
#   an $H$ that $cp$ does not divide. The copies cost bytes: k and v travel as $\max(H_{kv}, cp)$ heads.

# %%
class SeqToHeads(torch.autograd.Function):
    """forward: seq -> heads over the simulated ranks / backward: the gradients travel back, heads -> seq."""
    @staticmethod
    def forward(ctx, *xs):
        return tuple(seq_to_heads(list(xs)))

    @staticmethod
    def backward(ctx, *grads):
        return tuple(heads_to_seq(list(grads)))


class HeadsToSeq(torch.autograd.Function):
    """forward: heads -> seq / backward: seq -> heads."""
    @staticmethod
    def forward(ctx, *ys):
        return tuple(heads_to_seq(list(ys)))

    @staticmethod
    def backward(ctx, *grads):
        return tuple(seq_to_heads(list(grads)))


def ulysses_simulated(q, k, v, cp, causal=True, balanced=False):
    """Ulysses over cp simulated ranks. q (B, H, T, D), k/v (B, KVH, T, D) hold the whole sequence; rank r holds
    the tokens pos[r] (contiguous chunks, or the zig-zag shards). -> (each rank's output (B, H, T/cp, D), pos)."""
    H, KVH, T = q.shape[1], k.shape[1], q.shape[2]
    assert H % cp == 0 and (KVH % cp == 0 or cp % KVH == 0), f"H={H}, KVH={KVH}, cp={cp}"
    if KVH < cp:  # fewer kv heads than ranks: a copy per rank, rank j's the one its query heads read
        k, v = k.repeat_interleave(cp // KVH, dim=1), v.repeat_interleave(cp // KVH, dim=1)
    pos = [zigzag_positions(T, cp, r) if balanced else torch.arange(r * T // cp, (r + 1) * T // cp)
           for r in range(cp)]
    order = torch.argsort(torch.cat(pos))  # the gathered tokens (rank order) -> position order
    qs, ks, vs = (SeqToHeads.apply(*[t[:, :, p] for p in pos]) for t in (q, k, v))
    outs = [attention(qs[r][:, :, order], ks[r][:, :, order], vs[r][:, :, order], causal=causal)  # chapter 07
            [:, :, torch.argsort(order)] for r in range(cp)]  # back to rank order
    return list(HeadsToSeq.apply(*outs)), pos


# %% [markdown]
# Checked against plain attention on the whole sequence in one process (fp64 autograd): every rank's output and
# the gradients of q, k and v, for heads split evenly, GQA with kv heads split, and kv heads replicated (fewer than
# $cp$), in both layouts and non-causal.

# %% tags=["nbval-check-output"]
# CHECK: Ulysses against dense attention
def dense_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v over the whole sequence, kv heads repeated for GQA, in plain PyTorch."""
    rep = q.shape[1] // k.shape[1]
    s_ = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s_ = s_.masked_fill(torch.ones(s_.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s_, -1) @ v.repeat_interleave(rep, 1)


g = torch.Generator().manual_seed(7)
print(f"{'cp':>3}{'H':>3}{'KVH':>4}{'layout':>12}{'max |o - dense|':>17}{'max |dq,dk,dv - autograd|':>27}")
for cp, H, KVH, causal, balanced in ((2, 4, 4, True, True), (2, 8, 2, True, True), (4, 4, 2, True, True),
                                     (4, 8, 1, True, False), (3, 6, 3, False, False)):
    T = 3 * 2 * cp  # 3 tokens per zig-zag chunk: odd shards
    q, k, v = (torch.randn(2, h, T, 16, generator=g, dtype=torch.float64).to(DEVICE) for h in (H, KVH, KVH))
    do = torch.randn(2, H, T, 16, generator=g, dtype=torch.float64).to(DEVICE)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    o_ref = dense_attention(qa, ka, va, causal)
    o_ref.backward(do)
    qu, ku, vu = (t.float().requires_grad_() for t in (q, k, v))
    outs, pos = ulysses_simulated(qu, ku, vu, cp, causal, balanced)
    torch.autograd.backward(outs, [do[:, :, p].float() for p in pos])  # each rank's dO, for its own tokens
    e_o = max(float((o.detach() - o_ref.detach()[:, :, p]).abs().max()) for o, p in zip(outs, pos))
    e_g = max(float((a.grad - b.grad).abs().max()) for a, b in zip((qu, ku, vu), (qa, ka, va)))
    layout = ("zig-zag" if balanced else "contiguous") if causal else "non-causal"
    print(f"{cp:>3}{H:>3}{KVH:>4}{layout:>12}{'below 1e-5' if e_o < 1e-5 else f'{e_o:.1e}':>17}"
          f"{'below 1e-5' if e_g < 1e-5 else f'{e_g:.1e}':>27}")
    assert e_o < 1e-5 and e_g < 1e-5, (cp, H, KVH, e_o, e_g)  # fp32 kernel vs fp64; a wrong inverse is O(1)
print("PASS: Ulysses over simulated ranks equals dense attention: output, dq, dk and dv")

# %% [markdown]
# **On real ranks.** `minite.parallel.comm` has the same pair for a process group: `seq_to_heads(x, group)` packs
# the head groups into one (cp, …) buffer, row $j$ for rank $j$, and makes one `all_to_all_single` of it;
# `heads_to_seq` is its inverse; `SeqToHeads` / `HeadsToSeq` are the autograd Functions, and
# `minite.parallel.ulysses.ulysses_attention` is the function above on them (≈ 30 lines). The launch of section 5
# ran it on 2 ranks against the single-process kernel (o, LSE, dq, dk, dv; GQA with kv heads split and replicated),
# and the GPT under it (every weight gradient, then 5 AdamW steps, against the dense model):

# %%
a2a_checks = [n for n in rep[0] if "a2a" in n]
for name in a2a_checks:
    got = [rep[r][name] for r in rep]
    if "skipped" in got[0]:  # the Triton kernel on CPU tensors needs the interpreter: a GPU machine skips it
        print(f"{name:30} skipped: {got[0]['skipped'][:60]}")
        continue
    worst = max(x["max_err"] for x in got)
    print(f"{name:30} {'below 1e-5' if worst < 1e-5 else f'{worst:.1e}':>12}  {'ok' if all(x['ok'] for x in got) else 'FAIL'}")
assert all(x["ok"] for r in rep for name in a2a_checks if "skipped" not in (x := rep[r][name]))

# %% [markdown]
# ### When does the all-to-all beat the ring?
#
# Count the bytes one rank sends per attention layer, with $s = T/cp$ tokens per rank, head size $d$, $e$ bytes per
# element (2 in bf16), batch $b$.
#
# **All-to-all.** Each exchange sends $(cp-1)/cp$ of the tensor's shard (one of the $cp$ pieces stays home). The
# forward exchanges q (H heads), k and v ($H'_{kv} = \max(H_{kv}, cp)$ heads each, counting the copies) and o
# (H heads); the backward exchanges dO, dq, dk and dv, the same sizes. Per rank:
#
# $$\text{a2a} = 2\cdot\frac{cp-1}{cp}\, b\,s\,d\,(2H + 2H'_{kv})\, e .$$
#
# **Ring.** The forward sends the rank's K/V shard $cp-1$ hops, the backward again $cp-1$ hops, and the dK/dV
# accumulator $cp$ hops home (minite carries it in fp32, $e_{acc} = 4$, for exact sums):
#
# $$\text{ring} = 2\,b\,s\,d\,H_{kv}\,\big(2(cp-1)\,e + cp\,e_{acc}\big).$$
#
# In the forward alone the ratio is $\text{a2a}/\text{ring} = (H + H'_{kv})/(cp\,H_{kv})$: without GQA
# ($H_{kv} = H$) it is $2/cp$, equal at $cp = 2$ and falling from there; with GQA the ring's K/V are small and the
# all-to-all still moves all of q and o, so the crossover moves out to $cp > 1 + H/H_{kv}$ (5 for Llama-3-8B's
# 32/8 heads), and with one kv head (MQA) the ring always sends less. The deeper difference is the scaling: the
# ring's bytes per rank approach $2\,b\,T\,d\,H_{kv}(2e + e_{acc})$ whatever $cp$ is (every K/V shard passes every rank),
# the all-to-all's are $\propto T/cp$ and fall as ranks are added.
#
# Both formulas are checked below: the all-to-all's against the bytes the simulation counted (fp32, $e = 4$), the
# ring's against the bytes the ring sent on real ranks in section 6 (recorded, fp32).

# %%
def sent_per_rank(mode, T, cp, H, KVH, D, e=2, e_acc=4, B=1):
    """Bytes one rank sends per attention layer, forward + backward (the formulas above)."""
    s = T // cp
    if mode == "a2a":
        return 2 * (cp - 1) / cp * B * s * D * (2 * H + 2 * max(KVH, cp)) * e
    return 2 * B * s * D * KVH * (2 * (cp - 1) * e + cp * e_acc)


for cp, H, KVH in ((2, 4, 4), (4, 8, 2), (4, 4, 1)):
    T = 6 * cp
    q, k, v = (torch.randn(2, h, T, 16, generator=g).to(DEVICE).requires_grad_() for h in (H, KVH, KVH))
    SENT.clear()
    outs, pos = ulysses_simulated(q, k, v, cp)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    want = sent_per_rank("a2a", T, cp, H, KVH, 16, e=4, B=2)
    print(f"a2a  cp={cp} H={H} KVH={KVH}: counted {sorted(set(SENT.values()))} bytes per rank, formula {want:g}")
    assert set(SENT.values()) == {want}
for cp in (2, 4):
    m = rec["runs"][f"cp{cp}_T512"]["0"]["ring_balanced"]
    want = sent_per_rank("ring", 512, cp, 4, 4, 64, e=4) / (2 * (512 // cp) * 4 * 64 * 4)  # in K/V shards
    print(f"ring cp={cp}: recorded {m['bytes_sent'] / m['kv_shard_bytes']:g} K/V shards, formula {want:g}")
    assert m["bytes_sent"] / m["kv_shard_bytes"] == want

# %% [markdown]
# For a Llama-3-8B-sized attention layer ($H = 32$, $d = 128$) at $T = 128$k in bf16, per rank, forward +
# backward, with all 32 kv heads (MHA), 8 (its GQA) and 1 (MQA); "–" where $cp$ cannot split the heads:

# %%
T, H, D = 131072, 32, 128
cps = [2, 4, 8, 16, 32, 64]
fig, ax = plt.subplots(figsize=(6.5, 3.6), layout="tight")
print(f"{'kv heads':>8}{'':>6}" + "".join(f"{f'cp={c}':>9}" for c in cps))
for KVH, color in ((32, "tab:blue"), (8, "tab:orange"), (1, "tab:green")):
    ring = [sent_per_rank("ring", T, c, H, KVH, D) / 1e9 for c in cps]
    a2a = [sent_per_rank("a2a", T, c, H, KVH, D) / 1e9 if H % c == 0 and (KVH % c == 0 or c % KVH == 0)
           else float("nan") for c in cps]
    print(f"{KVH:>8}{'ring':>6}" + "".join(f"{x:>8.2f}G" for x in ring))
    print(f"{'':>8}{'a2a':>6}" + "".join(f"{x:>8.2f}G" if x == x else f"{'–':>9}" for x in a2a))
    ax.plot(cps, ring, "--", color=color, label=f"ring, {KVH} kv heads")
    ax.plot(cps, a2a, "o-", color=color, label=f"a2a, {KVH} kv heads")
ax.set(xscale="log", yscale="log", xticks=cps, xticklabels=cps, xlabel="cp", ylabel="GB sent per rank and layer",
       title="fwd+bwd, H=32, d=128, T=128k, bf16")
ax.legend(fontsize=7, ncol=2)
plt.show()

# %% [markdown]
# In the backward the ring's fp32 accumulator makes it heavier still, so over forward + backward the all-to-all
# sends less from $cp = 2$ for MHA and GQA, and the ring less for MQA up to $cp = 16$ (at $cp = H = 32$ they are
# even). What the table leaves out decides as much as the bytes:
# * **Overlap.** The ring posts each transfer before a block's compute and hides it when the step computes longer
#   than it sends (section 6). The all-to-all's bytes are on the critical path: attention cannot start before q, k
#   and v have arrived, nor the output projection before o has; only other work (the next tensor's projection) can
#   hide them.
# * **Who talks to whom.** The ring needs only a neighbour, so it runs across nodes as well as inside one. In an
#   all-to-all every pair of ranks exchanges at once: an NVLink/NVSwitch domain does that at full speed, a cluster
#   network at about a ninth of it per GPU (an H200's NVLink moves 450 GB/s each way, a 400 Gb/s NIC 50 GB/s).
# * **The limit $H/cp$.** Every rank needs whole heads: $cp$ must divide $H$, so $cp \le H$. With tensor
#   parallelism a rank holds only $H/tp$ heads and $cp$ must divide those: Llama-3-8B at $tp = 8$ keeps 4 heads per
#   rank, and Ulysses stops at $cp = 4$. Fewer kv heads than $cp$ cost the copies counted above. The ring has no
#   such limit; $cp$ is bounded by the sequence only.
#
# Hence the hybrid (USP; TE's `a2a+p2p`; `--parallel.cp_mode=hybrid --parallel.cp_a2a=a` in minite): the
# all-to-all over the $a$ ranks of a node, where bandwidth is high and $a$ divides the heads, and the ring across
# the $cp/a$ nodes, on $a\,T/cp$ tokens of $H/a$ heads per group. Sorted by position, the tokens an all-to-all
# group gathers are exactly a zig-zag shard of the sequence in $2\,cp/a$ chunks, so the ring of this chapter runs on
# them unchanged. minite tests it at $cp = 4$ (all-to-all in pairs, the ring across) against one process
# (`tests/parallel/test_context.py`).
#
# ## 8. Why not PyTorch's own?
#
# PyTorch ships an experimental `torch.distributed.tensor.experimental.context_parallel` that swaps SDPA for a ring.
# It does not run on the CPU: it needs the flash or efficient SDPA backends, and the math backend (the only one on
# CPU) fails with it (pytorch#147793). That is one more reason to build the ring here, on `parallel/comm.py`, where
# it runs on gloo with the chapter-07 kernel and unchanged on GPUs with NCCL.
#
# ## 9. In the GPT
#
# `minite.parallel.context_gpt.CPGPT` is the dense GPT with each attention core swapped for the ring: every other
# module is the dense one, working on $T/cp$ tokens. Two details: RoPE rotates each token by its **global**
# position (a balanced shard is two non-contiguous chunks), and the loss each rank computes is over its tokens only,
# so the parameter gradients are averaged over the cp ranks (the same all-reduce as data parallelism, over the
# dp × cp group), and the loss value is all-reduced for logging. From the command line:
#
# ```
# torchrun --nproc-per-node 2 -m minite.train --parallel.cp=2                          # the ring
# torchrun --nproc-per-node 2 -m minite.train --parallel.cp=2 --parallel.cp_mode=a2a   # Ulysses (section 7)
# torchrun --nproc-per-node 4 -m minite.train --parallel.cp=4 --parallel.cp_mode=hybrid --parallel.cp_a2a=2
# ```
#
# Every rank holds all of the dense model's weights in each mode, so a checkpoint does not depend on it. The run below trains 8 steps with CP on 2 ranks; the test suite compares 20 steps with one process.

# %%
import contextlib, io
from minite.config import make_config
from minite.train import train
cli_dir = tempfile.mkdtemp()
words = "the king and queen of night shall speak to thee my lord what art thou sweet love".split()
gen = torch.Generator().manual_seed(0)
with open(os.path.join(cli_dir, "corpus.txt"), "w") as f:
    f.write("".join(" ".join(words[i] for i in torch.randint(0, len(words), (6,), generator=gen)) + ".\n"
                    for _ in range(200)))
flags = {"model.n_layer": 2, "model.n_head": 4, "model.n_kv_head": 2, "model.n_embd": 32, "model.block_size": 32,
         "model.backend": "torch", "train.batch_size": 4, "train.max_iters": 8, "train.eval_interval": 8,
         "train.eval_iters": 1, "train.log_interval": 1, "train.sample_tokens": 0, "train.progress": False,
         "train.threads": 1, "data.path": os.path.join(cli_dir, "corpus.txt"), "data.data_dir": cli_dir,
         "train.device": "cpu", "train.precision": "fp32", "train.compile": "off"}  # both runs: CPU, gloo
res = torchrun(2, ["-m", "minite.train", *[f"--{k}={v}" for k, v in flags.items()], "--parallel.cp=2",
                   f"--train.out_dir={cli_dir}/cp2"], timeout=240)
assert res.returncode == 0, res.stdout[-2000:]
cp_loss = [json.loads(x)["loss"] for x in open(f"{cli_dir}/cp2/log.jsonl") if '"loss"' in x]
with contextlib.redirect_stdout(io.StringIO()):  # its banner names a temporary directory
    one = train(make_config("cpu", {**flags, "train.out_dir": f"{cli_dir}/one"}))
one_loss = [round(one["losses"][s], 6) for s in sorted(one["losses"])]
print("cp=2 on 2 ranks:", [round(x, 4) for x in cp_loss])
print("one process:    ", [round(x, 4) for x in one_loss])
print(f"max difference: {max(abs(a - b) for a, b in zip(cp_loss, one_loss)):.0e}")
assert len(cp_loss) == len(one_loss) == 8 and max(abs(a - b) for a, b in zip(cp_loss, one_loss)) < 1e-4  # a
# summation order; a missing gradient or a wrong shard moves the loss by 1e-2 or more within a few steps
