"""Naming the rank that failed a run, whoever launched it.

Under torchrun's agent a dead rank is named by the agent ("Root Cause ... rank: 1"). Launched any other way (a
rank per terminal with MASTER_ADDR/RANK set, a cluster scheduler, a killed process), the survivors see only the
transport's words: gloo's "Connection reset by peer" or "Timed out waiting ... for recv", naming no rank. So:

* every rank runs a heartbeat: a daemon thread that increments the counter ``minite/beat/<rank>`` in the run's
  rendezvous store once a second (``store.add``: a counter, so clocks of different nodes never matter);
* when an exception reaches the top of a process that is in a process group, the hook reads the counters twice,
  ``STALE_S`` apart, and names the ranks whose counter stood still: they are dead or frozen. A store that does not
  answer is itself the answer: its host, rank 0, is gone;
* a collective that timed out also asks the live ranks (gloo's ``monitored_barrier``) which of them are silent.
"""
from __future__ import annotations

import atexit
import datetime
import sys
import threading
import time

import torch.distributed as dist

__all__ = ["start", "stop", "stopped_ranks", "BEAT_S", "STALE_S"]

BEAT_S = 0.5  # a heartbeat every half second
STALE_S = 2.0  # a counter that does not move for this long belongs to a dead (or frozen) rank


_STOP = threading.Event()
_THREADS: list[threading.Thread] = []


def _key(rank: int) -> str:
    return f"minite/beat/{rank}"


def start() -> None:
    """The heartbeat of this rank, and the hook that names stopped ranks when this process dies of an error."""
    _install_hook()
    try:
        store = dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError):  # a process group without a store (tests that fake init_process_group)
        return
    rank = dist.get_rank()

    def beat():
        while True:
            try:
                store.add(_key(rank), 1)
            except Exception:  # the store's host is gone or the group was destroyed: nothing left to tell
                return
            if _STOP.wait(BEAT_S):
                return

    _STOP.clear()
    thread = threading.Thread(target=beat, daemon=True, name="minite-heartbeat")
    thread.start()
    _THREADS.append(thread)
    atexit.register(stop)  # a daemon thread still inside the store's C++ code at exit aborts the process


def stop() -> None:
    """End the heartbeat and wait for its thread (before the process exits or its group is destroyed)."""
    _STOP.set()
    while _THREADS:
        _THREADS.pop().join(timeout=5.0)


def stopped_ranks(world: int, wait_s: float = STALE_S) -> list[int] | None:
    """The ranks whose heartbeat stood still for `wait_s` seconds; None when the store does not answer (its
    host, rank 0, is gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        before = [store.add(_key(r), 0) for r in range(world)]
        time.sleep(wait_s)
        after = [store.add(_key(r), 0) for r in range(world)]
    except Exception:
        return None
    return [r for r in range(world) if after[r] == before[r]]


def _install_hook() -> None:
    previous = sys.excepthook

    def hook(kind, exc, tb):
        previous(kind, exc, tb)
        if not dist.is_initialized():
            return
        me = dist.get_rank()
        world = dist.get_world_size()
        if "Timed out" in str(exc) and dist.get_backend() == "gloo":
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=5), wait_all_ranks=True)
            except RuntimeError as e:
                print(f"[rank{me}] minite: a collective timed out; {e}", file=sys.stderr, flush=True)
        stopped = stopped_ranks(world)
        if stopped is None:
            why = "rank 0 is gone (it hosts the run's rendezvous store, which no longer answers)"
        elif [r for r in stopped if r != me]:
            named = ", ".join(str(r) for r in stopped if r != me)
            why = f"rank(s) {named} stopped: their heartbeat ended (look at their logs for the first error)"
        elif "Timed out" in str(exc):
            why = "every rank's heartbeat still runs: one is alive but stuck (the monitored barrier names it above)"
        else:
            why = "every other rank is alive: the error above is this rank's own"
        print(f"[rank{me}] minite: this rank failed with {kind.__name__}; {why}", file=sys.stderr, flush=True)

    sys.excepthook = hook
