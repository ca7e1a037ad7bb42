"""torch.compile in minite: the training model's compile mode, and the launch of a Triton kernel inside a graph.

``python -m minite.train --train.compile=MODE`` compiles the training model in place.

MODE: ``auto`` (``reduce-overhead`` on CUDA for bf16/fp32 runs of at least 500 steps, else ``off``), ``off``,
``default``, ``reduce-overhead`` (CUDA graphs: pays for a small, launch-bound model),
``max-autotune-no-cudagraphs``. ``nn.Module.compile`` compiles in place, so
the state_dict keys (checkpoints) are unchanged. minite's Triton kernels stay in the graph on CUDA: they are
registered as ``torch.ops.minite.*`` custom ops (``register_op``, kernels/_common.py), whose bodies launch their
kernels through ``launchable`` (below). Under the CPU interpreter nothing is compiled (``wrap_triton`` refuses
interpreted kernels).
"""
from __future__ import annotations

import contextlib
import threading

import torch

from minite._triton import HAS_TRITON, interpreting

MODES = ("auto", "off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


AUTO_MIN_STEPS = 500  # compile warm-up ~25 s on an H100, paid back by ~50 ms/step saved after ~500 steps


def resolve_compile(mode: str, dev: torch.device, max_iters: int = AUTO_MIN_STEPS, precision: str = "auto") -> str:
    """The mode actually used. "auto" -> "reduce-overhead" on CUDA when the run has at least AUTO_MIN_STEPS steps
    and its precision is bf16/fp32 (fp16 loss scaling and fp8 recipes are not validated under torch.compile),
    else "off". CPU + interpreter -> "off" whatever the mode."""
    if mode not in MODES:
        raise ValueError(f"train.compile={mode!r}: expected one of {MODES}")
    if mode == "auto":
        # CUDA graphs: the gpu-preset GPT (6 x 384, B=64, T=256) stepped in 7.2 ms with them vs 11.2 ms with plain
        # compile, 58.9 ms eager, and 11.4 ms for nanoGPT + compile on the same H100 (bench_train.py --steps).
        ok = dev.type == "cuda" and max_iters >= AUTO_MIN_STEPS and precision in ("auto", "bf16", "fp32")
        mode = "reduce-overhead" if ok else "off"
    if dev.type != "cuda" and interpreting():
        return "off"
    return mode


def compile_model(model: torch.nn.Module, t, dev: torch.device) -> str:
    """Compile `model` in place (``model.compile``) for the TrainConfig `t`; returns the resolved mode."""
    mode = resolve_compile(t.compile, dev, t.max_iters, t.precision)
    if t.compile == "auto" and mode == "off" and dev.type == "cuda" and t.precision in ("fp16", "fp8"):
        print(f"train.compile=auto -> off for --precision {t.precision}: its loss scaler / FP8 scaling state is "
              "not validated under torch.compile on a GPU yet; pass --train.compile=default to try it")
    if mode != "off":
        model.compile(mode=None if mode == "default" else mode)
    return mode


def eager_mode():
    """Context: run a compiled module eagerly (sampling: a new prompt length every step would recompile)."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


# --------------------------------------------------------------------- Triton kernels inside torch.compile
_TRACING = threading.local()  # .on: inside the body of a registered op (kernels/_common.py, register_op)


@contextlib.contextmanager
def traceable():
    """Inside: launchers launch through ``wrap_triton`` (set by the bodies of the ``torch.ops.minite.*`` ops, which
    torch.compile traces). Outside, eager launches skip it: wrap_triton's dispatch costs ~0.2 ms per launch
    (H100 machine, benchmarks/probe_overhead.py), more than the kernel of a small op."""
    old, _TRACING.on = getattr(_TRACING, "on", False), True
    try:
        yield
    finally:
        _TRACING.on = old


def launchable(kernel):
    """``kernel[grid](...)`` that torch.compile can trace inside a ``triton_op`` (CUDA), or the plain kernel."""
    if not HAS_TRITON or interpreting() or not getattr(_TRACING, "on", False):
        return kernel
    return torch.library.wrap_triton(kernel)
