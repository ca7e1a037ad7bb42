"""Chapter 16's checks: expert parallelism against one process (loss, every gradient, 5 AdamW steps, the dense
checkpoint) at every ep that divides the world, the all-to-all's bytes; the MoE GPT under tensor (+ sequence)
parallelism, alone and with dp; bad layouts refused; a rank killed during the dispatch."""
from __future__ import annotations

import os

import torch

from minite.errors import ParallelError
from minite.layers.moe import step_expert_bias
from minite.parallel import comm
from minite.parallel.dims import ParallelDims
from minite.parallel.expert import ExpertDataParallel, shard_experts
from minite.parallel.workers.common import CLIP, STEPS, TOL, adamw, batches, dense_run, maxerr, result, tiny_gpt

MOE = dict(moe_num_experts=4, moe_top_k=2)


def _mine(t: torch.Tensor, dims) -> torch.Tensor:
    n = t.shape[0] // dims.dp
    return t[dims.dp_rank * n:(dims.dp_rank + 1) * n]


def _ep_run(dims, data, balance: str):
    """(first loss of the global batch, first-step grads, bytes of the all-to-all per step, dense state after
    STEPS clipped AdamW steps) of the EP model on my slice of each batch."""
    model = tiny_gpt(**MOE, moe_balance=balance)
    ddp = ExpertDataParallel(shard_experts(model, dims), dims)
    opt = adamw(model)
    loss0 = grads = None
    with comm.CommLog() as log:
        for i, (x, y) in enumerate(data[:STEPS]):
            loss = model(_mine(x, dims), _mine(y, dims))[1]
            loss.backward()  # ExpertDataParallel reduces when the backward ends
            if i == 0:
                t = loss.detach().reshape(1).clone()
                comm.all_reduce(t, dims.group("dp"))
                loss0 = float(t) / dims.dp
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                a2a = log.total(op="all_to_all")
            ddp.clip_grad_norm_(CLIP)
            opt.step()
            step_expert_bias(model)  # the "bias" balance's step, as minite.train's
            opt.zero_grad(set_to_none=True)
    return loss0, grads, a2a, ddp.dense_state_dict()


def check_ep(dims, args) -> dict:
    """At each ep dividing the world (dp = world): the global loss, every gradient (the expert grads against my
    experts' rows of the dense grads) and the dense weights after 5 steps == one process on the whole batch."""
    world = dims.dp
    out = {}
    data = batches(STEPS, 2 * world)
    for balance in ("aux", "bias"):
        dense = tiny_gpt(**MOE, moe_balance=balance)
        loss_ref = dense(*data[0])[1]  # the global batch in one process
        loss_ref.backward()
        ref_grads = {n: p.grad for n, p in dense.named_parameters()}
        ref = dense_run(tiny_gpt(**MOE, moe_balance=balance), data).state_dict()
        for ep in [e for e in (2, 4) if world % e == 0]:
            d = ParallelDims(dp=world, ep=ep).build(dims.rank, dims.world)
            loss0, grads, a2a, state = _ep_run(d, data, balance)
            lo, El = d.ep_rank * 4 // ep, 4 // ep
            g_err = max(float((g - (ref_grads[n][lo:lo + El] if ".w_" in n else ref_grads[n])).abs().max())
                        for n, g in grads.items())
            res = result(maxerr(state, ref), TOL, loss_err=abs(loss0 - loss_ref.item()), grad_err=g_err,
                         a2a_bytes=a2a, experts=[lo, lo + El])
            bias = "blocks.0.mlp.expert_bias"  # "bias": every rank moved it by the global load, as one process
            res["ok"] &= res["loss_err"] < 1e-6 and g_err < 1e-6 and maxerr(state, {bias: ref[bias]}) == 0
            out[f"ep{ep}_{balance}"] = res
    return out


def check_ep_resume(dims, args) -> dict:
    """A one-process checkpoint (dense weights + dense AdamW state) resumed at ep = world: each rank's experts get
    their rows of the dense moments, and the next step equals one process's next step."""
    from minite.parallel.reshard import dense_optim_state, load_dense_optim_state
    data = batches(2, 2 * dims.dp)
    first = tiny_gpt(**MOE)  # one step in one process: the checkpoint
    opt_first = adamw(first)
    first(*data[0])[1].backward()
    opt_first.step()
    opt_first.zero_grad(set_to_none=True)
    saved = {"model": first.state_dict(), "optim": dense_optim_state(first, opt_first, None)}
    dense = tiny_gpt(**MOE)  # the reference: the next step in one process, from the checkpoint
    dense.load_state_dict(saved["model"])
    opt_dense = adamw(dense)
    opt_dense.load_state_dict(opt_first.state_dict())
    dense(*data[1])[1].backward()
    opt_dense.step()
    d = ParallelDims(dp=dims.dp, ep=dims.dp).build(dims.rank, dims.world)
    model = tiny_gpt(**MOE)
    model.load_state_dict(saved["model"])  # dense weights first, then the cut (as minite.train resumes)
    ddp = ExpertDataParallel(shard_experts(model, d), d)
    opt = adamw(model)
    load_dense_optim_state(model, opt, saved["optim"])
    model(_mine(data[1][0], d), _mine(data[1][1], d))[1].backward()
    opt.step()
    return {"ep_resume": result(maxerr(ddp.dense_state_dict(), dense.state_dict()), TOL)}


def _tp_grad_err(model, ref_grads: dict) -> tuple[float, str]:
    """The largest |grad - the dense grad's slice| over every parameter of a TPGPT (and the parameter's name)."""
    errs = {}
    for p in model.parameters():
        dim, index = p.dense_index
        ref = ref_grads[p.dense_name] if dim is None else ref_grads[p.dense_name].index_select(dim, index)
        errs[p.dense_name] = float((p.grad - ref).abs().max())
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def check_moe_tp(dims, args) -> dict:
    """The MoE GPT under tp = 2 (the world cut as dp = world/2 x tp = 2), with and without SP, wrapped as minite.train
    wraps it (runtime.Parallel): each tp pair on the whole batch (dp = 1 in effect: no dp wrapper), then dp x tp on
    my dp slice, and dp x tp with ep = 2: the global loss and every gradient of the first step (the MoE's whole, or
    my experts' rows, on every tp rank) and the dense state after 5 clipped AdamW steps (the "bias" balance's
    buffer included) == one process."""
    d = ParallelDims(dp=dims.world // 2, tp=2).build(dims.rank, dims.world)
    out = {}
    for balance, sp in (("aux", False), ("aux", True), ("bias", True)):
        _moe_tp_case(d, out, balance, sp, alone=True)
    if d.dp % 2 == 0:  # tp x ep: my E/2 experts, the same on both ranks of my tp pair
        _moe_tp_case(ParallelDims(dp=d.dp, tp=2, ep=2).build(dims.rank, dims.world), out, "aux", True, alone=False)
    return out


def _moe_tp_case(d, out: dict, balance: str, sp: bool, alone: bool) -> None:
    from minite.parallel.runtime import Parallel
    from minite.parallel.sequence import TPGPT
    kw = dict(**MOE, moe_balance=balance)
    data = batches(STEPS, 2 * d.dp)
    dense = tiny_gpt(**kw)
    loss_ref = dense(*data[0])[1]
    loss_ref.backward()
    ref_grads = {n: p.grad for n, p in dense.named_parameters()}
    ref = dense_run(tiny_gpt(**kw), data).state_dict()
    tag = f"tp{'_sp' if sp else ''}_{balance}"
    if alone:  # each tp pair alone on the whole batch (no dp): loss and grads of one step
        model = TPGPT.from_dense(tiny_gpt(**kw), d.group("tp"), sequence_parallel=sp)
        loss = model(*data[0])[1]
        loss.backward()
        g_err, worst = _tp_grad_err(model, ref_grads)
        out[f"moe_{tag}"] = res = result(g_err, 1e-5, loss_err=abs(loss.item() - loss_ref.item()), worst=worst)
        res["ok"] &= res["loss_err"] < 1e-5
    # dp x tp (x ep), through runtime.Parallel: my dp slice, grads averaged over dp, the norm over tp, 5 steps
    par = Parallel(d, sp=sp)
    model = par.wrap(tiny_gpt(**kw))
    opt = adamw(model)
    loss0 = g_err = None
    for i, (x, y) in enumerate(data):
        loss = model(*par.shard_batch(x, y))[1]
        loss.backward()
        if i == 0:
            loss0 = par.global_loss(loss.item())
            g_err, worst = _tp_grad_err(model, ref_grads)
        par.clip(model, opt, CLIP)
        opt.step()
        step_expert_bias(model)  # the "bias" balance's step, as minite.train's
        opt.zero_grad(set_to_none=True)
    state = par.model_state(model)
    res = result(maxerr(state, ref), TOL, loss_err=abs(loss0 - loss_ref.item()), grad_err=g_err, worst=worst,
                 experts_shape=list(state["blocks.0.mlp.w_gate_up"].shape))
    res["ok"] &= res["loss_err"] < 1e-5 and g_err < 1e-5 and set(state) == set(ref)
    out[f"moe_dp{d.dp}{f'_ep{d.ep}' if d.ep > 1 else ''}_{tag}"] = res


def check_moe_stats(dims, args) -> dict:
    """The log's routing under dp = world, ep = 2, rank 0's slice one token over and over (its own routing far from
    the batch's). Dropless: tokens per expert and the balance loss are one process's on the whole batch. With a
    capacity limit: dropped assignments are the sum over the dp ranks of what one process drops on each rank's
    slice (capacity is per rank), not rank 0's own."""
    from minite.parallel.runtime import Parallel
    x, y = batches(1, 4 * dims.dp)[0]
    x[:4] = 7
    n = x.shape[0] // dims.dp
    d = ParallelDims(dp=dims.dp, ep=2).build(dims.rank, dims.world)
    out = {}
    for cap in (0.0, 1.0):
        kw = dict(**MOE, moe_capacity_factor=cap)
        whole = tiny_gpt(**kw)
        whole(x, y)
        want = whole.moe_stats()
        if cap:  # one process on each rank's slice
            want["dropped"] = 0
            for r in range(dims.dp):
                part = tiny_gpt(**kw)
                part(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
                want["dropped"] += part.moe_stats()["dropped"]
        par = Parallel(d)
        model = par.wrap(tiny_gpt(**kw))
        model(*par.shard_batch(x, y))
        got = model.moe_stats()
        if cap:  # later blocks see other inputs where tokens were dropped: counts and balance differ from `whole`
            ok = got["dropped"] == want["dropped"] > 0
        else:
            ok = got["tokens_per_expert"] == want["tokens_per_expert"] and got["dropped"] == 0
            ok &= abs(got["balance_loss"] - want["balance_loss"]) <= 1e-4  # rounded to 4 places in the log
        out[f"moe_stats_cap{cap:g}"] = {"ok": bool(ok), "got": got, "want": want}
    return out


def check_ep_layouts(dims, args) -> dict:
    """Layouts the experts cannot take are refused, naming the numbers (no collective runs)."""
    msgs = []
    for kw in (dict(dp=dims.dp, ep=3), dict(dp=dims.dp, ep=dims.dp * 2)):
        try:
            ParallelDims(**kw)
        except ParallelError as e:
            msgs.append(str(e))
    try:
        ParallelDims(dp=dims.dp, ep=dims.dp).check_model(tiny_gpt(moe_num_experts=3).config)
    except ParallelError as e:
        msgs.append(str(e))
    ok = len(msgs) == 3 and "ep=3" in msgs[0] and "moe_num_experts=3" in msgs[2]
    return {"ep_layouts": {"ok": ok, "messages": msgs}}


def check_ep_die(dims, args) -> dict:
    """Rank 1 is killed while rank 0 waits in the expert dispatch's all-to-all: the run must end naming it."""
    d = ParallelDims(dp=dims.dp, ep=dims.dp).build(dims.rank, dims.world)
    model = tiny_gpt(**MOE)
    shard_experts(model, d)
    if d.rank == 1:
        os.kill(os.getpid(), 9)
    x, y = batches(1, 2 * d.dp)[0]
    model(_mine(x, d), _mine(y, d))  # rank 0: the count exchange waits for a rank that is gone
    return {"ep_die": {"ok": False}}  # not reached


CHECKS = {  # name: (check, the axis of ParallelDims that takes the world)
    "ep": (check_ep, "dp"),
    "ep_die": (check_ep_die, "dp"),
    "ep_layouts": (check_ep_layouts, "dp"),
    "ep_resume": (check_ep_resume, "dp"),
    "moe_stats": (check_moe_stats, "dp"),
    "moe_tp": (check_moe_tp, "dp"),
}
