"""Argument checks shared by the functional APIs: one clear error that names the function, the argument and the
value it got, before anything reaches a kernel. ``where`` is the caller's name ("rmsnorm", "quantize", ...).

Booleans must be booleans (``"false"`` is a truthy string, so ``bool("false")`` would turn a feature on), integers
must be integers (not floats that happen to be whole, not bools), and numbers must be finite and in range.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["tensor", "boolean", "integer", "real", "same_device", "describe"]


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


def same_device(where: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{where}: {name} is on {t.device} but {ref_name} is on {ref.device}")
