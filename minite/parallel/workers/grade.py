"""Exercise grading on real ranks (chapters 10-13): the learner's function, imported by every torchrun worker.

    ok, message = run_graded(source, "sharded_sgd_step", world=2)       # a notebook's check cell

writes `source` (the learner's function) to student.py and launches ``python -m minite.parallel.workers TASK
--file student.py``: every rank imports it, runs it on its own data and compares with what one process computes.
A task is a check of its chapter's file, written as ``@graded("task", tol) def grade(dims, student) -> max error``.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import re
import tempfile
import textwrap
from pathlib import Path

__all__ = ["Wrong", "graded", "load", "run_graded"]


class Wrong(Exception):
    """The learner's answer is wrong in a way that is not a number (a wrong step order): the message says how."""


def load(path: str):
    """The learner's file as a module."""
    spec = importlib.util.spec_from_file_location("student", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def graded(task: str, tol: float):
    """``@graded(task, tol)`` turns ``grade(dims, student) -> max error`` into the task's check: it imports the
    learner's file (--file) and reports {task: {"ok": err < tol, "err": err}}. An exception in the learner's code
    (or ``Wrong``) is reported as the result, on every rank that meets it, instead of ending the run."""
    def wrap(grade):
        @functools.wraps(grade)
        def check(dims, args) -> dict:
            try:
                err = grade(dims, load(args.file))
            except Wrong as e:
                return {task: {"ok": False, "err": math.inf, "why": str(e)}}
            except Exception as e:  # the learner's code raised
                return {task: {"ok": False, "err": math.inf, "why": f"raised {type(e).__name__}: {e}"}}
            return {task: {"ok": bool(err < tol), "err": err}}
        return check
    return wrap


def unwritten(source: str) -> str | None:
    """The name of `source`'s first function when its first statement (after a docstring) raises
    NotImplementedError, as the exercise's stub does: every rank would raise it before doing anything. Else None."""
    import ast
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None  # the launch reports it, from the file the ranks import
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None:
        return None
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and \
        isinstance(fn.body[0].value, ast.Constant) and isinstance(fn.body[0].value.value, str) else fn.body
    exc = body[0].exc if body and isinstance(body[0], ast.Raise) else None
    exc = exc.func if isinstance(exc, ast.Call) else exc
    return fn.name if isinstance(exc, ast.Name) and exc.id == "NotImplementedError" else None


def run_graded(source: str, task: str, world: int = 2, timeout: float = 120) -> tuple[bool, str]:
    """The check cell's call: write `source` (the learner's function and what it defines) to a file, torchrun
    the task on `world` ranks (CPU tensors over gloo), collect every rank's result; (ok, message). A function that
    is still the exercise's stub is not launched (its ranks could only raise NotImplementedError)."""
    if name := unwritten(source):
        return False, (f"{task}: {name} still raises NotImplementedError before anything else: write its body in "
                       "the task cell, run that cell, then this check")
    from minite.parallel.launch import results, torchrun
    d = Path(tempfile.mkdtemp(prefix="minite_grade_"))
    student = d / "student.py"
    student.write_text("import torch\nimport torch.distributed as dist\n" + textwrap.dedent(source))
    res = torchrun(world, ["-m", "minite.parallel.workers", task, "--file", str(student), "--out", str(d)],
                   timeout=timeout)
    got = [rep[task] for rep in results(d).values()]
    if len(got) != world:
        errs = [ln for ln in res.stdout.splitlines() if re.match(r"\[rank\d+\]: \w*(Error|Exception)\b", ln)]
        return False, f"{task}: the torchrun run failed (exit {res.returncode}): " + (errs[0] if errs else "")
    why = [r["why"] for r in got if "why" in r]
    if why:
        return False, f"{task}: {why[0]}"
    if all(r["ok"] for r in got):
        return True, f"{task} on {world} ranks: matches the single-process result"
    worst = max(r["err"] for r in got)
    return False, f"{task} on {world} ranks: max error {worst:.1e}, too large"
