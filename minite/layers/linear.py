"""``minite.nn.Linear``: an ``nn.Linear`` whose GEMMs run in FP8 inside ``fp8_autocast`` (chapter 02).

Outside ``fp8_autocast`` it is exactly ``nn.Linear`` (same constructor, parameters and state_dict). Inside,
like TransformerEngine's ``te.Linear``, the three GEMMs of a linear layer run on fp8 operands::

    forward   y  = x  @ W^T       x: E4M3 (N, K)   W: E4M3 (O, K)         -> (N, O)
    dgrad     dx = dy @ W         dy: E5M2 (N, O) under HYBRID, E4M3 else -> (N, K)
    wgrad     dW = dy^T @ x                                               -> (O, K)

Each of the three quantized tensors (input, weight, grad_output) has its own ``ScalingState`` (amax history
and scale) kept by the module, updated by the recipe after every quantization. The forward saves the *fp8*
input and weight for the backward: half the activation memory of bf16. The bias is added in the output dtype.

Accumulation follows TransformerEngine: ``FP8_ACCUMULATE = {"fprop": "fast", "dgrad": "split", "wgrad": "split"}``
(split = partial sums promoted to fp32 every 128 elements of K; see kernels/fp8_gemm.py). Change the module-level
dict to select another mode per GEMM.

The backend switch picks Triton (quantize kernel + FP8 GEMM kernel) or the torch reference (torch casts +
fp32 matmul of the dequantized operands): the same quantization math, so both give the same fp8 bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minite.backend import resolve_backend
from minite.formats.autocast import get_fp8_recipe, is_fp8_enabled
from minite.formats.fp8 import Float8Tensor, quantize
from minite.formats.recipe import CurrentScaling, DelayedScaling, ScalingState
from minite.kernels._common import use_op
from minite.kernels.fp8_gemm import fp8_gemm

__all__ = ["Linear", "fp8_linear", "fp8_linear_states"]

ROLES = ("input", "weight", "grad_output")
FP8_ACCUMULATE = {"fprop": "fast", "dgrad": "split", "wgrad": "split"}  # TransformerEngine's default


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
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias, ctx.x_shape = x.dtype, weight.dtype, bias is not None, x.shape
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

    recipe: default the active ``fp8_autocast`` recipe, else ``CurrentScaling()``.
    states: {"input", "weight", "grad_output"} ``ScalingState``s, updated in place (a module keeps them
    between steps); default fresh ones, which only make sense with current scaling.
    """
    _check(x, weight, bias)
    recipe = recipe or get_fp8_recipe() or CurrentScaling()
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
    FP8LinearFunction). Tests point this at ``_library.register_reference_ops()`` to trace the same code on the CPU."""
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


class Linear(nn.Linear):
    """``nn.Linear`` that runs FP8 GEMMs inside ``fp8_autocast`` (plain linear outside).

    The module owns its FP8 scaling states (amax histories and scales) and saves them as *module extra state*,
    the way TransformerEngine does: ``state_dict()`` gains a ``<prefix>_extra_state`` entry once the layer has run
    under FP8, so a checkpoint resumes FP8 training bit for bit. Before that (or never under FP8) the state_dict is
    exactly ``nn.Linear``'s, and an ``nn.Linear`` state_dict (no extra state) loads into it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 backend: str | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend = backend
        self.fp8_states: dict[str, ScalingState] | None = None
        self._fp8_key = None

    def fp8_states_for(self, recipe, device) -> dict[str, ScalingState]:
        """This module's states for `recipe`, made on first use (again if the format or history length change)."""
        key = (type(recipe).__name__, recipe.fp8_format, recipe.amax_history_len)
        if self.fp8_states is None or self._fp8_key != key:
            if torch.compiler.is_compiling():  # tensors made inside the graph cannot be mutated by its backward
                raise RuntimeError("Linear: FP8 scaling states must exist before torch.compile traces the layer: "
                                   "run one step eagerly under fp8_autocast, or call fp8_states_for(recipe, device)")
            self.fp8_states, self._fp8_key = fp8_linear_states(recipe, device), key
        elif self.fp8_states["input"].scale.device != torch.device(device):
            self.fp8_states = {k: s.to(device) for k, s in self.fp8_states.items()}
        return self.fp8_states

    # ------------------------------------------------------------------ FP8 state as module extra state
    def get_extra_state(self) -> dict | None:
        """The FP8 states as plain data (tensors, strings, ints: loadable with ``torch.load(weights_only=True)``)."""
        if self.fp8_states is None:
            return None
        kind, fmt, hist = self._fp8_key
        return {"recipe": kind, "format": fmt.name, "amax_history_len": hist,
                "states": {r: {"fp8_dtype": str(st.fp8_dtype).replace("torch.", ""),
                               "amax_history": st.amax_history.clone(), "scale": st.scale.clone()}
                           for r, st in self.fp8_states.items()}}

    def set_extra_state(self, state: dict | None) -> None:
        if state is None:  # a checkpoint from before FP8 ran (or from nn.Linear): fresh states on first use
            self.fp8_states, self._fp8_key = None, None
            return
        if not isinstance(state, dict) or set(state.get("states", {})) != set(ROLES):
            raise ValueError(f"Linear: FP8 extra state must hold the states {list(ROLES)}, got "
                             f"{sorted(state.get('states', {})) if isinstance(state, dict) else type(state).__name__}")
        from minite.formats.recipe import Format
        states = {}
        for r, d in state["states"].items():
            st = ScalingState(getattr(torch, d["fp8_dtype"]), d["amax_history"].numel(), d["scale"].device)
            st.amax_history.copy_(d["amax_history"])
            st.scale.copy_(d["scale"])
            states[r] = st
        self.fp8_states = states
        self._fp8_key = (state["recipe"], Format[state["format"]], int(state["amax_history_len"]))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.fp8_states is None:  # never ran under FP8: nn.Linear's exact key set
            destination.pop(prefix + "_extra_state", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(prefix + "_extra_state", None)  # nn.Linear's state_dict / no FP8 yet: no extra state
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fp8_enabled():
            return F.linear(x, self.weight, self.bias)
        recipe = get_fp8_recipe()
        return fp8_linear(x, self.weight, self.bias, recipe=recipe, states=self.fp8_states_for(recipe, x.device),
                          backend=self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", backend={self.backend!r}" if self.backend else "")
