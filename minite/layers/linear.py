"""``minite.nn.Linear``: an ``nn.Linear`` whose GEMMs run in FP8 inside ``fp8_autocast`` (chapter 02).

Outside ``fp8_autocast`` it is exactly ``nn.Linear`` (same constructor, parameters and state_dict). Inside,
like TransformerEngine's ``te.Linear``, the three GEMMs of a linear layer run on fp8 operands::

    forward   y  = x  @ W^T       x: E4M3 (N, K)   W: E4M3 (O, K)         -> (N, O)
    dgrad     dx = dy @ W         dy: E5M2 (N, O) under HYBRID, E4M3 else -> (N, K)
    wgrad     dW = dy^T @ x                                               -> (O, K)

through the functional ``fp8_linear`` (kernels/fp8_linear.py: quantization, autograd, the accumulation modes of
``FP8_ACCUMULATE``, the torch.compile ops). This module owns what persists between steps: the three
``ScalingState``s (amax history and scale of input, weight and grad_output), saved as module extra state.

Chapter 15: under ``BlockwiseScaling`` / ``MXFP8Scaling`` the three GEMMs use per-block scales instead
(kernels/fp8_block.py; no amax history, so the states only mark the recipe), and any recipe's ``min_dim`` keeps
a layer with min(in_features, out_features) < min_dim unquantized (the small-layer rule).

The backend switch picks Triton (quantize kernel + FP8 GEMM kernel) or the torch reference (torch casts +
fp32 matmul of the dequantized operands): the same quantization math, so both give the same fp8 bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minite.formats.autocast import get_fp8_recipe, is_fp8_enabled
from minite.formats.recipe import ScalingState
from minite.kernels.fp8_linear import FP8_ACCUMULATE, ROLES, fp8_linear, fp8_linear_states

__all__ = ["Linear", "fp8_linear", "fp8_linear_states", "FP8_ACCUMULATE", "ROLES"]

class Linear(nn.Linear):
    """``nn.Linear`` that runs FP8 GEMMs inside ``fp8_autocast`` (plain linear outside).

    The module owns its FP8 scaling states (amax histories and scales) and saves them as *module extra state*,
    the way TransformerEngine does: ``state_dict()`` gains a ``<prefix>_extra_state`` entry once the layer has run
    under FP8, so a checkpoint resumes FP8 training bit for bit. Before that (or never under FP8) the state_dict is
    exactly ``nn.Linear``'s, and an ``nn.Linear`` state_dict (no extra state) loads into it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 backend: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend = backend
        self.fp8_states: dict[str, ScalingState] | None = None
        self._fp8_key = None

    def fp8_states_for(self, recipe: object, device: torch.device | str) -> dict[str, ScalingState]:
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
        if min(self.in_features, self.out_features) < recipe.min_dim:  # chapter 15's small-layer rule
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, recipe=recipe, states=self.fp8_states_for(recipe, x.device),
                          backend=self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", backend={self.backend!r}" if self.backend else "")
