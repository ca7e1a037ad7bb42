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
# # 12 — Pipeline parallelism: stages, AFAB (GPipe) and 1F1B, the bubble measured
#
# Tensor parallelism (chapter 11) splits every layer and pays two all-reduces of the activations per layer in the
# forward pass and two in the backward: it needs NVLink-class links and stays inside a node. **Pipeline
# parallelism (PP)** splits the model the other way, by depth: rank $s$ holds layers $[a_s, a_{s+1})$, and the
# only traffic is the activation at each stage boundary going forward and its gradient coming back,
# $b \cdot T \cdot C$ numbers per micro-batch per boundary. That is cheap enough to cross nodes.
#
# The price is the **bubble**: stage 1 cannot start before stage 0 has finished, and stage 0 waits for the
# gradients to come back. Cutting the batch into $m$ micro-batches keeps the stages busy; the schedule decides in
# which order each stage runs its forwards and backwards, and with it how many micro-batches of activations each
# stage holds at once. This chapter builds:
#
# * the GPT cut into stages by layers, balanced by parameter count, the embedding on the first stage and the
#   (tied) head on the last (`minite/parallel/pipeline_stage.py`);
# * the two classic schedules, AFAB (all-forward-all-backward, GPipe) and 1F1B (PipeDream-flush), as data
#   (`pipeline_schedule.py`), run by one executor with ordered `isend`/`irecv` (`pipeline.py`);
# * the bubble $(p-1)/(m+p-1)$ derived, then measured from per-rank events; the activation memory per stage of
#   AFAB vs 1F1B, measured.
#
# Everything runs on real `torch.distributed` through `torchrun`, with CPU tensors over gloo on any machine (NCCL
# needs a GPU per rank); the workers live in `minite/parallel/workers/pipeline.py` and the cells read what each
# rank wrote.

# %%
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or minite kernels
import tempfile
import matplotlib.pyplot as plt
from minite.models.gpt import GPT, GPTConfig
from minite.parallel.launch import torchrun, results
from minite.parallel.pipeline_stage import Stage, partition
from minite.parallel.pipeline_schedule import one_f_one_b, simulate, plot_timeline, bubble_fraction
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. What crosses a stage boundary
#
# Per micro-batch of $b$ sequences of $T$ tokens, one boundary carries $bTC$ activations forward and $bTC$
# gradients back. Tensor parallelism all-reduces a tensor of the same size twice per layer forward and twice
# backward, a ring all-reduce sending $2\frac{t-1}{t}$ times its size per rank. For a 70B-class model
# ($C = 8192$, 80 layers, $T = 4096$, bf16, $b = 1$):

# %%
C, L = 8192, 80  # width, layers
T, b = 4096, 1  # sequence, micro-batch
nbytes = 2  # bf16
act = b * T * C * nbytes
print(f"one boundary, one micro-batch: {act / 2**20:.0f} MiB forward + {act / 2**20:.0f} MiB backward")
for t in (2, 8):
    tp = 4 * L * 2 * (t - 1) / t * act  # 2 all-reduces forward + 2 backward per layer, every layer
    print(f"TP={t}: {tp / 2**30:.1f} GiB sent per rank per micro-batch (all {L} layers)")
for p in (2, 8):
    print(f"PP={p}: {2 * act / 2**20:.0f} MiB sent per rank per micro-batch (one boundary each way)")

# %% [markdown]
# Two orders of magnitude less: PP goes across nodes, TP stays on NVLink. Megatron combines them: TP inside a
# node, PP (and DP) across.
#
# ## 2. Cutting the GPT into stages
#
# `partition(model, p)` finds contiguous layer ranges that minimise the largest stage's parameter count (a small
# dynamic programme over cut points). The embedding counts on stage 0 and the head on stage $p-1$: with the head
# **tied** to the embedding (chapter 14's GPT), both end stages hold a copy of the $V \times C$ matrix, and a
# large vocabulary pushes blocks away from the ends.

# %%
for V in (64, 2048):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=8, n_head=4, n_kv_head=2, n_embd=32,
                          mlp_hidden=64, backend="torch"))
    parts = partition(model, 4)
    stages = [Stage(model, r, s == 0, s == 3) for s, r in enumerate(parts)]
    print(f"V={V:5}: layers {[f'{r.start}-{r.stop - 1}' for r in parts]}, parameters per stage "
          f"{[sum(q.numel() for q in st.parameters()) for st in stages]}")

# %% [markdown]
# A `Stage` holds deep copies of the dense modules under their dense names (`blocks.5.attn.qkv.weight` stays
# that), so the stages' state dicts together are the dense one. Below, the whole protocol in one process: each
# stage's output is **detached** and handed to the next stage as a fresh leaf (what `irecv` produces), the
# backward runs stage by stage from the last, each stage handing its input's gradient to the previous one (what
# `isend` carries back). The tied embedding gets two gradients, one per end stage: they are summed.

# %%
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64,
                backend="torch")
dense = GPT(cfg)
g = torch.Generator().manual_seed(1)
x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
p = 2
stages = [Stage(dense, r, s == 0, s == p - 1) for s, r in enumerate(partition(dense, p))]

# %%
def run_stages(stages, x, y):
    """One micro-batch through all stages and back, in one process; returns the loss."""
    ins, outs, h = [], [], x
    for s, st in enumerate(stages):
        inp = h if s == 0 else h.detach().requires_grad_()  # the received activation
        h = st(inp, y if st.last else None)
        ins.append(inp)
        outs.append(h)
    grad = None  # the last stage's output is the loss: its gradient is 1
    for s in reversed(range(len(stages))):
        torch.autograd.backward(outs[s], grad)
        grad = ins[s].grad if s > 0 else None  # the gradient "sent" to stage s - 1
    first, last = stages[0].wte.weight, stages[-1].wte.weight
    total = first.grad + last.grad  # the tied embedding: both uses' gradients
    first.grad, last.grad = total, total.clone()
    return outs[-1]

for st in stages:
    st.zero_grad(set_to_none=True)
dense.zero_grad(set_to_none=True)
loss = run_stages(stages, x, y)
dense_loss = dense(x, y)[1]
dense_loss.backward()
ref = dict(dense.named_parameters())
worst = max(float((q.grad - ref[n].grad).abs().max()) for st in stages for n, q in st.named_parameters())
print(f"|loss - dense| = {abs(loss.item() - dense_loss.item()):.1e}, worst |grad - dense grad| = {worst:.1e}")

# %% [markdown]
# ## 3. The naive pipeline and the bubble
#
# Run that on $p$ real ranks with the whole batch as one micro-batch: at any moment exactly one stage works.
# Cut the batch into $m$ micro-batches and let stage $s$ start micro-batch $i+1$ while stage $s+1$ works on $i$.
# The simplest schedule, **AFAB** (GPipe, Huang et al. 2019): every stage runs all $m$ forwards, then all $m$
# backwards. In the timelines below a light bar is a forward, a dark bar a backward, the number its micro-batch.

# %%
def afab_steps(p, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]

fig, axs = plt.subplots(1, 2, figsize=(11, 2.6), layout="tight")
for ax, m in zip(axs, (1, 8)):
    plot_timeline(simulate(afab_steps, 4, m), ax, f"AFAB, p=4, m={m} (t_F=1, t_B=2)")

# %% [markdown]
# **The bubble.** Let a forward take $t_F$ and a backward $t_B$ on every stage, and communication take no time.
# The last forward on the last stage ends after $(m + p - 1)\,t_F$ (stage $p-1$ starts $p-1$ forwards late); the
# backward wave then needs $(m + p - 1)\,t_B$ to drain back to stage 0. Each stage works $m(t_F + t_B)$ of the
# step's $(m+p-1)(t_F+t_B)$, so every stage idles
#
# $$\text{bubble} = \frac{(p-1)(t_F+t_B)}{(m+p-1)(t_F+t_B)} = \frac{p-1}{m+p-1}.$$
#
# It does not depend on $t_B/t_F$; it falls with $m$ (Megatron's rule of thumb: $m \geq 4p$ for a bubble under
# 20%). The simulator agrees:

# %%
print(" p   m   simulated  (p-1)/(m+p-1)")
for p_, m in ((2, 1), (2, 8), (4, 4), (4, 16), (8, 32)):
    ev = simulate(afab_steps, p_, m)
    span = max(e[3] for v in ev.values() for e in v)
    idle = 1 - sum(e[3] - e[2] for e in ev[0]) / span
    print(f"{p_:2} {m:3}   {idle:9.3f}  {bubble_fraction(p_, m):13.3f}")

# %% [markdown]
# ## 4. 1F1B: the same bubble, less memory
#
# AFAB's stage 0 finishes all $m$ forwards before its first backward: it holds the saved activations of $m$
# micro-batches. A larger $m$ shrinks the bubble and grows this memory. **1F1B** (PipeDream-flush, Narayanan et
# al. 2021) starts backwards as early as possible:
#
# * **warm-up**: stage $s$ runs $\min(p-1-s,\, m)$ forwards (enough to fill the pipeline below it);
# * **steady state**: one forward, one backward, alternating;
# * **cool-down**: the remaining backwards.
#
# Its order per stage (from `minite.parallel.pipeline_schedule.one_f_one_b`, the exercise asks you to write it):

# %%
for s in range(4):
    print(f"stage {s}: " + " ".join(f"{k}{i}" for k, i in one_f_one_b(4, 6, s)))
fig, axs = plt.subplots(1, 2, figsize=(11, 2.6), layout="tight")
for ax, (name, sched) in zip(axs, (("AFAB", afab_steps), ("1F1B", one_f_one_b))):
    plot_timeline(simulate(sched, 4, 6), ax, f"{name}, p=4, m=6 (simulated)")

# %% [markdown]
# Same length, same bubble. What changed is how many micro-batches each stage has forwarded but not yet
# backwarded, i.e. holds activations for:

# %%
def max_in_flight(steps):
    live = peak = 0
    for kind, _ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak

for m in (2, 6, 16):
    print(f"m={m:2}: AFAB {[max_in_flight(afab_steps(4, m, s)) for s in range(4)]}, "
          f"1F1B {[max_in_flight(one_f_one_b(4, m, s)) for s in range(4)]}")

# %% [markdown]
# AFAB holds $m$ on every stage; 1F1B holds $\min(p - s, m)$, at most $p$ on stage 0, independent of $m$. So with
# 1F1B one can raise $m$ to shrink the bubble without running out of activation memory.
#
# ## 5. On real ranks
#
# `PipelineGPT` (`minite/parallel/pipeline.py`) is one executor for any schedule given as such a list. A forward
# step receives its input with `irecv(...).wait()` (stage 0 reads the token ids), runs the stage and sends the
# output with `isend`; a backward step receives the output's gradient (the last stage starts from $1/m$: the loss
# is the mean over micro-batches), runs `torch.autograd.backward(output, grad)` and sends the input's gradient
# back. Sends never wait, receives do: a schedule whose dependencies are acyclic cannot deadlock. On gloo
# `batch_isend_irecv` hangs (PiPPy #989, pytorch#132644), so the messages are single ordered `isend`/`irecv`s.
# After the last backward, the two copies of the tied embedding exchange gradients and both add.
#
# One launch on 2 ranks compares loss and every gradient with the dense model for both schedules and
# $m \in \{1, 2, 3, 4, 6\}$, then trains 3 AdamW steps through `minite.train`'s interface (gradient
# accumulation, clipping on the global norm over stages) and checks the rejections:

# %%
out2 = tempfile.mkdtemp()  # one launch (~6 s each) also records section 6's timeline
res = torchrun(2, ["-m", "minite.parallel.workers", "pp_grads", "pp_train", "pp_reject", "pp_timeline",
                   "--micro", "1", "4", "8", "--out", out2], timeout=240)
assert res.returncode == 0, res.stdout[-2000:]
rep = results(out2)
for name in rep[0]:
    if name.startswith("grads"):
        err = max(max(r[name]["loss_err"], r[name]["grad_err"]) for r in rep.values())
        print(f"{name:15} max |loss or grad - dense| over both stages: {err:.0e}  ok={all(r[name]['ok'] for r in rep.values())}")
print("train 3 steps: parameters vs dense", f"{rep[0]['train_3_steps']['param_err']:.0e}")
for msg in rep[0]["reject"]["messages"]:
    print("rejected:", msg)

# %% [markdown]
# ## 6. The bubble, measured
#
# Inside `with trace.Recorder() as rec:` (`minite.parallel.trace`) `PipelineGPT` reports each executed step as
# `(kind, micro-batch, start, end)` on its rank; without a recorder it records nothing. Below: an 8-layer, 96-wide
# GPT on 2 ranks, a global batch of 16 sequences cut into $m = 1, 4, 8$ micro-batches, three timed steps each (the
# one with the shortest span is kept). The measured bubble of a rank is $1 - \text{busy}/\text{span}$, the span
# running from the first rank's first start to the last rank's last end.

# %%
tl = {r: {k.removeprefix("timeline_"): v for k, v in rep[r].items() if k.startswith("timeline_")}
      for r in rep}  # from the launch of section 5

def best_run(name):
    runs = [{r: tl[r][name]["runs"][k] for r in tl} for k in range(len(tl[0][name]["runs"]))]
    spans = [max(e[3] for v in ev.values() for e in v) - min(e[2] for v in ev.values() for e in v) for ev in runs]
    return runs[spans.index(min(spans))]

print("measured bubble per rank, their mean, and (p-1)/(m+p-1)")
print(f"{'schedule':8} {'m':>2}  {'rank 0':>6}  {'rank 1':>6}  {'mean':>6}  {'formula':>7}")
for name in tl[0]:
    ev = best_run(name)
    t0, t1 = min(e[2] for v in ev.values() for e in v), max(e[3] for v in ev.values() for e in v)
    idle = [1 - sum(e[3] - e[2] for e in ev[r]) / (t1 - t0) for r in ev]
    sched, m = name.split("_m")
    print(f"{sched:8} {m:>2}  {idle[0]:6.2f}  {idle[1]:6.2f}  {sum(idle) / 2:6.2f}  {tl[0][name]['bubble_formula']:7.2f}")
fig, axs = plt.subplots(1, 2, figsize=(11, 2.4), layout="tight")
for ax, name in zip(axs, ("afab_m8", "1f1b_m8")):
    ev = best_run(name)
    plot_timeline({r: [(k, i, a * 1e3, b_ * 1e3) for k, i, a, b_ in ev[r]] for r in ev}, ax,
                  f"{name}: measured, 2 ranks on 2 shared CPU cores (ms)")

# %% [markdown]
# At $m = 1$ about half of the ranks' time is idle (the mean column), as the formula says. With more micro-batches the formula is a
# lower bound that real runs do not reach: it assumes equal, constant step times, but here the last stage also
# runs the head and the loss (a longer forward and backward), small micro-batches make per-step overheads
# (Python, the message, `autograd`'s set-up) a larger share, and the two processes share 2 CPU cores with
# everything else on the machine, so a step can lose its core half-way and the numbers change from run to run
# (re-run the cell). The timelines show what the bubble *is*: the gap before stage 1's first forward and the gap
# after stage 0's last forward while the first gradient travels back; 1F1B's interleaving does not remove them.
#
# ## 7. Activation memory per stage, measured
#
# Under a recorder the executor also reports the bytes autograd saves during each forward (`saved_tensors_hooks`,
# by storage, parameters and buffers excluded); they are held until that micro-batch's backward, so replaying the
# step order gives the peak per stage: the activation memory. On 4 ranks with $m = 6$:

# %%
out4 = tempfile.mkdtemp()
res = torchrun(4, ["-m", "minite.parallel.workers", "pp_memory", "--out", out4], timeout=240)
assert res.returncode == 0, res.stdout[-2000:]
mem = results(out4)
fig, ax = plt.subplots(figsize=(7, 2.8), layout="tight")
for k, (sched, c) in enumerate((("afab", "tab:red"), ("1f1b", "tab:blue"))):
    peaks = [mem[r][f"memory_{sched}"]["peak_act_bytes"] / 1e3 for r in range(4)]
    ax.bar([r + 0.4 * k - 0.2 for r in range(4)], peaks, width=0.4, color=c, label=sched.upper())
    print(f"{sched.upper():4}: peak KB per stage {[round(v) for v in peaks]}, micro-batches held "
          f"{[mem[r][f'memory_{sched}']['held'] for r in range(4)]}, "
          f"measured = held x per-micro-batch bytes: {all(mem[r][f'memory_{sched}']['ok'] for r in range(4))}")
ax.set(xticks=range(4), xticklabels=[f"stage {r}" for r in range(4)], ylabel="KB of saved activations",
       title="peak activation memory per stage, p=4, m=6 (measured)")
ax.legend()
plt.show()

# %% [markdown]
# AFAB holds all 6 micro-batches on every stage; 1F1B holds 4, 3, 2, 1. The last stage's bars are taller per
# micro-batch: it also saves the logits for the loss. (On a GPU the same numbers show in
# `torch.cuda.max_memory_allocated`; on the CPU we count what autograd keeps.)
#
# ## 8. In the GPT
#
# ```
# torchrun --nproc-per-node 2 -m minite.train --parallel.pp=2 --parallel.microbatches=4    # 1F1B by default
# torchrun --nproc-per-node 2 -m minite.train --parallel.pp=2 --parallel.pp_schedule=afab
# ```
# `--train.batch_size` is still the global batch: every rank draws the same batch, stage 0 reads the tokens, the
# last stage the targets, and the loss (computed on the last stage) is broadcast so rank 0 logs it. `PipelineGPT`
# runs the whole schedule inside `model(x, y)`; the loss it returns carries the gradients to `.grad` when
# `minite.train` calls `loss.backward()` (scaled by $1/$`grad_accum`), clipping uses the norm over all stages, and
# the checkpoint gathers the stages into the dense state dict. A test trains 20 steps this way and matches the
# single-process curve. Beyond this chapter: the **interleaved** 1F1B (Megatron: $v$ chunks per rank divide the
# bubble by $v$ for $v\times$ the messages) and the **zero-bubble** schedules, which split the backward into the
# input gradient (on the critical path) and the weight gradient (that can fill the bubble).
