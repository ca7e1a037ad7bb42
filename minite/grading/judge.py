"""The judge: the student's records of a check compared with the reference run's, in the grader's process."""
from __future__ import annotations

import ast
import copy
import math

from .rewrite import _COMPARATORS, _dotted


class _Unknown(Exception):
    pass


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
            raise _Unknown(v["__unrecordable__"])
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
                raise _Unknown("identity")
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
    raise _Unknown(type(node).__name__)


def _compare_op(name: str, got: dict, ref: dict) -> str | None:
    """Why the student's check_op record fails against the reference run's, or None."""
    import torch

    from minite.testing import assert_close
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


def _judge(name, tests, got: list[dict], ref: list[dict]) -> str | None:
    """Why the student's records of check `name` fail, or None."""
    from minite.testing import assert_close
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
                assert_close(g["actual"], g["expected"], **(r.get("kwargs") or {}))
            else:
                try:
                    ok = _truthy(_evaluate(tests[g["rid"]], g["leaves"]))
                except _Unknown:
                    ok = True  # not recordable: the assert ran in the student's kernel without raising
                if not ok:
                    return f"assert {ast.unparse(_plain_test(tests[g['rid']]))} is false"
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
