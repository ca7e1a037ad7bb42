"""Chapter 14: checkpoints that load under any layout (``--resume`` after changing dp, tp, pp, cp or zero).

A checkpoint never stores a rank's view. It stores the DENSE model (``Parallel.model_state``) and the DENSE AdamW
state: each moment keyed by the dense parameter's name and shaped like it, plus the step count::

    {"format": "minite.dense_adamw/1", "step": 10, "exp_avg": {"blocks.0.attn.qkv.weight": (3C, C), ...},
     "exp_avg_sq": {...}}

Saving gathers, loading slices, by the same map from a local parameter to its dense tensor:
  tp     the tag ``p.dense_name``, ``p.dense_index = (dim, index)``: all-gather along dim, place by index / index_select
  pp     each stage holds its own names: every stage's dict is all-gathered (objects) over the pp group
  ep     an expert parameter (``expert_parallel``) holds rows dense_index of the dense experts: gathered over ep
  ZeRO   each dp rank holds a flat shard of the moments: all-gathered per unit, cut per parameter / my pieces of it
  dp, cp every replica holds the whole parameter: nothing to gather
Loading the dense weights happens before the wrappers cut the model (``minite.train``), so the model side is the
same code as a fresh start from a dense GPT. This is DCP's idea (``torch.distributed.checkpoint``: save by global
names, reshard at load) in its simplest form: one file written by rank 0, fine for the models of this course.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minite.checkpoint import CheckpointError
from minite.parallel import comm
from minite.parallel.sequence import gather_dense

__all__ = ["FORMAT", "dense_optim_state", "load_dense_optim_state", "local_slice"]

FORMAT = "minite.dense_adamw/1"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _named(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(dense name, local parameter) for every parameter: the TP/PP tag where there is one, else the module's name."""
    return [(getattr(p, "dense_name", name), p) for name, p in model.named_parameters()]


def local_slice(dense: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """My part of a dense tensor shaped like p's dense parameter: index_select by p's tp tag (or all of it)."""
    dim, index = getattr(p, "dense_index", (None, None))
    return dense if dim is None else dense.index_select(dim, index.to(dense.device))


def _local_moments(opt) -> tuple[dict, float]:
    """{local parameter: (exp_avg, exp_avg_sq)} and the step count, from torch's AdamW or ZeRO's ShardedAdamW."""
    if hasattr(opt, "full_moments"):  # ZeRO >= 1: all-gathered from the dp ranks' shards (a collective)
        return opt.full_moments()
    moments, step = {}, 0.0
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                moments[p], step = (st["exp_avg"], st["exp_avg_sq"]), float(st["step"])
    return moments, step


def dense_optim_state(model, opt, dims) -> dict:
    """The layout-free AdamW state (a collective: every rank calls it; rank 0 writes what it returns)."""
    moments, step = _local_moments(opt)
    tp = dims.group("tp") if dims is not None else None
    ep = dims.group("ep") if dims is not None else None
    mine = {k: {} for k in MOMENTS}
    for name, p in _named(model):
        if p in moments:
            for k, t in zip(MOMENTS, moments[p]):
                mine[k][name] = gather_dense(t, p, ep if getattr(p, "expert_parallel", False) else tp).cpu()
    pp = dims.group("pp") if dims is not None else None
    if pp is not None:  # every stage's names (the tied embedding arrives from both end stages: the same tensor)
        parts = [None] * comm.size(pp)
        dist.all_gather_object(parts, mine, group=pp)
        mine = {k: {n: t for part in parts for n, t in part[k].items()} for k in MOMENTS}
    return {"format": FORMAT, "step": step, **mine}


def load_dense_optim_state(model, opt, state: dict, path="the checkpoint") -> None:
    """Give every local parameter its slice of the dense moments; the names and shapes are checked first."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        if isinstance(state, dict) and "state" in state and "param_groups" in state:  # torch's own (one process)
            return opt.load_state_dict(state)
        raise CheckpointError(f"{path} holds no optimizer state that can be resumed (written by an older minite "
                              "from a sharded run); start from its weights with --init_from instead")
    moments = {}
    trainable = {p for g in opt.param_groups for p in g["params"]} if not hasattr(opt, "full_moments") else None
    for name, p in _named(model):
        if trainable is not None and p not in trainable or state["step"] == 0:
            continue
        if name not in state["exp_avg"] and not p.requires_grad:  # frozen (LoRA's base): AdamW never stepped it
            continue
        if name not in state["exp_avg"]:
            raise CheckpointError(f"{path}: no optimizer state for parameter {name!r} (a different model?)")
        moments[p] = tuple(local_slice(state[k][name], p).to(p.device) for k in MOMENTS)
        if moments[p][0].shape != p.shape:
            raise CheckpointError(f"{path}: optimizer state for {name!r} is {tuple(state['exp_avg'][name].shape)}, "
                                  f"which does not give this rank's {tuple(p.shape)} slice")
    if hasattr(opt, "load_moments"):
        return opt.load_moments(moments, state["step"])
    sd = opt.state_dict()  # torch's format: parameters by index, in param_groups order
    order = [p for g in opt.param_groups for p in g["params"]]
    sd["state"] = {i: {"step": torch.tensor(float(state["step"])), "exp_avg": moments[p][0],
                       "exp_avg_sq": moments[p][1]} for i, p in enumerate(order) if p in moments}
    opt.load_state_dict(sd)
