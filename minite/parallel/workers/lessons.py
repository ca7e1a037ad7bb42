"""Chapter 11's lesson and exercise helpers on real ranks: minite's TP MLP for the lesson to compare its simulated
ranks with, and the graded exercise tasks (vocab-parallel embedding; the SP norm between a reduce-scatter and an
all-gather), each against the dense computation from the same seed."""
from __future__ import annotations

import torch

from minite.parallel.tensor import TPMLP
from minite.parallel.workers.common import tiny_gpt
from minite.parallel.workers.grade import graded


def mlp_inputs(seed: int = 5, C: int = 32):
    """The lesson's MLP input x (2, 3, C) and upstream gradient dy, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, C, generator=g), torch.randn(2, 3, C, generator=g)


def check_tp_mlp(dims, args) -> dict:
    """minite's TPMLP (column gate_up, row down) on this rank, from the dense MLP of tiny_gpt(): its output and
    gradients, as lists, for the lesson to compare with its own simulated ranks."""
    dense = tiny_gpt().blocks[0].mlp
    mlp = TPMLP(dense, dims.group("tp"), name="mlp")
    x, dy = mlp_inputs(C=dense.dim)
    x = x.requires_grad_()
    y = mlp(x)
    y.backward(dy)
    return {"tp_mlp": {"ok": True, "y": y.tolist(), "dx": x.grad.tolist(),
                       "d_gate_up": mlp.gate_up.weight.grad.tolist(), "d_down": mlp.down.weight.grad.tolist()}}


@graded("vocab_parallel_embedding", tol=1e-5)
def grade_vocab_parallel_embedding(dims, student) -> float:
    """Token rows split over ranks: the (B, T, C) embedding on every rank, and each rank's weight-slice gradient."""
    world, rank = dims.tp, dims.tp_rank
    g = torch.Generator().manual_seed(11)
    V, C = 6 * world, 5
    tokens = torch.randint(0, V, (3, 7), generator=g)
    w = torch.randn(V, C, generator=g)
    dy = torch.randn(3, 7, C, generator=g)
    wd = w.clone().requires_grad_()
    torch.nn.functional.embedding(tokens, wd).backward(dy)
    rows = V // world
    wl = w[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    y = student.vocab_parallel_embedding(tokens, wl, rank * rows, dims.group("tp"))
    y.backward(dy)
    want = wd.grad[rank * rows:(rank + 1) * rows]
    return float(max((y - w[tokens]).abs().max(), (wl.grad - want).abs().max()))


@graded("sp_rmsnorm", tol=1e-5)
def grade_sp_rmsnorm(dims, student) -> float:
    """The SP region around a norm: the partial sums of a row-parallel linear in, the gathered normalised
    activation out; every rank's input gradient and the replicated weight's gradient vs dense."""
    world, rank = dims.tp, dims.tp_rank
    g = torch.Generator().manual_seed(12)
    B, T, C = 2, 3 * world, 8
    partials = torch.randn(world, B, T, C, generator=g)
    w = 1 + 0.1 * torch.randn(C, generator=g)
    dys = torch.randn(world, B, T, C, generator=g)  # each rank's column linear sends back its own dL/d(out)
    z = partials.sum(0).requires_grad_()
    wd = w.clone().requires_grad_()
    out = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    out.backward(dys.sum(0))
    p = partials[rank].clone().requires_grad_()
    wl = w.clone().requires_grad_()
    y = student.sp_rmsnorm(p, wl, dims.group("tp"))
    if tuple(y.shape) != (B, T, C):
        raise ValueError(f"sp_rmsnorm returned shape {tuple(y.shape)}, expected the gathered {(B, T, C)}")
    y.backward(dys[rank])
    return float(max((y - out).abs().max(), (p.grad - z.grad).abs().max(), (wl.grad - wd.grad).abs().max()))


CHECKS = {  # name: (check, the axis of ParallelDims that takes the world)
    "tp_mlp": (check_tp_mlp, "tp"),
    "vocab_parallel_embedding": (grade_vocab_parallel_embedding, "tp"),
    "sp_rmsnorm": (grade_sp_rmsnorm, "tp"),
}
