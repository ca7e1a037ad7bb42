"""minite: Transformer-Engine + Megatron + FlashAttention ideas, rebuilt small enough to read.

    import minite
    y = minite.ops.rmsnorm(x, w)             # Triton on CUDA (or the CPU interpreter), else the reference
    with minite.use_backend("torch"):        # force the PyTorch reference
        ...

``minite.ops``, ``minite.nn``, ``minite.formats`` and ``minite.lora`` are imported on first use, so importing
one part of the library (``minite.parallel.dims``, ``minite.errors``) loads only what that part uses.
"""
from __future__ import annotations

import importlib as _importlib
import sys as _sys

if _sys.argv[:1] == ["-m"] and _sys.path and _sys.path[0] and not getattr(_sys.flags, "safe_path", False):
    del _sys.path[0]  # `python -m minite.X`: its working directory is no import path (a planted argparse.py, say)

from minite._triton import HAS_TRITON, interpreting  # noqa: F401
from minite.backend import resolve_backend, use_backend  # noqa: F401

__version__ = "0.1.0"
__all__ = ["ops", "nn", "formats", "lora", "use_backend", "resolve_backend", "HAS_TRITON", "interpreting",
           "__version__"]


_PARTS = ("ops", "nn", "formats", "lora", "errors", "models", "kernels", "layers", "parallel", "train", "data")


def __getattr__(name: str):
    if name in _PARTS:  # lazy: keeps `import minite` light
        return _importlib.import_module(f"minite.{name}")
    raise AttributeError(f"module 'minite' has no attribute {name!r}")


def __dir__() -> list[str]:  # dir(minite) and tab completion list the lazy parts, not the module's plumbing
    return sorted(set(__all__) | set(_PARTS))
