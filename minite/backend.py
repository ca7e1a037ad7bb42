"""One place decides which implementation of an op runs: the PyTorch reference or the Triton kernel.

Precedence (first that is set wins)::

    call argument  >  module attribute  >  use_backend() context  >  $MINITE_BACKEND  >  "auto"

A module attribute reaches here as the call argument (``RMSNorm(backend="torch")`` passes it on).
"auto" picks Triton when the tensor is on a CUDA device, or on the CPU while the Triton interpreter is on;
otherwise the reference. On CUDA an op that names itself (``op="attention"``) follows the recorded benchmark of the
device's family instead (minite/choices.py): the peer the torch backend runs (SDPA, Inductor's fusion) where it was
faster than minite's kernel. "auto" never raises. A forced "triton" that cannot run raises a RuntimeError
that says why. ``$MINITE_BACKEND`` is read at call time, never inside a kernel.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from minite import _triton, choices
from minite._triton import HAS_TRITON, TRITON_IMPORT_ERROR, interpreting

__all__ = ["BACKENDS", "use_backend", "get_backend", "resolve_backend", "triton_available_for"]

BACKENDS = ("auto", "torch", "triton")
_local = threading.local()


def _check_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} from {where}; valid: {', '.join(BACKENDS)}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Context manager: ops called inside use `name` unless the call or module says otherwise.

    >>> with use_backend("torch"):
    ...     y = minite.ops.softmax(x)      # reference path
    """
    _check_name(name, "use_backend()")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        yield name
    finally:
        stack.pop()


def get_backend() -> str:
    """The backend requested by context or environment (before per-tensor "auto" resolution)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    env = os.environ.get("MINITE_BACKEND")
    if env:
        return _check_name(env.strip().lower(), "$MINITE_BACKEND")
    return "auto"


def triton_available_for(x: torch.Tensor) -> tuple[bool, str]:
    """Can a Triton kernel run on tensor `x` here? Returns (ok, reason-if-not)."""
    if not HAS_TRITON:
        return False, f"triton is not installed ({TRITON_IMPORT_ERROR!r})"
    if x.device.type == "cuda":
        return True, ""
    if x.device.type == "cpu":
        if interpreting():
            problem = _triton.INTERPRETER_PROBLEM
            return (False, problem) if problem else (True, "")
        return False, (
            "the tensor is on the CPU and the Triton interpreter is off: set TRITON_INTERPRET=1 "
            "before minite is imported (or move the tensor to a CUDA device)"
        )
    return False, f"Triton kernels run on CUDA (or the CPU interpreter), not on device {x.device}"


def resolve_backend(x: torch.Tensor, backend: str | None = None, op: str | None = None) -> str:
    """Return "torch" or "triton" for an op whose main input is `x`; `op` (a key of minite.choices.TABLE) lets
    "auto" on CUDA run the peer where the device family's recorded benchmark shows it faster."""
    name = _check_name(backend, "the backend argument") if backend is not None else get_backend()
    if name == "torch":
        return "torch"
    ok, why = triton_available_for(x)
    if name == "triton":
        if not ok:
            raise RuntimeError(f"backend='triton' was forced but cannot run: {why}")
        return "triton"
    if ok and op is not None and x.device.type == "cuda" and choices.peer_runs(op, x.device):
        return "torch"  # "auto" on a GPU where the recorded peer wins
    return "triton" if ok else "torch"  # "auto": never raises
