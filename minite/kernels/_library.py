"""minite's launchers as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` keeps the Triton kernels
in its graph (forward and backward) instead of breaking the graph around them.

Each op is a thin, fully annotated wrapper of a launcher in its concept file, registered with
``torch.library.triton_op`` (the launchers launch through ``wrap_triton``, see ``_common.launchable``), and the
forward ops get ``register_autograd`` with the matching backward op. The concept files' autograd Functions call
``torch.ops.minite.<name>`` while torch.compile traces (``_common.op``) and the launcher directly otherwise (eager
calls skip the dispatcher). Nothing is registered under ``TRITON_INTERPRET=1``: ``wrap_triton`` refuses
interpreted kernels (pytorch#152868), and there the eager path is all there is. The file lives apart from the
concept files to keep them within their line budget; tests: tests/kernels/test_compile.py (opcheck + fullgraph).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from minite._triton import HAS_TRITON, interpreting
from minite.kernels import cross_entropy as CE
from minite.kernels import fp8_gemm as G
from minite.kernels import rmsnorm as N
from minite.kernels import rope as R
from minite.kernels import softmax as S
from minite.kernels import swiglu as W
from minite.kernels._common import REGISTERED, traceable

__all__ = ["ENABLED", "REGISTERED"]

ENABLED = HAS_TRITON and not interpreting() and hasattr(torch.library, "triton_op")


def _register(fn, bwd=None, setup=None):
    """triton_op("minite::<fn name>") of `fn` (its launchers go through wrap_triton while it runs); with
    `bwd`/`setup`, also its autograd formula."""
    name = fn.__name__

    @functools.wraps(fn)  # keeps the annotations the schema is inferred from
    def body(*args, **kwargs):
        with traceable():
            return fn(*args, **kwargs)

    torch.library.triton_op(f"minite::{name}", body, mutates_args=())
    if bwd is not None:
        torch.library.register_autograd(f"minite::{name}", bwd, setup_context=setup)
    REGISTERED.add(name)


# ------------------------------------------------------------------------------------------------ wrappers
def softmax_fwd(x: Tensor, dim: int) -> Tensor:
    return S.softmax_fwd(x, dim)


def softmax_bwd(y: Tensor, dy: Tensor, dim: int) -> Tensor:
    return S.softmax_bwd(y, dy, dim)


def rmsnorm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return N.rmsnorm_fwd(x, weight, eps)


def rmsnorm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return N.rmsnorm_bwd(dy, x, weight, rstd)


def layernorm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return N.layernorm_fwd(x, weight, bias, eps)


def layernorm_bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return N.layernorm_bwd(dy, x, weight, mean, rstd)


def rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str, sign: int) -> Tensor:
    return R._launch(x, cos, sin, layout, sign)


def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return W.swiglu_fwd(gate, up)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return W.swiglu_bwd(dy, gate, up)


def cross_entropy_fwd(logits: Tensor, target: Tensor, ignore_index: int,
                      label_smoothing: float) -> tuple[Tensor, Tensor]:
    return CE.cross_entropy_fwd(logits, target, ignore_index, label_smoothing)


def cross_entropy_bwd(dl: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
                      label_smoothing: float) -> Tensor:
    return CE.cross_entropy_bwd(dl, logits, target, lse, ignore_index, label_smoothing)


def fp8_gemm(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype,
             split_acc: bool) -> Tensor:
    return G.fp8_gemm_raw(a, b, a_scale_inv, b_scale_inv, out_dtype, split_acc)


# ------------------------------------------------------------------------------------------------ autograd
def _softmax_setup(ctx, inputs, output):
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.minite.softmax_bwd(y, dy, ctx.dim), None


def _rmsnorm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _rmsnorm_grad(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    dx, dw = torch.ops.minite.rmsnorm_bwd(dy, x, w, rstd)
    return dx, dw, None


def _layernorm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1], output[2])


def _layernorm_grad(ctx, dy, _dmean, _drstd):
    x, w, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.minite.layernorm_bwd(dy, x, w, mean, rstd)
    return dx, dw, db, None


def _rope_setup(ctx, inputs, output):
    ctx.layout, ctx.sign = inputs[3], inputs[4]
    ctx.save_for_backward(inputs[1], inputs[2])


def _rope_grad(ctx, dy):
    cos, sin = ctx.saved_tensors
    return torch.ops.minite.rope(dy, cos, sin, ctx.layout, -ctx.sign), None, None, None, None


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.minite.swiglu_bwd(dy, gate, up)


def _ce_setup(ctx, inputs, output):
    ctx.args = (inputs[2], inputs[3])
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _ce_grad(ctx, dloss, _dlse):
    logits, target, lse = ctx.saved_tensors
    return torch.ops.minite.cross_entropy_bwd(dloss, logits, target, lse, *ctx.args), None, None, None


if ENABLED:
    _register(softmax_bwd)
    _register(softmax_fwd, _softmax_grad, _softmax_setup)
    _register(rmsnorm_bwd)
    _register(rmsnorm_fwd, _rmsnorm_grad, _rmsnorm_setup)
    _register(layernorm_bwd)
    _register(layernorm_fwd, _layernorm_grad, _layernorm_setup)
    _register(rope, _rope_grad, _rope_setup)
    _register(swiglu_bwd)
    _register(swiglu_fwd, _swiglu_grad, _swiglu_setup)
    _register(cross_entropy_bwd)
    _register(cross_entropy_fwd, _ce_grad, _ce_setup)
    _register(fp8_gemm)
