"""Chapter 16 x chapter 12: the MoE GPT under pipeline parallelism, wrapped as minite.train wraps it
(runtime.Parallel), against one process from the same seed: the global loss and every gradient of the first step,
the routing (moe_stats), the dense state after 5 clipped AdamW steps (the "bias" buffers exactly) and the dense
checkpoint. The m micro-batches are gradient accumulation: under balance "aux" the reference runs the dense GPT
micro-batch by micro-batch (the Switch loss per micro-batch, loss / m each); under "bias" on the whole batch.
Layouts at world 4: pp2 x dp2 (aux, bias), pp2 x dp2 x ep2 (aux; then a one-process checkpoint resumed there),
pp2 x tp2 with SP (aux), pp2 x cp2 (aux, bias: each cp rank's T/cp tokens, the load summed over cp). At world 8
(``moe_pp_cp_ep``, by hand: ~20 s on 2 CPU cores, not in the test suite): pp2 x dp2 x cp2 x ep2 (aux, bias, each
resumed), whose expert gradients are summed over edp x cp."""
from __future__ import annotations

import torch

from minite.layers.moe import step_expert_bias
from minite.parallel.dims import ParallelDims
from minite.parallel.workers.common import CLIP, STEPS, TOL, adamw, batches, maxerr, result, tiny_gpt
from minite.parallel.workers.moe import MOE, _tp_grad_err

M = 2  # micro-batches of the pipeline


def _micro(x: torch.Tensor, dp: int, i: int) -> torch.Tensor:
    """Global micro-batch i: micro-batch i of every dp rank's slice (what the stats group balances together)."""
    return torch.cat([s.chunk(M)[i] for s in x.chunk(dp)])


def _reference(kw: dict, data, dp: int, per_micro: bool):
    """One process: (first loss, first grads, first-step routing stats, model, optimizer) after STEPS steps; the
    batch micro-batch by micro-batch (loss / M each) when per_micro, else whole."""
    model = tiny_gpt(**kw)
    opt = adamw(model)
    tokens, bal = 0, 0.0
    with torch.no_grad():  # the first step's routing, micro-batch by micro-batch (what the pipeline reports)
        for i in range(M):
            model(_micro(data[0][0], dp, i), _micro(data[0][1], dp, i))
            st = model.moe_stats()  # (its balance loss rounded: the Switch losses themselves, below)
            bal += float(sum(b.mlp.aux_loss for b in model.blocks)) / len(model.blocks) / M
            tokens = tokens + torch.tensor(st["tokens_per_expert"])
    stats = {"tokens_per_expert": tokens.tolist(), "balance_loss": bal}
    loss0 = grads = None
    for step, (x, y) in enumerate(data[:STEPS]):
        parts = [(_micro(x, dp, i), _micro(y, dp, i)) for i in range(M)] if per_micro else [(x, y)]
        total = 0.0
        for xi, yi in parts:
            loss = model(xi, yi)[1] / len(parts)
            loss.backward()
            total += float(loss.detach())
        if step == 0:
            loss0, grads = total, {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        step_expert_bias(model)  # the "bias" balance's step, as minite.train's
        opt.zero_grad(set_to_none=True)
    return loss0, grads, stats, model, opt


def _case(out: dict, d, balance: str, sp: bool = False, refs: dict | None = None) -> None:
    from minite.parallel.runtime import Parallel
    kw = dict(**MOE, moe_balance=balance)
    data = batches(STEPS + 1, 8)
    refs = {} if refs is None else refs  # the reference of (balance, dp), shared by the layouts that need it
    if (balance, d.dp) not in refs:
        refs[balance, d.dp] = _reference(kw, data, d.dp, per_micro=balance == "aux")
    loss_ref, ref_grads, ref_stats, ref, ref_opt = refs[balance, d.dp]
    par = Parallel(d, sp=sp, microbatches=M)
    model = par.wrap(tiny_gpt(**kw))
    opt = adamw(model)
    loss0 = g_err = stats = None
    for i, (x, y) in enumerate(data[:STEPS]):
        loss = model(*par.shard_batch(x, y))[1]
        loss.backward()
        if i == 0:
            loss0 = par.global_loss(loss.item())
            g_err, worst = _tp_grad_err(model.stage, ref_grads)
            stats = model.moe_stats()  # every rank: a collective over pp, then dp (x cp)
        par.clip(model, opt, CLIP)
        opt.step()
        step_expert_bias(model)  # the "bias" balance's step, as minite.train's
        opt.zero_grad(set_to_none=True)
    state = par.model_state(model)
    want = ref.state_dict()
    bias = {k: v for k, v in want.items() if k.endswith("expert_bias")}
    res = result(maxerr(state, want), TOL, loss_err=abs(loss0 - loss_ref), grad_err=g_err, worst=worst,
                 bias_err=maxerr(state, bias), tokens=stats["tokens_per_expert"],
                 bal_err=abs(stats["balance_loss"] - ref_stats["balance_loss"]),
                 n_params=model.num_params(), experts_shape=list(state["blocks.0.mlp.w_gate_up"].shape))
    # bal_err: the logged balance loss is rounded to 4 decimals (5e-5); rank 0's Switch loss alone is off by more
    res["ok"] &= (res["loss_err"] < 1e-6 and g_err < 1e-6 and set(state) == set(want) and res["bias_err"] == 0
                  and stats["tokens_per_expert"] == ref_stats["tokens_per_expert"] and res["bal_err"] < 6e-5
                  and stats["dropped"] == 0 and res["n_params"] == ref.num_params())
    if balance == "bias":  # the bias moved: the check of "exactly equal" is not 0 == 0
        res["ok"] &= float(bias["blocks.0.mlp.expert_bias"].abs().max()) > 0
    layout = "".join(f"_{a}{getattr(d, a)}" for a in ("pp", "dp", "cp", "ep", "tp") if getattr(d, a) > 1)
    name = f"moe{layout}{'_sp' if sp else ''}_{balance}"
    out[name] = res
    if d.ep > 1:  # (last: it takes the reference one step further)
        out[name + "_resume"] = _resume(par, model, opt, ref, ref_opt, data[STEPS], kw)


def _resume(par, model, opt, ref, ref_opt, batch, kw) -> dict:
    """The layout-free optimizer state gathered from this layout == one process's; a one-process checkpoint
    (dense weights + dense AdamW state) resumed under this layout takes the same next step as one process."""
    from minite.parallel.reshard import dense_optim_state, load_dense_optim_state
    from minite.parallel.runtime import Parallel
    mine, theirs = par.optim_state(opt, model), dense_optim_state(ref, ref_opt, None)
    moment_err = max(maxerr(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq"))
    same_names = all(set(mine[k]) == set(theirs[k]) for k in ("exp_avg", "exp_avg_sq"))
    par2 = Parallel(par.dims, microbatches=M)
    again = tiny_gpt(**kw)
    again.load_state_dict(ref.state_dict())  # dense weights first, then the cut (as minite.train resumes)
    again = par2.wrap(again)
    opt2 = adamw(again)
    load_dense_optim_state(again, opt2, theirs)
    x, y = batch
    again(*par2.shard_batch(x, y))[1].backward()
    par2.clip(again, opt2, CLIP)
    opt2.step()
    step_expert_bias(again)  # the "bias" balance's step, as minite.train's
    dp = par.dims.dp  # one process's next step, micro-batch by micro-batch under "aux" (as _reference)
    parts = [(_micro(x, dp, i), _micro(y, dp, i)) for i in range(M)] if kw["moe_balance"] == "aux" else [(x, y)]
    for xi, yi in parts:
        (ref(xi, yi)[1] / len(parts)).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    ref_opt.step()
    step_expert_bias(ref)  # the "bias" balance's step, as minite.train's
    res = result(maxerr(par2.model_state(again), ref.state_dict()), TOL, moment_err=moment_err)
    res["ok"] &= moment_err < TOL and same_names
    return res


def check_moe_pp(dims, args) -> dict:
    """World 4: pp2 x dp2 (aux, bias), pp2 x dp2 x ep2 (aux, then resume), pp2 x tp2 with SP (aux), pp2 x cp2
    (aux, bias)."""
    out, refs = {}, {}
    d = ParallelDims(pp=2, dp=2).build(dims.rank, dims.world)
    for balance in ("aux", "bias"):
        _case(out, d, balance, refs=refs)
    _case(out, ParallelDims(pp=2, dp=2, ep=2).build(dims.rank, dims.world), "aux", refs=refs)
    _case(out, ParallelDims(pp=2, tp=2).build(dims.rank, dims.world), "aux", sp=True, refs=refs)
    d = ParallelDims(pp=2, cp=2).build(dims.rank, dims.world)  # my stage, on my T/cp tokens of each sequence
    for balance in ("aux", "bias"):
        _case(out, d, balance, refs=refs)
    return out


def check_moe_pp_cp_ep(dims, args) -> dict:
    """World 8: pp2 x dp2 x cp2 x ep2 (aux, then resume; bias): each stage's expert gradients summed over edp x cp."""
    out, refs = {}, {}
    d = ParallelDims(pp=2, dp=2, cp=2, ep=2).build(dims.rank, dims.world)
    for balance in ("aux", "bias"):
        _case(out, d, balance, refs=refs)
    return out


CHECKS = {"moe_pp": (check_moe_pp, "dp"), "moe_pp_cp_ep": (check_moe_pp_cp_ep, "dp")}
