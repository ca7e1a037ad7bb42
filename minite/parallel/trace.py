"""What the parallel layers did, in time and bytes: recorded for the lessons, and only while someone asks.

    with trace.Recorder() as rec:
        pipe.step(x, y)
    rec.rows("pp")   # [{"kind": "pp", "step": "F", "mb": 0, "t0": ..., "t1": ..., "saved_bytes": ...}, ...]

Like ``comm.CommLog``, the recorder is context-local (a contextvar). The layers open a ``span`` around the work
they report; with no recorder active a span reads no clock and records nothing, so the hot paths pay one lookup.
Who reports what:

    kind       reported by                 fields
    dp_comm    data.DataParallel           unit; t0 = its reduction launched, t1 = seen complete
    pp         pipeline.PipelineGPT        step ("F" or "B"), mb (micro-batch); a forward also saved_bytes:
                                           the activations autograd keeps for its backward (weights excluded)
    cp_block   context attention           step (of the ring), scores (score entries computed): a forward call
    cp_wait    context.RingAttention       step: the forward waiting for the next K/V block after computing

Times are wall-clock seconds (``time.time()``: one clock for all the ranks of a node, so their events line up),
read after the queued kernels have run when the device is CUDA.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterable

import torch

__all__ = ["Recorder", "now", "begin", "end", "span", "saved_bytes"]

_RECORDER: contextvars.ContextVar = contextvars.ContextVar("minite_trace", default=None)


class Recorder:
    """``with Recorder() as rec:`` collects one dict per event, in the order the events began."""

    def __init__(self):
        self.events: list[dict] = []

    def __enter__(self):
        self._token = _RECORDER.set(self)
        return self

    def __exit__(self, *exc):
        _RECORDER.reset(self._token)

    def rows(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


def now(device: torch.device | None = None) -> float:
    """Wall-clock seconds; on CUDA after the kernels queued on `device` have run."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def begin(kind: str, device: torch.device | None = None, **fields) -> dict | None:
    """Start an event (t0 now) when a recorder is active, and return its row; None otherwise."""
    recorder = _RECORDER.get()
    if recorder is None:
        return None
    row = {"kind": kind, **fields, "t0": now(device), "t1": None}
    recorder.events.append(row)
    return row


def end(row: dict | None, device: torch.device | None = None) -> None:
    """End an event begun by ``begin`` (t1 now); a row already ended, or None, is left as it is."""
    if row is not None and row["t1"] is None:
        row["t1"] = now(device)


@contextlib.contextmanager
def span(kind: str, device: torch.device | None = None, **fields):
    """``with span("pp", step="F", mb=0) as row:`` an event from entering to leaving (row None: not recording)."""
    row = begin(kind, device, **fields)
    try:
        yield row
    finally:
        end(row, device)


@contextlib.contextmanager
def saved_bytes(row: dict | None, weights: Iterable[torch.Tensor]):
    """Inside a span: ``row["saved_bytes"]`` = the bytes of the storages autograd saves for backward in the block,
    each storage once, those of `weights` excluded (parameters: not activations). No row: nothing."""
    if row is None:
        yield
        return
    weights = {t.untyped_storage().data_ptr() for t in weights}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    row["saved_bytes"] = sum(seen.values())
