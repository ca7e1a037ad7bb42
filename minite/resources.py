"""What this machine gives a run: CPU threads worth using, and memory enough for the batch asked for.

    pick_threads(model, batch_size, block)   the faster of all cores and one for training steps, timed (minite.train)
    pick_decode_threads(model, batch_size, prompt_len)   the same for generation (minite.sample)
    check_memory(cfg, block, dims, device)   refuse a batch that cannot fit, before anything is allocated
"""
from __future__ import annotations

import copy
import os
import time

import torch

from minite._triton import interpreting
from minite.backend import resolve_backend
from minite.errors import ConfigError

__all__ = ["pick_threads", "pick_decode_threads", "free_bytes", "check_memory"]


def pick_threads(model, batch_size: int, block: int) -> int:
    """The faster of "all cores" and 1 thread for training steps, timed on a throwaway copy of the model (RNG
    untouched).

    On a quiet machine all cores win (~1.5x on 2). When other processes share the cores, OpenMP threads wait for
    each other at every op and a 2-thread run can be 10x slower than a 1-thread one (measured on 2 shared cores).
    """
    x = torch.randint(0, model.config.vocab_size, (batch_size, block), generator=torch.Generator().manual_seed(0))

    def steps():  # a fresh copy and optimizer per thread count: each times the same steps
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=0.0)

        def step():
            m(x, x)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return _fastest(steps)


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


def _fastest(make_work, *, warmup: int = 2, timed: int = 3) -> int:
    """All cores or 1: the thread count under which the work runs faster. make_work() -> work, a callable, made
    once per thread count; work() runs `warmup` times untimed, then `timed` times timed. One core: 1, untimed."""
    counts = sorted({_cores(), 1}, reverse=True)
    if len(counts) == 1:
        return 1
    timings = {}
    with torch.random.fork_rng(devices=[]):
        for n in counts:
            torch.set_num_threads(n)
            work = make_work()
            for i in range(warmup + timed):
                if i == warmup:
                    t0 = time.perf_counter()
                work()
            timings[n] = time.perf_counter() - t0
    return min(timings, key=timings.get)


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
