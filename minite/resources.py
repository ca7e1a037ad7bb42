"""What this machine gives a run: CPU threads worth using, and memory enough for the batch asked for.

    pick_threads(model, batch_size, block)   the faster of all cores and one, timed (minite.train, minite.sample)
    check_memory(cfg, block, dims, device)   refuse a batch that cannot fit, before anything is allocated
"""
from __future__ import annotations

import copy
import os
import time

import torch

from minite.errors import ConfigError

__all__ = ["pick_threads", "free_bytes", "check_memory"]


def pick_threads(model, batch_size: int, block: int) -> int:
    """The faster of "all cores" and 1 thread, timed on a throwaway copy of the model (RNG untouched).

    On a quiet machine all cores win (~1.5x on 2). When other processes share the cores, OpenMP threads wait for
    each other at every op and a 2-thread run can be 10x slower than a 1-thread one (measured on 2 shared cores).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    timings = {}
    with torch.random.fork_rng(devices=[]):
        x = torch.randint(0, model.config.vocab_size, (batch_size, block))
        for n in (cores, 1):
            torch.set_num_threads(n)
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=0.0)
            for i in range(5):  # 2 warm-up steps, 3 timed
                if i == 2:
                    t0 = time.perf_counter()
                m(x, x)[1].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
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
