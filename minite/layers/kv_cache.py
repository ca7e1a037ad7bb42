"""KVCache (chapter 08): the keys and values of every layer, kept between decode steps.

Without a cache, generating token t+1 re-runs the model over all t tokens: O(t) work per token, O(T^2) per
sequence. Keys and values of past tokens never change (causal attention), so each layer stores them once:

    k[layer], v[layer]: (B, KVH, T_max, D), preallocated      lengths: (B,) tokens held per sequence

A step then computes q/k/v for the new token(s) only, writes k/v at each sequence's own position, rotates them by
RoPE at that position (not at 0), and attends over the cache. Bytes per cached token: 2 * L * KVH * D * bytes,
which is why GQA/MQA (small KVH) matter at inference.

Sequences of one batch may hold different lengths (prompts of different lengths, right-padded for the prefill):
``lengths`` is kept on the host too, so no step needs a device sync to know where to write.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn

from minite import _validate as _v

__all__ = ["KVCache", "cache_bytes_per_token"]


def cache_bytes_per_token(n_layer: int, n_kv_head: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """2 (k and v) * L * KVH * D * bytes: what one more token of context costs in cache memory."""
    return 2 * n_layer * n_kv_head * head_dim * bytes_per_elem


class KVCache(nn.Module):
    """Preallocated per-layer key/value cache with per-sequence lengths.

    Args:
        n_layer, batch_size, n_kv_head, max_len (T_max), head_dim: the cache shape, (B, KVH, T_max, D) per layer.
        dtype, device: of the stored keys and values (the model's activation dtype). A write of k/v in another
            dtype (autocast) converts that layer's cache to it.
    """

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        for name, val in (("n_layer", n_layer), ("batch_size", batch_size), ("n_kv_head", n_kv_head),
                          ("max_len", max_len), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, numbers.Integral):
                raise TypeError(f"KVCache: {name} must be an int, got {_v.describe(val)}")
            if val <= 0:
                raise ValueError(f"KVCache: {name} must be positive, got {val}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"KVCache: dtype must be a floating-point torch.dtype, got {dtype}")
        shape = (batch_size, n_kv_head, max_len, head_dim)  # (B, KVH, T_max, D)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.n_layer, self.batch_size, self.max_len = n_layer, batch_size, max_len
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.int64, device=device), persistent=False)
        self.host_lengths = [0] * batch_size  # the same numbers on the host: write positions without a sync

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None) -> "KVCache":
        """A cache shaped for a minite GPT (its config, parameter dtype and device)."""
        c = model.config
        p = next(model.parameters())
        return cls(c.n_layer, batch_size, c.n_kv_head, max_len or c.block_size, c.n_embd // c.n_head,
                   dtype=p.dtype, device=p.device)

    def reset(self) -> None:
        self.lengths.zero_()
        self.host_lengths = [0] * self.batch_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def check_room(self, T: int) -> None:
        """Raise before anything is written if appending T tokens would overflow T_max for some sequence."""
        worst = max(self.host_lengths) + T
        if worst > self.max_len:
            raise ValueError(f"KVCache overflow: appending {T} token(s) to a sequence holding "
                             f"{max(self.host_lengths)} needs {worst} positions, but max_len={self.max_len} "
                             "(allocate a larger cache, or crop the context and prefill again)")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, KVH, T, D) of `layer` at positions lengths[b] ... lengths[b] + T - 1 of each sequence.
        Lengths do not move until ``advance``: every layer of one step writes at the same positions."""
        # layer=-1 would index the last layer from the end: refuse it, as an int in [0, n_layer).
        layer = _v.integer("KVCache.write", "layer", layer, lo=0, hi=self.n_layer - 1)
        for name, t in (("k", k), ("v", v)):
            _v.tensor("KVCache.write", name, t, floating=True)  # int k/v would turn the cache into ints
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(f"KVCache.write: k must be (B, KVH, T, D) and v of the same shape; v {tuple(v.shape)} "
                             f"does not match k {tuple(k.shape)}")
        B, KVH, T, D = k.shape
        if (B, KVH, D) != (self.batch_size, self.k[layer].shape[1], self.k[layer].shape[3]):
            raise ValueError(f"KVCache.write: k {tuple(k.shape)} does not fit cache {tuple(self.k[layer].shape)}")
        self.check_room(T)
        if k.dtype != self.k[layer].dtype or v.dtype != self.v[layer].dtype:
            # The cache follows the activations' dtype: under autocast the weights (and so `for_model`) are fp32
            # but k, v come out of the projections in bf16/fp16, and attention needs q, k, v in one dtype.
            # Held entries are converted once (a bf16 activation stored as fp32 converts back exactly).
            if k.dtype != v.dtype:
                raise ValueError(f"KVCache.write: k and v dtypes differ: {k.dtype}, {v.dtype}")
            self.k[layer], self.v[layer] = self.k[layer].to(k.dtype), self.v[layer].to(k.dtype)
        pos = self.host_lengths
        if all(p == pos[0] for p in pos):  # the common case: one slice for the whole batch
            self.k[layer][:, :, pos[0]:pos[0] + T] = k
            self.v[layer][:, :, pos[0]:pos[0] + T] = v
        else:
            for b, p in enumerate(pos):
                self.k[layer][b, :, p:p + T] = k[b]
                self.v[layer][b, :, p:p + T] = v[b]

    def advance(self, n: int | list[int] | tuple[int, ...] | torch.Tensor) -> None:
        """Move every sequence on by n tokens (an int, or one count per sequence: a right-padded prefill whose
        prompts hold fewer real tokens than the padded width; the padding's k/v are overwritten later).
        Atomic: everything is checked before anything moves, so a refused call leaves host and device lengths equal."""
        ns = self._counts(n)
        new = [a + b for a, b in zip(self.host_lengths, ns)]
        if max(new) > self.max_len:
            raise ValueError(f"KVCache overflow: advancing lengths {self.host_lengths} by {ns} gives {new}, "
                             f"past max_len={self.max_len}")
        if all(x == ns[0] for x in ns):
            self.lengths.add_(ns[0])  # on the device: no host-to-device copy (a pageable one waits for the stream)
        else:  # a right-padded prefill: once per prompt
            self.lengths.copy_(torch.tensor(new, dtype=torch.int64))
        self.host_lengths = new

    def _counts(self, n) -> list[int]:
        """`n` as batch_size non-negative ints: an int for every sequence, or a sequence / 1-D int tensor of them."""
        if isinstance(n, torch.Tensor):
            if n.is_floating_point() or n.dtype == torch.bool or n.dim() > 1:
                raise TypeError(f"KVCache.advance: n must hold integer counts, got a {n.dtype} tensor of shape "
                                f"{tuple(n.shape)}")
            n = n.tolist()
        if isinstance(n, numbers.Integral) and not isinstance(n, bool):
            ns = [int(n)] * self.batch_size
        elif isinstance(n, (list, tuple)):
            ns = [_v.integer("KVCache.advance", f"n[{i}]", x) for i, x in enumerate(n)]
        else:
            raise TypeError(f"KVCache.advance: n must be an int or {self.batch_size} ints, got {_v.describe(n)}")
        if len(ns) != self.batch_size or min(ns) < 0:
            raise ValueError(f"KVCache.advance: n must be {self.batch_size} counts >= 0 (one per sequence), got {ns}")
        return ns

    def extra_repr(self) -> str:
        return (f"n_layer={self.n_layer}, shape={tuple(self.k[0].shape)}, dtype={self.k[0].dtype}, "
                f"lengths={self.host_lengths}")
