"""torch.compile in minite: the training model's compile mode, and the launch of a Triton kernel inside a graph.

``python -m minite.train --train.compile=MODE`` compiles the training model in place, one region at a time
(``compile_regions``): torch.compile wraps each transformer block, not the whole model. Every block runs the same
code (``Block.forward``) on tensors of the same shapes, and since torch 2.5 Dynamo treats a module's parameters as
graph inputs, so the first block's graph is traced and built once and every other block runs it: compile time no
longer grows with n_layer (torchtitan does the same). The ends of the model (embedding, final norm, head, loss) run
eagerly, a handful of kernels. ``CompileClock`` splits a run's time into compiling and steady state.

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
import math
import sys
import threading
import time

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
        compile_regions(model, mode)
    return mode


BACKEND = "inductor"  # what compile_model hands the graphs to (tests count them with "eager" or a backend of theirs)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks: GPT.blocks (a TP GPT's too), a pipeline stage's; [] if none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleDict):
        return list(blocks.values())
    return list(blocks) if isinstance(blocks, (torch.nn.ModuleList, list, tuple)) else []


def compile_regions(model: torch.nn.Module, mode: str = "default", backend=None) -> int:
    """torch.compile each block in place (``Module.compile``: state_dict keys unchanged); a model without blocks is
    compiled whole. Returns the number of compiled regions. backend: None = BACKEND with `mode`'s options, else
    a torch.compile backend (e.g. "aot_eager", or a function that counts the graphs it is given)."""
    backend = backend or BACKEND
    kw = {"mode": None if mode == "default" else mode} if backend == "inductor" else {}
    regions = blocks_of(model) or [model]
    for region in regions:
        region.compile(backend=backend, **kw)
    return len(regions)


def graphs_compiled() -> int:
    """Graphs Dynamo has built in this process so far (a recompile counts; a cache hit does not)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class CompileClock:
    """A job's time split into compiling and steady state, and what the user is told meanwhile.

    ``with clock.timed(steps):`` around every training step (steps=1) and evaluation (steps=0): a call during which
    Dynamo built a graph counts as compiling (the trace, Inductor's and Triton's builds and that first run), every
    other training step as steady state. ``start(mode, regions, bar)`` says that the model compiles: a line, and
    the progress bar's description with its clock ticking (a compile holds the main thread for seconds);
    ``first_step(t0)`` ends that and says how long it took."""

    def __init__(self):
        self.compile_s = 0.0  # seconds of the calls that compiled
        self.graphs = 0  # graphs they built
        self.steady_s = 0.0  # seconds of the training steps that did not compile
        self.steady_steps = 0
        self.first_step_s = math.nan  # seconds from the job's start to the end of its first step
        self._tick, self._say, self._bar = contextlib.ExitStack(), None, None
        self.tick_s = 1.0  # the bar's clock moves this often while compiling

    @contextlib.contextmanager
    def timed(self, steps: int = 1):
        g, t0 = graphs_compiled(), time.perf_counter()
        yield
        dt, new = time.perf_counter() - t0, graphs_compiled() - g
        if new:
            self.compile_s += dt
            self.graphs += new
        elif steps:
            self.steady_s += dt
            self.steady_steps += steps

    def start(self, mode: str, regions: int, bar=None) -> None:
        if mode == "off":
            return
        self._bar = bar
        self._say = lambda msg: ((print if bar is None else bar.write)(msg), sys.stdout.flush())
        what = f"one graph for all {regions} blocks" if regions > 1 else "the model"
        self._say(f"minite.train: compiling (torch.compile {mode}, {what}): the first evaluation and step wait for "
                  "Dynamo, Inductor and Triton")
        if bar is not None:
            bar.set_description_str("compiling")
            self._tick.enter_context(ticking(bar.refresh, self.tick_s))

    def first_step(self, t0: float) -> None:
        self.first_step_s = time.perf_counter() - t0
        self.stop()
        if self._say is not None:
            if self._bar is not None:
                self._bar.set_description_str("")
            self._say(f"minite.train: compiled in {self.compile_s:.1f} s ({self.graphs} graphs); first step done "
                      f"{self.first_step_s:.1f} s after the start")

    def stop(self) -> None:
        self._tick.close()

    def rate(self, tokens_per_step: int, steps: int, train_s: float) -> float:
        """Tokens/s of the steps that compiled nothing; of all `steps` in `train_s` if every one compiled."""
        if self.steady_steps:
            return tokens_per_step * self.steady_steps / max(self.steady_s, 1e-9)
        return tokens_per_step * steps / max(train_s, 1e-9)

    def summary(self) -> dict:
        return {"compile_time_s": self.compile_s, "compile_graphs": self.graphs, "steady_steps": self.steady_steps,
                "steady_time_s": self.steady_s, "first_step_s": self.first_step_s}


@contextlib.contextmanager
def ticking(refresh, every: float = 1.0):
    """Call refresh() every `every` seconds from a daemon thread while the body runs: a progress bar whose clock
    moves during a compile that holds the main thread for seconds."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [refresh() for _ in iter(lambda: stop.wait(every), True)], daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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
