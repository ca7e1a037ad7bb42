"""The one place minite imports Triton.

Everything else does ``from minite._triton import triton, tl, HAS_TRITON``. Where Triton is not installed
(macOS, Windows, a CPU-only environment) a small stub stands in: kernel modules still import, ``@triton.jit``
still decorates, and launching a kernel raises a RuntimeError that says why. The backend switch never picks
Triton there, so the reference paths keep working.

The Triton interpreter (``TRITON_INTERPRET=1``) is read by ``@triton.jit`` *when a kernel is decorated*, i.e.
when its module is imported. ``interpreting()`` therefore reports the value in force when minite's kernels
were decorated, not whatever the environment says now.
"""

from __future__ import annotations

import os
import threading

__all__ = ["triton", "tl", "HAS_TRITON", "TRITON_IMPORT_ERROR", "interpreting", "gpu_tiles", "CAPTURE_GPU",
           "interpreter_problem",
           "INTERPRETER_PROBLEM"]


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


class _Missing:
    """Stands in for any Triton object when Triton is absent; fails loudly only when used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __getitem__(self, _):  # kernel[grid]
        return self

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} needs Triton, which is not installed ({TRITON_IMPORT_ERROR!r}). "
            "Use backend='torch' (the reference path), or install triton (Linux only)."
        )


class _TritonStub(_Missing):
    """Enough of the `triton` module for kernel files to import without it."""

    @staticmethod
    def jit(fn=None, **_kwargs):
        if fn is None:
            return lambda f: _Missing(f"triton.jit({f.__name__})")
        return _Missing(f"triton.jit({fn.__name__})")

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as e:  # ImportError, or a broken install (missing driver libraries, ...)
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = e
    triton = _TritonStub("triton")  # type: ignore[assignment]
    tl = _Missing("triton.language")  # type: ignore[assignment]

# Snapshot: the kernels decorated after this import run in the mode in force now.
_INTERPRET_AT_IMPORT = HAS_TRITON and _env_interpret()


def interpreting() -> bool:
    """True when minite's Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return _INTERPRET_AT_IMPORT


# Set by minite.gpu_compile while it captures the launches a GPU would make (tiles, sm count), never otherwise.
CAPTURE_GPU = threading.local()


def gpu_tiles(t) -> bool:
    """Choose the GPU's tiles (block sizes, warps, hardware casts) for a launch on tensor `t`: on CUDA, or while
    the compile gate captures the launches a GPU makes (minite.gpu_compile). Launchers ask this, never ``t.is_cuda``."""
    return t.is_cuda or getattr(CAPTURE_GPU, "on", False)


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why the Triton interpreter cannot run here, or None. Measured: triton 3.6's interpreter fails under numpy
    2.5 ("only 0-dimensional arrays can be converted to Python scalars", H100 machine, 2026-11-25); triton 3.7.1
    with numpy 2.5.5 works. The backend switch then keeps CPU tensors on the reference path (a forced Triton
    backend raises this message) instead of failing deep inside a kernel."""
    if triton_version is None:
        if not HAS_TRITON:
            return None
        triton_version = getattr(triton, "__version__", "0")
    if numpy_version is None:
        try:
            import numpy
        except ImportError:
            return None
        numpy_version = numpy.__version__
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 5):
        return (f"the Triton interpreter of triton {triton_version} fails under numpy {numpy_version} "
                "(measured: triton 3.6 + numpy 2.5); install triton>=3.7.1 or numpy<2.5, or run on a CUDA device")
    return None


INTERPRETER_PROBLEM = interpreter_problem() if _INTERPRET_AT_IMPORT else None
