"""Chapter 11's checks: the TP (+SP) GPT and the vocab-parallel cross-entropy against the dense model from the
same seed; the lesson's activation memory per block with and without SP; the exercise's row-parallel linear."""
from __future__ import annotations

import torch

from minite.parallel import comm, trace
from minite.parallel.launch import triton_skipped
from minite.parallel.sequence import TPGPT
from minite.parallel.tensor import vocab_parallel_cross_entropy
from minite.parallel.workers.common import CLIP, MID, STEPS, TOL, adamw, batches, dense_run, maxerr, result, tiny_gpt


def _run_keeping_input_grad(model, x, y):
    """loss.backward() of model(x, y), keeping the gradient of the first block's input: (logits, loss, that grad)."""
    kept = {}

    def keep(module, args):
        args[0].retain_grad()
        kept["in"] = args[0]

    hook = model.blocks[0].register_forward_pre_hook(keep)
    logits, loss = model(x, y)
    loss.backward()
    hook.remove()
    return logits.detach(), loss.detach(), kept["in"].grad


def check_tp(dims, args, sp: bool = False) -> dict:
    """TP (+SP) vs dense: logits, loss, input grads, every sharded slice of every weight grad, 5 AdamW steps."""
    group, tp, r = dims.group("tp"), dims.tp, dims.tp_rank
    tag = "sp" if sp else "tp"
    (x, y), = batches(1, 4)
    dense = tiny_gpt()
    d_logits, d_loss, d_in = _run_keeping_input_grad(dense, x, y)
    d_grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
    model = TPGPT.from_dense(tiny_gpt(), group, sequence_parallel=sp)
    logits, loss, g_in = _run_keeping_input_grad(model, x, y)
    Vl = logits.shape[-1]  # my vocabulary slice
    out = {f"{tag}_logits": result(float((logits - d_logits[..., r * Vl:(r + 1) * Vl]).abs().max()), 1e-5),
           f"{tag}_loss": result(abs(float(loss) - float(d_loss)), 1e-5)}
    d_in_mine = d_in.chunk(tp, dim=1)[r] if sp else d_in
    out[f"{tag}_input_grad"] = result(float((g_in - d_in_mine).abs().max()), 1e-6)
    errs = {}
    for name, p in model.named_parameters():
        dim, index = p.dense_index
        ref = d_grads[p.dense_name] if dim is None else d_grads[p.dense_name].index_select(dim, index)
        errs[name] = float((p.grad - ref).abs().max())
    out[f"{tag}_weight_grads"] = result(max(errs.values()), 1e-5, n_params=len(errs), worst=max(errs, key=errs.get))
    model.zero_grad()
    data = batches(STEPS, 4, seed=3)
    ref = dense_run(tiny_gpt(), data).state_dict()
    opt = adamw(model)
    for xb, yb in data:
        model(xb, yb)[1].backward()
        comm.clip_grad_norm_(model.parameters(), CLIP, [group])
        opt.step()
        opt.zero_grad()
    out[f"{tag}_5_steps"] = result(maxerr(model.dense_state_dict(), ref), TOL)
    return out


def check_sp(dims, args) -> dict:
    return check_tp(dims, args, sp=True)


def check_vce(dims, args) -> dict:
    """Vocab-parallel cross-entropy with minite's CE kernel on each shard (and the torch recipe) vs the dense CE."""
    from minite.ops import cross_entropy
    group, tp, r = dims.group("tp"), dims.tp, dims.tp_rank
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 64, generator=g) * 3).to(args.device)
    target = torch.randint(0, 64, (12,), generator=g).to(args.device)
    target[3] = -100  # an ignored row
    dense = logits.clone().requires_grad_()
    cross_entropy(dense, target, backend="torch").backward()
    skip = triton_skipped(logits)  # a GPU machine's CPU workers: no Triton kernel here
    out = {"vce_triton": skip} if skip else {}
    for backend in ("torch",) if skip else ("triton", "torch"):
        mine = logits.chunk(tp, dim=1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target, group, r * 64 // tp, backend=backend)
        loss.backward()
        ref = cross_entropy(logits, target, backend="torch")
        gerr = float((mine.grad - dense.grad.chunk(tp, dim=1)[r]).abs().max())
        err = max(abs(float(loss.detach()) - float(ref)), gerr)
        out[f"vce_{backend}"] = result(err, 1e-5)
    return out


def sp_memory(dims, args) -> dict:
    """Bytes of activations one transformer block saves for backward (parameters excluded), per rank: TP vs TP+SP."""
    group = dims.group("tp")
    x, y = batches(1, 2, T=64, V=256)[0]
    out = {"ok": True}
    for sp in (False, True):
        model = TPGPT.from_dense(tiny_gpt(**MID), group, sequence_parallel=sp)
        row = {}
        counting = trace.saved_bytes(row, list(model.parameters()))

        def enter(module, args):  # forward hooks: returning a value would replace the block's input / output
            counting.__enter__()

        def leave(module, args, output):
            counting.__exit__(None, None, None)

        block = model.blocks[1]
        hooks = [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
        model(x, y)[1].backward()
        for hook in hooks:
            hook.remove()
        out["sp" if sp else "tp"] = row["saved_bytes"]
    return {"sp_memory": out}


CHECKS = {  # name: (check, the axis of ParallelDims that takes the world)
    "tp": (check_tp, "tp"),
    "sp": (check_sp, "tp"),
    "vce": (check_vce, "tp"),
    "sp_memory": (sp_memory, "tp"),
}
