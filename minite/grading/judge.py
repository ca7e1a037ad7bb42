"""The judge: the student's records of a check compared with the reference run's, in the grader's process.

The student's process may have run any code, so nothing it recorded for the *reference side* of a check is used:
``check_op`` outputs are compared with the reference run's outputs, ``assert_close``'s actual tensor with the
reference run's expected one, and an ``assert`` must hold on the student's values, and again with every value
that does not depend on the answers (flow.py) taken from the reference run. A value that cannot be re-checked
(not recordable) fails its check."""
from __future__ import annotations

import ast
import copy
import math

from .rewrite import _COMPARATORS, _dotted

_assert_close = None  # minite.testing.assert_close, imported by ready() before any student's notebook runs


class _Unknown(Exception):
    """An assert test the grader cannot re-evaluate from the recorded values."""


def ready() -> None:
    """Import what judging needs (torch, minite.testing) now: once a student's notebook runs, the grader imports
    nothing of minite (guard.sealed_imports), so no file the student's code can write runs in the grader."""
    global _assert_close
    import torch  # noqa: F401

    from minite.testing import assert_close
    _assert_close = assert_close


def _truthy(v) -> bool:
    import torch
    if isinstance(v, torch.Tensor):
        return bool(v.all()) if v.numel() != 1 else bool(v.item())
    return bool(v)


def _evaluate(node, leaves):
    """Re-evaluate an assert test (as rewritten) from recorded leaves, with the grader's own functions."""
    import torch
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Call) and _dotted(node.func) == "_minite.v":
        k = str(node.args[0].value)
        if k not in leaves:
            raise KeyError(k)
        v = leaves[k]
        if isinstance(v, dict) and "__unrecordable__" in v:
            raise _Unknown(f"a value of type {v['__unrecordable__']} is not recordable")
        return v
    if isinstance(node, (ast.Tuple, ast.List)):
        vals = [_evaluate(e, leaves) for e in node.elts]
        return tuple(vals) if isinstance(node, ast.Tuple) else vals
    if isinstance(node, ast.BoolOp):
        v = None
        for sub in node.values:
            v = _evaluate(sub, leaves)
            if _truthy(v) != isinstance(node.op, ast.And):
                return v
        return v
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand, leaves)
        return {ast.Not: lambda x: not _truthy(x), ast.USub: lambda x: -x, ast.UAdd: lambda x: +x,
                ast.Invert: lambda x: ~x}[type(node.op)](v)
    if isinstance(node, ast.Compare):
        import operator as o
        ops = {ast.Eq: o.eq, ast.NotEq: o.ne, ast.Lt: o.lt, ast.LtE: o.le, ast.Gt: o.gt, ast.GtE: o.ge,
               ast.Is: o.is_, ast.IsNot: o.is_not, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
        left, res = _evaluate(node.left, leaves), True
        for op, right in zip(node.ops, node.comparators):
            r = _evaluate(right, leaves)
            if isinstance(op, (ast.Is, ast.IsNot)) and not (r is None or isinstance(r, bool)):
                raise _Unknown("an 'is' test between objects is not recordable")
            res = ops[type(op)](left, r)
            if not _truthy(res):
                return res
            left = r
        return res
    if isinstance(node, ast.Call):
        args = [_evaluate(a, leaves) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value, leaves) for k in node.keywords}
        name = _dotted(node.func)
        if name in _COMPARATORS:
            import builtins
            head, _, attr = name.rpartition(".")
            f = getattr({"torch": torch, "math": math}[head], attr) if head else getattr(builtins, name)
            return f(*args, **kwargs)
        base = _evaluate(node.func.value, leaves)
        return getattr(base, node.func.attr)(*args, **kwargs)
    raise _Unknown(f"a {type(node).__name__} expression is not recordable")


def _compare_op(name: str, got: dict, ref: dict) -> str | None:
    """Why the student's check_op record fails against the reference run's, or None."""
    import torch

    assert_close = _assert_close
    if got.get("error"):
        return got["error"]
    outs, exps = got.get("out") or [], ref.get("out") or []
    if len(outs) != len(exps):
        return f"{name}: returned {len(outs)} outputs, the reference returns {len(exps)}"
    try:
        for i, (o, e) in enumerate(zip(outs, exps)):
            tag = f"{name}: " + ("output" if len(exps) == 1 else f"output[{i}]")
            if isinstance(e, torch.Tensor):
                assert_close(o, e, name=tag, atol=ref.get("atol"), rtol=ref.get("rtol"))
            elif not isinstance(o, type(e)) or o != e:
                return f"{tag}: got {o!r}, expected {e!r}"
        if ref.get("grad") and ref.get("grads"):
            mine = got.get("grads") or [None] * len(ref["grads"])
            for i, (g, e) in enumerate(zip(mine, ref["grads"])):
                if e is None:
                    continue
                if g is None:
                    return f"{name}: grad[{i}]: no gradient reached input {i}"
                assert_close(g, e, name=f"{name}: grad[{i}]", atol=ref.get("atol"), rtol=ref.get("rtol"))
    except AssertionError as err:
        return str(err)
    return None


def _holds(test, got: dict, ref: dict) -> bool:
    """Does an assert (rewrite.Assert) hold on the student's values, and again with every value that does not
    depend on the answers taken from the reference run? (A student's process that computes or records the
    check's expected side wrongly gains nothing; one that changes the check's own inputs fails the first.)"""
    if not _truthy(_evaluate(test.test, got)):
        return False
    mixed = {**got, **{k: v for k, v in ref.items() if k not in test.answer_leaves}}
    return _truthy(_evaluate(test.test, mixed))


def _judge(name, tests, got: list[dict], ref: list[dict]) -> str | None:
    """Why the student's records of check `name` fail, or None."""
    if [(r["kind"], r["rid"]) for r in got] != [(r["kind"], r["rid"]) for r in ref]:
        return (f"its steps differ from the reference run ({len(got)} of {len(ref)} recorded values): "
                "did the check stop early?")
    for g, r in zip(got, ref):
        try:
            if g["kind"] == "op":
                why = _compare_op(g.get("name", name), g, r)
                if why:
                    return why
            elif g["kind"] == "close":
                _assert_close(g["actual"], r["expected"], **(r.get("kwargs") or {}))
            else:
                test = tests[g["rid"]]
                try:
                    ok = _holds(test, g["leaves"], r["leaves"])
                except _Unknown as err:
                    return f"assert {ast.unparse(_plain_test(test.test))} cannot be re-checked by the grader: {err}"
                if not ok:
                    return f"assert {ast.unparse(_plain_test(test.test))} is false"
        except AssertionError as err:
            return str(err)
        except Exception as err:  # noqa: BLE001 - a malformed record fails the check
            return f"could not check a recorded value: {type(err).__name__}: {err}"[:300]
    return None


def _plain_test(test):
    class Unwrap(ast.NodeTransformer):
        def visit_Call(self, node):
            if _dotted(node.func) == "_minite.v":
                return self.visit(node.args[1])
            return self.generic_visit(node)
    return Unwrap().visit(copy.deepcopy(test))
