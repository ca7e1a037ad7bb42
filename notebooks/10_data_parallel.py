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
# # 10 — Data parallelism: DDP, the distributed optimizer, ZeRO-1/2/3 (FSDP)
#
# One GPU trains a model whose **parameters, gradients and optimizer state** fit in its memory. With fp32 AdamW
# that is $4 + 4 + 8 = 16$ bytes per parameter (mixed precision: 2 + 2 + 12, still 16): a 7B-parameter model
# needs 112 GB before a single activation. Data parallelism (DP) runs $W$ copies of the model on $W$ devices, each
# on $1/W$ of the global batch, and averages the gradients: $W\times$ the throughput, and at first **no** memory
# saved. ZeRO (Rajbhandari et al. 2020) then shards what every copy holds in duplicate:
#
# | stage | params | grads | AdamW state | bytes/param/rank (fp32) | sent per step |
# |---|---|---|---|---|---|
# | 0 (DDP) | $N$ | $N$ | $2N$ | 16 | all-reduce: $2N\frac{W-1}{W}$ |
# | 1 (distributed optimizer) | $N$ | $N$ | $2N/W$ | $8 + 8/W$ | reduce-scatter + all-gather: the same |
# | 2 | $N$ | $N/W$ | $2N/W$ | $4 + 12/W$ | the same |
# | 3 (FSDP) | $N/W$ | $N/W$ | $2N/W$ | $16/W$ | $3N\frac{W-1}{W}$ (params gathered twice) |
#
# Everything below runs on real `torch.distributed`, launched by `torchrun` (multi-node is torchrun's
# `--nnodes/--rdzv-endpoint`). These workers hold CPU tensors over gloo on any machine: NCCL wants one GPU per rank,
# and one GPU cannot host 2-4 ranks. (`torchrun -m minite.train` takes NCCL + `cuda:LOCAL_RANK` when the node has a
# GPU per local rank, and stops with an error naming the numbers when `--train.device=cuda` asks for more GPUs than
# it has.) A notebook cannot `mp.spawn` a function defined in a cell, so the workers live in `minite/parallel/` and
# the cells launch them with `torchrun` as a subprocess and read what the ranks wrote.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import tempfile
import matplotlib.pyplot as plt
from minite.models.gpt import GPT, GPTConfig
from minite.parallel.launch import torchrun, results
from minite.parallel.zero import memory_per_rank, bytes_per_step
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. Why averaging gradients is exact
#
# The loss of a batch of $B$ sequences is a mean, $L = \frac1B\sum_i \ell_i$. Cut the batch into $W$ equal slices:
# $\nabla L = \frac1W \sum_{r} \nabla L_r$ where $L_r$ is the mean loss of slice $r$. So if every rank computes the
# gradient of its slice and the ranks average them, every rank holds the full-batch gradient and takes the same
# AdamW step a single process would. No approximation, only a different order of floating-point additions.

# %%
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, backend="torch")
g = torch.Generator().manual_seed(1)
x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)

def grads(model, x, y):
    model.zero_grad()
    model(x, y)[1].backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])

torch.manual_seed(0)
model = GPT(cfg)
full = grads(model, x, y)
W = 4
avg = sum(grads(model, x[r * 2:(r + 1) * 2], y[r * 2:(r + 1) * 2]) for r in range(W)) / W
print(f"max |full-batch grad - mean of {W} slice grads| = {float((full - avg).abs().max()):.1e}")
assert torch.allclose(full, avg, atol=1e-6), float((full - avg).abs().max())  # fp32: the order of the sums only

# %% [markdown]
# ## 2. The ring all-reduce, built by hand
#
# How do $W$ ranks average a vector of $N$ numbers? Sending everything to one rank costs that rank $(W-1)N$.
# The ring does better: cut the vector into $W$ chunks. **Reduce-scatter**: in $W-1$ steps each rank passes one
# chunk to its right neighbour, which adds its own copy; afterwards rank $r$ holds the complete sum of chunk
# $r+1$. **All-gather**: $W-1$ more steps pass the finished chunks around. Each rank sends
# $2(W-1)\cdot N/W$ numbers, independent of $W$ for large $W$: that is why DP scales. Below, $W$ "ranks" are
# list entries and every send is counted.

# %%
def ring_all_reduce(vectors):
    W = len(vectors)
    chunks = [list(v.clone().chunk(W)) for v in vectors]  # chunks[rank][c]
    sent = 0
    for step in range(W - 1):  # reduce-scatter: at step s, rank r sends chunk (r - s) % W to rank r + 1
        msgs = [(r, (r - step) % W, chunks[r][(r - step) % W].clone()) for r in range(W)]
        for r, c, data in msgs:
            chunks[(r + 1) % W][c] += data
            sent += data.numel()
    for step in range(W - 1):  # all-gather: rank r owns the finished chunk (r + 1) % W; pass finished chunks on
        msgs = [(r, (r + 1 - step) % W, chunks[r][(r + 1 - step) % W].clone()) for r in range(W)]
        for r, c, data in msgs:
            chunks[(r + 1) % W][c] = data
            sent += data.numel()
    return [torch.cat(c) for c in chunks], sent

vs = [torch.randn(1200, generator=g) for _ in range(4)]
out, sent = ring_all_reduce(vs)
err = max(float((o - sum(vs)).abs().max()) for o in out)
print(f"every rank holds the sum: max |rank's vector - sum| = {err:.1e}")
print(f"numbers sent per rank: {sent // 4} = 2(W-1)/W * N = {2 * 3 / 4 * 1200:.0f}")
assert err < 1e-5 and sent // 4 == 2 * 3 * 1200 // 4  # four fp32 additions per element at most

# %% [markdown]
# ## 3. DDP and ZeRO, built on simulated ranks
#
# Before the real thing, the algorithms in cells (DDP, ZeRO-1/2, ZeRO-3). The $W$ "ranks" are $W$ copies of the
# GPT in this process, each given its slice of the batch; a collective is a function of every rank's tensor
# (section 2's ring).
#
# ### Bucketed DDP: all-reduce a bucket as soon as it is full
#
# Backward produces gradients roughly in reverse order of the parameters' registration: the last block's first.
# DDP packs parameters, in that order, into **buckets** of about `cap` elements, and a
# `register_post_accumulate_grad_hook` on every parameter counts the gradients each bucket has received. When a
# bucket is complete its all-reduce starts, while backward carries on with the earlier layers. Averaging (sum,
# then divide by $W$) makes every rank hold the full-batch gradient (section 1).
#
# Simulated ranks run their backwards one after another, so a bucket's all-reduce can only happen once the *last*
# rank has filled it: the log below shows those reductions interleaved with that rank's backward, which is the
# overlap real ranks get (each rank launches its bucket, and the collective completes when every rank has).

# %%
import functools


class BucketedDDP:
    """W simulated ranks (model copies): gradients averaged bucket by bucket from backward hooks."""

    def __init__(self, replicas, cap):
        self.replicas, W = replicas, len(replicas)
        self.params = [list(m.parameters()) for m in replicas]
        self.buckets, current, size = [], [], 0
        for i in reversed(range(len(self.params[0]))):  # reverse registration order ~ the order of backward
            current.append(i)
            size += self.params[0][i].numel()
            if size >= cap:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.filled = [[0] * len(self.buckets) for _ in range(W)]  # filled[rank][bucket]: gradients received
        self.log = []
        for r, ps in enumerate(self.params):
            for i, p in enumerate(ps):
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, r, i))

    def _grad_ready(self, rank, i, p):
        b = self.bucket_of[i]
        self.filled[rank][b] += 1
        self.log.append(f"r{rank}:grad")
        if all(f[b] == len(self.buckets[b]) for f in self.filled):  # the last rank just completed bucket b
            self._all_reduce(b)

    def _all_reduce(self, b):
        flats = [torch.cat([ps[i].grad.flatten() for i in self.buckets[b]]) for ps in self.params]  # one message
        summed, _ = ring_all_reduce(flats)
        for ps, flat in zip(self.params, summed):
            for i, piece in zip(self.buckets[b], flat.split([ps[i].numel() for i in self.buckets[b]])):
                ps[i].grad.copy_(piece.view_as(ps[i]) / len(self.params))
        self.log.append(f"REDUCE bucket {b}")

    def backward(self, x, y):
        self.filled = [[0] * len(self.buckets) for _ in self.replicas]
        for r, (m, xs, ys) in enumerate(zip(self.replicas, x.chunk(len(self.replicas)), y.chunk(len(self.replicas)))):
            m(xs, ys)[1].backward()  # rank r's slice of the batch


# %% tags=["nbval-check-output"]
# CHECK: simulated bucketed DDP == the full-batch gradient
import copy
torch.manual_seed(0)
single = GPT(cfg)
W = 4
ddp = BucketedDDP([copy.deepcopy(single) for _ in range(W)], cap=4000)
ddp.backward(x, y)
full = grads(single, x, y)
for m in ddp.replicas:
    assert torch.allclose(torch.cat([p.grad.flatten() for p in m.parameters()]), full, atol=1e-6)
last = [i for i, e in enumerate(ddp.log) if e.startswith(f"r{W - 1}:")]
first_reduce = ddp.log.index("REDUCE bucket 0")
sizes = [sum(ddp.params[0][i].numel() for i in b) for b in ddp.buckets]
print(f"{len(ddp.buckets)} buckets of {sizes} elements; rank {W - 1}'s backward produced "
      f"{sum(i > first_reduce for i in last)} of its {len(last)} gradients after bucket 0 was reduced")
print("  " + " ".join(e.replace(f"r{W - 1}:grad", ".") for e in ddp.log[last[0]:]))
assert first_reduce < last[-1]  # communication started before backward ended
print(f"PASS: on {W} simulated ranks every copy holds the full-batch gradient, reduced bucket by bucket")

# %% [markdown]
# ### ZeRO-1 and ZeRO-2: shard the optimizer step
#
# DDP has every rank run the same AdamW step on the same full gradient, holding the same $2N$ numbers of state.
# ZeRO-1 cuts the flat parameter vector into $W$ shards: rank $r$ receives only the **sum of shard $r$** of the
# gradients (a **reduce-scatter**: the first half of the ring), steps shard $r$ with AdamW state for that shard
# only, and the ranks **all-gather** the updated shards (the second half of the ring). Same bytes as one
# all-reduce, $1/W$ of the optimizer state. ZeRO-2 also frees each rank's full gradient as soon as it has been
# scattered, keeping only its shard. The optimizer itself is unchanged: rank $r$ builds `torch.optim.AdamW` over
# *one* parameter, its flat fp32 shard, so AdamW's `exp_avg` and `exp_avg_sq` exist for that shard only.

# %%
def zero_step(replicas, shards, opts, x, y, stage):
    """One training step of W simulated ranks under ZeRO-`stage` (1 or 2): rank r owns shards[r], a flat fp32
    parameter, and opts[r], an AdamW over it. Returns the elements each rank holds after the step: gradients,
    optimizer state."""
    W = len(replicas)
    flat_grads = []
    for m, xs, ys in zip(replicas, x.chunk(W), y.chunk(W)):
        m.zero_grad()
        m(xs, ys)[1].backward()
        flat_grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]) / W)
    N = flat_grads[0].numel()
    bounds = [r * N // W for r in range(W + 1)]  # shard r = elements [bounds[r], bounds[r + 1])
    # reduce-scatter: rank r receives the sum of every rank's shard r
    my_grad = [sum(g[bounds[r]:bounds[r + 1]] for g in flat_grads) for r in range(W)]
    if stage == 2:
        for m in replicas:  # the full gradients are no longer needed anywhere
            m.zero_grad(set_to_none=True)
    for shard, opt, grad in zip(shards, opts, my_grad):
        shard.grad = grad
        opt.step()  # AdamW on my 1/W of the elements: its state exists for my shard only
    new = torch.cat([sh.detach() for sh in shards])  # all-gather: every rank receives every updated shard
    for m in replicas:
        torch.nn.utils.vector_to_parameters(new.clone(), m.parameters())
    held_grads = [sum(p.grad.numel() for p in m.parameters() if p.grad is not None) + len(g) for m, g in
                  zip(replicas, my_grad)]
    return held_grads, [sum(v.numel() for st in o.state.values() for v in st.values() if v.dim()) for o in opts]


# %% tags=["nbval-check-output"]
# CHECK: simulated ZeRO-1/2 == single-process AdamW
torch.manual_seed(0)
single = GPT(cfg)
ref = copy.deepcopy(single)
opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
batches = [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)) for _ in range(3)]
for xb, yb in batches:
    opt.zero_grad()
    ref(xb, yb)[1].backward()
    opt.step()
want = torch.nn.utils.parameters_to_vector(ref.parameters())
for stage in (1, 2):
    replicas = [copy.deepcopy(single) for _ in range(W)]
    n = sum(p.numel() for p in single.parameters())
    flat = torch.nn.utils.parameters_to_vector(single.parameters()).detach()
    shards = [torch.nn.Parameter(flat[r * n // W:(r + 1) * n // W].clone()) for r in range(W)]  # rank r's shard
    opts = [torch.optim.AdamW([sh], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) for sh in shards]
    for xb, yb in batches:
        held, state = zero_step(replicas, shards, opts, xb, yb, stage)
    for m in replicas:
        assert torch.allclose(torch.nn.utils.parameters_to_vector(m.parameters()), want, atol=1e-4)
    print(f"ZeRO-{stage}, W={W}, N={n:,}: per rank {held[0]:,} gradient and {state[0]:,} AdamW-state elements "
          f"(DDP: {n:,} and {2 * n:,})")
print("PASS: 3 steps of ZeRO-1 and ZeRO-2 on simulated ranks == single-process AdamW on the full batch")

# %% [markdown]
# ### ZeRO-3 (FSDP): gather a layer's parameters just before it runs, free them right after
#
# ZeRO-3 also shards the **parameters**: rank $r$ keeps only its $1/W$ of each layer's flat weight. A layer's full
# weight exists only while that layer computes: **all-gather** it, run the layer, free the gathered copy; the
# backward gathers it **again** (the second all-gather of the table's $3N$), computes the layer's input gradient
# and weight gradient, frees it, and **reduce-scatters** the weight gradient so each rank receives the sum of its
# own piece. Below, a stack of $L$ linear layers with $\tanh$, its forward and backward written out layer by
# layer (the backward by hand, so that the moment each weight is needed is visible), on $W$ simulated ranks that
# count the weight elements they hold gathered at once.

# %%
def zero3_step(shards, shapes, xs, ys, lr):
    """One SGD step of W simulated ranks under ZeRO-3. shards[r][l]: rank r's 1/W of layer l's flat weight, the
    only copy of it rank r keeps; layer l computes h -> tanh(h @ W_l^T); the loss is the mean squared error over
    the whole batch (rank r holds the slice xs[r], ys[r]). Returns the most gathered weight elements held at once."""
    W, L = len(shards), len(shapes)
    live = peak = 0

    def gather(l):  # all-gather layer l's weight from every rank's shard
        nonlocal live, peak
        live += shapes[l][0] * shapes[l][1]
        peak = max(peak, live)
        return torch.cat([shards[q][l] for q in range(W)]).view(shapes[l])

    def free(w):
        nonlocal live
        live -= w.numel()

    grads = [[None] * L for _ in range(W)]  # rank r's full gradient of layer l, before the reduce-scatter
    for r in range(W):
        h = [xs[r]]  # activations are kept for the backward; weights are not
        for l in range(L):
            w = gather(l)
            h.append(torch.tanh(h[-1] @ w.T))
            free(w)
        dh = 2 * (h[-1] - ys[r]) / ys[r].numel() / W  # d(my slice's mean loss)/dh, averaged over the W ranks
        for l in reversed(range(L)):
            w = gather(l)  # gathered again for the backward
            dz = dh * (1 - h[l + 1] ** 2)  # through tanh
            grads[r][l] = (dz.T @ h[l]).flatten()
            dh = dz @ w
            free(w)
    for l in range(L):  # reduce-scatter: rank r receives the sum over ranks of its piece of the gradient
        n = shards[0][l].numel()
        for r in range(W):
            shards[r][l] -= lr * sum(grads[q][l][r * n:(r + 1) * n] for q in range(W))
    return peak


# %% tags=["nbval-check-output"]
# CHECK: simulated ZeRO-3 == single-process SGD, one layer's weight gathered at a time
shapes = [(32, 16), (64, 32), (16, 64)]  # (out, in) of each layer: 512, 2048 and 1024 elements
dense_w = [(torch.randn(o, i, generator=g) / i**0.5).requires_grad_() for o, i in shapes]
shards3 = [[w.detach().flatten().chunk(W)[r].clone() for w in dense_w] for r in range(W)]
for step in range(3):
    xb, yb = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    h = xb
    for w in dense_w:
        h = torch.tanh(h @ w.T)
    ((h - yb) ** 2).mean().backward()  # the reference: autograd on the whole batch, one process
    with torch.no_grad():
        for w in dense_w:
            w -= 0.1 * w.grad
            w.grad = None
    peak = zero3_step(shards3, shapes, xb.chunk(W), yb.chunk(W), 0.1)
err = max(float((torch.cat([shards3[r][l] for r in range(W)]) - dense_w[l].detach().flatten()).abs().max())
          for l in range(len(shapes)))
print(f"ZeRO-3, W={W}: after 3 steps max |gathered shards - single-process weights| = {err:.1e}; each rank keeps "
      f"{sum(s.numel() for s in shards3[0])} of {sum(o * i for o, i in shapes)} weight elements and held at most "
      f"{peak} gathered at once (the largest layer)")
assert err < 1e-5 and peak == max(o * i for o, i in shapes)
print("PASS: ZeRO-3 on simulated ranks == single-process SGD, parameters gathered per layer and freed after use")

# %% [markdown]
# ## 4. DP, DDP and ZeRO-1/2/3 on real ranks, against one process
#
# `minite.parallel.data.DataParallel` is the real thing (≈ 250 lines):
# * **naive DP** (`allreduce_grads`): after backward, one all-reduce per gradient tensor;
# * **DDP (stage 0)**: the parameters become views into one flat buffer cut into *units* (one per transformer
#   block, plus a root unit for the embedding and the final norm). A `register_post_accumulate_grad_hook` counts each
#   unit's gradients; when a unit is complete its all-reduce is launched **asynchronously** while backward carries
#   on with the earlier layers;
# * **ZeRO-1**: the same hook launches a *reduce-scatter* into one contiguous shard buffer; `zero.ShardedAdamW`
#   keeps AdamW state for that shard only, steps it, and all-gathers the parameters; clipping uses the norm summed
#   over shards (one all-reduce of a single number);
# * **ZeRO-2**: each unit's full gradients are dropped as soon as they are scattered;
# * **ZeRO-3 (FSDP)**: a unit's parameters exist only between a forward pre-hook that all-gathers them and a forward
#   hook that frees the storage (`untyped_storage().resize_(0)`: the parameter *views* survive, their memory does
#   not); a hook on the unit's output gathers them again just before its backward.
#
# The check: 5 AdamW steps at world 2 from the same seed, parameters compared with single-process AdamW on the
# full batch; the gradient after the first backward is compared too (AdamW would hide a wrong scale). The same
# launch trains the GPT under PyTorch's own FSDP2 (`fully_shard`), which works on gloo. The workers live in
# `minite/parallel/workers/` (chapter 10's in `data.py`); each rank writes what it found to `rank<r>.json`.

# %%
m_dir = tempfile.mkdtemp()  # one launch: the checks, and the measurements of sections 5-7
res = torchrun(2, ["-m", "minite.parallel.workers", "dp", "fsdp2", "dp_timeline", "zero_memory", "--out", m_dir],
               timeout=240)
assert res.returncode == 0, res.stdout[-2000:]
rank0 = results(m_dir)[0]
print(f"{'variant':8} {'params vs 1 process':>20} {'grad vs full batch':>19}")
for k in ("naive", "zero0", "zero1", "zero2", "zero3", "fsdp2"):
    v = rank0[k]
    print(f"{k:8} {v['max_err']:>20.1e} {v.get('grad_err', float('nan')):>19.1e}  {'ok' if v['ok'] else 'FAIL'}")
assert all(r[k]["ok"] for r in results(m_dir).values() for k in ("naive", "zero0", "zero1", "zero2", "zero3", "fsdp2"))

# %% [markdown]
# ## 5. Overlap: the per-rank timeline
#
# Naive DP waits for the whole backward, then communicates. Bucketed DDP starts the last block's all-reduce while
# the earlier blocks are still differentiating. Below: one step of a 4-layer GPT on 2 ranks, rank 0's events,
# recorded by `minite.parallel.trace`: inside `with trace.Recorder() as rec:` `DataParallel` reports each unit's
# reduction (launched, seen complete); outside, it records nothing and reads no clock.
#
# %%
fig, ax = plt.subplots(figsize=(9, 2.8), layout="tight")
for row, name in enumerate(("naive", "bucketed")):
    tl = rank0["dp_timeline"][name]
    ax.barh(row + 0.2, tl["backward"][1] * 1e3, left=0, height=0.35, color="tab:blue",
            label="backward" if row == 0 else None)
    for e in tl["events"]:  # one per reduction: launched (t0) until seen complete (t1)
        ax.barh(row - 0.2, max(e["t1"] - e["t0"], 2e-4) * 1e3, left=e["t0"] * 1e3, height=0.35,
                color="tab:orange", edgecolor="k", label="all-reduce (in flight)" if row == 0 else None)
    ax.axvline(tl["step_end"] * 1e3, ymin=row / 2, ymax=(row + 1) / 2, color="k", ls="--")
ax.set(yticks=[0, 1], yticklabels=["naive: after backward", "bucketed: from the hooks"], xlabel="ms since step start",
       title="rank 0, world 2, gloo on 2 CPU cores (dashed: gradients ready)")
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
plt.show()
for name in ("naive", "bucketed"):
    tl = rank0["dp_timeline"][name]
    print(f"{name:9}: backward ends {tl['backward'][1] * 1e3:5.1f} ms, gradients ready {tl['step_end'] * 1e3:5.1f} ms")

# %% [markdown]
# **Read the plot honestly.** The *shape* is what DDP is about: the bucketed reductions start inside the backward
# (orange bars before the blue bar ends), the naive ones only after it. The *finish line* is another matter: on
# this machine bucketing buys little or nothing. Compare the two lines printed under the plot: the bucketed
# backward itself takes longer than the naive one, and the step ends at about the same time, sometimes later
# (runs have shown ~100 ms against ~82 ms), sometimes a little earlier. Overlap hides communication only when the
# communication runs on resources the computation does not use. On GPUs it does: NCCL's kernels use a few SMs and the NVLink/InfiniBand links while the backward's GEMMs
# use the rest. Here both ranks and gloo's communication threads share **2 CPU cores**: the additions and copies of
# an "overlapped" all-reduce take cycles from the backward instead of hiding behind it, and bucketing adds fixed
# costs (several collectives instead of one, each with its own latency, and a hook per parameter) that nothing
# pays back. So this cell shows *when* DDP communicates; whether that saves time can only be measured where
# compute and communication have separate hardware, and no such measurement is recorded in `benchmarks/results/`.
#
# ## 6. Memory per rank: formula and measurement
#
# `zero.memory_per_rank` is the table at the top (this implementation also keeps, at stage 1/2, an fp32 copy of
# its shard to step, as mixed-precision ZeRO does with its master weights). The measurement counts the storages
# each rank really holds after one step (`zero_memory` in `minite/parallel/workers/data.py`: the flat parameter
# and gradient buffers, the shard, AdamW's `exp_avg` and `exp_avg_sq`), at world 1 (here), 2 and 4 (torchrun).
# ZeRO-3 also holds, briefly, one gathered unit at a time (the largest is printed).

# %%
from minite.parallel.workers.data import zero_memory
from minite.parallel.dims import ParallelDims
m4_dir = tempfile.mkdtemp()
res = torchrun(4, ["-m", "minite.parallel.workers", "zero_memory", "--out", m4_dir], timeout=240)
assert res.returncode == 0, res.stdout[-2000:]
meas = {1: zero_memory(ParallelDims().build(), None)["zero_memory"],  # world 1: here, in this process
        2: rank0["zero_memory"],
        4: results(m4_dir)[0]["zero_memory"]}
N = meas[2]["zero0"]["n_params"]
print(f"GPT with N = {N:,} parameters; MB per rank (measured / formula)")
fig, ax = plt.subplots(figsize=(8, 3.6), layout="tight")
for stage, c in zip(range(4), ("tab:red", "tab:orange", "tab:green", "tab:blue")):
    ws = [1, 2, 4, 8]
    ax.plot(ws, [memory_per_rank(N, w, stage)["total"] / 1e6 for w in ws], "--", color=c)
    mb = [meas[w][f"zero{stage}"]["total"] / 1e6 for w in (1, 2, 4)]
    ax.plot([1, 2, 4], mb, "o", color=c, label=f"ZeRO-{stage}" if stage else "DDP")
    print(f"  {'DDP   ' if stage == 0 else f'ZeRO-{stage}'}: " + "  ".join(
        f"W={w}: {b:5.2f} / {memory_per_rank(N, w, stage)['total'] / 1e6:5.2f}" for w, b in zip((1, 2, 4), mb)))
ax.set(xscale="log", xticks=[1, 2, 4, 8], xticklabels=[1, 2, 4, 8], xlabel="world size W", ylabel="MB per rank",
       title="params + grads + AdamW state per rank (dots measured, dashes formula)")
ax.legend()
plt.show()
print(f"ZeRO-3's largest gathered unit at W=4: {meas[4]['zero3']['gathered_unit_peak'] / 1e6:.2f} MB")

# %% [markdown]
# The measured dots sit on the formula (the small excess is padding: each unit is padded to a multiple of $W$).
# At $W = 1$ ZeRO-1/2 cost *more* than DDP (the extra fp32 shard), and stage 3 equals DDP: sharding only pays
# with more ranks.
#
# ## 7. Bytes per step
#
# Every collective goes through `minite.parallel.comm`, which logs the bytes a ring algorithm sends per rank. gloo
# actually implements `reduce_scatter` as an all-reduce (twice the traffic), so we count, we do not time.

# %%
for w in (2, 4):
    for stage in range(4):
        got = meas[w][f"zero{stage}"]["sent_by_op"]
        tot = sum(got.values())
        print(f"W={w} {'DDP   ' if stage == 0 else f'ZeRO-{stage}'}: sent {tot / 1e6:5.2f} MB  formula "
              f"{bytes_per_step(N, w, stage) / 1e6:5.2f} MB   " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in got.items()))

# %% [markdown]
# ZeRO-1/2 send what DDP sends (an all-reduce *is* a reduce-scatter plus an all-gather); ZeRO-3 sends 1.5×, a
# little less here because minite keeps the root unit (embedding and final norm) gathered from forward to
# backward.
#
# ## 8. The sharded checkpoint, at another world size
#
# `ShardedAdamW.save_sharded(dir)` writes one file per rank; each element carries its parameter name and range. A
# run with another world size reads the pieces that overlap its own shard: the test suite saves at world 2 and
# loads at world 4 (`tests/parallel/test_distributed.py::test_world4[ckpt_load]`), then checks that one more step
# equals the world-2 run's.
#
# ## 9. When to use PyTorch's FSDP2 instead
#
# `minite.parallel.data` exists to be read: one flat buffer per unit, hooks you can print, the whole algorithm
# in a file. For real training use `torch.distributed.fsdp.fully_shard` (FSDP2) as soon as you need any of:
# mixed-precision parameters (bf16 compute, fp32 master), CPU offload, activation checkpointing or
# `torch.compile` composed with sharding, DTensor state dicts (distributed checkpointing that reshards on load),
# prefetching the next unit's all-gather during the current unit's compute, or HSDP (shard within a node,
# replicate across nodes). The check above trains this GPT with FSDP2 on gloo: same parameters as one process.
#
# ## 10. In the GPT
#
# ```
# torchrun --nproc-per-node 2 -m minite.train --parallel.dp=2                    # DDP
# torchrun --nproc-per-node 2 -m minite.train --parallel.dp=2 --parallel.zero=3  # FSDP
# ```
# `--train.batch_size` is the global batch: every rank draws the same batch from the same seed and keeps its
# slice, and rank 0 logs the dp-averaged loss. The same flags give the same curve in any layout (a test checks 20
# steps against one process).
