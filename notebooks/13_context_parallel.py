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
# passes through); this chapter builds the first two:
#
# * **the ring** (`cp_comm_type="p2p"`): K/V blocks travel around the ranks, each step runs the chapter-07 flash
#   kernel on the block at hand, and the partial outputs are merged exactly by their **log-sum-exp**;
# * **all-gather K/V** (`cp_comm_type="all_gather"`): gather all keys once, reduce-scatter their gradients;
# * **all-to-all** (`cp_comm_type="a2a"`, DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all trades the
#   sequence shard for a head shard, so each rank runs ordinary attention over the *whole* sequence for $H/cp$ of
#   the heads, and a second all-to-all trades back; $cp$ must divide the number of (kv) heads;
# * `"a2a+p2p"`: all-to-all inside a group of ranks (a node), the ring between groups.

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
res = torchrun(2, ["-m", "minite.parallel.workers", "cp_attn", "cp_gpt", "cp_measure", "--T", "256",
                   "--out", out_dir], timeout=240)
assert res.returncode == 0, res.stdout[-2000:]
rep = results(out_dir)
print(f"{'check':34} {'max error (both ranks)':>24}")
for name in [n for n in rep[0] if n != "cp_measure"]:
    worst = max(rep[r][name]["max_err"] for r in rep)
    print(f"{name:34} {'below 1e-5' if worst < 1e-5 else f'{worst:.1e}':>24}  "
          f"{'ok' if all(rep[r][name]['ok'] for r in rep) else 'FAIL'}")
print("GPT under CP, losses of the 5 steps:", [round(x, 4) for x in rep[0]["gpt_ring_5_steps"]["losses"]])
assert all(rep[r][name]["ok"] and rep[r][name]["max_err"] < 1e-4 for r in rep for name in rep[r] if name != "cp_measure")

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
#
# ## 7. Why not PyTorch's own?
#
# PyTorch ships an experimental `torch.distributed.tensor.experimental.context_parallel` that swaps SDPA for a ring.
# It does not run on the CPU: it needs the flash or efficient SDPA backends, and the math backend (the only one on
# CPU) fails with it (pytorch#147793). That is one more reason to build the ring here, on `parallel/comm.py`, where
# it runs on gloo with the chapter-07 kernel and unchanged on GPUs with NCCL.
#
# ## 8. In the GPT
#
# `minite.parallel.context_gpt.CPGPT` is the dense GPT with each attention core swapped for the ring: every other
# module is the dense one, working on $T/cp$ tokens. Two details: RoPE rotates each token by its **global**
# position (a balanced shard is two non-contiguous chunks), and the loss each rank computes is over its tokens only,
# so the parameter gradients are averaged over the cp ranks (the same all-reduce as data parallelism, over the
# dp × cp group), and the loss value is all-reduced for logging. From the command line:
#
# ```
# torchrun --nproc-per-node 2 -m minite.train --parallel.cp=2
# ```
#
# The run below trains 8 steps with CP on 2 ranks; the test suite compares 20 steps with one process.

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
