"""Argument checks shared by the functional APIs: one clear error that names the function, the argument and the
value it got, before anything reaches a kernel. ``where`` is the caller's name ("rmsnorm", "quantize", ...).

Booleans must be booleans (``"false"`` is a truthy string, so ``bool("false")`` would turn a feature on), integers
must be integers (not floats that happen to be whole, not bools), and numbers must be finite and in range.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["tensor", "boolean", "integer", "real", "same_device", "describe", "scale", "lengths"]


def describe(v) -> str:
    """`str '1e-6'`, `float 1.5`, `None`: the type and the value, for error messages."""
    return "None" if v is None else f"{type(v).__name__} {v!r}"


def tensor(where: str, name: str, x, *, floating: bool = False) -> torch.Tensor:
    """`x` must be a torch.Tensor (floating point when `floating`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(x).__name__ if x is not None else 'None'}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{where}: {name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def boolean(where: str, name: str, v, *, allow_none: bool = False) -> bool | None:
    """A real bool (numpy's bool_ too); None only when `allow_none`."""
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return bool(v)
    raise TypeError(f"{where}: {name} must be a bool{' or None' if allow_none else ''}, got {describe(v)}")


def integer(where: str, name: str, v, *, lo: int | None = None, hi: int | None = None) -> int:
    """An int (not a bool, not a float), optionally in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int, got {describe(v)}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise ValueError(f"{where}: {name} must be an int {'in ' if '[' in rng else ''}{rng}, got {v}")
    return v


def real(where: str, name: str, v, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
         le: float | None = None, finite: bool = True) -> float:
    """A real number (int or float, not a bool, not a string), finite unless told otherwise, within the bounds."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}: {name} must be a real number, got {describe(v)}")
    v = float(v)
    bad = (finite and not math.isfinite(v)) or math.isnan(v)
    for bound, ok in ((gt, lambda b: v > b), (ge, lambda b: v >= b), (lt, lambda b: v < b), (le, lambda b: v <= b)):
        if bound is not None and not ok(bound):
            bad = True
    if bad:
        parts = (["finite"] if finite else []) + [f"{op} {b}" for op, b in ((">", gt), (">=", ge), ("<", lt),
                                                                            ("<=", le)) if b is not None]
        raise ValueError(f"{where}: {name} must be {' and '.join(parts)}, got {v}")
    return v


def scale(where: str, v) -> float | None:
    """An attention softmax scale: None (1 / sqrt(D)), else finite and > 0 (NaN made one backend return zeros and
    the other NaN; 0 or a negative scale is a uniform or inverted attention, never what was meant)."""
    return None if v is None else real(where, "scale", v, gt=0)


def lengths(where: str, lens, B: int, T_max: int, max_len=None) -> int | None:
    """Per-sequence key counts (B,) of an integer dtype, each in [0, T_max]; max_len, when given, an int in
    [0, T_max] and >= every length. Returns max_len as an int (or None).

    The dtype and shape are always checked (metadata, free). The values only when `lens` lives on the CPU: on
    CUDA reading them is a device-to-host sync per decode step and per layer, and it would break CUDA-graph
    capture. There the decode kernel clamps each length to [0, T_max] itself, so it never reads past the cache."""
    tensor(where, "lengths", lens)
    if lens.dtype == torch.bool or lens.is_floating_point() or lens.is_complex():
        raise TypeError(f"{where}: lengths must be an integer tensor (key counts), got dtype {lens.dtype}")
    if tuple(lens.shape) != (B,):
        raise ValueError(f"{where}: lengths must have shape ({B},), got {tuple(lens.shape)}")
    if max_len is not None:
        max_len = integer(where, "max_len", max_len, lo=0, hi=T_max)
    if lens.device.type == "cpu" and B and not torch.compiler.is_compiling():  # (a traced step reads no value)
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > T_max:
            i = int(((lens < 0) | (lens > T_max)).nonzero()[0, 0])
            raise ValueError(f"{where}: lengths[{i}] = {int(lens[i])} is outside [0, T_max={T_max}] "
                             "(the cache holds T_max positions per sequence)")
        if max_len is not None and hi > max_len:
            raise ValueError(f"{where}: max_len={max_len} is below the longest sequence, lengths.max() = {hi}")
    return max_len


def same_device(where: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{where}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def ce_args(logits, target, reduction, label_smoothing, name="logits"):
    """cross_entropy / linear_cross_entropy argument checks (minite/kernels/cross_entropy.py)."""
    tensor("cross_entropy", name, logits)
    tensor("cross_entropy", "target", target)
    if logits.dim() != 2:
        raise ValueError(f"cross_entropy: {name} must be 2-D, got shape {tuple(logits.shape)}; flatten (B, T, .)")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"cross_entropy: {name} dtype {logits.dtype} is not fp16, bf16, fp32 or fp64")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cross_entropy: target dtype {target.dtype} must be int64 (class indices)")
    if target.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: target shape {tuple(target.shape)} != ({logits.shape[0]},), "
                         f"the rows of {name} {tuple(logits.shape)}")
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {target.device} but {name} is on {logits.device}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; expected one of ('mean', 'sum', 'none')")
    real("cross_entropy", "label_smoothing", label_smoothing, ge=0.0, le=1.0)


def ce_targets(target, V, ignore_index, max_vocab):
    """Vocabulary size and target range (the range only on the CPU, where the check costs no host sync)."""
    if V > max_vocab:
        raise ValueError(f"cross_entropy: vocabulary V={V} is too large (max {max_vocab}: int32 column offsets)")
    # Range check only where it is free, on the CPU (on CUDA: a host sync per call; the kernels mask instead).
    if target.device.type == "cpu" and target.numel() and not torch.compiler.is_compiling():  # traced: no value
        bad = (target != ignore_index) & ((target < 0) | (target >= V))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"cross_entropy: target[{i}] = {int(target[i])} is out of range [0, {V}) "
                             f"and is not ignore_index={ignore_index}")


def norm_args(op: str, x, weight, bias, eps) -> None:
    """rmsnorm / layernorm argument checks (minite/kernels/rmsnorm.py)."""
    tensor(op, "weight", weight)
    if bias is not None:
        tensor(op, "bias", bias)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: x must be a tensor with at least 1 dimension (..., C), got {type(x).__name__} "
                         f"of shape {tuple(getattr(x, 'shape', ()))}")
    C = x.shape[-1]
    for name, p in (("x", x), ("weight", weight)) + ((("bias", bias),) if bias is not None else ()):
        if not p.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got dtype {p.dtype}")
        if p.device != x.device:
            raise ValueError(f"{op}: {name} is on {p.device} but x is on {x.device}")
        if name != "x" and tuple(p.shape) != (C,):
            raise ValueError(f"{op}: {name} must have shape ({C},) to match x's last dim, got {tuple(p.shape)}")
    real(op, "eps", eps, gt=0)
