"""Chapter 16 x chapter 13: the MoE GPT under context parallelism, wrapped as minite.train wraps it
(``runtime.Parallel``: tp -> CPGPT -> the global-load stats group -> ep), against one process on the whole batch.

Each case (world 4): cp = 2 x dp = 2 (the Switch loss), cp = 4 alone (the bias), cp = 2 x dp = 2 x ep = 2 (both
balances), cp = 2 x tp = 2 with and without SP, cp = 2 x dp = 2 under ZeRO-1 (the bias) and ZeRO-3 (ep = 1), and
cp = 2 x dp = 2 x ep = 2 under ZeRO-2 (two shards: dense over dp x cp, experts over edp x cp).
Compared: the global loss and every gradient of the first step (1e-6; my experts' rows under ep, my tp slice under
tp, my flat shard under ZeRO), then after 5 clipped AdamW steps the dense checkpoint (every key, TOL), the "bias"
balance's buffers (exactly: every rank moved them by the global load, as one process did) and the dense AdamW
moments (TOL). Dropless routing (capacity_factor = 0): with a capacity each rank would cap its own T/cp tokens.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from minite.layers.moe import step_expert_bias
from minite.parallel.dims import ParallelDims
from minite.parallel.reshard import dense_optim_state, local_slice
from minite.parallel.runtime import Parallel
from minite.parallel.workers.common import CLIP, LR, STEPS, TOL, WD, adamw, batches, maxerr, result, tiny_gpt

MOE = dict(moe_num_experts=4, moe_top_k=2)
B = 4  # the global batch: 2 sequences per dp rank at dp = 2
GRAD_TOL = 1e-6
# name: (degrees, balance, sp, zero)
CASES = {
    "moe_cp2_dp2_aux": (dict(dp=2, cp=2), "aux", False, 0),
    "moe_cp4_bias": (dict(cp=4), "bias", False, 0),
    "moe_cp2_dp2_ep2_aux": (dict(dp=2, cp=2, ep=2), "aux", False, 0),
    "moe_cp2_dp2_ep2_bias": (dict(dp=2, cp=2, ep=2), "bias", False, 0),
    "moe_cp2_tp2_aux": (dict(cp=2, tp=2), "aux", False, 0),
    "moe_cp2_tp2_sp_bias": (dict(cp=2, tp=2), "bias", True, 0),
    "moe_cp2_dp2_zero1_bias": (dict(dp=2, cp=2), "bias", False, 1),
    "moe_cp2_dp2_zero3_aux": (dict(dp=2, cp=2), "aux", False, 3),
    "moe_cp2_dp2_ep2_zero2_aux": (dict(dp=2, cp=2, ep=2), "aux", False, 2),
}


def _reference(kw: dict, data):
    """One process on the whole batches: (first loss, first grads, dense state and AdamW moments after STEPS)."""
    model = tiny_gpt(**kw)
    loss = model(*data[0])[1]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model = tiny_gpt(**kw)  # afresh: the "bias" balance moved the first model's buffer
    opt = adamw(model)
    for x, y in data:
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        step_expert_bias(model)  # the "bias" balance's step, as minite.train's
        opt.zero_grad(set_to_none=True)
    return loss.item(), grads, model.state_dict(), dense_optim_state(model, opt, None)


def _grad_err(par: Parallel, model, ref: dict) -> tuple[float, str]:
    """The largest |my gradient - my part of the dense one| (the parameter named): the slice that a parameter's
    dense_index names (an ep shard's experts, a tp slice), or my flat shard of every gradient under ZeRO."""
    if par.zero:  # ep x ZeRO (expert.ExpertZero): a dense and an expert DataParallel, each its own shard
        return max(float((dp.shard_grad - dp.shard_mask(lambda n, p: local_slice(ref[getattr(p, "dense_name", n)],
                                                                                  p))).abs().max())
                   for dp in getattr(par.dp, "parts", [par.dp])), "zero shard"
    errs = {}
    for n, p in model.named_parameters():
        name = getattr(p, "dense_name", n)
        dim, index = getattr(p, "dense_index", (None, None))
        want = ref[name] if dim is None else ref[name].index_select(dim, index)
        errs[name] = float((p.grad - want).abs().max())
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def check_moe_cp(dims, args) -> dict:
    """Every case of CASES through runtime.Parallel vs one process (see the module's docstring)."""
    out, grids, refs = {}, {}, {}
    data = batches(STEPS, B)
    for name, (deg, balance, sp, zero) in CASES.items():
        kw = dict(**MOE, moe_balance=balance)
        refs[balance] = refs.get(balance) or _reference(kw, data)
        loss_ref, grads_ref, state_ref, optim_ref = refs[balance]
        key = tuple(sorted(deg.items()))  # the groups of a layout are built once (new_group is collective)
        d = grids[key] = grids.get(key) or ParallelDims(**deg).build(dims.rank, dims.world)
        par = Parallel(d, zero=zero, sp=sp)
        model = par.wrap(tiny_gpt(**kw))
        opt = par.optimizer(model, adamw, SimpleNamespace(lr=LR, beta1=0.9, beta2=0.999, weight_decay=WD))
        for i, (x, y) in enumerate(data):
            loss = model(*par.shard_batch(x, y))[1]
            loss.backward()  # DataParallel / ExpertDataParallel reduce when the backward ends
            if i == 0:
                loss0 = par.global_loss(loss.item())
                g_err, worst = _grad_err(par, model, grads_ref)
            par.clip(model, opt, CLIP)
            opt.step()
            step_expert_bias(model)  # the "bias" balance's step, as minite.train's
            opt.zero_grad(set_to_none=True)
        state, optim = par.model_state(model), par.optim_state(opt, model)
        biases = {k: v for k, v in state_ref.items() if k.endswith("expert_bias")}
        moments = max(maxerr(optim[k], optim_ref[k]) for k in ("exp_avg", "exp_avg_sq"))
        res = result(maxerr(state, state_ref), TOL, loss_err=abs(loss0 - loss_ref), grad_err=g_err, worst=worst,
                     bias_err=maxerr(state, biases), moments_err=moments, keys_ok=set(state) == set(state_ref))
        res["ok"] &= (res["loss_err"] <= GRAD_TOL and g_err <= GRAD_TOL and res["bias_err"] == 0 and moments <= TOL
                      and res["keys_ok"] and set(optim["exp_avg"]) == set(optim_ref["exp_avg"]))
        out[name] = res
    return out


CHECKS = {"moe_cp": (check_moe_cp, "dp")}  # name: (check, the axis of ParallelDims that takes the world)
