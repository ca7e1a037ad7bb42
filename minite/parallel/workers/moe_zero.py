"""Chapter 16 x chapter 10: the MoE GPT under ZeRO-1/2/3, with and without expert parallelism, and under tp x ZeRO,
wrapped as minite.train wraps it (``runtime.Parallel``), against one process from the same seed: the global loss,
the reduced gradients ZeRO's optimizer steps with (every shard, dense and expert, at 1e-6), the dense weights and
the dense AdamW state after 5 clipped steps, and a one-process checkpoint resumed under the layout (one more step)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from minite.layers.moe import step_expert_bias
from minite.parallel.dims import ParallelDims
from minite.parallel.reshard import dense_optim_state, local_slice
from minite.parallel.workers.common import CLIP, LR, STEPS, TOL, WD, adamw, batches, maxerr, result, tiny_gpt

MOE = dict(moe_num_experts=4, moe_top_k=2)
HYPER = SimpleNamespace(lr=LR, beta1=0.9, beta2=0.999, weight_decay=WD)  # adamw()'s, as minite.train's config
# (zero, dp, ep, tp, sp, balance) at world 4: ep 1 (every expert on every rank), 2 and 4 at each stage ("bias"
# balancing at the last); under tp (ZeRO-3 is refused with tp), with and without ep and SP
CASES = [*[(z, 4, ep, 1, False, "bias" if (z, ep) == (3, 4) else "aux") for z in (1, 2, 3) for ep in (1, 2, 4)],
         (1, 2, 1, 2, True, "aux"), (2, 2, 1, 2, False, "bias"), (2, 2, 2, 2, True, "aux")]


def case_name(zero: int, dp: int, ep: int, tp: int, sp: bool, balance: str) -> str:
    layout = f"dp{dp}" + (f"_ep{ep}" if ep > 1 else "") + (f"_tp{tp}" if tp > 1 else "") + ("_sp" if sp else "")
    return f"moe_zero{zero}_{layout}_{balance}"


def _step(par, model, opt, x, y, ref_grads=None) -> tuple[float, float, float]:
    """One clipped step of my slice; (the global loss, the reduced gradients' error against ref_grads if given, the
    global gradient norm before clipping)."""
    loss = model(*par.shard_batch(x, y))[1]
    loss.backward()  # the DataParallel(s) reduce when the backward ends
    g_err = _grad_err(par, ref_grads) if ref_grads is not None else None
    norm = float(par.clip(model, opt, CLIP))
    opt.step()
    step_expert_bias(model)  # the "bias" balance's step, as minite.train's
    opt.zero_grad(set_to_none=True)
    return par.global_loss(loss.item()), g_err, norm


def _reference(balance: str, data):
    """One process on the whole batches: the first step's loss, grads and their norm, the checkpoint after STEPS
    clipped AdamW steps (weights, dense AdamW state) and the weights one step later."""
    dense = tiny_gpt(**MOE, moe_balance=balance)
    loss = dense(*data[0])[1]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
    model = tiny_gpt(**MOE, moe_balance=balance)
    opt = adamw(model)
    for i, (x, y) in enumerate(data):
        if i == STEPS:
            ckpt = {k: v.clone() for k, v in model.state_dict().items()}, dense_optim_state(model, opt, None)
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        step_expert_bias(model)  # the "bias" balance's step, as minite.train's
        opt.zero_grad(set_to_none=True)
    norm = float(torch.cat([g.reshape(-1) for g in grads.values()]).double().norm())
    return loss.item(), grads, norm, ckpt, model.state_dict()


def _shards(par) -> list:
    """The DataParallel(s) whose reduced shards ZeRO's optimizer steps (expert.ExpertZero: dense, experts)."""
    return par.dp.parts if hasattr(par.dp, "parts") else [par.dp]


def _grad_err(par, ref_grads: dict) -> float:
    """The largest |reduced gradient - the one-process gradient| over every shard's elements (the dense gradient
    sliced by each parameter's tags: my experts' rows, my tp slice)."""
    return max(float((dp.shard_grad - dp.shard_mask(lambda n, p: local_slice(ref_grads[getattr(p, "dense_name", n)],
                                                                              p))).abs().max())
               for dp in _shards(par))


def _moments_err(state: dict, ref: dict) -> float:
    """The largest error of a dense AdamW state relative to each moment's largest entry (inf: other names)."""
    if set(state["exp_avg"]) != set(ref["exp_avg"]) or state["step"] != ref["step"]:
        return float("inf")
    return max(float((state[k][n] - ref[k][n]).abs().max() / ref[k][n].abs().max().clamp_min(1e-30))
               for k in ("exp_avg", "exp_avg_sq") for n in ref[k])


def _case(d, case, ref) -> dict:
    from minite.parallel.runtime import Parallel
    zero, dp, ep, tp, sp, balance = case
    loss_ref, ref_grads, norm_ref, (ckpt_model, ckpt_optim), final, data = ref
    par = Parallel(d, zero=zero, sp=sp)
    model = par.wrap(tiny_gpt(**MOE, moe_balance=balance))
    opt = par.optimizer(model, adamw, HYPER)
    loss0, g_err, norm = _step(par, model, opt, *data[0], ref_grads)
    for x, y in data[1:STEPS]:
        _step(par, model, opt, x, y)
    state, optim = par.model_state(model), par.optim_state(opt, model)
    m_err = _moments_err(optim, ckpt_optim)
    # a one-process checkpoint resumed under this layout: the weights before the cut, then the moments sliced
    resumed = tiny_gpt(**MOE, moe_balance=balance)
    resumed.load_state_dict(ckpt_model)
    par = Parallel(d, zero=zero, sp=sp)
    resumed = par.wrap(resumed)
    opt = par.optimizer(resumed, adamw, HYPER)
    par.load_optim(opt, resumed, ckpt_optim, "the one-process checkpoint")
    _step(par, resumed, opt, *data[STEPS])
    r_err = maxerr(par.model_state(resumed), final)
    res = result(maxerr(state, ckpt_model), TOL, loss_err=abs(loss0 - loss_ref), grad_err=g_err, moments_err=m_err,
                 resume_err=r_err, norm=norm, norm_err=abs(norm - norm_ref))
    bias = "blocks.0.mlp.expert_bias"  # "bias": moved by the global load, as in one process, bit for bit
    res["ok"] &= (res["loss_err"] < 1e-6 and g_err < 1e-6 and res["norm_err"] < 1e-6 and m_err < 1e-3 and r_err <= TOL
                  and set(state) == set(ckpt_model) and maxerr(state, {bias: ckpt_model[bias]}) == 0)
    return res


def check_moe_zero(dims, args) -> dict:
    """Every case of CASES (world 4) against one process on the whole batches (see the module's docstring)."""
    data = batches(STEPS + 1, 8)
    refs = {b: (*_reference(b, data), data) for b in ("aux", "bias")}
    grids, out = {}, {}  # (dp, ep, tp) -> its ParallelDims, built once (new_group is collective: the same order)
    for c in [c for c in CASES if c[1] * c[3] == dims.world]:
        if c[1:4] not in grids:
            grids[c[1:4]] = ParallelDims(dp=c[1], ep=c[2], tp=c[3]).build(dims.rank, dims.world)
        out[case_name(*c)] = _case(grids[c[1:4]], c, refs[c[-1]])
    return out


CHECKS = {"moe_zero": (check_moe_zero, "dp")}
