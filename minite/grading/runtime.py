"""What a graded notebook's kernel runs on behalf of the grader (see ``minite.grading``; the kernel loads it from
this file, nothing imports it): it *records*, it does not judge.

The grader rewrites every check cell so that
* ``check_op(name, fn, ref, *args, ...)`` becomes ``_minite.op(rid, name, fn, ref, *args, ...)``; in the
  student's run ``ref`` is replaced by ``None`` before the cell runs, so only ``fn``'s outputs and input
  gradients are recorded. The reference run (the pristine solution, another process) records ``ref``'s.
* ``assert_close(a, b, ...)`` becomes ``_minite.close(rid, a, b, ...)``: both tensors are recorded.
* ``assert TEST`` keeps its structure, with every leaf value recorded (``_minite.v``) and the whole test
  announced (``_minite.a``), so the grader can re-evaluate the comparison in its own process.

Records leave the kernel as display data of type ``application/x-minite-record`` (``torch.save`` bytes, base64:
the grader reads them with ``torch.load(weights_only=True)``, which runs no code). Whatever this module does in
the student's process can be tampered with; the grader only trusts what it can recompute: see the README.
"""
from __future__ import annotations

import base64
import io
import random

import torch

MIME = "application/x-minite-record"


def plain(value, depth: int = 0):
    """`value` as something ``torch.load(weights_only=True)`` reads back: tensors (detached, on the CPU), numbers,
    strings, None, dtypes, and tuples / lists / str-keyed dicts of those. Anything else becomes a marker."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if value is None or isinstance(value, (bool, int, float, str, complex, torch.dtype)):
        return value
    if depth < 4 and isinstance(value, (tuple, list)):
        return type(value)(plain(v, depth + 1) for v in value) if type(value) in (tuple, list) else \
            tuple(plain(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: plain(v, depth + 1) for k, v in value.items()}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:  # numpy scalar
        return value.item()
    return {"__unrecordable__": type(value).__name__}


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class Recorder:
    def __init__(self, mode: str):
        assert mode in ("student", "reference"), mode
        self.mode = mode
        self.leaves: dict[str, object] = {}
        self.buffer: list[dict] = []
        from IPython.display import publish_display_data
        self._publish = publish_display_data

    def _emit(self, record: dict) -> None:
        self.buffer.append(plain(record))

    def begin(self, name: str) -> None:
        """Start of a check cell: the same random state in both runs, whatever ran before."""
        self.buffer = []
        torch.manual_seed(0)
        random.seed(0)

    def flush(self) -> None:
        """End of a check cell that ran through: one message with all its records (a message per record could
        be dropped by the kernel's output channel when there are many)."""
        buf = io.BytesIO()
        torch.save(self.buffer, buf)
        self.buffer = []
        self._publish({MIME: base64.b64encode(buf.getvalue()).decode()})

    def v(self, k: int, value):
        self.leaves[str(k)] = value
        return value

    def a(self, rid: int, test):
        leaves, self.leaves = self.leaves, {}
        self._emit({"kind": "assert", "rid": rid, "leaves": leaves})
        return test

    def close(self, rid: int, actual, expected, *args, **kwargs):
        self._emit({"kind": "close", "rid": rid, "actual": actual, "expected": expected, "kwargs": kwargs})
        from minite.testing import assert_close  # feedback in the notebook; the grader decides on its own
        assert_close(actual, expected, *args, **kwargs)

    def op(self, rid: int, name: str, fn, ref, *args, grad: bool = True, seed: int = 0, atol=None, rtol=None,
           verbose: bool = True, **kwargs):
        call = ref if self.mode == "reference" else fn
        xs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                c = a.detach().clone()
                if grad and c.is_floating_point():
                    c.requires_grad_(True)
                xs.append(c)
            else:
                xs.append(a)
        rec = {"kind": "op", "rid": rid, "name": name, "grad": grad, "atol": atol, "rtol": rtol, "error": None,
               "out": None, "grads": None}
        try:
            outs = _as_tuple(call(*xs, **kwargs))
            rec["out"] = list(outs)
            diff = [(i, o) for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
            if grad and diff:
                ups = [torch.randn(o.shape, generator=torch.Generator().manual_seed(seed * 1000 + i),
                                   dtype=torch.float32).to(o.dtype).to(o.device) for i, o in diff]
                torch.autograd.backward([o for _, o in diff], ups)
                rec["grads"] = [x.grad if isinstance(x, torch.Tensor) else None for x in xs]
        except Exception as err:  # noqa: BLE001 - reported by the grader as this check's failure
            rec["error"] = f"{type(err).__name__}: {err}"[:300]
        self._emit(rec)
        if rec["error"] and self.mode == "student":
            raise RuntimeError(f"{name}: {rec['error']}")
        if verbose and self.mode == "student":
            print(f"{name}: outputs recorded; the grader compares them with the reference")
        return True
