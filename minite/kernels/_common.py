"""What every concept file shares: the compute dtype, launch settings, the device's SM count, and the bridge to
``torch.compile`` (``torch.library.triton_op`` + ``wrap_triton``).

One helper per question, so the kernels cannot drift apart:

* ``compute_dtype(dtype)`` / ``tl_compute_dtype(dtype)``: fp32, or fp64 for fp64 input (gradcheck), as torch and
  Triton dtypes; ``_acc`` is the same rule inside a kernel.
* ``row_launch(n_cols, max_block)``: (BLOCK_SIZE, num_warps) for one row per program (norms, softmax, CE, SwiGLU).
* ``sm_count(device)``: multiprocessors, read once per device and cached (a driver query per call costs ~10 us).
* ``gpu_tiles(t)``: pick the GPU's tiles for a launch on `t`? True on CUDA, and while the compile gate captures
  the GPU's launches on a CPU (``minite.gpu_compile``): every launcher asks this, never ``t.is_cuda``, so the gate
  compiles the tiles a GPU really runs.
* ``launchable(kernel)`` (from minite/compile.py, where formats/fp8.py takes it too): the kernel wrapped by
  ``torch.library.wrap_triton`` inside a registered op, so ``torch.compile`` can trace the launch; the plain kernel
  otherwise (eager calls, and under ``TRITON_INTERPRET=1``: wrap_triton refuses interpreted kernels, pytorch#152868).
* ``@register_op(name)``: on a launcher (section 3 of a concept file). Where real Triton kernels run (``ENABLED``:
  Triton, not the interpreter) it becomes the custom op ``torch.ops.minite.<name>`` (``torch.library.triton_op``),
  so ``torch.compile(fullgraph=True)`` keeps its kernels in the graph. The launcher itself is returned unchanged.
* ``register_autograd(name, backward, setup_context)``: the op's gradient (section 4), from the same two functions
  the concept's ``autograd.Function`` runs: each formula is written once.
* ``op(name, launcher)``: what the autograd Functions call: ``torch.ops.minite.<name>`` while torch.compile traces
  (the kernel lands in the graph instead of breaking it) and inside a registered op's backward, else the launcher
  (eager calls skip the dispatcher, ~10 us each).
"""
from __future__ import annotations

import functools
import inspect
import threading

import torch

from minite._triton import CAPTURE_GPU, HAS_TRITON, gpu_tiles, interpreting, tl, triton
from minite.compile import launchable, traceable

__all__ = ["compute_dtype", "tl_compute_dtype", "row_launch", "sm_count", "gpu_tiles", "CAPTURE_GPU", "launchable",
           "traceable", "register_op",
           "register_autograd", "calling_ops", "op", "use_op", "ENABLED", "REGISTERED", "OPS", "FORMULAS", "_acc"]

# Register the minite:: ops? Only where real (not interpreted) Triton kernels run: wrap_triton refuses interpreted
# ones (pytorch#152868). On a CPU machine without the interpreter they are registered but never called.
ENABLED = HAS_TRITON and not interpreting() and hasattr(torch.library, "triton_op")
REGISTERED: set[str] = set()  # names of the torch.ops.minite.* ops registered in this process
OPS: dict = {}  # name -> (op body, mutates_args) of every op declared, registered or not (tests/kernels/conftest.py)
FORMULAS: dict = {}  # name -> (backward, setup_context) of every op with a gradient


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
        return 132 if getattr(CAPTURE_GPU, "on", False) else 4  # the gate captures an H100's grid
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_CALLING = threading.local()  # .ns: the namespace whose ops op() returns, inside a registered backward


def use_op(name: str) -> bool:
    """Call the registered custom op ``torch.ops.minite.<name>``? True only while torch.compile traces, on a
    machine where the ops are registered (Triton on CUDA, not the interpreter). Eager calls skip the dispatcher
    (~10 us per call) and run the launcher directly."""
    return name in REGISTERED and torch.compiler.is_compiling()


def op(name: str, launcher):
    """``torch.ops.<ns>.<name>`` inside the backward of an op registered in namespace ns (see register_autograd),
    ``torch.ops.minite.<name>`` while torch.compile traces (the kernel stays in the graph), else `launcher`."""
    ns = getattr(_CALLING, "ns", None)
    if ns is not None:
        return getattr(getattr(torch.ops, ns), name)
    return getattr(torch.ops.minite, name) if use_op(name) else launcher


def register_op(name: str, *, mutates_args: tuple[str, ...] = (), eager_only: tuple[str, ...] = ()):
    """Decorator for a launcher: where ENABLED, ``torch.ops.minite.<name>`` becomes a ``torch.library.triton_op`` that
    runs it with its kernels launched through wrap_triton (``traceable``). Returns the launcher unchanged.

    The op's schema is the launcher's annotated signature without its defaults (compiled callers pass every
    argument) and without the parameters named in `eager_only` (a test's tile sizes, an output buffer).
    `mutates_args`: the tensors the op writes in place. Every op is also recorded in OPS, registered or not: the
    tests register the same bodies as CPU ops, where the interpreter runs them (tests/kernels/conftest.py)."""
    def register(launcher):
        sig = inspect.signature(launcher, eval_str=True)  # annotations as types, from the launcher's own module
        params = [p.replace(default=inspect.Parameter.empty) for p in sig.parameters.values()
                  if p.name not in eager_only]

        @functools.wraps(launcher)
        def body(*args, **kwargs):
            with traceable():
                return launcher(*args, **kwargs)

        body.__signature__ = sig.replace(parameters=params)  # what torch.library infers the schema from
        OPS[name] = (body, mutates_args)
        if ENABLED:
            torch.library.triton_op(f"minite::{name}", body, mutates_args=mutates_args)
            REGISTERED.add(name)
        return launcher
    return register


def calling_ops(ns: str, backward):
    """`backward` run as the registered backward of an op in namespace `ns`: the ops it calls through ``op()`` are
    ``torch.ops.<ns>.*`` (AOTAutograd traces it with FakeTensors, which a plain launcher cannot take)."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        old, _CALLING.ns = getattr(_CALLING, "ns", None), ns
        try:
            return backward(ctx, *grads)
        finally:
            _CALLING.ns = old
    return run


def register_autograd(name: str, backward, setup_context) -> None:
    """The gradient of op `name`: `setup_context(ctx, inputs, output)` saves what `backward(ctx, *grads)` needs, with
    the op's inputs and outputs. The concept's autograd.Function calls the same two functions: one formula."""
    FORMULAS[name] = (backward, setup_context)
    if name in REGISTERED:
        torch.library.register_autograd(f"minite::{name}", calling_ops("minite", backward),
                                        setup_context=setup_context)


@triton.jit
def _acc(x, FP64: tl.constexpr):
    # Upcast right after a load: accumulate in fp32 (fp64 when given fp64, for gradcheck). Never compute in
    # bf16: its arithmetic is wrong under the CPU interpreter and slow on some GPUs.
    # tl.cast, not .to: it also takes a float scalar argument (fp32 in an eager launch, fp64 under Inductor).
    if FP64:
        return tl.cast(x, tl.float64)
    else:
        return tl.cast(x, tl.float32)
