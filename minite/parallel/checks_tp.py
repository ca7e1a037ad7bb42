"""Chapter 11's distributed checks (run by ``python -m minite.parallel.checks tp sp vce``): the TP(+SP) GPT and
the vocab-parallel cross-entropy against the dense model from the same seed."""
from __future__ import annotations

import torch

from minite.parallel.checks import CLIP, STEPS, TOL, _result, adamw, batches, dense_run, maxerr, tiny_gpt
from minite.parallel.dims import ParallelDims
from minite.parallel.runtime import clip_grad_norm_
from minite.parallel.sequence import TPGPT


def _keep(acts: dict, x: torch.Tensor) -> None:
    x.retain_grad()
    acts["in"] = x


def _dense_grads(model, x, y):
    acts = {}
    h = model.blocks[0].register_forward_pre_hook(lambda m, a: _keep(acts, a[0]))
    logits, loss = model(x, y)
    loss.backward()
    h.remove()
    return logits.detach(), loss.detach(), acts["in"].grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def check_tp(dims: ParallelDims, args, sp: bool = False) -> dict:
    """TP (+SP) vs dense: logits, loss, input grads, every sharded slice of every weight grad, 5 AdamW steps."""
    group, tp, r = dims.group("tp"), dims.tp, dims.tp_rank
    tag = "sp" if sp else "tp"
    (x, y), = batches(1, 4)
    dense = tiny_gpt()
    d_logits, d_loss, d_in, d_grads = _dense_grads(dense, x, y)
    model = TPGPT.from_dense(tiny_gpt(), group, sequence_parallel=sp)
    acts = {}
    h = model.blocks[0].register_forward_pre_hook(lambda m, a: _keep(acts, a[0]))
    logits, loss = model(x, y)
    loss.backward()
    h.remove()
    Vl = logits.shape[-1]
    out = {f"{tag}_logits": _result(float((logits.detach() - d_logits[..., r * Vl:(r + 1) * Vl]).abs().max()), 1e-5),
           f"{tag}_loss": _result(abs(float(loss) - float(d_loss)), 1e-5)}
    d_in_mine = d_in.chunk(tp, dim=1)[r] if sp else d_in
    out[f"{tag}_input_grad"] = _result(float((acts["in"].grad - d_in_mine).abs().max()), 1e-6)
    errs = {}
    for name, p in model.named_parameters():
        dim, index = p.dense_index
        ref = d_grads[p.dense_name] if dim is None else d_grads[p.dense_name].index_select(dim, index)
        errs[name] = float((p.grad - ref).abs().max())
    out[f"{tag}_weight_grads"] = _result(max(errs.values()), 1e-5, n_params=len(errs),
                                         worst=max(errs, key=errs.get))
    model.zero_grad()
    data = batches(STEPS, 4, seed=3)
    ref = dense_run(tiny_gpt(), data).state_dict()
    opt = adamw(model)
    for xb, yb in data:
        model(xb, yb)[1].backward()
        clip_grad_norm_(model.parameters(), CLIP, group)
        opt.step()
        opt.zero_grad()
    out[f"{tag}_5_steps"] = _result(maxerr(model.dense_state_dict(), ref), TOL)
    return out


def check_sp(dims, args):
    return check_tp(dims, args, sp=True)


def check_vce(dims: ParallelDims, args) -> dict:
    """Vocab-parallel cross-entropy with minite's CE kernel on each shard (and the torch recipe) vs the dense CE."""
    from minite.ops import cross_entropy
    from minite.parallel.launch import triton_skipped
    from minite.parallel.tensor import vocab_parallel_cross_entropy
    group, tp, r = dims.group("tp"), dims.tp, dims.tp_rank
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 64, generator=g) * 3).to(args.device)
    target = torch.randint(0, 64, (12,), generator=g).to(args.device)
    target[3] = -100  # an ignored row
    dense = logits.clone().requires_grad_()
    cross_entropy(dense, target, backend="torch").backward()
    out = {"vce_triton": skip} if (skip := triton_skipped(logits)) else {}  # a GPU machine's CPU workers
    for backend in ("torch",) if skip else ("triton", "torch"):
        mine = logits.chunk(tp, dim=1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target, group, r * 64 // tp, backend=backend)
        loss.backward()
        ref = cross_entropy(logits, target, backend="torch")
        gerr = float((mine.grad - dense.grad.chunk(tp, dim=1)[r]).abs().max())
        err = max(abs(float(loss.detach()) - float(ref)), gerr)
        out[f"vce_{backend}"] = _result(err, 1e-5)
    return out
