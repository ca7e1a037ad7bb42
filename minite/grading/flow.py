"""Which values of a check depend on the answers: a data flow over the notebook's cells, by name.

A name depends on the answers when a task cell binds it at module level (the answer's function, kernel, launcher,
constant), or when a statement binds it from an expression that loads such a name (``y = softmax(x)``, a ``for``
over such a value, a function whose body uses one, ``out.copy_(y)``). Passing a value to such a function does not
make it depend on the answers. The judge takes every other value of an ``assert`` from the reference run, so a
student's process that computes or records the check's expected side wrongly gains nothing.
"""
from __future__ import annotations

import ast


def loads(node) -> set[str]:
    """Every name read under `node`."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _targets(node) -> set[str]:
    """The names an assignment target binds or writes into (``x``, ``x[i]``, ``x.a``, ``a, *b``)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _step(st, tainted: set[str]) -> None:
    """Add to `tainted` the names statement `st` binds from answer-dependent values."""
    for n in ast.walk(st):  # walrus anywhere: (y := f(x))
        if isinstance(n, ast.NamedExpr) and loads(n.value) & tainted:
            tainted.add(n.target.id)
    if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = st.targets if isinstance(st, ast.Assign) else [st.target]
        if st.value is not None and loads(st.value) & tainted:
            for t in targets:
                tainted |= _targets(t)
    elif isinstance(st, (ast.For, ast.AsyncFor)):
        if loads(st.iter) & tainted:
            tainted |= _targets(st.target)
        _block(st.body + st.orelse, tainted)
    elif isinstance(st, (ast.While, ast.If)):
        _block(st.body + st.orelse, tainted)
    elif isinstance(st, (ast.With, ast.AsyncWith)):
        for item in st.items:
            if item.optional_vars is not None and loads(item.context_expr) & tainted:
                tainted |= _targets(item.optional_vars)
        _block(st.body, tainted)
    elif isinstance(st, ast.Try):
        _block(st.body + [s for h in st.handlers for s in h.body] + st.orelse + st.finalbody, tainted)
    elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        if loads(st) & tainted:
            tainted.add(st.name)
    elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
        call = st.value
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        if isinstance(receiver, ast.Name) and (loads(call) - {receiver.id}) & tainted:
            tainted.add(receiver.id)  # out.copy_(y): `out` now holds an answer's values


def _block(stmts, tainted: set[str]) -> None:
    for st in stmts:
        _step(st, tainted)


def propagate(stmts, tainted: set[str]) -> set[str]:
    """The names that depend on the answers once `stmts` (a cell) ran, given those that did before (every
    statement of a loop is seen as running again, until nothing changes)."""
    out = set(tainted)
    while True:
        size = len(out)
        _block(stmts, out)
        if len(out) == size:
            return out


def answer_leaves(test, tainted: set[str]) -> frozenset[str]:
    """Keys of the recorded leaves (``_minite.v(k, expr)``) of a rewritten assert test that depend on the answers."""
    out = set()
    for n in ast.walk(test):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "v" \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "_minite":
            if loads(n.args[1]) & tainted:
                out.add(str(n.args[0].value))
    return frozenset(out)
