"""What this machine gives a run: CPU threads worth using, and memory enough for the batch asked for.

    pick_threads(model, batch_size, block)   the faster of all cores and one for training steps: timed within a
                                             budget (3 s), then cached per machine and model size (minite.train)
    pick_decode_threads(model, batch_size, prompt_len)   the same for generation (minite.sample)
    check_memory(cfg, block, dims, device)   refuse a batch that cannot fit, before anything is allocated
"""
from __future__ import annotations

import copy
import json
import os
import platform
import socket
import time
from pathlib import Path
from time import time as _wall_clock  # the cache's timestamps (tests replace `time` with a fake perf_counter)

import torch

from minite._triton import interpreting
from minite.backend import resolve_backend
from minite.errors import ConfigError

__all__ = ["pick_threads", "pick_decode_threads", "threads_note", "free_bytes", "check_memory", "THREAD_BUDGET_S",
           "last_pick"]

THREAD_BUDGET_S = 3.0  # what timing thread counts may cost before a run's first line (issue 37: it was ~27 s)
CACHE_MAX_AGE_S = 24 * 3600  # a pick older than a day is timed again (the machine's load changes)
last_pick = ""  # how the last pick_threads chose: "picked in 2.1 s", "cached", "one core" (minite.train prints it)


def pick_threads(model, batch_size: int, block: int, *, budget_s: float = THREAD_BUDGET_S, cache: bool = True) -> int:
    """The faster of "all cores" and 1 thread for training steps, timed on a throwaway copy of the model (RNG
    untouched) within about `budget_s` seconds, and remembered (``cache``) in ``<cache dir>/minite/threads.json``
    per machine, cores, model size, batch and block for a day. When the load average already exceeds the cores
    (other processes want them all), 1, untimed: there a single all-cores step can outlast any budget (12 s,
    against 0.55 s for 1 thread, on 2 cores at load 11). ``last_pick`` says which it was.

    On a quiet machine all cores win (~1.5x on 2). When other processes share the cores, OpenMP threads wait for
    each other at every op and a 2-thread run can be 10x slower than a 1-thread one (measured on 2 shared cores).
    """
    global last_pick
    if _cores() == 1:
        last_pick = "one core"
        return 1
    key = _cache_key(model, batch_size, block)
    if cache and (n := _cache_get(key)) is not None:
        last_pick = "cached"
        return n
    load = _load()
    if load is not None and load >= _cores() + 1:  # more runnable processes than cores, besides this one: there
        last_pick = f"load {load:.1f} on {_cores()} cores, not timed"  # one all-cores step took 12 s, 1 thread 0.55
        return 1  # (not cached: the load passes)
    x = torch.randint(0, model.config.vocab_size, (batch_size, block), generator=torch.Generator().manual_seed(0))

    def steps():  # a fresh copy and optimizer per thread count: each times the same steps
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=0.0)

        def step():
            m(x, x)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    t0 = time.perf_counter()
    n = _fastest(steps, budget_s=budget_s)
    last_pick = f"picked in {time.perf_counter() - t0:.1f} s"
    if cache:
        _cache_put(key, n)
    return n


def threads_note(told: int, dev: torch.device, parallel: bool) -> str:
    """What minite.train's first line adds after its thread count: how pick_threads chose it, when it did."""
    return f" ({last_pick})" if dev.type == "cpu" and not told and not parallel and last_pick else ""


def _load() -> float | None:
    """The 1-minute load average (runnable processes, this one included), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cache_file() -> Path:
    """Where picks are remembered: $MINITE_CACHE_DIR, else $XDG_CACHE_HOME/minite, else ~/.cache/minite."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minite"
    return Path(os.environ.get("MINITE_CACHE_DIR") or base) / "threads.json"


def _cache_key(model, batch_size: int, block: int) -> str:
    params = sum(p.numel() for p in model.parameters())
    return (f"{socket.gethostname()}|{platform.machine()}|cores={_cores()}|params={params}|batch={batch_size}|"
            f"block={block}|torch={torch.__version__}")


def _cache_read() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}  # none yet, unreadable or corrupt: time again


def _cache_get(key: str) -> int | None:
    e = _cache_read().get(key)
    ok = isinstance(e, dict) and isinstance(e.get("threads"), int) and e["threads"] >= 1
    return e["threads"] if ok and 0 <= _wall_clock() - float(e.get("at", 0)) < CACHE_MAX_AGE_S else None


def _cache_put(key: str, n: int) -> None:
    f = cache_file()
    entries = _cache_read()
    entries[key] = {"threads": n, "at": _wall_clock()}
    try:  # a read-only home only costs the next run its timing
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(f)  # atomic: two runs starting at once never read half a file
    except OSError:
        pass


def pick_decode_threads(model, batch_size: int, prompt_len: int, *, new_tokens: int = 8,
                        use_cache: bool = True) -> int:
    """The faster of "all cores" and 1 thread for generation (minite.sample): `new_tokens` tokens decoded after a
    prompt of `prompt_len`, `batch_size` rows at once (RNG untouched). One token at a time is small ops: under
    load, 1 thread was 2.7x faster than 2 on 2 shared cores (issue 26: 4.4 s vs 11.7 s). Kernels on the Triton
    interpreter (TRITON_INTERPRET=1, backend auto or triton): 1, untimed (a 15-token sample took 11 s with 1 thread
    and 137 s with the 2-thread probe on 2 busy cores)."""
    p = next(model.parameters())
    if interpreting() and resolve_backend(p, getattr(model, "backend", None)) == "triton":
        return 1
    x = torch.zeros(batch_size, max(1, min(prompt_len, model.config.block_size)), dtype=torch.long, device=p.device)

    @torch.no_grad()
    def decode():
        model.generate(x, new_tokens, temperature=0.0, use_cache=use_cache)
    return _fastest(lambda: decode)


def _cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fastest(make_work, *, warmup: int = 2, timed: int = 3, budget_s: float = THREAD_BUDGET_S) -> int:
    """All cores or 1: the thread count under which the work runs faster. make_work() -> work, a callable, made
    once per thread count. 1 thread first (its cost is predictable): up to `warmup` untimed steps (until a quarter
    of the budget is spent), then up to `timed` timed ones (until half is). Then all cores, on shapes already warm:
    timed steps until one of them shows it 2x slower than 1 thread (on shared cores a 2-thread step took 2-12 s
    where 1 thread took 0.55 s), or the rest of the budget is spent. Cost: the budget, or when steps are longer
    than that, 2 one-thread steps and 1 all-cores step. One core: 1, untimed."""
    counts = sorted({1, _cores()})
    if len(counts) == 1:
        return 1
    per_step = {}
    begin = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        for n in counts:
            torch.set_num_threads(n)
            work = make_work()
            for _ in range(warmup if n == 1 else 0):  # allocation, lazy initialisation: untimed
                work()
                if time.perf_counter() - begin >= budget_s / 4:
                    break
            t0, done = time.perf_counter(), 0
            while done < timed:
                work()
                done += 1
                per_step[n] = (time.perf_counter() - t0) / done
                spent = time.perf_counter() - begin
                if spent >= (budget_s / 2 if n == 1 else budget_s) or (n > 1 and per_step[n] > 2 * per_step[1]):
                    break
    return min(per_step, key=per_step.get)


def free_bytes(dev: torch.device) -> int | None:
    """Memory this rank may use: free GPU memory, or the host's available memory shared by its local ranks."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None  # not Linux: no check
    return kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_memory(cfg, block: int, dims, dev: torch.device) -> None:
    """Refuse a batch that cannot fit before anything is allocated (the kernel's OOM killer says nothing).

    A lower bound of what one micro-batch keeps for the backward on one rank: per token, each of its layers
    saves at least its input (C values; 4C + 2 x mlp_hidden without recompute), and the logits with their
    gradient take 2 x V fp32 values. A real step needs more: a refusal is never wrong."""
    m = cfg.model
    t = cfg.train
    d = dims
    tokens = t.batch_size * block // (d.dp * d.cp)
    per_layer = m.n_embd if t.recompute == "full" else 4 * m.n_embd + 2 * m.mlp_hidden
    fp32 = t.precision == "fp32" or (t.precision == "auto" and dev.type != "cuda")
    width = 4 if fp32 else 2  # bytes per saved activation
    need = tokens * (m.n_layer // d.pp * per_layer * width + 2 * m.padded_vocab_size * 4) // d.tp
    free = free_bytes(dev)
    if free is not None and need > free:
        raise ConfigError(f"--train.batch_size={t.batch_size} x {block} tokens needs at least "
                          f"{need / 2**30:.1f} GiB of activations per rank, more than the {free / 2**30:.1f} GiB "
                          f"free on {dev}; lower --train.batch_size (--train.grad_accum keeps the tokens per step)")
