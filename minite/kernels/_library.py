"""minite's launchers as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` keeps the Triton kernels
in its graph (forward and backward) instead of breaking the graph around them.

Each op is a thin, fully annotated wrapper of a launcher in its concept file, registered with
``torch.library.triton_op`` (the launchers launch through ``wrap_triton``, see ``_common.launchable``), and the
forward ops get ``register_autograd`` with the matching backward op. The concept files' autograd Functions call
``torch.ops.minite.<name>`` while torch.compile traces (``_common.op``) and the launcher directly otherwise (eager
calls skip the dispatcher). Nothing is registered under ``TRITON_INTERPRET=1``: ``wrap_triton`` refuses
interpreted kernels (pytorch#152868), and there the eager path is all there is. The file lives apart from the
concept files to keep them within their line budget; tests: tests/kernels/test_compile.py (opcheck + fullgraph),
tests/kernels/test_compile_fused.py (linear_cross_entropy, FP8 Linear; CPU reference ops via register_reference_ops).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from minite._triton import HAS_TRITON, interpreting
from minite.formats import fp8 as F8
from minite.formats.recipe import compute_scale, fp8_max
from minite.kernels import attention as A
from minite.kernels import cross_entropy as CE
from minite.kernels import decode as Dc
from minite.kernels import fp8_gemm as G
from minite.kernels import lora as LR
from minite.kernels import rmsnorm as N
from minite.kernels import rope as R
from minite.kernels import softmax as S
from minite.kernels import swiglu as W
from minite.kernels._common import REGISTERED, traceable

__all__ = ["ENABLED", "REGISTERED", "register_reference_ops"]

ENABLED = HAS_TRITON and not interpreting() and hasattr(torch.library, "triton_op")


def _register(fn, bwd=None, setup=None, mutates_args=()):
    """triton_op("minite::<fn name>") of `fn` (its launchers go through wrap_triton while it runs); with
    `bwd`/`setup`, also its autograd formula."""
    name = fn.__name__

    @functools.wraps(fn)  # keeps the annotations the schema is inferred from
    def body(*args, **kwargs):
        with traceable():
            return fn(*args, **kwargs)

    torch.library.triton_op(f"minite::{name}", body, mutates_args=mutates_args)
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


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str,
                         label_smoothing: float, chunk_size: int, need_dx: bool,
                         need_dw: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dx, dW) of the chunked Triton path; a gradient not asked for is a (0,) tensor (an op returns no None)."""
    loss, dx, dw = CE.linear_cross_entropy_fwd(x, weight, target, ignore_index, reduction, label_smoothing,
                                               chunk_size, True, need_dx, need_dw)
    return loss, x.new_empty(0) if dx is None else dx, x.new_empty(0) if dw is None else dw


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], cu_seqlens: Optional[Tensor],
                  max_seqlen: int) -> tuple[Tensor, Tensor]:
    """(o, lse): bhsd, or thd with cu_seqlens (varlen). lse carries no gradient."""
    return A.attention_fwd(q, k, v, causal, scale, cu_seqlens, max_seqlen)


def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                  scale: Optional[float], cu_seqlens: Optional[Tensor],
                  max_seqlen: int) -> tuple[Tensor, Tensor, Tensor]:
    return A.attention_bwd(do, q, k, v, o, lse, causal, scale, cu_seqlens, max_seqlen)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: Optional[float],
                     num_splits: Optional[int], max_len: Optional[int]) -> Tensor:
    """One decode step (inference: no autograd), so CUDA-graph decoding keeps the split-K kernels in the graph."""
    return Dc.decode_attention_triton(q, k_cache, v_cache, lengths, scale, num_splits, max_len)


def lora_fwd(x2: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    return LR.lora_fwd(x2, weight, lora_A, lora_B, scaling)


def lora_bwd(dy: Tensor, x2: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, g: Tensor,
             scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    return LR.lora_bwd(dy, x2, weight, lora_A, lora_B, g, scaling)


_ALGOS = ("max", "most_recent", "current")  # DelayedScaling.amax_compute_algo, or CurrentScaling


def fp8_quantize_update(x: Tensor, amax_history: Tensor, scale: Tensor, fp8_dtype: torch.dtype, margin: int,
                        algo: str) -> tuple[Tensor, Tensor]:
    """Quantize `x` (kernel) and update its scaling state IN PLACE, as the recipes do (formats/recipe.py), but as
    tensor mutations the compiler keeps in the graph (declared in mutates_args) instead of Python attribute
    rebinding. Returns (fp8 data, the scale_inv it was quantized with: a new tensor, taken before the update)."""
    m = fp8_max(fp8_dtype)
    if algo == "current":  # CurrentScaling: the scale from this tensor's amax, before quantizing
        scale.copy_(compute_scale(x.detach().abs().amax().float(), m, margin, scale))
    data, amax = F8.fp8_quantize_fwd(x, scale, fp8_dtype)
    scale_inv = 1.0 / scale
    if algo == "current":
        amax_history[0] = amax
    else:  # DelayedScaling.update: roll the history, this amax first, next scale from max / most recent
        amax_history.copy_(torch.roll(amax_history, 1))
        amax_history[0] = amax
        new = amax_history.max() if algo == "max" else amax_history[0]
        scale.copy_(compute_scale(new, m, margin, scale))
    return data, scale_inv


def fp8_linear_mm(x: Tensor, weight: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, g_history: Tensor,
                  g_scale: Tensor, g_dtype: torch.dtype, margin: int, algo: str, fprop_split: bool, dgrad_split: bool,
                  wgrad_split: bool) -> Tensor:
    """y = x @ W^T from the fp8 operands (qx, sx) (N, K) and (qw, sw) (O, K). x and weight are there for autograd
    only (their gradients); the backward quantizes dy with the grad_output state (g_history, g_scale), in place."""
    return G.fp8_gemm_raw(qx, qw.t(), sx, sw, x.dtype, fprop_split)


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


def _attn_setup(ctx, inputs, output):
    q, k, v, causal, scale, cu, max_seqlen = inputs
    ctx.args, ctx.has_cu = (causal, scale, max_seqlen), cu is not None
    ctx.save_for_backward(q, k, v, output[0], output[1], *(() if cu is None else (cu,)))


def _attn_grad(ns, ctx, do, _dlse):
    q, k, v, o, lse, *cu = ctx.saved_tensors
    causal, scale, max_seqlen = ctx.args
    dq, dk, dv = getattr(torch.ops, ns).attention_bwd(do.contiguous(), q, k, v, o, lse, causal, scale,
                                                cu[0] if ctx.has_cu else None, max_seqlen)
    return dq, dk, dv, None, None, None, None


def _lora_setup(ctx, inputs, output):
    ctx.scaling = inputs[4]
    ctx.save_for_backward(*inputs[:4], output[1])


def _lora_grad(ns, ctx, dy, _dg):
    x2, w, a, b, g = ctx.saved_tensors
    dx, dA, dB = getattr(torch.ops, ns).lora_bwd(dy.contiguous(), x2, w, a, b, g, ctx.scaling)
    dw = (dy.t().float() @ x2.float()).to(w.dtype) if ctx.needs_input_grad[1] else None  # only if unfrozen
    return dx, dw, dA, dB, None


def _lce_setup(ctx, inputs, output):
    ctx.w_dtype, ctx.need = inputs[1].dtype, inputs[7:9]
    ctx.save_for_backward(output[1], output[2])


def _lce_grad(ctx, dloss, _ddx, _ddw):
    dx, dw = ctx.saved_tensors  # computed in the forward for an upstream gradient of 1: scale by dloss
    dx = dx * dloss.to(dx.dtype) if ctx.need[0] else None
    dw = (dw * dloss).to(ctx.w_dtype) if ctx.need[1] else None
    return (dx, dw) + (None,) * 7


def _fp8_mm_setup(ctx, inputs, output):
    x, w, qx, sx, qw, sw, gh, gs, gdt, margin, algo, _, dsplit, wsplit = inputs
    ctx.save_for_backward(qx, sx, qw, sw)  # fp8: 1 byte per element
    ctx.state = (gh, gs)  # mutated in the backward (a forward input the compiler lets the backward mutate)
    ctx.args = (gdt, margin, algo, dsplit, wsplit, x.dtype, w.dtype)


def _fp8_mm_grad(ns, ctx, dy):
    ops = getattr(torch.ops, ns)
    qx, sx, qw, sw = ctx.saved_tensors
    gdt, margin, algo, dsplit, wsplit, x_dtype, w_dtype = ctx.args
    qg, sg = ops.fp8_quantize_update(dy.detach().contiguous(), *ctx.state, gdt, margin, algo)  # (N, O)
    dx = ops.fp8_gemm(qg, qw, sg, sw, x_dtype, dsplit) if ctx.needs_input_grad[0] else None  # (N,O)@(O,K)
    dw = ops.fp8_gemm(qg.t(), qx, sg, sx, w_dtype, wsplit) if ctx.needs_input_grad[1] else None  # (O,N)@(N,K)
    return (dx, dw) + (None,) * 12


def register_reference_ops(ns: str = "minite_ref") -> str:
    """The fused and attention-class ops (linear_cross_entropy, fp8_quantize_update, fp8_linear_mm, fp8_gemm,
    attention_fwd/bwd (varlen too), decode_attention, lora_fwd/bwd) as CPU custom ops in
    namespace `ns`: the same wrappers and autograd formulas as the triton_ops above, run eagerly (the interpreter
    runs their kernels), with explicit fake impls. Where ENABLED is False (CPU) they let opcheck and
    torch.compile(fullgraph=True, backend="aot_eager") check the schemas, the in-place state updates and the
    autograd wiring. Nothing here touches torch.ops.minite. Idempotent; returns `ns`."""
    if hasattr(torch.ops, ns) and hasattr(getattr(torch.ops, ns), "lora_fwd"):
        return ns
    fakes = {
        "linear_cross_entropy": lambda x, w, t, ii, red, ls, cs, ndx, ndw: (
            x.new_empty((), dtype=torch.float64 if x.dtype == torch.float64 else torch.float32),
            torch.empty_like(x) if ndx else x.new_empty(0),
            w.new_empty(w.shape, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32) if ndw
            else x.new_empty(0)),
        "fp8_quantize_update": lambda x, h, s, dt, m, a: (x.new_empty(x.shape, dtype=dt), s.new_empty(s.shape)),
        "fp8_linear_mm": lambda x, w, qx, sx, qw, *_: x.new_empty((qx.shape[0], qw.shape[0])),
        "fp8_gemm": lambda a, b, sa, sb, dt, split: a.new_empty((a.shape[0], b.shape[1]), dtype=dt),
        "attention_fwd": lambda q, k, v, c, s, cu, m: (torch.empty_like(q), q.new_empty(
            (q.shape[0], q.shape[1], q.shape[2]) if cu is None else (q.shape[1], q.shape[0]), dtype=torch.float32)),
        "attention_bwd": lambda do, q, k, v, *_: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
        "decode_attention": lambda q, *_: torch.empty_like(q),
        "lora_fwd": lambda x2, w, a, b, s: (x2.new_empty((x2.shape[0], w.shape[0])),
                                            x2.new_empty((x2.shape[0], a.shape[0]), dtype=torch.float32)),
        "lora_bwd": lambda dy, x2, w, a, b, g, s: (torch.empty_like(x2), torch.empty_like(a), torch.empty_like(b)),
    }
    mutates = {"fp8_quantize_update": ("amax_history", "scale")}
    for fn in (linear_cross_entropy, fp8_quantize_update, fp8_linear_mm, fp8_gemm, attention_fwd, attention_bwd,
               decode_attention, lora_fwd, lora_bwd):
        o = torch.library.custom_op(f"{ns}::{fn.__name__}", fn, mutates_args=mutates.get(fn.__name__, ()),
                                    device_types="cpu")
        o.register_fake(fakes[fn.__name__])
    torch.library.register_autograd(f"{ns}::linear_cross_entropy", _lce_grad, setup_context=_lce_setup)
    torch.library.register_autograd(f"{ns}::fp8_linear_mm", functools.partial(_fp8_mm_grad, ns),
                                    setup_context=_fp8_mm_setup)
    for name, grad, setup in (("attention_fwd", _attn_grad, _attn_setup), ("lora_fwd", _lora_grad, _lora_setup)):
        torch.library.register_autograd(f"{ns}::{name}", functools.partial(grad, ns), setup_context=setup)
    return ns


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
    _register(linear_cross_entropy, _lce_grad, _lce_setup)
    _register(fp8_quantize_update, mutates_args=("amax_history", "scale"))
    _register(fp8_linear_mm, functools.partial(_fp8_mm_grad, "minite"), _fp8_mm_setup)
    _register(attention_bwd)
    _register(attention_fwd, functools.partial(_attn_grad, "minite"), _attn_setup)
    _register(decode_attention)
    _register(lora_bwd)
    _register(lora_fwd, functools.partial(_lora_grad, "minite"), _lora_setup)
