"""Check cells rewritten to record values (``_minite.op`` / ``close`` / ``v`` / ``a``) instead of judging them."""
from __future__ import annotations

import ast
from dataclasses import dataclass

from .flow import answer_leaves, propagate
from .notebook import _python

_COMPARATORS = {"torch.equal", "torch.allclose", "torch.isclose", "math.isclose", "all", "any", "bool", "len",
                "abs", "min", "max", "torch.all", "torch.any", "torch.isnan", "torch.isinf", "torch.isfinite",
                "round", "int", "float", "sum"}
_METHODS = {"all", "any", "item", "abs", "max", "min", "tolist", "float", "double", "sum"}


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_call_to(node, name: str) -> bool:
    return isinstance(node, ast.Call) and (_dotted(node.func) or "").split(".")[-1] == name


def _structural(node) -> bool:
    if isinstance(node, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Tuple, ast.List, ast.Constant)):
        return True
    if isinstance(node, ast.Call):
        if _dotted(node.func) in _COMPARATORS:
            return True
        return isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS and not node.args
    return False


class _Leaves:
    """Wrap every leaf of an assert test in ``_minite.v(k, leaf)``."""

    def __init__(self):
        self.k = 0

    def visit(self, node):
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.GeneratorExp):  # recorded as the list it yields: a generator is not recordable
            node = ast.copy_location(ast.ListComp(node.elt, node.generators), node)
        if not _structural(node):
            self.k += 1
            return ast.Call(ast.Attribute(ast.Name("_minite", ast.Load()), "v", ast.Load()),
                            [ast.Constant(self.k), node], [])
        if isinstance(node, ast.Call):
            if _dotted(node.func) not in _COMPARATORS:  # a method: x.all()
                node.func.value = self.visit(node.func.value)
            node.args = [self.visit(a) for a in node.args]
            for kw in node.keywords:
                kw.value = self.visit(kw.value)
        elif isinstance(node, ast.Compare):
            node.left = self.visit(node.left)
            node.comparators = [self.visit(c) for c in node.comparators]
        elif isinstance(node, ast.BoolOp):
            node.values = [self.visit(v) for v in node.values]
        elif isinstance(node, ast.UnaryOp):
            node.operand = self.visit(node.operand)
        elif isinstance(node, (ast.Tuple, ast.List)):
            node.elts = [self.visit(e) for e in node.elts]
        return node


@dataclass(frozen=True)
class Assert:
    """An assert of a check cell, as the judge re-evaluates it."""
    test: ast.expr  # the rewritten test: each leaf is _minite.v(k, expr)
    answer_leaves: frozenset[str]  # the keys of the leaves that depend on the answers (flow.py)


class _Rewrite(ast.NodeTransformer):
    def __init__(self, mode: str):
        self.mode = mode
        self.rid = 0
        self.tests = {}

    def _rt(self, attr):
        return ast.Attribute(ast.Name("_minite", ast.Load()), attr, ast.Load())

    def visit_Call(self, node):
        self.generic_visit(node)
        if _is_call_to(node, "check_op"):
            self.rid += 1
            args = list(node.args)
            if self.mode == "student":  # the student's process never sees the reference function
                if len(args) >= 3:
                    args[2] = ast.Constant(None)
                node.keywords = [k for k in node.keywords if k.arg != "ref"]
            return ast.Call(self._rt("op"), [ast.Constant(self.rid), *args], node.keywords)
        if _is_call_to(node, "assert_close"):
            self.rid += 1
            return ast.Call(self._rt("close"), [ast.Constant(self.rid), *node.args], node.keywords)
        return node

    def visit_Assert(self, node):
        self.generic_visit(node)
        self.rid += 1
        test = _Leaves().visit(node.test)
        self.tests[self.rid] = test
        node.test = ast.Call(self._rt("a"), [ast.Constant(self.rid), test], [])
        return node


def rewrite_check(source: str, name: str, mode: str, tainted: frozenset[str] = frozenset()) -> tuple[str, dict]:
    """A check cell's source rewritten to record (see module doc), and its asserts by record id. `tainted`: the
    names that depend on the answers before the cell runs (flow.py)."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError as err:
        raise ValueError(f"check {name!r} does not parse: line {err.lineno}: {err.msg}") from None
    names = propagate(tree.body, set(tainted))
    rw = _Rewrite(mode)
    tree = ast.fix_missing_locations(rw.visit(tree))
    tests = {rid: Assert(test, answer_leaves(test, names)) for rid, test in rw.tests.items()}
    return f"_minite.begin({name!r})\n" + ast.unparse(tree) + "\n_minite.flush()", tests
