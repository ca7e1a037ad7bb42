"""minite: Transformer-Engine + Megatron + FlashAttention ideas, rebuilt small enough to read.

    import minite
    y = minite.ops.rmsnorm(x, w)             # Triton on CUDA (or the CPU interpreter), else the reference
    with minite.use_backend("torch"):        # force the PyTorch reference
        ...

``minite.ops``, ``minite.nn``, ``minite.formats`` and ``minite.lora`` are imported on first use, so importing
one part of the library (``minite.parallel.dims``, ``minite.errors``) loads only what that part uses.
"""
from __future__ import annotations

import importlib

from minite._triton import HAS_TRITON, interpreting  # noqa: F401
from minite.backend import resolve_backend, use_backend  # noqa: F401

__version__ = "0.1.0"
__all__ = ["ops", "nn", "formats", "lora", "use_backend", "resolve_backend", "HAS_TRITON", "interpreting",
           "__version__"]


def __getattr__(name: str):
    if name in ("ops", "nn", "formats", "lora"):  # lazy: keeps `import minite` light
        return importlib.import_module(f"minite.{name}")
    raise AttributeError(f"module 'minite' has no attribute {name!r}")
