"""Shared pieces of the benchmark scripts: device name and slug, peak HBM bandwidth, timing, tables, JSON results.

Every ``bench_<concept>.py`` imports it as ``import common`` after putting its own folder on ``sys.path``, so
``python benchmarks/bench_x.py`` (from any folder) and ``python -m benchmarks.bench_x`` both work. The name does
not start with ``bench_``: ``make bench`` runs every ``benchmarks/bench_*.py``.
"""
from __future__ import annotations

import gc
import json
import platform
import re
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# HBM bandwidth peaks (bytes/s) by device-name substring; the first match wins. H100 SXM: 3.35 TB/s.
PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.039e12), ("L40S", 0.864e12)]
DEFAULT_PEAK = 3.35e12  # unknown device: report against the H100 number, and say so in the JSON


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (for result file names)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_name(dev: str = "cuda") -> str:
    """The GPU's name for a CUDA device; for the CPU its model name (from /proc/cpuinfo) and torch's threads."""
    if dev.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(dev))
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


def peak_bandwidth(name: str) -> tuple[float, str]:
    """(peak HBM bytes/s, the table key it came from) for a device name."""
    for key, bw in PEAK_BW:
        if key in name:
            return bw, key
    return DEFAULT_PEAK, "H100 (default; device not in the table)"


def require_cuda(script: str) -> bool:
    """True on a CUDA machine; elsewhere print why the benchmark does nothing (the caller then exits 0)."""
    if torch.cuda.is_available():
        return True
    print(f"{script}: no CUDA device found; this benchmark runs on a GPU only (nothing to do on CPU).")
    return False


# ------------------------------------------------------------------------------------------------- timing
_STREAM = None
TIMER = "graph"  # "graph": CUDA-graph replays (kernel time, no Python/launch overhead); "eager": plain calls


def _do_bench_eager(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench as _do_bench  # GPU only: needs an active driver, so imported on use

    return _do_bench(fn, grad_to_none=grad_to_none, return_mode="median")


def _do_bench_graph(fn, grad_to_none=None, reps: int = 50) -> float:
    """Median ms of replaying a CUDA graph of one fn() call, L2 flushed before each replay (like do_bench).

    The graph removes the CPU side (Python, autograd, launch latency) from every implementation alike, so the
    number is what the kernels cost on the GPU. Grads in `grad_to_none` are reset before the capture, so the
    captured backward writes (does not accumulate into) them."""
    global _STREAM
    _STREAM = stream = _STREAM or torch.cuda.Stream()  # one side stream for every capture of the process
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compiles, autotunes, allocator pools
            for t in grad_to_none or []:
                t.grad = None
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    for t in grad_to_none or []:
        t.grad = None
    dev, prev_stream = torch.cuda.current_device(), torch.cuda.current_stream()
    pool = torch.cuda.graph_pool_handle()  # our own pool id: after a failed capture only we can release it
    rng = torch.cuda.get_rng_state(dev)
    g, failure = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(g, pool=pool):
            fn()
    except Exception as e:  # keep only the message: the traceback's frames hold tensors of the capture's pool
        failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"
    if failure is not None:
        _recover_from_failed_capture(g, dev, pool, rng, prev_stream, grad_to_none)
        raise RuntimeError(f"CUDA graph capture failed ({failure})")
    torch.cuda.synchronize()
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")  # > L2: flush between replays
    times = []
    for _ in range(reps):
        cache.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _recover_from_failed_capture(g, dev: int, pool, rng_state, stream, grad_to_none) -> None:
    """Undo what a failed ``torch.cuda.graph`` capture leaves behind, so the process can go on (eagerly).

    When the capture is invalidated (a host sync, an illegal call inside fn), ``CUDAGraph.capture_end`` raises at
    ``cudaStreamEndCapture``, before its bookkeeping (torch/csrc ATen/cuda/CUDAGraph.cpp), so:
    * the allocator still counts the capture's private pool as in use (``capture_ended_`` is false, so the graph's
      reset/destructor never releases it): every failed capture leaked its pool (76 GiB reserved in private
      pools, then an OOM, on the H100). We end and release the pool ourselves, as ``torch.cuda.use_mem_pool``
      does at exit, then ``empty_cache`` returns it;
    * the default CUDA generator stays in capture mode (the epilogue never ran): the next ``torch.randn`` raised
      "Offset increment outside graph capture encountered unexpectedly". We give it a fresh state
      (``graphsafe_set_state``) and restore the seed/offset saved before the capture;
    * ``torch.cuda.graph.__exit__`` never restored the caller's stream.
    Every step is best effort: torch versions differ in what a failed capture leaves.
    """
    torch.cuda.set_stream(stream)
    for t in grad_to_none or []:  # grads written during the capture live in its pool
        t.grad = None
    gc.collect()
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    try:
        g.pool()  # succeeds only if capture_end got far enough: then the graph's destructor releases the pool
        ended = True
    except RuntimeError:
        ended = False
    del g
    if not ended:
        for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
            try:
                getattr(torch._C, name)(dev, pool)
            except (AttributeError, RuntimeError):
                pass  # not allocating to that pool any more / binding absent in this torch
    gen = torch.cuda.default_generators[dev]
    if hasattr(gen, "graphsafe_set_state"):
        gen.graphsafe_set_state(torch.Generator(device=f"cuda:{dev}"))
    torch.cuda.set_rng_state(rng_state, dev)
    gc.collect()
    torch.cuda.empty_cache()


def do_bench(fn, grad_to_none=None, eager: bool = False) -> float:
    """Milliseconds per call of fn: CUDA-graph replay when TIMER == "graph" and fn can be captured (a host sync
    inside fn cannot), else triton.testing.do_bench (median, L2 flushed). `grad_to_none`: grads reset per call.
    eager=True: always the eager timer (for code known to sync with the host, e.g. Liger's CE). A failed capture
    is cleaned up (its memory pool released, the CUDA RNG and the current stream restored: see
    `_recover_from_failed_capture`) and fn is timed eagerly instead. Leaf tensors timed with grads must not have
    been used in a graph on another stream before (their AccumulateGrad node would tie the capture to that
    stream)."""
    if TIMER == "graph" and not eager:
        try:
            return _do_bench_graph(fn, grad_to_none)
        except Exception as e:  # capture refused (a .item() / host sync inside): time it eagerly, and say so
            print(f"  (not capturable, timed eagerly: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})")
            torch.cuda.synchronize()
    return _do_bench_eager(fn, grad_to_none)


def fwd_bwd_ms(fwd, fwd_bwd, grads: list, bench=None) -> dict[str, float]:
    """{"fwd": ms of fwd(), "fwd+bwd": ms of fwd_bwd()}; the .grad of `grads` is reset before each backward."""
    bench = bench or do_bench
    return {"fwd": bench(fwd), "fwd+bwd": bench(fwd_bwd, grad_to_none=grads)}


def strict_compile(fn, **kwargs):
    """torch.compile(fn, dynamic=False) that fails loudly instead of silently running eager: raises the
    recompile limit (one graph per shape and per requires_grad) and turns hitting it into an error."""
    import torch._dynamo.config as dc

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, key):
            setattr(dc, key, max(getattr(dc, key), 256))
    if hasattr(dc, "fail_on_recompile_limit_hit"):
        dc.fail_on_recompile_limit_hit = True
    return torch.compile(fn, dynamic=False, **kwargs)


def add_timer_args(p) -> None:
    p.add_argument("--timer", default="graph", choices=["graph", "eager"],
                   help="graph: CUDA-graph replays (kernel time); eager: plain calls (includes launch overhead)")


def set_timer(name: str) -> None:
    global TIMER
    TIMER = name


# ------------------------------------------------------------------------------------------------- output
def print_bandwidth_table(results: list[dict], key_cols: list[tuple[str, int]], peak: float, *, rate: str = "GBps",
                          base_impl: str = "eager", base_label: str = "eager", ms_fmt: str = "9.4f",
                          rate_width: int = 8) -> None:
    """Print one line per result of a memory-bound op: key columns, mode, impl, ms, GB/s, % of `peak` (bytes/s)
    and the speedup over `base_impl` at the same key columns and mode.

    key_cols: [(result key, column width)], e.g. [("C", 6)]; `rate`: the result key holding GB/s. Adds
    r["pct_peak"] and r[f"speedup_vs_{base_label}"] to every result, so they are saved in the JSON too.
    """
    cols = [*key_cols, ("mode", 8), ("impl", 14)]
    ms_width = int(ms_fmt.split(".")[0])
    speedup = f"speedup_vs_{base_label}"
    base = {tuple(r[k] for k, _ in cols[:-1]): r["ms"] for r in results if r["impl"] == base_impl}
    print(" ".join(f"{k:>{w}}" for k, w in cols)
          + f" {'ms':>{ms_width}} {'GB/s':>{rate_width}} {'% peak':>7} {'vs ' + base_label:>9}")
    for r in results:
        r["pct_peak"] = 100 * r[rate] * 1e9 / peak
        r[speedup] = base[tuple(r[k] for k, _ in cols[:-1])] / r["ms"]
        print(" ".join(f"{r[k]:>{w}}" for k, w in cols)
              + f" {r['ms']:>{ms_fmt}} {r[rate]:>{rate_width}.0f} {r['pct_peak']:>6.1f}% {r[speedup]:>8.2f}x")


def results_path(concept: str, device: str, out: str | Path | None = None) -> Path:
    """`out` if given, else benchmarks/results/<concept>_<device-name-slug>.json."""
    return Path(out) if out else RESULTS / f"{concept}_{slug(device)}.json"


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def save_results(concept: str, results: list[dict], *, device: str, out: str | Path | None = None,
                 **meta) -> Path:
    """Save {"device", "torch", "triton", **meta, "results"} as JSON (see `results_path`) and print where."""
    from minite._triton import triton

    payload = {"device": device, "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
               "timer": TIMER, **meta, "results": results}
    path = write_json(results_path(concept, device, out), payload)
    print(f"saved {path}")
    return path


def save_plot(concept: str, device: str, draw, out: str | Path | None = None) -> Path | None:
    """Save a PNG beside the JSON (same name, .png): draw(fig) fills the figure; the title names the device."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib missing: the JSON is the result, the plot a convenience
        print(f"(no plot: {type(e).__name__}: {e})")
        return None
    fig = plt.figure(figsize=(11, 4.5))
    draw(fig)
    fig.suptitle(f"{concept} on {device}, torch {torch.__version__} ({TIMER} timer)", fontsize=10)
    fig.tight_layout()
    path = results_path(concept, device, out).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"saved {path}")
    return path


def bandwidth_plot(results: list[dict], key: str, peak: float, rate: str = "GBps", panels=("fwd", "fwd+bwd"),
                   group: str | None = None):
    """draw(fig) for save_plot: % of HBM peak against `key`, one line per implementation, one panel per mode
    (and per value of `group`, e.g. the op)."""
    groups = sorted({r[group] for r in results}) if group else [None]

    def draw(fig):
        n = len(groups) * len(panels)
        for i, (g, mode) in enumerate((g, m) for g in groups for m in panels):
            ax = fig.add_subplot(1, n, i + 1)
            rows = [r for r in results if r["mode"] == mode and (g is None or r[group] == g)]
            for impl in dict.fromkeys(r["impl"] for r in rows):
                pts = sorted((r[key], 100 * r[rate] * 1e9 / peak) for r in rows if r["impl"] == impl)
                ax.plot([str(p[0]) for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_title(f"{g + ' ' if g else ''}{mode}", fontsize=9)
            ax.set_xlabel(key)
            ax.set_ylabel("% of HBM peak")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return draw
