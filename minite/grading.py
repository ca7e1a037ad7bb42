"""Exercise notebooks: generate them from solutions, and grade a student's copy.

Conventions (docs/chapter_template.md)
--------------------------------------
* ``solutions/NN_topic.ipynb`` is the solved notebook. A *task cell* carries ``metadata.minite.task = NAME``
  and has one or more answer regions between the lines ``### BEGIN SOLUTION`` and ``### END SOLUTION``.
* A *check cell* carries ``metadata.minite.check = NAME`` (the same NAME as its task), is tagged
  ``nbval-check-output``, starts with ``# CHECK: NAME``, ends with an ``assert`` and prints ``PASS: ...``.
* ``exercises/NN_topic.ipynb`` is generated (``generate``): every region becomes ::

      ### BEGIN YOUR CODE
      raise NotImplementedError()
      ### END YOUR CODE

  at the same indentation; code outputs and execution counts are cleared, jupytext pairing is removed.

Grading (``grade``)
-------------------
1. *Assemble.* The graded notebook is the pristine solution notebook with only the student's answers spliced
   in: the code between ``### BEGIN YOUR CODE`` / ``### END YOUR CODE`` of the student's task cell of the same
   NAME (cell ids play no part). Each answer must parse as code inside its own block, the solution cell's
   structure around it unchanged (an answer that dedents out of its function fails), and may not reach outside
   itself (imports other than math/torch/triton/numpy..., ``globals``/``open``/``eval``..., private or dunder
   attributes, ``global``, assigning to attributes of objects it did not create, rebinding the notebook's names).
   A rejected answer is replaced by the stub, and a note says why.
2. *Record, in two processes.* Check cells are rewritten (``minite._grade_runtime``) to record values instead of
   judging them: ``check_op`` records ``fn``'s outputs and input gradients (in the student's run ``ref`` is
   removed from the call before it runs), ``assert_close`` its two tensors, every ``assert`` its leaf values.
   The pristine solution runs the same way in a separate kernel and records ``ref``'s outputs.
3. *Judge in the grader's process.* Each kernel runs under ``--timeout`` seconds per cell; then the kernel and
   every process it started (the grader is their child subreaper) are killed, and only then the grader compares
   the records: ``check_op`` outputs/gradients against the reference run's with ``minite.testing``'s tolerances,
   ``assert_close`` and ``assert`` tests re-evaluated with the grader's own ``torch``. No file, no pytest report
   and no state of the student's process decides a score.

Limits (the README says them too): answers run as Python in the student's kernel, so they may call what the
notebook imported (including minite's own kernels, or torch) and read files; a student who can read
``solutions/`` can copy it (ship ``make bundle``'s zip instead); values of raw ``assert`` and ``assert_close``
checks are computed in the student's process, so patching torch in a way the lint does not see could fake them.
``check_op`` checks cannot be faked without producing the right outputs.

CLI::

    python -m minite.grading grade exercises/00_triton_from_zero.ipynb [more.ipynb] [--json] [--timeout S]
    python -m minite.grading generate [--check]                             # solutions/ -> exercises/
"""

from __future__ import annotations

import argparse
import ast
import base64
import copy
import ctypes
import hashlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

__all__ = ["make_exercise", "generate_all", "assemble", "grade", "GradeReport", "check_cells", "task_cells",
           "regions", "stub_source"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_YOURS, END_YOURS = "### BEGIN YOUR CODE", "### END YOUR CODE"
STUB = "raise NotImplementedError()"
CHECK_TAG = "nbval-check-output"
RECORD_MIME = "application/x-minite-record"
DEFAULT_TIMEOUT = 300  # seconds per task cell and per check cell (--timeout)
OTHER_CELLS_TIMEOUT = 600  # the notebook's other cells (set-up, imports)
_CHECK_RE = re.compile(r"^\s*#\s*CHECK:\s*(.+?)\s*$")


# --------------------------------------------------------------------------------------------- cells
def regions(source: str, where: str, markers=((BEGIN, END),)) -> list[tuple[int, int]]:
    """(first, last) line index of each answer region's markers, for any of the marker pairs."""
    out, start, pair = [], None, None
    for i, line in enumerate(source.splitlines()):
        stripped = line.strip()
        for b, e in markers:
            if stripped == b:
                if start is not None:
                    raise ValueError(f"{where}: line {i + 1}: '{b}' inside another region")
                start, pair = i, (b, e)
            elif stripped == e:
                if start is None or pair[1] != e:
                    raise ValueError(f"{where}: line {i + 1}: '{e}' without '{b}'")
                out.append((start, i))
                start = None
    if start is not None:
        raise ValueError(f"{where}: '{pair[0]}' is never closed")
    return out


def stub_source(source: str, where: str) -> str:
    """Each solution region -> BEGIN YOUR CODE / raise NotImplementedError() / END YOUR CODE."""
    lines = source.splitlines()
    out, prev = [], 0
    for b, e in regions(source, where):
        indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
        out += lines[prev:b] + [f"{indent}{BEGIN_YOURS}", f"{indent}{STUB}", f"{indent}{END_YOURS}"]
        prev = e + 1
    return "\n".join(out + lines[prev:])


def _meta(cell, key: str):
    m = cell.get("metadata", {}).get("minite", {})
    return m.get(key) if isinstance(m, dict) else None


def task_name(cell) -> str | None:
    return _meta(cell, "task") if cell.cell_type == "code" else None


def check_name(cell) -> str | None:
    return _meta(cell, "check") if cell.cell_type == "code" else None


def task_cells(nb, where: str = "notebook") -> dict[str, int]:
    """NAME -> cell index of every task cell. A code cell with solution markers but no task name is an error."""
    out = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        name = task_name(cell)
        has = any(ln.strip() == BEGIN for ln in cell.source.splitlines())
        if has and not name:
            raise ValueError(f"{where}: cell {i} has '{BEGIN}' but no task name: add the cell metadata "
                             'minite={"task": NAME} (docs/chapter_template.md)')
        if name:
            if name in out:
                raise ValueError(f"{where}: task name {name!r} is used by cells {out[name]} and {i}")
            out[name] = i
    return out


def check_cells(nb) -> list[tuple[int, str]]:
    """(cell index, NAME) of every check cell (``metadata.minite.check``), in notebook order."""
    return [(i, check_name(c)) for i, c in enumerate(nb.cells) if check_name(c)]


# --------------------------------------------------------------------------------------------- generation
def make_exercise(solution_nb):
    """The exercise notebook of a solution notebook: regions stubbed, code outputs and execution counts cleared,
    jupytext pairing removed."""
    task_cells(solution_nb, "solution")
    nb = copy.deepcopy(solution_nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if task_name(cell):
            cell.source = stub_source(cell.source, f"cell {i}")
        cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("jupytext", None)
    nb.metadata["minite"] = {"generated_from": "solutions/ by `make exercises`; edit the solution, not this file"}
    return nb


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def generate_all(solutions: Path, exercises: Path, check: bool = False) -> list[str]:
    """Write exercises/X.ipynb for every solutions/X.ipynb. With `check`, write nothing and return the
    names of exercises that are missing or out of date."""
    stale = []
    if not check:
        exercises.mkdir(parents=True, exist_ok=True)
    for sol in sorted(solutions.glob("*.ipynb")):
        text = nbformat.writes(make_exercise(nbformat.read(sol, as_version=4))) + "\n"
        target = exercises / sol.name
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not check:
            target.write_text(text)
    if check:
        extra = {p.name for p in exercises.glob("*.ipynb")} - {p.name for p in solutions.glob("*.ipynb")}
        stale += sorted(f"{n} (no solution)" for n in extra)
    return stale


# ------------------------------------------------------------------------------ answers: structure and lint
_ALLOWED_IMPORTS = {"math", "torch", "triton", "numpy", "functools", "itertools", "operator", "collections",
                    "typing", "dataclasses", "cmath", "statistics", "fractions", "decimal", "struct"}
_DENIED_NAMES = {"globals", "locals", "vars", "eval", "exec", "compile", "open", "breakpoint", "input",
                 "getattr", "setattr", "delattr", "get_ipython", "exit", "quit", "help", "memoryview",
                 "_minite", "sys", "os", "importlib", "subprocess", "builtins", "inspect", "gc", "ctypes",
                 "signal", "shutil", "pathlib", "pickle", "socket", "threading", "multiprocessing", "minite"}
_DENIED_ATTRS = {"sys", "os", "modules", "builtins", "importlib", "subprocess", "system", "popen", "f_globals",
                 "f_locals", "f_back", "gi_frame", "cr_frame", "tb_frame", "func_globals", "reload",
                 "import_module", "path_hooks", "meta_path"}


def _stmt_lists(node, path=()):
    """Yield (path, list of statements) for every statement list under `node`."""
    for fname, value in ast.iter_fields(node):
        if isinstance(value, list) and value and all(isinstance(v, ast.AST) for v in value):
            if all(isinstance(v, ast.stmt) for v in value):
                yield path + (fname,), value
            for j, child in enumerate(value):
                yield from _stmt_lists(child, path + (fname, j))
        elif isinstance(value, ast.AST):
            yield from _stmt_lists(value, path + (fname,))


def _resolve(tree, path):
    node = tree
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p, None)
        if node is None:
            return None
    return node


def _in(lo, hi, node) -> bool:
    return lo <= node.lineno <= hi


def _region_stmts(tree, lo, hi):
    """(path, statements) of the deepest statement list holding a statement that starts on lines lo..hi and
    whose owner (function, loop, module...) starts before them."""
    best = None
    for path, stmts in _stmt_lists(tree):
        owner = _resolve(tree, path[:-1])
        if getattr(owner, "lineno", 0) >= lo:
            continue
        if any(_in(lo, hi, s) for s in stmts) and (best is None or len(path) > len(best[0])):
            best = (path, stmts)
    return best


def _skeleton(tree, cuts) -> str:
    """ast.dump of `tree` without the statements in `cuts` (path, lo, hi)."""
    tree = copy.deepcopy(tree)
    lists = [(_resolve(tree, path), lo, hi) for path, lo, hi in cuts]
    for stmts, lo, hi in lists:
        stmts[:] = [s for s in stmts if not _in(lo, hi, s)] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def _bound_names(nodes) -> set[str]:
    out = set()
    for n in nodes:
        for sub in ast.walk(n):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                out.add(sub.id)
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(sub.name)
            elif isinstance(sub, ast.arg):
                out.add(sub.arg)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return out


def _module_names(nodes) -> set[str]:
    """Names bound at module level by `nodes` (not inside the functions, lambdas or classes they define)."""
    out, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            todo += n.decorator_list
            continue
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        todo += list(ast.iter_child_nodes(n))
    return out


def _enclosing_function(tree, path):
    node, fn = tree, None
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            fn = node
    return fn


def _lint(stmts, local: set[str], notebook_names: set[str], top_level: bool) -> str | None:
    """Why an answer reaches outside itself, or None."""
    for st in stmts:
        for n in ast.walk(st):
            if isinstance(n, (ast.Global, ast.Nonlocal)):
                return f"line {n.lineno}: '{type(n).__name__.lower()}' is not allowed in an answer"
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                mods = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
                bad = [m for m in mods if m.split(".")[0] not in _ALLOWED_IMPORTS]
                if bad or getattr(n, "level", 0):
                    return f"line {n.lineno}: an answer may import only {sorted(_ALLOWED_IMPORTS)}, not {bad}"
            if isinstance(n, ast.Name) and (n.id in _DENIED_NAMES or n.id.startswith("__")):
                return f"line {n.lineno}: an answer may not use {n.id!r}"
            if isinstance(n, ast.Attribute) and (n.attr.startswith("_") or n.attr in _DENIED_ATTRS):
                return f"line {n.lineno}: an answer may not use the attribute '.{n.attr}'"
            if isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, (ast.Store, ast.Del)):
                root = n.value
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                if not (isinstance(root, ast.Name) and root.id in local):
                    what = ast.unparse(n)
                    return f"line {n.lineno}: assigning to {what!r} changes an object your answer did not create"
        if top_level:
            clash = _module_names([st]) & notebook_names
            if clash:
                return f"line {st.lineno}: an answer may not rebind {sorted(clash)}, which the notebook defines"
    return None


def _verify_answers(solution_src: str, spliced: str, notebook_names: set[str], where: str) -> None:
    """Raise ValueError unless every answer in `spliced` is code inside its own block (the solution cell's
    structure around it unchanged) that does not reach outside itself."""
    try:
        sol_tree = ast.parse(solution_src)
    except SyntaxError as err:
        raise ValueError(f"{where}: the solution cell does not parse: {err}") from None
    try:
        tree = ast.parse(spliced)
    except SyntaxError as err:
        raise ValueError(f"{where}: your answer does not parse: line {err.lineno}: {err.msg}") from None
    sol_cuts, cuts = [], []
    for (sb, se), (b, e) in zip(regions(solution_src, where), regions(spliced, where)):
        found = _region_stmts(sol_tree, sb + 2, se)
        if found is None:
            raise ValueError(f"{where}: a solution region holds no statement")
        sol_cuts.append((found[0], sb + 2, se))
        got = _region_stmts(tree, b + 2, e)
        path = got[0] if got else ()
        mine = [s for s in got[1] if _in(b + 2, e, s)] if got else []
        inside = {id(n) for s in mine for n in ast.walk(s)}
        stray = [s for s in ast.walk(tree) if isinstance(s, ast.stmt) and _in(b + 2, e, s) and id(s) not in inside]
        shape = [type(_resolve(tree, path[:j])).__name__ for j in range(len(path)) if isinstance(path[j], str)]
        sol_shape = [type(_resolve(sol_tree, found[0][:j])).__name__ for j in range(len(found[0]))
                     if isinstance(found[0][j], str)]
        if not mine or stray or shape != sol_shape:
            raise ValueError(f"{where}: your answer (lines {b + 2}-{e}) must be code inside its own block, at the "
                             "indentation of its markers; it leaves that block (a dedent?) or holds no statement")
        cuts.append((path, b + 2, e))
        fn = _enclosing_function(tree, path)
        local = _bound_names(mine) | (_bound_names([fn]) if fn is not None else set())
        why = _lint(mine, local, notebook_names, top_level=fn is None)
        if why:
            raise ValueError(f"{where}: {why}")
    if _skeleton(tree, cuts) != _skeleton(sol_tree, sol_cuts):
        raise ValueError(f"{where}: the code around your answer changed shape (did your answer leave its block?)")


def _splice(solution_src: str, student_src: str, where: str) -> str:
    """The solution cell with each region's body replaced by the student's answer for that region."""
    sol_lines, stu_lines = solution_src.splitlines(), student_src.splitlines()
    sol_reg = regions(solution_src, where)
    stu_reg = regions(student_src, where, ((BEGIN_YOURS, END_YOURS), (BEGIN, END)))
    if len(stu_reg) != len(sol_reg):
        raise ValueError(f"{where}: expected {len(sol_reg)} answer region(s) between '{BEGIN_YOURS}' and "
                         f"'{END_YOURS}', found {len(stu_reg)}")
    out, prev = [], 0
    for (b, e), (sb, se) in zip(sol_reg, stu_reg):
        out += sol_lines[prev:b + 1] + stu_lines[sb + 1:se] + [sol_lines[e]]
        prev = e + 1
    return "\n".join(out + sol_lines[prev:])


def _student_tasks(student_nb, names: list[str], notes: list[str]) -> dict[str, str]:
    """NAME -> source of the student's task cell. Notebooks from before task names (no minite metadata at all)
    are matched by order when they have exactly as many answer cells as the solution has tasks."""
    by_name = {}
    for c in student_nb.cells:
        if task_name(c):
            by_name.setdefault(task_name(c), c.source)
    if by_name or not names:
        return by_name
    old = [c.source for c in student_nb.cells if c.cell_type == "code"
           and any(ln.strip() in (BEGIN_YOURS, BEGIN) for ln in c.source.splitlines())]
    if len(old) != len(names):
        raise ValueError(f"this notebook's cells carry no task names (minite metadata), and it has {len(old)} "
                         f"answer cell(s) for {len(names)} task(s): regenerate it with `make exercises` and "
                         "copy your answers over")
    notes.append("this notebook's cells carry no task names: its answer cells were matched to tasks by order")
    return dict(zip(names, old))


def _notebook_names(nb) -> set[str]:
    out = set()
    for c in nb.cells:
        if c.cell_type == "code" and not task_name(c):
            try:
                out |= _module_names([ast.parse(_python(c.source))])
            except SyntaxError:
                pass
    return out


def assemble(student_nb, solution_nb, notes: list[str] | None = None, lint: bool = True):
    """The notebook that is actually graded: the solution notebook with the student's answers spliced in, task
    cells matched by NAME. A missing task, a broken region or a rejected answer stays stubbed (it scores
    nothing) and a line saying why is appended to `notes`."""
    notes = [] if notes is None else notes
    names = task_cells(solution_nb, "solution")
    mine = _student_tasks(student_nb, list(names), notes)
    nb_names = _notebook_names(solution_nb) if lint else set()
    graded = copy.deepcopy(solution_nb)
    for name, i in names.items():
        cell = graded.cells[i]
        where = f"task {name!r}"
        try:
            if name not in mine:
                raise ValueError(f"{where}: no cell with this task name in your notebook (deleted?)")
            spliced = _splice(cell.source, mine[name], where)
            if lint:
                _verify_answers(cell.source, spliced, nb_names, where)
            cell.source = spliced
        except ValueError as err:
            notes.append(str(err))
            cell.source = _splice(cell.source, stub_source(cell.source, where), where)
    for cell in graded.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("tags", None)
    return graded


# ------------------------------------------------------------------------- check cells: record, then judge
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


class _Rewrite(ast.NodeTransformer):
    def __init__(self, mode: str):
        self.mode, self.rid, self.tests = mode, 0, {}

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


def _python(source: str) -> str:
    """Cell source as plain Python (IPython magics translated)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)
    except ImportError:
        return source


def rewrite_check(source: str, name: str, mode: str) -> tuple[str, dict]:
    """A check cell's source rewritten to record (see module doc), and its assert tests by record id."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError as err:
        raise ValueError(f"check {name!r} does not parse: line {err.lineno}: {err.msg}") from None
    rw = _Rewrite(mode)
    tree = ast.fix_missing_locations(rw.visit(tree))
    return f"_minite.begin({name!r})\n" + ast.unparse(tree) + "\n_minite.flush()", rw.tests


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


# ---------------------------------------------------------------------------------------- execution
_PR_SET_CHILD_SUBREAPER = 36


def _subreaper(on: bool) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> set[int]:
    me, out = os.getpid(), set()
    for p in Path("/proc").glob("[0-9]*"):
        try:
            stat = (p / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(p.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _kill_new_children(before: set[int]) -> int:
    """SIGKILL and reap every child of this process that is not in `before` (orphans of the kernel are
    reparented to us while we are a subreaper), until none is left."""
    killed = 0
    for _ in range(100):
        new = _children() - before
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        for pid in new:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        time.sleep(0.05)
    return killed


@dataclass
class _Cell:
    ok: bool = True
    error: str = ""
    timed_out: bool = False
    records: list = field(default_factory=list)


def _records(outputs) -> list[dict]:
    import torch
    out = []
    for o in outputs:
        data = o.get("data", {}) if o.get("output_type") in ("display_data", "execute_result") else {}
        if RECORD_MIME in data:
            try:
                rec = torch.load(io.BytesIO(base64.b64decode(data[RECORD_MIME])), weights_only=True)
            except Exception:  # noqa: BLE001 - an unreadable record is no record
                continue
            out += [r for r in (rec if isinstance(rec, list) else [])
                    if isinstance(r, dict) and r.get("kind") in ("op", "close", "assert") and "rid" in r]
    return out


def _execute(nb, timeout: int) -> list[_Cell]:
    """Run `nb` in a fresh kernel (cwd: a temporary folder), every cell even after errors: `timeout` s for each
    task and check cell, max(timeout, OTHER_CELLS_TIMEOUT) for the others (set-up, imports, ...).
    Afterwards kill the kernel and every process it left behind, then return what each cell did."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    results: list[_Cell] = [_Cell() for _ in nb.cells]
    replies = {}
    before = _children()
    reaper = _subreaper(True)
    try:
        with tempfile.TemporaryDirectory(prefix="minite-grade-") as tmp:
            other = max(timeout, OTHER_CELLS_TIMEOUT)
            client = NotebookClient(
                nb, timeout=timeout, kernel_name="python3", allow_errors=True, interrupt_on_timeout=True,
                timeout_func=lambda cell: timeout if task_name(cell) or check_name(cell) else other,
                error_on_timeout={"ename": "Timeout", "evalue": "timed out", "traceback": []},
                resources={"metadata": {"path": tmp}},
                on_cell_executed=lambda cell, cell_index, execute_reply: replies.__setitem__(cell_index,
                                                                                             execute_reply))
            env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
            with client.setup_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
                for i, cell in enumerate(nb.cells):
                    if cell.cell_type != "code":
                        continue
                    res = results[i]
                    try:
                        client.execute_cell(cell, i)
                    except DeadKernelError:
                        res.ok, res.error = False, "the kernel died"
                        for j in range(i + 1, len(nb.cells)):
                            results[j] = _Cell(False, f"not run: the kernel died in cell {i}")
                        break
                    content = (replies.get(i) or {}).get("content", {})
                    if content.get("status") == "error":
                        res.ok = False
                        res.timed_out = content.get("ename") == "Timeout"
                        res.error = f"{content.get('ename')}: {content.get('evalue')}"[:300] \
                            if not res.timed_out else f"timed out after {client._get_timeout(cell)} s"
                    res.records = _records(cell.outputs)
                    if res.timed_out and not _responds(client, i):
                        for j in range(i + 1, len(nb.cells)):
                            results[j] = _Cell(False, f"not run: the kernel did not recover from the timeout in "
                                                      f"cell {i}")
                        break
    finally:
        _kill_new_children(before)
        if reaper:
            _subreaper(False)
    return results


def _responds(client, index: int, wait: int = 20) -> bool:
    """After interrupted cell `index`: does the kernel run a trivial cell again within `wait` seconds? (The probe
    takes that cell's place in the client's notebook; its results were read already.)"""
    probe = copy.deepcopy(client.nb.cells[index])
    probe.source, probe.outputs = "pass", []
    saved = client.timeout, client.interrupt_on_timeout, client.error_on_timeout, client.timeout_func
    client.timeout, client.interrupt_on_timeout, client.error_on_timeout, client.timeout_func = wait, False, None, None
    try:
        client.execute_cell(probe, index)
        return True
    except Exception:  # noqa: BLE001 - a dead or stuck kernel
        return False
    finally:
        client.timeout, client.interrupt_on_timeout, client.error_on_timeout, client.timeout_func = saved


def _prepare(nb, mode: str, timeout: int):
    """The notebook as it runs: the recorder set up first, each check cell rewritten. Returns (nb, tests by
    check name)."""
    nb = copy.deepcopy(nb)
    tests = {}
    for i, cell in enumerate(nb.cells):
        name = check_name(cell)
        if name:
            cell.source, tests[name] = rewrite_check(cell.source, name, mode)
    # Loaded from its file, not imported: importing the minite package here would decorate its Triton kernels
    # before the notebook's first cell has chosen the interpreter.
    runtime = Path(__file__).with_name("_grade_runtime.py")
    setup = nbformat.v4.new_code_cell(
        "import importlib.util as _u\n"
        f"_s = _u.spec_from_file_location('minite_grade_runtime', {str(runtime)!r})\n"
        "_rt = _u.module_from_spec(_s)\n_s.loader.exec_module(_rt)\n"
        f"_minite = _rt.Recorder({mode!r})\ndel _u, _s, _rt")
    nb.cells.insert(0, setup)
    return nb, tests


_REFERENCE_CACHE: dict[tuple, dict] = {}


def _reference(solution: Path, sol_nb, timeout: int) -> dict[str, list[dict]]:
    """The reference run of a solution (cached per content): records of each check, by name. It runs under
    max(timeout, DEFAULT_TIMEOUT): a short --timeout is for the student's answers."""
    timeout = max(timeout, DEFAULT_TIMEOUT)
    key = (str(solution.resolve()), hashlib.sha256(solution.read_bytes()).hexdigest())
    if key not in _REFERENCE_CACHE:
        nb, _ = _prepare(sol_nb, "reference", timeout)
        cells = _execute(nb, timeout)
        out = {}
        for i, name in check_cells(nb):
            if not cells[i].ok:
                raise RuntimeError(f"{solution}: the solution's own check {name!r} fails in the reference run: "
                                   f"{cells[i].error}")
            out[name] = cells[i].records
        _REFERENCE_CACHE[key] = out
    return _REFERENCE_CACHE[key]


# ---------------------------------------------------------------------------------------------- grading
@dataclass
class GradeReport:
    notebook: str
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # failed check -> why
    order: list[str] = field(default_factory=list)  # every check, in notebook order
    errors: list[str] = field(default_factory=list)  # notes, and non-check cells that raised (hints)

    @property
    def score(self) -> int:
        return len(self.passed)

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.failed)

    def summary(self) -> str:
        lines = [f"{self.notebook}"]
        for n in self.order or self.passed + self.failed:
            why = f": {self.reasons[n]}" if self.reasons.get(n) else ""
            lines.append(f"  PASS  {n}" if n in self.passed else f"  FAIL  {n}{why}")
        lines += [f"  note: {e}" for e in self.errors]
        lines.append(f"score: {self.score}/{self.total}")
        return "\n".join(lines)


def _default_solution(student: Path) -> Path:
    for cand in (student.resolve().parent.parent / "solutions" / student.name,
                 _repo_root() / "solutions" / student.name):
        if cand.exists():
            return cand
    raise FileNotFoundError(f"no solutions/{student.name} next to {student} or in {_repo_root()}; pass --solution")


def grade(student: str | Path, solution: str | Path | None = None, *, timeout: int = DEFAULT_TIMEOUT,
          lint: bool = True) -> GradeReport:
    """Grade a student's notebook against the pristine solution notebook; see the module doc.
    `lint=False` skips the answer lint (tests use it to show that the records alone hold)."""
    student = Path(student)
    if not student.exists():
        raise FileNotFoundError(f"notebook to grade not found: {student}")
    if timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    solution = Path(solution) if solution else _default_solution(student)
    sol_nb = nbformat.read(solution, as_version=4)
    checks = check_cells(sol_nb)
    if not checks:
        raise ValueError(f"{solution} has no check cells (code cells with metadata minite={{'check': NAME}})")
    tasks = task_cells(sol_nb, str(solution))
    notes: list[str] = []
    graded = assemble(nbformat.read(student, as_version=4), sol_nb, notes, lint=lint)
    reference = _reference(solution, sol_nb, timeout)
    nb, tests = _prepare(graded, "student", timeout)
    cells = _execute(nb, timeout)  # the kernel and its processes are dead when this returns
    report = GradeReport(notebook=str(student), errors=notes)
    check_idx = {i for i, _ in check_cells(nb)}
    task_idx = {tasks[n] + 1: n for n in tasks}
    for i, name in check_cells(nb):
        why = None
        task_cell = tasks.get(name)
        if task_cell is not None and cells[task_cell + 1].timed_out:
            why = f"timed out after {timeout} s (in the task cell)"
        elif not cells[i].ok:
            why = cells[i].error
        else:
            why = _judge(name, tests[name], cells[i].records, reference.get(name, []))
        (report.failed if why else report.passed).append(name)
        report.order.append(name)
        if why:
            report.reasons[name] = why
    for i, c in enumerate(cells):
        if i and not c.ok and i not in check_idx and not c.error.startswith("not run"):
            what = f"task {task_idx[i]!r}" if i in task_idx else f"code cell {i - 1}"
            report.errors.append(f"{what} failed: {c.error}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minite.grading", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grade", help="score a student's notebook: prints 'score: k/n'")
    g.add_argument("notebook", nargs="+")
    g.add_argument("--solution", help="the pristine solution notebook (default: solutions/<same name>)")
    g.add_argument("--json", action="store_true", help="print the report as JSON")
    g.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT,
                   help=f"seconds each cell may run (a task's cell, its check) before it fails (default "
                        f"{DEFAULT_TIMEOUT})")
    gen = sub.add_parser("generate", help="write exercises/ from solutions/")
    gen.add_argument("--solutions", default=str(_repo_root() / "solutions"))
    gen.add_argument("--exercises", default=str(_repo_root() / "exercises"))
    gen.add_argument("--check", action="store_true", help="only report exercises that are out of date (exit 1)")
    args = p.parse_args(argv)
    if args.cmd == "generate":
        stale = generate_all(Path(args.solutions), Path(args.exercises), check=args.check)
        if args.check:
            if stale:
                print("exercises out of sync with solutions (run `make exercises`): " + ", ".join(stale))
                return 1
            print("exercises in sync with solutions")
        else:
            print(f"wrote {len(stale)} exercise notebook(s)" + (": " + ", ".join(stale) if stale else ""))
        return 0
    if args.solution and len(args.notebook) > 1:
        p.error("--solution applies to a single notebook")
    if args.timeout <= 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    full = True
    for nb in args.notebook:
        rep = grade(nb, args.solution, timeout=args.timeout)
        print(json.dumps(rep.__dict__ | {"score": rep.score, "total": rep.total}) if args.json else rep.summary())
        full &= rep.score == rep.total
    return 0 if full else 1


if __name__ == "__main__":
    sys.exit(main())
