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
# # 12 — Pipeline parallelism: stages, AFAB (GPipe), 1F1B and zero bubble, the bubble measured
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
# * the two classic schedules, AFAB (all-forward-all-backward, GPipe) and 1F1B (PipeDream-flush), as data,
#   each written here in a cell (minite's own are in `pipeline_schedule.py`), and an executor for any such schedule, written here in cells on simulated stages in
#   one process, then run for real with ordered `isend`/`irecv` (`pipeline.py`);
# * the bubble $(p-1)/(m+p-1)$ derived, then measured from per-rank events; the activation memory per stage of
#   AFAB vs 1F1B, measured;
# * the backward split into B (the input gradient) and W (the weight gradients), and the zero-bubble schedule
#   ZB-H1 built on it, its bubble $(p-1)/(3m+p-1)$ derived; AFAB, 1F1B, interleaved 1F1B and ZB-H1 side by side.
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
from matplotlib.patches import Patch
from minite.parallel import pipeline_schedule
from minite.parallel.pipeline_schedule import simulate, plot_timeline, bubble_fraction
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
# **tied** to the embedding (as in minite's GPT, `minite.models.gpt`), both end stages hold a copy of the $V \times C$ matrix, and a
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
assert abs(loss.item() - dense_loss.item()) < 1e-6 and worst < 1e-6  # the same ops in the same order, in fp32

# %% [markdown]
# ## 3. The naive pipeline and the bubble
#
# Run that on $p$ real ranks with the whole batch as one micro-batch: at any moment exactly one stage works.
# Cut the batch into $m$ micro-batches and let stage $s$ start micro-batch $i+1$ while stage $s+1$ works on $i$.
# The simplest schedule, **AFAB** (GPipe, Huang et al. 2019): every stage runs all $m$ forwards, then all $m$
# backwards. In the timelines below a light bar is a forward, a dark bar a backward, the number its micro-batch;
# `simulate` lays a schedule out in time with a forward taking $t_F = 1$ time unit, a backward $t_B = 2$, and
# messages taking none.

# %%
def afab_steps(p, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]

def label(ax, unit):
    """Axis unit and legend for plot_timeline's bars."""
    ax.set_xlabel(unit)
    ax.legend(handles=[Patch(facecolor="#9ecae1", edgecolor="k", label="forward of micro-batch i"),
                       Patch(facecolor="#3182bd", edgecolor="k", label="backward of micro-batch i")],
              loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, fontsize=8, frameon=False)

fig, axs = plt.subplots(1, 2, figsize=(11, 3.4), layout="tight")
for ax, m in zip(axs, (1, 8)):
    plot_timeline(simulate(afab_steps, 4, m), ax, f"AFAB, p=4, m={m} (simulated)")
    label(ax, "time, in units of one forward (t_F = 1, t_B = 2)")
plt.show()

# %% [markdown]
# **The bubble.** Let a forward take $t_F$ and a backward $t_B$ on every stage, and communication take no time.
# The last forward on the last stage ends after $(m + p - 1)\,t_F$ (stage $p-1$ starts $p-1$ forwards late); the
# backward wave then needs $(m + p - 1)\,t_B$ to drain back to stage 0. Each stage works $m(t_F + t_B)$ of the
# step's $(m+p-1)(t_F+t_B)$, so every stage idles
#
# $$\text{bubble} = \frac{(p-1)(t_F+t_B)}{(m+p-1)(t_F+t_B)} = \frac{p-1}{m+p-1}.$$
#
# It does not depend on $t_B/t_F$; it falls with $m$. GPipe's rule of thumb (Huang et al. 2019: the bubble is
# negligible once $M \geq 4K$, for $M$ micro-batches and $K$ partitions) is $m \geq 4p$, which keeps it under
# $(p-1)/(5p-1) < 20\%$. The simulator agrees:

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
# * **steady state**: one forward, then the oldest backward not yet run, alternating;
# * **cool-down**: the remaining backwards, in micro-batch order.
#
# Written as a generator of each stage's steps:

# %%
def one_f_one_b_steps(p, m, stage):
    """PipeDream-flush 1F1B: the ("F", i) / ("B", i) steps stage `stage` of `p` runs for `m` micro-batches."""
    warm = min(p - 1 - stage, m)
    steps = [("F", i) for i in range(warm)]  # warm-up
    for i in range(warm, m):  # steady state: the next forward, then the oldest backward
        steps += [("F", i), ("B", i - warm)]
    return steps + [("B", i) for i in range(m - warm, m)]  # cool-down


# %% tags=["nbval-check-output"]
# CHECK: the 1F1B generator
for p_ in range(1, 7):
    for m in range(1, 13):
        for s_ in range(p_):
            steps = one_f_one_b_steps(p_, m, s_)
            assert sorted(steps) == sorted((k, i) for k in "FB" for i in range(m)), (p_, m, s_, steps)
            assert steps == pipeline_schedule.one_f_one_b(p_, m, s_), (p_, m, s_)  # minite's, for the real ranks
        sim = simulate(one_f_one_b_steps, p_, m)  # runs without deadlock, as long as AFAB's (section 3)
        span = max(e[3] for v in sim.values() for e in v)
        assert span == 3 * (m + p_ - 1), (p_, m, span)
print("PASS: 1F1B has every step once, equals minite's schedule, and takes (m + p - 1)(t_F + t_B)")

# %% [markdown]
# Now what runs it. A schedule is data: `schedule(p, m, s)` is the list of `("F", i)` / `("B", i)` steps stage
# $s$ runs, in order. The **executor** below runs such lists on $p$ simulated stages in one process, with the rules
# of the real one (section 5):
#
# * a forward of micro-batch $i$ on stage $s > 0$ can run only once stage $s-1$ has "sent" its output for $i$ (a
#   mailbox entry, what `irecv` waits for); it keeps its input and output for the backward and "sends" the output
#   on, **detached**, as a fresh leaf that requires a gradient;
# * a backward of $i$ on stage $s < p-1$ waits for the gradient of its output from stage $s+1$; the last stage
#   starts from $1/m$ (the step's loss is the mean of the $m$ micro-batch losses); it runs
#   `torch.autograd.backward(output, grad)`, sends its input's gradient back and frees what it kept;
# * each round every stage tries its next step; a round in which no stage can move is a **deadlock**.
#
# It also counts, per stage, the micro-batches whose activations are held at once: the activation memory.

# %%
def run_schedule(stages, schedule, x, y, m):
    """One optimizer step's forwards and backwards of `schedule` on simulated stages. Returns the loss (mean over
    the m micro-batches), the most micro-batches each stage held at once, and the steps in the order they ran."""
    p = len(stages)
    plans = [list(schedule(p, m, s)) for s in range(p)]
    xs, ys = x.chunk(m), y.chunk(m)  # m micro-batches of b / m sequences
    to_next, to_prev = {}, {}  # mailboxes: (receiving stage, micro-batch) -> activation / its gradient
    kept = [{} for _ in range(p)]  # stage s: micro-batch -> (input, output), held until its backward
    pos, held, losses, ran = [0] * p, [0] * p, [], []
    while any(pos[s] < len(plans[s]) for s in range(p)):
        moved = False
        for s, st in enumerate(stages):
            if pos[s] == len(plans[s]):
                continue
            kind, i = plans[s][pos[s]]
            if kind == "F":
                if s > 0 and (s, i) not in to_next:
                    continue  # irecv would wait
                inp = xs[i] if s == 0 else to_next.pop((s, i))
                out = st(inp, ys[i] if st.last else None)
                kept[s][i] = (inp, out)
                if st.last:
                    losses.append(out.detach())
                else:
                    to_next[(s + 1, i)] = out.detach().requires_grad_()  # isend: a fresh leaf on the next stage
            else:
                if not st.last and (s, i) not in to_prev:
                    continue
                inp, out = kept[s].pop(i)
                grad = torch.tensor(1.0 / m) if st.last else to_prev.pop((s, i))
                torch.autograd.backward(out, grad)
                if s > 0:
                    to_prev[(s - 1, i)] = inp.grad  # isend of the input's gradient
            held[s] = max(held[s], len(kept[s]))
            ran.append((s, kind, i))
            pos[s] += 1
            moved = True
        if not moved:
            raise RuntimeError(f"deadlock: the stages wait at {[plans[s][pos[s]:pos[s] + 1] for s in range(p)]}")
    first, last = stages[0].wte.weight, stages[-1].wte.weight
    total = first.grad + last.grad  # the tied embedding: both uses' gradients
    first.grad, last.grad = total, total.clone()
    return torch.stack(losses).mean(), held, ran

# %% [markdown]
# Checked against the dense GPT on a batch of 12 sequences: the loss and every gradient, for both schedules, $p = 2$
# and $p = 4$ stages and several $m$ (a micro-batch's loss is a mean over its tokens, so the mean over equal
# micro-batches is the whole batch's loss). The real executor, `minite.parallel.pipeline.PipelineGPT`, is checked
# against the same dense model on real ranks in section 5.

# %%
torch.manual_seed(0)
cfg4 = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64,
                 backend="torch")
dense4 = GPT(cfg4)
x12, y12 = torch.randint(0, 64, (12, 16), generator=g), torch.randint(0, 64, (12, 16), generator=g)
dense4.zero_grad(set_to_none=True)
want = dense4(x12, y12)[1]
want.backward()
ref4 = dict(dense4.named_parameters())
for p_ in (2, 4):
    for name, sched in (("AFAB", afab_steps), ("1F1B", one_f_one_b_steps)):
        for m in (1, 3, 6):
            sts = [Stage(dense4, r, s == 0, s == p_ - 1) for s, r in enumerate(partition(dense4, p_))]
            got, held, _ = run_schedule(sts, sched, x12, y12, m)
            worst = max(float((q.grad - ref4[n].grad).abs().max()) for st in sts for n, q in st.named_parameters())
            assert abs(got.item() - want.item()) < 1e-5 and worst < 1e-5, (name, p_, m, worst)
            print(f"p={p_} {name} m={m}: |loss - dense| {abs(got.item() - want.item()):.0e}, worst |grad - dense| "
                  f"{worst:.0e}, micro-batches held per stage {held}")
print("PASS: the executor matches the dense GPT for both schedules")

# %% [markdown]
# A schedule that waits on itself is caught. With $p = 2$, let stage 0 alternate one forward and one backward from
# the start while stage 1 runs both forwards first: stage 1 waits for micro-batch 1's activation, which stage 0
# sends only after micro-batch 0's backward, which waits for stage 1.

# %%
def stuck(p, m, s):
    return [("F", 0), ("B", 0), ("F", 1), ("B", 1)] if s == 0 else afab_steps(p, m, s)

try:
    run_schedule([Stage(dense4, r, s == 0, s == 1) for s, r in enumerate(partition(dense4, 2))], stuck, x12, y12, 2)
except RuntimeError as e:
    print(e)

# %% [markdown]
# Laid out in time, 1F1B and AFAB take the same length:

# %%
fig, axs = plt.subplots(1, 2, figsize=(11, 3.4), layout="tight")
for ax, (name, sched) in zip(axs, (("AFAB", afab_steps), ("1F1B", one_f_one_b_steps))):
    plot_timeline(simulate(sched, 4, 8), ax, f"{name}, p=4, m=8 (simulated)")
    label(ax, "time, in units of one forward (t_F = 1, t_B = 2)")
plt.show()

# %% [markdown]
# Same length, same bubble. What changed is how many micro-batches each stage has forwarded but not yet
# backwarded, i.e. holds activations for; the executor counted it above, and so does this replay of the orders:

# %%
def max_in_flight(steps):
    live = peak = 0
    for kind, _ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak

for m in (2, 6, 16):
    print(f"m={m:2}: AFAB {[max_in_flight(afab_steps(4, m, s)) for s in range(4)]}, "
          f"1F1B {[max_in_flight(one_f_one_b_steps(4, m, s)) for s in range(4)]}")

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
# One launch on 2 ranks compares loss and every gradient with the dense model for each schedule (AFAB and 1F1B,
# and the two of sections 8-9: ZB-H1 and the interleaved 1F1B) and $m \in \{1, 2, 3, 4, 6\}$ (interleaved:
# $m \in \{4, 12\}$), then trains 3 AdamW steps through `minite.train`'s interface (gradient
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
        assert err < 1e-5 and all(r[name]["ok"] for r in rep.values()), name
print("train 3 steps: parameters vs dense", f"{rep[0]['train_3_steps']['param_err']:.0e}")
assert rep[0]["train_3_steps"]["param_err"] < 1e-4  # 3 AdamW steps amplify fp32 rounding (lr 1e-2 moves ~1e-2)
assert len(rep[0]["reject"]["messages"]) == 2
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
print("\nm = 8, the runs plotted below: each stage's forward and backward times, shortest and longest (ms)")
fig, axs = plt.subplots(1, 2, figsize=(11, 3.4), layout="tight")
for ax, name in zip(axs, ("afab_m8", "1f1b_m8")):
    ev = best_run(name)
    for r in ev:
        dur = {k: [(b_ - a) * 1e3 for k_, _, a, b_ in ev[r] if k_ == k] for k in "FB"}
        print(f"  {name} stage {r}: " + ", ".join(f"{'forward' if k == 'F' else 'backward'} "
                                                  f"{min(v):.1f} to {max(v):.1f}" for k, v in dur.items()))
    plot_timeline({r: [(k, i, a * 1e3, b_ * 1e3) for k, i, a, b_ in ev[r]] for r in ev}, ax,
                  f"{name}: measured, 2 ranks on 2 shared CPU cores")
    label(ax, "time since the step's first start (ms)")
plt.show()

# %% [markdown]
# At $m = 1$ about half of the ranks' time is idle (the mean column), as the formula says. With more micro-batches
# the formula is a lower bound that real runs do not reach, because its assumptions fail here:
#
# * **equal, constant step times.** Section 2 balanced the stages by **parameter count**, which is not time: the
#   embedding counted on stage 0 is a table lookup, while the tied head counted on the last stage is a GEMM with
#   the $V \times C$ matrix followed by the loss, so the last stage does more work per micro-batch than its share
#   of parameters says, and runs can show it (one printed the last stage's 1F1B backwards at 11–17 ms against
#   stage 0's 5–10 ms). Read the printed ranges of the run above: the same step on one stage also varies from
#   one micro-batch to the next, by up to a factor of 2 or more, which blurs the difference between stages. The two processes share 2 CPU cores with everything else on the
#   machine, so a step that loses its core half-way runs long, and a stage can sit idle with its input ready (a
#   gap in one row with no matching work in the other row). The numbers change from run to run (re-run the cell).
# * **free messages**: every hand-over passes through gloo, and small micro-batches make the per-step overheads
#   (Python, the message, `autograd`'s set-up) a larger share.
#
# Through that noise the timelines show what the bubble *is*: the gap before stage 1's first forward and the gap
# on stage 0 after its last forward while the first gradient travels back; 1F1B's interleaving does not remove
# them.
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
# ## 8. Zero bubble: the backward split into B and W
#
# 1F1B kept the bubble where it was. Look at what a backward computes. For a linear layer $y = x W^\top$ that
# receives $dy = \partial L / \partial y$:
#
# * **B**, the input gradient $dx = dy\, W$: the previous stage waits for it, so it is on the critical path;
# * **W**, the weight gradient $dW = dy^\top x$: only the optimizer step, after the whole schedule, reads it.
#   Nothing downstream waits for a weight gradient: the other stages receive $dx$, and this stage's later
#   forwards and backwards read $W$, not $dW$.
#
# Qi, Wan, Huang and Lin ("Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241) split each stage's
# backward into these two passes: B runs when the output's gradient arrives and sends $dx$ upstream at once; W
# runs whenever the stage would otherwise idle, any time before the optimizer step. For a stage of linear layers
# the three passes cost the same, one GEMM of the same size per layer each ($x W^\top$, $dy\, W$, $dy^\top x$);
# sections 3-4's backward, $t_B = 2 t_F$, was B + W.
#
# The split on a tiny stage, two linear layers with a tanh between. B asks `torch.autograd.grad` for the gradient
# of the stage's input and of the first layer's output $h$ (what W needs, computed on the way to $dx$ anyway), and
# for no weight: autograd then runs no weight GEMM. W is $dy^\top x$ per layer (the bias: $\sum dy$ over the
# rows), written out. Checked against one whole backward, with the GEMM flops of each pass counted
# (`torch.utils.flop_counter`):

# %%
from torch.utils.flop_counter import FlopCounterMode

def counted(fn):
    """fn() and the flops of the matrix products it ran."""
    with FlopCounterMode(display=False) as fc:
        out = fn()
    return out, fc.get_total_flops()

torch.manual_seed(0)
lin1, lin2 = torch.nn.Linear(24, 48), torch.nn.Linear(48, 24)  # the stage: lin2(tanh(lin1(x)))
x_in = torch.randn(6, 24, requires_grad=True)  # the activation received from the previous stage
dy_out = torch.randn(6, 24)  # the gradient of the stage's output, received from the next stage

def stage_forward(x):
    h = lin1(x)
    a = torch.tanh(h)
    return h, a, lin2(a)

(h, a, out), f_flops = counted(lambda: stage_forward(x_in))                      # F
(dx, dh), b_flops = counted(lambda: torch.autograd.grad(out, (x_in, h), dy_out))  # B: dx goes upstream now
assert lin1.weight.grad is None and lin2.weight.grad is None  # B computed no weight gradient
w_grads, w_flops = counted(lambda: {                                              # W: any time later
    (lin2, "weight"): dy_out.t() @ a.detach(), (lin2, "bias"): dy_out.sum(0),
    (lin1, "weight"): dh.t() @ x_in.detach(), (lin1, "bias"): dh.sum(0)})

x_ref = x_in.detach().clone().requires_grad_()  # the whole backward at once, as sections 3-7 ran it
out_ref = stage_forward(x_ref)[2]
_, full_flops = counted(lambda: out_ref.backward(dy_out))
torch.testing.assert_close(dx, x_ref.grad, rtol=0, atol=1e-6)
for (layer, name), g in w_grads.items():
    torch.testing.assert_close(g, getattr(layer, name).grad, rtol=0, atol=1e-6)
print(f"flops of the matrix products: F {f_flops}, B {b_flops}, W {w_flops}, the whole backward {full_flops}")
assert f_flops == b_flops == w_flops and b_flops + w_flops == full_flops
print("PASS: B then W gives the whole backward's gradients, and each pass does one forward's GEMM work")

# %% [markdown]
# Between its B and its W a micro-batch keeps only each linear layer's input and output gradient (here `x_in`,
# `a`, `dh`, `dy_out`); B frees the rest of its graph. `minite.parallel.schedules.DeferredWeights` does the same
# on a real stage (it keeps the gradient edge of each linear layer's output and asks autograd for those), and
# `torch.distributed.pipelining` does it with `stage_backward_input` / `stage_backward_weight`
# (`torch/distributed/pipelining/_backward.py`).
#
# **ZB-H1** (Qi et al., section 2.1, "memory efficient schedule"). Count in units $F = B = W = 1$ (1F1B's
# backward is $B + W = 2$) and take $m \ge p$. A lower bound first: the last stage cannot start before micro-batch
# 0's forward reaches it at time $p - 1$, and it has $3m$ units of work, so the step takes at least $3m + p - 1$.
# ZB-H1 reaches it with this order on stage $s$:
#
# * 1F1B's forwards and B's in 1F1B's order: $\min(p-1-s, m)$ warm-up forwards, then one forward and one B;
# * after each B, one W, the oldest one waiting; except that stage $s$ holds back the W's of its **first $s$**
#   B's, which run in the cool-down, where 1F1B's stages wait.
#
# Why $s$ of them. At the start, B runs alone on the critical path: B of micro-batch 0 leaves the last stage at
# $p + 1$ and climbs one unit a stage, so stage $s$ runs it at $2p - 1 - s$. Stage $s$ got its first forward at
# $s$ and ran its $p - s$ forwards by $p$: it idles $s$ units before its first forward and $p - 1 - s$ waiting for
# its first B, $p - 1$ in all. At the end, the last micro-batch's B climbs the same way, so stage $s$ runs its
# last B $s$ units before stage 0 runs its own: to end with stage 0 without idling, stage $s$ needs $s$ units of
# work after it more than stage 0 has (every stage has the W of its last B), and only W's are left: the $s$ it
# held back. With fewer held back, stage $s$ idles in the
# cool-down, as in 1F1B: there the B's arrive once every $F + B + W$ (the pace of the last stage's steady state),
# and a stage with no forward left has only $B + W$ to do between two of them. So every stage idles exactly
# $p - 1$ units of the $3m + p - 1$, the lower bound:
#
# $$\text{bubble}_\text{ZB-H1} = \frac{p-1}{3m+p-1} \qquad\text{against}\qquad \text{bubble}_\text{1F1B} =
# \frac{3(p-1)}{3(m+p-1)} = \frac{p-1}{m+p-1},$$
#
# a third of 1F1B's idle time per stage (Qi et al. write it for any costs: $(p-1)(T_F + T_B - T_W)$ against
# 1F1B's $(p-1)(T_F + T_B + T_W)$). Memory: a micro-batch is held from its F to its W (W still needs $x$ and $dy$;
# counted here as a whole micro-batch, which overstates it). Stage $s$ of 1F1B holds at most $p - s$; holding
# back $s$ W's makes it $p - s + s = p$ on every stage: no stage holds more than 1F1B's stage 0.
#
# The generator, from 1F1B's steps (section 4):

# %%
def zbh1_steps(p, m, stage):
    """ZB-H1: 1F1B's F and B steps; after each B the oldest W waiting, except after the first `stage` B's."""
    steps, waiting = [], []  # waiting: micro-batches whose B ran and whose W did not
    for kind, i in one_f_one_b_steps(p, m, stage):
        steps.append((kind, i))
        if kind == "B":
            waiting.append(i)
            if i >= stage:  # 1F1B runs the B's in micro-batch order: B i is this stage's (i+1)-th
                steps.append(("W", waiting.pop(0)))
    return steps + [("W", i) for i in waiting]  # cool-down: the W's held back

print("stage 0:", " ".join(f"{k}{i}" for k, i in zbh1_steps(4, 8, 0)))
print("stage 3:", " ".join(f"{k}{i}" for k, i in zbh1_steps(4, 8, 3)))

# %% [markdown]
# Checked with minite's schedule tools (`minite.parallel.schedules`): `check_plan` runs every stage's list as
# `PipelineGPT` would (each F, B and W once and in order, every receive meeting the message sent for it, no
# deadlock), `simulate_ops` lays the plan out in time (messages free), `in_flight` counts the micro-batches held
# between F and W. Against minite's own ZB-H1 (`schedules.zbh1`) and the formula:

# %% tags=["nbval-check-output"]
# CHECK: the ZB-H1 generator
from minite.parallel import schedules

def timed(schedule, p, m, cost=(1.0, 1.0, 1.0)):
    """(span, idle time of each stage, most micro-batches held on a stage) of a schedule at the given F, B, W
    costs (a backward that is not split costs B + W)."""
    ops = schedules.plan(schedule, p, m)
    schedules.check_plan(ops, p, m)
    ev = schedules.simulate_ops(ops, p, cost=cost)
    span = max(e[4] for r in ev.values() for e in r)
    return span, [span - sum(e[4] - e[3] for e in ev[r]) for r in ev], max(schedules.in_flight(o) for o in ops.values())

for p_ in range(1, 7):
    for m in range(p_, 13):
        span, idle, held = timed(zbh1_steps, p_, m)
        assert (span, idle) == timed(schedules.zbh1, p_, m)[:2], (p_, m)  # minite's: the same bubble
        assert span == 3 * m + p_ - 1 and idle == [p_ - 1] * p_ and held <= p_, (p_, m, span, idle, held)
        assert abs(idle[0] / span - (p_ - 1) / (3 * m + p_ - 1)) < 1e-12
print("PASS: ZB-H1 is a valid plan, every stage idles p - 1 of 3m + p - 1 units, at most p micro-batches held")

# %% [markdown]
# What the W's placement buys, at $p = 4$, $m = 8$: the split alone (W right after its B) already sends the
# gradient upstream after B instead of B + W; holding back one W too few leaves a unit of the bubble; one too many
# gains nothing and holds one more micro-batch; all W's at the end hold all $m$.

# %%
def zb_variant(held_back):
    """1F1B's F/B order, stage s holding back the W's of its first held_back(p, s) B's."""
    def schedule(p, m, stage):
        steps, waiting = [], []
        for kind, i in one_f_one_b_steps(p, m, stage):
            steps.append((kind, i))
            if kind == "B":
                waiting.append(i)
                if i >= held_back(p, stage):
                    steps.append(("W", waiting.pop(0)))
        return steps + [("W", i) for i in waiting]
    return schedule

print(f"{'p=4, m=8, F = B = W = 1':34} {'span':>5} {'idle a stage':>13} {'most held':>9}")
for name, sched in (("1F1B (backward unsplit, B + W = 2)", one_f_one_b_steps),
                    ("W right after its B", zb_variant(lambda p, s: 0)),
                    ("first s - 1 W's held back", zb_variant(lambda p, s: max(s - 1, 0))),
                    ("ZB-H1: first s W's held back", zbh1_steps),
                    ("first s + 1 W's held back", zb_variant(lambda p, s: s + 1)),
                    ("every W at the end", zb_variant(lambda p, s: 8))):
    span, idle, held = timed(sched, 4, 8)
    print(f"{name:34} {span:5.0f} {max(idle):13.0f} {held:9}")
assert timed(zb_variant(lambda p, s: 0), 4, 8)[0] == 3 * 8 + 2 * 3  # (p-1)(F + B) idle: the split alone
assert timed(zbh1_steps, 4, 8)[0] == 3 * 8 + 3 < timed(zb_variant(lambda p, s: max(s - 1, 0)), 4, 8)[0]

# %% [markdown]
# Real costs are not equal. At other costs the same order keeps Qi et al.'s $(p-1)(T_F + T_B - T_W)$ idle per
# stage (with W no longer than F or B), against 1F1B's $(p-1)(T_F + T_B + T_W)$; W is usually the cheaper half
# (no activation function or attention to differentiate):

# %%
for cost in ((1.0, 1.2, 0.8), (1.0, 1.0, 0.5)):
    F, B, W = cost
    zb, one = timed(zbh1_steps, 4, 8, cost), timed(one_f_one_b_steps, 4, 8, cost)
    print(f"F, B, W = {cost}: idle a stage ZB-H1 {max(zb[1]):.2f} (formula {3 * (F + B - W):.2f}), "
          f"1F1B {max(one[1]):.2f} (formula {3 * (F + B + W):.2f})")
    assert abs(max(zb[1]) - 3 * (F + B - W)) < 1e-9 and abs(max(one[1]) - 3 * (F + B + W)) < 1e-9

# %% [markdown]
# ## 9. Four schedules side by side
#
# The fourth is Megatron's **interleaved 1F1B** (Narayanan et al. 2021, section 2.2; `schedules.interleaved`): the
# model is cut into $pv$ chunks and rank $r$ holds the $v$ chunks $r, r + p, \dots$; each chunk's forward and
# backward take $1/v$ of a stage's, so the pipeline fills $v$ times faster: bubble $(p-1)/(vm+p-1)$, for $v$ times
# the messages and $p + (p-1)/v$ stages' worth of activations on rank 0. The four timelines at $p = 4$, $m = 8$,
# unit costs (interleaved: $v = 2$, chunk 1 hatched), laid out by `simulate_ops`:

# %%
COLOURS = {"F": "#9ecae1", "B": "#3182bd", "W": "#31a354"}

def plot_ops(events, ax, title):
    """Gantt chart of simulate_ops' events: one row a rank, the micro-batch on each bar."""
    for r, ev in events.items():
        for kind, i, c, a, b in ev:
            ax.barh(r, b - a, left=a, color=COLOURS[kind], edgecolor="k", lw=0.5, hatch="//" if c else None)
            ax.text((a + b) / 2, r, str(i), ha="center", va="center", fontsize=6)
    ax.set_yticks(list(events), [f"rank {r}" for r in events])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9, loc="left")

four = (("AFAB", schedules.SCHEDULES["afab"]), ("1F1B", schedules.SCHEDULES["1f1b"]),
        ("interleaved 1F1B, v = 2", schedules.SCHEDULES["interleaved"]), ("ZB-H1", zbh1_steps))
fig, axs = plt.subplots(4, 1, figsize=(11, 8), sharex=True, layout="tight")
for ax, (name, sched) in zip(axs, four):
    v = getattr(sched, "v", 1)
    ev = schedules.simulate_ops(schedules.plan(sched, 4, 8), 4, v)
    span = max(e[4] for r_ in ev.values() for e in r_)
    plot_ops(ev, ax, f"{name}: the step takes {span:g} units")
axs[-1].set_xlabel("time, in units of one forward (F = B = W = 1; an unsplit backward takes 2)")
axs[-1].legend(handles=[Patch(facecolor=COLOURS["F"], edgecolor="k", label="F"),
                        Patch(facecolor=COLOURS["B"], edgecolor="k", label="B (unsplit: B + W)"),
                        Patch(facecolor=COLOURS["W"], edgecolor="k", label="W"),
                        Patch(facecolor="w", edgecolor="k", hatch="//", label="chunk 1 (interleaved)")],
               loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
plt.show()

# %% [markdown]
# The table, from the same simulation (`schedules.schedule_table`): the bubble (the idle fraction of the most
# idle rank) and the peak activations (the fullest rank, in stages' worth of one micro-batch), against each
# formula:

# %%
print(f"{'schedule':12} {'span':>5} {'bubble':>7} {'formula':>7}   {'peak':>4} {'formula':>7}")
for row in schedules.schedule_table(4, 8, 2):
    print(f"{row['schedule']:12} {row['span']:5g} {row['bubble']:7.3f} {row['bubble_formula']:7.3f}   "
          f"{row['peak_activations']:4g} {row['peak_formula']:7g}")
    assert row["bubble"] == row["bubble_formula"] and row["peak_activations"] == row["peak_formula"], row
print("formulas: AFAB and 1F1B (p-1)/(m+p-1); interleaved (p-1)/(vm+p-1); ZB-H1 (p-1)/(3m+p-1); "
      "peaks m, p, p + (p-1)/v, p")

# %% [markdown]
# The memory column was measured too: section 7's launch ran every schedule on 4 ranks and replayed the bytes
# autograd saved (ZB-H1 at $m = 6$ holds a micro-batch until its W; interleaved at $m = 4$, in stages' worth):

# %%
for sched in ("afab", "1f1b", "zbh1", "interleaved"):
    print(f"{sched:12} micro-batches held per stage (measured): {[mem[r][f'memory_{sched}']['held'] for r in range(4)]}"
          f", ok: {all(mem[r][f'memory_{sched}']['ok'] for r in range(4))}")
    assert all(mem[r][f"memory_{sched}"]["ok"] for r in range(4)), sched

# %% [markdown]
# And timed: `benchmarks/bench_pp_schedules.py` ran the four schedules through `PipelineGPT` on gloo CPU ranks and
# recorded the measured bubble and peaks (`benchmarks/results/pp_schedules_*.json`, read by `minite.recorded`):

# %%
from minite.recorded import recorded

runs = recorded("pp_schedules")
if not runs:
    print("no recorded run of benchmarks/bench_pp_schedules.py here (a source checkout has one)")
for fname, run in runs.items():
    print(f"{fname}: {run['device']}\n  {run['measured_model']}\n  {run['command']}")
    print(f"  {'schedule':12} {'p':>2} {'m':>2} {'span ms':>8} {'bubble':>7} {'mean':>6} {'formula':>7}   peaks")
    form = {(r["schedule"], r["p"], r["m"]): r for r in run["simulated"]}
    for r in run["measured"]:
        sim = form[(r["schedule"], r["p"], r["m"])]
        print(f"  {r['schedule']:12} {r['p']:2} {r['m']:2} {r['span_ms']:8.1f} {r['bubble_max']:7.3f} "
              f"{r['bubble_mean']:6.3f} {sim['bubble_formula']:7.3f}   {r['peak_activations_per_rank']}")
    c = run.get("split_cost_ms")
    if c:
        print(f"  one stage ({c['shape']}): F {c['F']:.0f} ms, B {c['B']:.0f} + W {c['W']:.0f} ms, "
              f"the whole backward {c['backward']:.0f} ms")
        zb, one = (timed(s, 4, 8, (c["F"], c["B"], c["W"])) for s in (zbh1_steps, one_f_one_b_steps))
        print(f"  at those costs, p=4, m=8, messages free: bubble ZB-H1 {max(zb[1]) / zb[0]:.3f}, "
              f"1F1B {max(one[1]) / one[0]:.3f}")

# %% [markdown]
# The measured peaks follow the formulas (at $p = 4$ interleaved's rank 0 holds $5.5 = p + (p-1)/v$ stages' worth;
# a chunk is half a stage, and the chunks' saved bytes differ a little, hence 5.501). The measured bubbles do not,
# and the recorded note says why: with more ranks than free cores the idle time includes waiting for a core, and
# on a model this small the messages and Python's overhead per step weigh as much as the GEMMs, which the unit-cost
# formulas leave out (section 6's caveats, for four schedules). In the recorded run ZB-H1's measured bubble is the
# smallest of the four at $p = 4$ (0.26 against 1F1B's 0.42) and not at $p = 2$: one run on shared cores, not a
# measurement of the formula. The split itself costs a little: the recorded B + W, 98 + 64 = 162 ms, against
# 156 ms for the one backward (two passes over the graph instead of one); at those three costs the simulation
# still gives ZB-H1 about half of 1F1B's bubble.
#
# ## 10. In the GPT
#
# ```
# torchrun --nproc-per-node 2 -m minite.train --parallel.pp=2 --parallel.microbatches=4    # 1F1B by default
# torchrun --nproc-per-node 2 -m minite.train --parallel.pp=2 --parallel.pp_schedule=afab
# torchrun --nproc-per-node 2 -m minite.train --parallel.pp=2 --parallel.pp_schedule=zbh1
# torchrun --nproc-per-node 2 -m minite.train --parallel.pp=2 --parallel.pp_schedule=interleaved  # 2 chunks a rank
# ```
# `--train.batch_size` is still the global batch: every rank draws the same batch, stage 0 reads the tokens, the
# last stage the targets, and the loss (computed on the last stage) is broadcast so rank 0 logs it. `PipelineGPT`
# runs the whole schedule inside `model(x, y)`; the loss it returns carries the gradients to `.grad` when
# `minite.train` calls `loss.backward()` (scaled by $1/$`grad_accum`), clipping uses the norm over all stages, and
# the checkpoint gathers the stages into the dense state dict. A test trains 20 steps this way with `zbh1` and with
# `interleaved` and matches the single-process curve. With `zbh1` each stage's backward runs as B and W through
# `DeferredWeights`; `interleaved` needs $m$ divisible by $p$ and at least $2p$ layers.
#
# Beyond minite: ZB-H2 (Qi et al., section 2.2) fills the rest of the bubble with more warm-up forwards, for up to
# $2p - 1$ micro-batches held, once the optimizer step no longer waits for every stage to finish (section 8's
# lower bound assumed it does; they validate the step after the fact instead); ZB-V (the same authors) and
# DeepSeek-V3's DualPipe combine the split with two chunks a rank. `torch.distributed.pipelining` has them as
# `ScheduleInterleavedZeroBubble` (the ZB-H1 order over several chunks a rank), `ScheduleZBVZeroBubble` and
# `ScheduleDualPipeV` (its actions: F, I for the input gradient, W, and B for an unsplit backward); torchtitan
# picks one by name with `--parallelism.pipeline_parallel_schedule` (e.g. `ZBVZeroBubble`).
