"""Counting memory traffic and peak memory of eager PyTorch, without running anything big.

Both counters are ``TorchDispatchMode``s: inside ``with CountBytes() as cb:`` every aten op that runs (forward
*and* autograd's backward) is logged. On the ``meta`` device only shapes flow, so GPT-sized tensors cost nothing.
Chapter 00 derives the idea; chapters 03-06 use it to count the passes a naive op makes over memory::

    x = torch.empty(4096, 1000, device="meta")
    with CountBytes() as cb:
        torch.softmax(x, -1)
    cb.total() / (x.numel() * x.element_size())    # passes over x
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["nbytes", "CountBytes", "PeakBytes", "saved_bytes"]


def nbytes(tree) -> int:
    """Bytes of every tensor in a (nested) structure of args/outputs."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


class CountBytes(TorchDispatchMode):
    """Log each aten op run inside the block as (name, bytes read, bytes written).

    Reads are the op's tensor inputs, writes its outputs. Views (reshape, transpose, split...) move no data and
    are skipped. An upper bound on what a real kernel moves (caches can serve a re-read), and the right count
    for memory-bound ops whose tensors are far larger than the caches."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops.append((func.__name__.split(".")[0], nbytes((args, kwargs)), nbytes(out)))
        return out

    def total(self) -> int:
        """Bytes read + written by every logged op."""
        return sum(r + w for _, r, w in self.ops)


class PeakBytes(TorchDispatchMode):
    """Bytes of every tensor storage created inside the block; ``.peak`` is the most alive at once.

    A storage is counted once (views share it) and freed when its last tensor dies (a weakref finalizer).
    Tensors created before the block (inputs, parameters) are not counted: add them yourself."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.live: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live.discard(key)
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in self.live:
                    self.live.add(st._cdata)
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, st._cdata, st.nbytes())
        return out


def saved_bytes(fn, *args, **kwargs) -> int:
    """Bytes autograd keeps between forward and backward for ``fn(*args, **kwargs)``: every tensor saved for
    backward, each storage counted once (inputs that are saved count too)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(seen.values())
