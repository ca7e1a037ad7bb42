"""``python -m minite.train --train.compile=MODE``: torch.compile for the training model, in place.

MODE: ``auto`` (``default`` on CUDA, ``off`` elsewhere), ``off``, ``default``, ``reduce-overhead`` (CUDA graphs:
pays for a small, launch-bound model), ``max-autotune-no-cudagraphs``. ``nn.Module.compile`` compiles in place, so
the state_dict keys (checkpoints) are unchanged. minite's Triton kernels stay in the graph on CUDA: they are
registered as ``torch.ops.minite.*`` custom ops (kernels/_library.py). Under the CPU interpreter nothing is
compiled (``wrap_triton`` refuses interpreted kernels).
"""
from __future__ import annotations

import torch

from minite._triton import interpreting

MODES = ("auto", "off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


def resolve_compile(mode: str, dev: torch.device) -> str:
    """The mode actually used: "auto" -> "default" on CUDA, "off" elsewhere; CPU + interpreter -> "off"."""
    if mode not in MODES:
        raise ValueError(f"train.compile={mode!r}: expected one of {MODES}")
    if mode == "auto":
        mode = "default" if dev.type == "cuda" else "off"
    if dev.type != "cuda" and interpreting():
        return "off"
    return mode


def compile_model(model: torch.nn.Module, mode: str, dev: torch.device) -> str:
    """Compile `model` in place (``model.compile``) for `mode`; returns the resolved mode."""
    mode = resolve_compile(mode, dev)
    if mode != "off":
        model.compile(mode=None if mode == "default" else mode)
    return mode
