"""``python -m minite.train --train.compile=MODE``: torch.compile for the training model, in place.

MODE: ``auto`` (``reduce-overhead`` on CUDA, ``off`` elsewhere), ``off``, ``default``, ``reduce-overhead`` (CUDA graphs:
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
    """The mode actually used: "auto" -> "reduce-overhead" on CUDA, "off" elsewhere; CPU + interpreter -> "off"."""
    if mode not in MODES:
        raise ValueError(f"train.compile={mode!r}: expected one of {MODES}")
    if mode == "auto":
        # CUDA graphs: the gpu-preset GPT (6 x 384, B=64, T=256) steps in 7.2 ms with them vs 11.2 ms with plain
        # compile and 11.4 ms for nanoGPT + compile on the same H100 (benchmarks/bench_train.py --steps).
        mode = "reduce-overhead" if dev.type == "cuda" else "off"
    if dev.type != "cuda" and interpreting():
        return "off"
    return mode


def compile_model(model: torch.nn.Module, mode: str, dev: torch.device) -> str:
    """Compile `model` in place (``model.compile``) for `mode`; returns the resolved mode."""
    mode = resolve_compile(mode, dev)
    if mode != "off":
        model.compile(mode=None if mode == "default" else mode)
    return mode
