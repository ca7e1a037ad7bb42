"""FP8 linear (chapter 02): y = x @ W^T + b through three FP8 GEMMs, forward and backward.

Like TransformerEngine's ``te.Linear``, the three GEMMs of a linear layer run on fp8 operands::

    forward   y  = x  @ W^T       x: E4M3 (N, K)   W: E4M3 (O, K)         -> (N, O)
    dgrad     dx = dy @ W         dy: E5M2 (N, O) under HYBRID, E4M3 else -> (N, K)
    wgrad     dW = dy^T @ x                                               -> (O, K)

Each of the three quantized tensors (input, weight, grad_output) has its own ``ScalingState`` (amax history
and scale), updated by the recipe after every quantization. The forward saves the *fp8* input and weight for
the backward: half the activation memory of bf16. The bias is added in the output dtype.

Accumulation follows TransformerEngine: ``FP8_ACCUMULATE = {"fprop": "fast", "dgrad": "split", "wgrad": "split"}``
(split = partial sums promoted to fp32 every 128 elements of K; see kernels/fp8_gemm.py). Change the module-level
dict to select another mode per GEMM.

The sections of a concept file: the kernels are the quantize kernel (formats/fp8.py) and the FP8 GEMM
(kernels/fp8_gemm.py); the reference is this same Function on the torch backend (torch casts + fp32 matmul of the
dequantized operands: the same quantization math, so the same fp8 bits); the module is ``minite.nn.Linear``
(layers/linear.py). Under torch.compile on CUDA the layer runs as two custom ops instead (section 3):
``fp8_quantize_update`` updates a scaling state in place (a mutation the graph keeps) and ``fp8_linear_mm`` is the
forward GEMM, whose registered backward quantizes dy and runs dgrad and wgrad.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minite.backend import resolve_backend
from minite.formats.autocast import get_fp8_recipe
from minite.formats.fp8 import Float8Tensor, fp8_quantize_fwd, quantize
from minite.formats.recipe import CurrentScaling, DelayedScaling, ScalingState, current_scale, fp8_max, roll_history
from minite.kernels._common import op, register_autograd, register_op, use_op
from minite.kernels.fp8_block import BlockFP8LinearFunction
from minite.kernels.fp8_gemm import fp8_gemm, fp8_gemm_raw

__all__ = ["fp8_linear", "fp8_linear_states", "FP8LinearFunction", "fp8_quantize_update", "fp8_linear_mm",
           "FP8_ACCUMULATE", "ROLES"]

ROLES = ("input", "weight", "grad_output")
FP8_ACCUMULATE = {"fprop": "fast", "dgrad": "split", "wgrad": "split"}  # TransformerEngine's default


# ---------------------------------------------------------------------------------- 3. ops for torch.compile
@register_op("fp8_quantize_update", mutates_args=("amax_history", "scale"))  # torch.ops.minite.fp8_quantize_update
def fp8_quantize_update(x: Tensor, amax_history: Tensor, scale: Tensor, fp8_dtype: torch.dtype, margin: int,
                        algo: str) -> tuple[Tensor, Tensor]:
    """Quantize `x` (kernel) and update its scaling state IN PLACE, with the recipes' own arithmetic
    (formats/recipe.py), as tensor mutations the compiler keeps in the graph (declared in mutates_args) instead of
    Python attribute rebinding. algo: DelayedScaling.amax_compute_algo, or "current" (CurrentScaling).
    Returns (fp8 data, the scale_inv it was quantized with: a new tensor, taken before the update)."""
    m = fp8_max(fp8_dtype)
    if algo == "current":  # CurrentScaling: the scale from this tensor's amax, before quantizing
        scale.copy_(current_scale(x, m, margin, scale))
    data, amax = fp8_quantize_fwd(x, scale, fp8_dtype)
    scale_inv = 1.0 / scale
    if algo == "current":
        amax_history[0] = amax
    else:  # DelayedScaling.update: roll the history, this amax first, next scale from max / most recent
        history, next_scale = roll_history(amax_history, amax, m, margin, algo, scale)
        amax_history.copy_(history)
        scale.copy_(next_scale)
    return data, scale_inv


@register_op("fp8_linear_mm")  # torch.ops.minite.fp8_linear_mm
def fp8_linear_mm(x: Tensor, weight: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, g_history: Tensor,
                  g_scale: Tensor, g_dtype: torch.dtype, margin: int, algo: str, fprop_split: bool, dgrad_split: bool,
                  wgrad_split: bool) -> Tensor:
    """y = x @ W^T from the fp8 operands (qx, sx) (N, K) and (qw, sw) (O, K). x and weight are there for autograd
    only (their gradients); the backward quantizes dy with the grad_output state (g_history, g_scale), in place."""
    return fp8_gemm_raw(qx, qw.t(), sx, sw, x.dtype, fprop_split)


# ------------------------------------------------------------------------------------------ 4. autograd
def _fp8_linear_mm_setup(ctx, inputs, output):
    x, weight, qx, sx, qw, sw, g_history, g_scale, g_dtype, margin, algo, _, dgrad_split, wgrad_split = inputs
    ctx.save_for_backward(qx, sx, qw, sw)  # fp8: 1 byte per element
    ctx.state = (g_history, g_scale)  # mutated in the backward (a forward input the compiler lets the backward mutate)
    ctx.args = (g_dtype, margin, algo, dgrad_split, wgrad_split, x.dtype, weight.dtype)


def _fp8_linear_mm_backward(ctx, dy):
    qx, sx, qw, sw = ctx.saved_tensors
    g_dtype, margin, algo, dgrad_split, wgrad_split, x_dtype, w_dtype = ctx.args
    quantize_update = op("fp8_quantize_update", fp8_quantize_update)
    qg, sg = quantize_update(dy.detach().contiguous(), *ctx.state, g_dtype, margin, algo)  # (N, O)
    gemm = op("fp8_gemm", fp8_gemm_raw)
    dx = gemm(qg, qw, sg, sw, x_dtype, dgrad_split) if ctx.needs_input_grad[0] else None  # (N, O) @ (O, K)
    dw = gemm(qg.t(), qx, sg, sx, w_dtype, wgrad_split) if ctx.needs_input_grad[1] else None  # (O, N) @ (N, K)
    return (dx, dw) + (None,) * 12


# fp8_linear_mm's gradient. Eager calls take FP8LinearFunction below instead: the same math on ScalingState
# objects (rebound, not mutated) and on either backend; the tests compare the two bit for bit.
register_autograd("fp8_linear_mm", _fp8_linear_mm_backward, setup_context=_fp8_linear_mm_setup)


def fp8_linear_states(recipe: DelayedScaling | CurrentScaling, device=None) -> dict[str, ScalingState]:
    """Fresh scaling states for the three quantized tensors of a linear layer under `recipe`."""
    fmt = recipe.fp8_format
    return {"input": recipe.new_state(fmt.fwd, device), "weight": recipe.new_state(fmt.fwd, device),
            "grad_output": recipe.new_state(fmt.bwd, device)}


def _quantize(x: torch.Tensor, state: ScalingState, recipe, backend: str) -> Float8Tensor:
    """Quantize with the recipe's scale for `state`, then let the recipe record this tensor's amax."""
    scale = recipe.scale_for(state, x)                  # delayed: from history; current: amax(x) now
    q = quantize(x, scale, fp8_dtype=state.fp8_dtype, backend=backend)
    recipe.update(state, q.amax)                        # roll the history, compute the next scale
    return q


class FP8LinearFunction(torch.autograd.Function):
    """Forward and both gradients of y = x @ W^T + b through three FP8 GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, states, backend):
        O, K = weight.shape
        x2 = x.reshape(-1, K)                                              # (N, K)
        qx = _quantize(x2, states["input"], recipe, backend)              # E4M3 (N, K)
        qw = _quantize(weight, states["weight"], recipe, backend)         # E4M3 (O, K)
        y = fp8_gemm(qx, qw.t(), out_dtype=x.dtype, accumulate=FP8_ACCUMULATE["fprop"],
                     backend=backend)       # (N, K) @ (K, O) -> (N, O)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(qx.data, qx.scale_inv, qw.data, qw.scale_inv)   # fp8: 1 byte per element
        ctx.recipe, ctx.states, ctx.backend = recipe, states, backend
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], O)                                 # (..., O)

    @staticmethod
    def backward(ctx, grad_y):
        qx_data, qx_sinv, qw_data, qw_sinv = ctx.saved_tensors
        qx = Float8Tensor(qx_data, qx_sinv, ctx.x_dtype)                   # (N, K)
        qw = Float8Tensor(qw_data, qw_sinv, ctx.w_dtype)                   # (O, K)
        O = qw_data.shape[0]
        g2 = grad_y.reshape(-1, O)                                         # (N, O)
        qg = _quantize(g2, ctx.states["grad_output"], ctx.recipe, ctx.backend)   # E5M2 under HYBRID
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(qg, qw, out_dtype=ctx.x_dtype, accumulate=FP8_ACCUMULATE["dgrad"],
                          backend=ctx.backend).reshape(ctx.x_shape)                # (N, O) @ (O, K)
        if ctx.needs_input_grad[1]:
            dw = fp8_gemm(qg.t(), qx, out_dtype=ctx.w_dtype, accumulate=FP8_ACCUMULATE["wgrad"],
                          backend=ctx.backend)                                     # (O, N) @ (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(ctx.w_dtype)                         # bias grad in full precision
        return dx, dw, db, None, None, None


# -------------------------------------------------------------------------------------------- 5. functional
def _check(x, weight, bias):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fp8_linear: x must be a float32/float16/bfloat16 tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} "
                         f"(need x[..., K] and weight (O, K))")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")
    if x.device != weight.device:
        raise ValueError(f"fp8_linear: x is on {x.device}, weight on {weight.device}")


def _check_states(states) -> None:
    missing = [r for r in ROLES if not isinstance(states, dict) or not isinstance(states.get(r), ScalingState)]
    if missing:
        raise ValueError(f"fp8_linear: states must hold 'input', 'weight' and 'grad_output' ScalingStates (or be "
                         f"None for fresh ones); missing {missing}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               recipe: DelayedScaling | CurrentScaling | None = None, states: dict | None = None,
               backend: str | None = None) -> torch.Tensor:
    """x @ weight^T + bias with FP8 GEMMs. x: (..., K), weight: (O, K), bias: (O,) -> (..., O).

    recipe: default the active ``fp8_autocast`` recipe, else ``CurrentScaling()``. ``BlockwiseScaling`` and
    ``MXFP8Scaling`` (per-block scales, kernels/fp8_block.py) need no states; under torch.compile their kernels
    are the custom ops ``block_quantize`` and ``block_scaled_mm``.
    states: {"input", "weight", "grad_output"} ``ScalingState``s, updated in place (a module keeps them
    between steps); default fresh ones, which only make sense with current scaling.
    """
    _check(x, weight, bias)
    recipe = recipe or get_fp8_recipe() or CurrentScaling()
    if getattr(recipe, "block_scaled", False):  # BlockwiseScaling / MXFP8Scaling (chapter 15): stateless
        return BlockFP8LinearFunction.apply(x, weight, bias, recipe, resolve_backend(x, backend))
    if states is not None:
        _check_states(states)
    states = states if states is not None else fp8_linear_states(recipe, x.device)
    backend = resolve_backend(x, backend)
    ops = _graph_ops(backend)
    if ops is not None:
        return _fp8_linear_in_graph(ops, x, weight, bias, recipe, states)
    return FP8LinearFunction.apply(x, weight, bias, recipe, states, backend)


def _graph_ops(backend: str):
    """``torch.ops.minite`` while torch.compile traces with the ops registered (Triton on CUDA), else None (eager:
    FP8LinearFunction). Tests point this at CPU copies of the ops (tests/kernels/conftest.py) to trace it there."""
    return torch.ops.minite if backend == "triton" and use_op("fp8_linear_mm") else None


def _fp8_linear_in_graph(ops, x, weight, bias, recipe, states):
    """FP8LinearFunction as custom ops torch.compile keeps in one graph: each quantize (kernel) updates its state
    in place (``fp8_quantize_update``, mutates_args = history and scale; no Python attribute rebinding), and
    ``fp8_linear_mm`` (fprop GEMM; its registered backward quantizes dy, updating the grad_output state in place,
    then runs dgrad and wgrad). Same kernels, same fp8 bits and same state values as the eager Function."""
    O, K = weight.shape
    algo = recipe.amax_compute_algo if recipe.delayed else "current"
    x2 = x.reshape(-1, K)                                              # (N, K)
    qx, qw = (ops.fp8_quantize_update(t.detach(), states[r].amax_history, states[r].scale, states[r].fp8_dtype,
                                      recipe.margin, algo) for r, t in (("input", x2), ("weight", weight)))
    g = states["grad_output"]
    y = ops.fp8_linear_mm(x2, weight, *qx, *qw, g.amax_history, g.scale, g.fp8_dtype, recipe.margin, algo,
                          *(FP8_ACCUMULATE[k] == "split" for k in ("fprop", "dgrad", "wgrad")))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], O)

