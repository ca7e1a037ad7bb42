"""What every concept file shares: the compute dtype, launch settings, the device's SM count, and the bridge to
``torch.compile`` (``wrap_triton`` / ``torch.library.triton_op``).

One helper per question, so the kernels cannot drift apart:

* ``compute_dtype(dtype)`` / ``tl_compute_dtype(dtype)``: fp32, or fp64 for fp64 input (gradcheck), as torch and
  Triton dtypes; ``_acc`` is the same rule inside a kernel.
* ``row_launch(n_cols, max_block)``: (BLOCK_SIZE, num_warps) for one row per program (norms, softmax, CE, SwiGLU).
* ``sm_count(device)``: multiprocessors, read once per device and cached (a driver query per call costs ~10 us).
* ``launchable(kernel)``: the kernel wrapped by ``torch.library.wrap_triton`` on CUDA, so ``torch.compile`` can
  trace a launcher registered with ``triton_op``; the plain kernel under ``TRITON_INTERPRET=1`` (wrap_triton
  refuses interpreted kernels, pytorch#152868).
* ``use_op(name)``: True while ``torch.compile`` traces and the op ``minite::name`` is registered: the autograd
  Functions then call ``torch.ops.minite.<name>`` so that the kernel lands in the graph instead of breaking it.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

from minite._triton import HAS_TRITON, interpreting, tl, triton

__all__ = ["compute_dtype", "tl_compute_dtype", "row_launch", "sm_count", "launchable", "traceable", "op", "use_op",
           "REGISTERED", "_acc"]

REGISTERED: set[str] = set()  # names of the minite:: custom ops registered (filled by kernels/_library.py)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and accumulators use: fp32, or fp64 when the input is fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_compute_dtype(dtype: torch.dtype):
    """``compute_dtype`` as a Triton dtype, for an ``ACC: tl.constexpr`` kernel argument."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def row_launch(n_cols: int, max_block: int | None = None) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for a program that holds `n_cols` columns (capped at `max_block`) of one row.

    BLOCK_SIZE is the next power of 2 (tl.arange needs one), at least 16. num_warps keeps about 8-16 fp32 values
    per thread and per live array: 4 warps up to 1024 columns, then doubling to 32 warps at 16384 and beyond
    (H100: a 16384-wide LayerNorm backward spilled registers at 16 warps, 9.96 ms instead of ~1.5 ms).
    """
    block = max(16, triton.next_power_of_2(max(int(n_cols), 1)))
    if max_block is not None:
        block = min(block, max_block)
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16 if block <= 8192 else 32
    return block, num_warps


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device); 4 on the CPU interpreter (few programs,
    each one ~0.5 ms there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_TRACE = threading.local()


@contextlib.contextmanager
def traceable():
    """Inside: launchers launch through ``wrap_triton`` (set by the ``torch.ops.minite.*`` wrappers, whose bodies
    torch.compile traces). Outside, eager launches skip it: wrap_triton's dispatch costs ~0.2 ms per launch
    (H100 machine, benchmarks/probe_overhead.py), more than the kernel of a small op."""
    old, _TRACE.on = getattr(_TRACE, "on", False), True
    try:
        yield
    finally:
        _TRACE.on = old


def launchable(kernel):
    """``kernel[grid](...)`` that torch.compile can trace inside a ``triton_op`` (CUDA), or the plain kernel."""
    if not HAS_TRITON or interpreting() or not getattr(_TRACE, "on", False):
        return kernel
    return torch.library.wrap_triton(kernel)


def use_op(name: str) -> bool:
    """Call the registered custom op ``torch.ops.minite.<name>``? True only while torch.compile traces, on a
    machine where the ops are registered (Triton on CUDA, not the interpreter). Eager calls skip the dispatcher
    (~10 us per call) and run the launcher directly."""
    return name in REGISTERED and torch.compiler.is_compiling()


def op(name: str, launcher):
    """``torch.ops.minite.<name>`` while torch.compile traces (the kernel stays in the graph), else `launcher`."""
    return getattr(torch.ops.minite, name) if use_op(name) else launcher


@triton.jit
def _acc(x, FP64: tl.constexpr):
    # Upcast right after a load: accumulate in fp32 (fp64 when given fp64, for gradcheck). Never compute in
    # bf16: its arithmetic is wrong under the CPU interpreter and slow on some GPUs.
    # tl.cast, not .to: it also takes a float scalar argument (fp32 in an eager launch, fp64 under Inductor).
    if FP64:
        return tl.cast(x, tl.float64)
    else:
        return tl.cast(x, tl.float32)
