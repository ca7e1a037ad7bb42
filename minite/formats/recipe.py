"""FP8 scaling recipes (chapter 02), shaped like TransformerEngine's ``transformer_engine.common.recipe``.

An FP8 number has 3 (E4M3) or 2 (E5M2) mantissa bits and a narrow exponent range, so a tensor is stored as
``fp8(x * scale)`` with one fp32 ``scale`` per tensor, chosen so that the tensor's largest magnitude (its
*amax*) lands just under the format's maximum::

    scale = fp8_max / amax / 2**margin          # and  x ~= fp8_value * scale_inv,  scale_inv = 1 / scale

Two ways to know amax:

* ``CurrentScaling`` ("just-in-time"): read the tensor once to get its amax, then read it again to quantize.
  Exact, but two passes over memory.
* ``DelayedScaling`` (TransformerEngine's default): quantize with the scale computed from the amaxes of
  *previous* steps (a rolling history), and record this step's amax in the same pass. One pass; the risk is
  a sudden spike in amax, which saturates (clamps) until the history catches up.

``Format`` picks the fp8 encodings: E4M3 (more precision) for activations and weights in the forward pass,
E5M2 (more range) for gradients in the backward pass under ``HYBRID``.

Each quantized tensor of a module (input, weight, grad_output) owns a ``ScalingState``: its amax history and
its current scale (TransformerEngine's ``FP8TensorMeta``, one tensor at a time). Everything stays on the
tensor's device: no ``.item()``, so no host synchronisation per step.

The arithmetic of the two recipes is ``roll_history`` and ``current_scale``, functions of tensors: the recipes'
methods call them on a ``ScalingState``, and the compiled FP8 Linear (kernels/fp8_linear.py) calls them on the
state's tensors, which it updates in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from minite import _validate as _v

__all__ = ["Format", "DelayedScaling", "CurrentScaling", "BlockwiseScaling", "MXFP8Scaling", "RECIPES", "ScalingState",
           "compute_scale", "fp8_max", "roll_history", "current_scale"]


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of a torch fp8 dtype: 448.0 for float8_e4m3fn, 57344.0 for float8_e5m2."""
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"unsupported fp8 dtype {fp8_dtype}; use torch.float8_e4m3fn or torch.float8_e5m2")
    return float(torch.finfo(fp8_dtype).max)


class Format(Enum):
    """Which fp8 encoding the forward pass (activations, weights) and the backward pass (gradients) use.

    E4M3: both E4M3. E5M2: both E5M2. HYBRID: E4M3 forward, E5M2 backward (gradients have a wide dynamic
    range and tolerate a coarser mantissa; activations and weights need the extra mantissa bit).
    """

    E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = (torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = (torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def fwd(self) -> torch.dtype:
        """fp8 dtype of forward tensors (input, weight)."""
        return self.value[0]

    @property
    def bwd(self) -> torch.dtype:
        """fp8 dtype of backward tensors (grad_output)."""
        return self.value[1]

    @property
    def max_fwd(self) -> float:
        return fp8_max(self.fwd)

    @property
    def max_bwd(self) -> float:
        return fp8_max(self.bwd)


def compute_scale(amax: torch.Tensor, fp8_max: float, margin: int, prev_scale: torch.Tensor) -> torch.Tensor:
    """scale = fp8_max / amax / 2**margin, keeping `prev_scale` where amax is 0 or not finite.

    amax == 0 (an all-zero tensor) would give an infinite scale; an inf/NaN amax (an overflow upstream) would
    give 0 or NaN. Either would poison every later step, so the previous scale is kept instead.
    """
    amax = amax.to(torch.float32)
    sf = (fp8_max / amax) / (2.0 ** margin)
    ok = (amax > 0.0) & torch.isfinite(amax)
    return torch.where(ok, sf, prev_scale.to(torch.float32))


def roll_history(history: torch.Tensor, amax: torch.Tensor, fp8_max: float, margin: int, algo: str,
                 prev_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling's step after a quantization: (the history rolled with `amax` first, the next scale from the
    history's max (algo "max") or from `amax` alone ("most_recent")). New tensors; `history` is not modified."""
    hist = torch.roll(history, 1)  # oldest entry falls off the end
    hist[0] = amax.to(torch.float32)
    amax_r = hist.max() if algo == "max" else hist[0]
    return hist, compute_scale(amax_r, fp8_max, margin, prev_scale)


def current_scale(x: torch.Tensor, fp8_max: float, margin: int, prev_scale: torch.Tensor) -> torch.Tensor:
    """Current scaling's scale for `x`: from its amax, read now (an extra pass over x)."""
    return compute_scale(x.detach().abs().amax().to(torch.float32), fp8_max, margin, prev_scale)


class ScalingState:
    """Scaling state of one quantized tensor: amax history (newest first) and the scale to use next."""

    def __init__(self, fp8_dtype: torch.dtype, amax_history_len: int = 1024,
                 device: torch.device | str | None = None) -> None:
        if amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {amax_history_len}")
        self.fp8_dtype = fp8_dtype
        self.fp8_max = fp8_max(fp8_dtype)
        self.amax_history = torch.zeros(amax_history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    @property
    def scale_inv(self) -> torch.Tensor:
        return 1.0 / self.scale

    def to(self, device: torch.device | str) -> "ScalingState":
        self.amax_history, self.scale = self.amax_history.to(device), self.scale.to(device)
        return self

    def copy(self) -> "ScalingState":
        new = ScalingState(self.fp8_dtype, self.amax_history.numel(), self.scale.device)
        new.amax_history.copy_(self.amax_history)
        new.scale.copy_(self.scale)
        return new

    def __repr__(self) -> str:
        return (f"ScalingState({str(self.fp8_dtype).replace('torch.', '')}, "
                f"history_len={self.amax_history.numel()}, scale={self.scale.item():.4g})")


@dataclass
class DelayedScaling:
    """Delayed scaling: quantize with a scale derived from the amax *history*, then record this step's amax.

    margin: scale down by 2**margin for headroom. amax_history_len: steps remembered.
    amax_compute_algo: "max" (max over the history: safe, slow to shrink) or "most_recent" (last amax only).
    fp8_format: ``Format`` (HYBRID: E4M3 forward, E5M2 backward).
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: Format = Format.HYBRID
    min_dim: int = 0  # layers with min(in_features, out_features) < min_dim stay unquantized (chapter 15)

    def __post_init__(self):
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        # scale = fp8_max / amax / 2**margin: a negative margin pushes values past fp8_max (-200: scale = inf,
        # every product NaN); a huge one flushes everything to 0. TransformerEngine's margin is a small int >= 0.
        self.margin = _v.integer("DelayedScaling", "margin", self.margin, lo=0, hi=64)
        _v.integer("DelayedScaling", "amax_history_len", self.amax_history_len)
        _v.integer("DelayedScaling", "min_dim", self.min_dim, lo=0)
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"fp8_format must be a minite.formats.Format, got {self.fp8_format!r}")

    delayed = True  # the quantize pass can use state.scale as is (one pass over memory)

    def new_state(self, fp8_dtype: torch.dtype, device: torch.device | str | None = None) -> ScalingState:
        return ScalingState(fp8_dtype, self.amax_history_len, device)

    def scale_for(self, state: ScalingState, x: torch.Tensor) -> torch.Tensor:
        """The scale to quantize `x` with: the one computed at the previous step (x is not read)."""
        return state.scale

    def update(self, state: ScalingState, amax: torch.Tensor) -> None:
        """After quantizing: roll the history, put this step's amax first, compute the next scale."""
        state.amax_history, state.scale = roll_history(state.amax_history, amax, state.fp8_max, self.margin,
                                                       self.amax_compute_algo, state.scale)


@dataclass
class CurrentScaling:
    """Current ("just-in-time") scaling: read the tensor's amax first, then quantize with fp8_max / amax.

    Exact scale every time, at the cost of an extra pass over the tensor. The state keeps the last amax in
    ``amax_history[0]`` (for inspection only) and the last scale used.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1  # nothing to remember; kept so both recipes build states the same way
    min_dim: int = 0  # as DelayedScaling.min_dim

    def __post_init__(self):
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"fp8_format must be a minite.formats.Format, got {self.fp8_format!r}")
        _v.integer("CurrentScaling", "min_dim", self.min_dim, lo=0)

    delayed = False

    def new_state(self, fp8_dtype: torch.dtype, device: torch.device | str | None = None) -> ScalingState:
        return ScalingState(fp8_dtype, 1, device)

    def scale_for(self, state: ScalingState, x: torch.Tensor) -> torch.Tensor:
        """Extra pass: amax of x now, scale from it (previous scale if amax is 0 or not finite)."""
        state.scale = current_scale(x, state.fp8_max, self.margin, state.scale)
        return state.scale

    def update(self, state: ScalingState, amax: torch.Tensor) -> None:
        state.amax_history[0] = amax.to(torch.float32)


def _check_block_recipe(name: str, r) -> None:
    if not isinstance(r.fp8_format, Format):
        raise ValueError(f"{name}: fp8_format must be a minite.formats.Format, got {r.fp8_format!r}")
    _v.integer(name, "block", r.block, lo=1)
    _v.integer(name, "min_dim", r.min_dim, lo=0)


@dataclass
class BlockwiseScaling:
    """Blockwise scaling (DeepSeek-V3 §3.3; TransformerEngine's ``Float8BlockScaling``, chapter 15).

    Activations and gradients get one scale per 1 x `block` slice of a row, weights one per `block` x `block`
    tile, each scale = fp8_max / amax of its block, computed when the tensor is quantized (no history). Every
    GEMM applies the scales to the fp32 partial sum of each K-block (kernels/fp8_block.py). pow2: scales rounded
    down to powers of two. min_dim: a ``minite.nn.Linear`` with min(in_features, out_features) < min_dim runs
    unquantized (the small-layer rule of chapter 15). Stateless: ``new_state`` exists for the layer's bookkeeping.
    """

    fp8_format: Format = Format.E4M3
    block: int = 128
    pow2: bool = False
    min_dim: int = 0

    kind = "blockwise"
    block_scaled = True
    delayed = False
    margin = 0
    amax_history_len = 1

    def __post_init__(self):
        _check_block_recipe("BlockwiseScaling", self)
        self.pow2 = _v.boolean("BlockwiseScaling", "pow2", self.pow2)

    def new_state(self, fp8_dtype: torch.dtype, device: torch.device | str | None = None) -> ScalingState:
        return ScalingState(fp8_dtype, 1, device)


@dataclass
class MXFP8Scaling:
    """MXFP8 (OCP Microscaling v1.0; TransformerEngine's ``MXFP8BlockScaling``, chapter 15): every operand gets one
    E8M0 power-of-two scale per `block` = 32 consecutive elements along its GEMM's K dimension,
    2^(floor(log2 amax) - emax_elem). min_dim: as ``BlockwiseScaling``. Stateless."""

    fp8_format: Format = Format.E4M3
    block: int = 32
    min_dim: int = 0

    kind = "mx"
    block_scaled = True
    delayed = False
    margin = 0
    pow2 = True
    amax_history_len = 1

    def __post_init__(self):
        _check_block_recipe("MXFP8Scaling", self)

    def new_state(self, fp8_dtype: torch.dtype, device: torch.device | str | None = None) -> ScalingState:
        return ScalingState(fp8_dtype, 1, device)


RECIPES = {"delayed": DelayedScaling, "current": CurrentScaling, "blockwise": BlockwiseScaling,
           "mxfp8": MXFP8Scaling}  # the names of --fp8.recipe (chapter 15)
