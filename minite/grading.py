"""Exercise notebooks: generate them from solutions, and grade a student's copy tamper-proof.

Conventions (DESIGN.md §8)
--------------------------
* ``solutions/NN_topic.ipynb`` is the solved, executed notebook. Each answer sits between the lines
  ``### BEGIN SOLUTION`` and ``### END SOLUTION`` in a code cell.
* A *check cell* is a code cell tagged ``nbval-check-output`` whose first line is ``# CHECK: <name>``.
  It ends with an ``assert`` and prints ``PASS: ...``; nbval compares that output with the stored one.
* ``exercises/NN_topic.ipynb`` is generated: every solution region becomes ::

      ### BEGIN YOUR CODE
      raise NotImplementedError()
      ### END YOUR CODE

  at the same indentation; stored outputs are kept.

Grading
-------
nbval compares against the outputs stored *in the file it runs*, so a student could save a wrong answer with a
PASS output, or edit a check cell. ``grade`` therefore rebuilds the notebook from the solution notebook (every
cell, with its pristine outputs) and splices in only the student's *answers*: the code between
``### BEGIN YOUR CODE`` / ``### END YOUR CODE`` in each task cell (matched by cell id), with nbval's skip /
raises-exception comment markers stripped. Launchers and wrappers around an answer stay the solution's own, and
each check cell first reloads ``minite.testing`` (undoing a patched ``check_op``). It runs that with
``pytest --nbval-lax`` in a fresh kernel and scores the check cells: ``score: k/n``, with the reason of each
failure. Limits: the answers run in the same Python process as the checks, so deliberate monkeypatching of torch
itself is not prevented; review submitted code where that matters.

CLI::

    python -m minite.grading grade exercises/00_triton_from_zero.ipynb      # score a student's notebook
    python -m minite.grading generate [--check]                             # solutions/ -> exercises/
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

__all__ = ["make_exercise", "generate_all", "assemble", "grade", "GradeReport", "check_cells"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_YOURS, END_YOURS = "### BEGIN YOUR CODE", "### END YOUR CODE"
STUB = "raise NotImplementedError()"
# Put at the top of every check cell of the graded notebook: a fresh minite.testing, whatever the answers did.
_RELOAD = "import importlib as _il, minite.testing as _mt; _mt = _il.reload(_mt); from minite.testing import *"
CHECK_TAG = "nbval-check-output"
_CHECK_RE = re.compile(r"^\s*#\s*CHECK:\s*(.+?)\s*$")
# Tags / comment markers that would let a task cell opt out of being run or checked.
_ESCAPE_TAGS = {"nbval-skip", "raises-exception", "nbval-raises-exception", "nbval-ignore-output", CHECK_TAG}
_ESCAPE_COMMENTS = re.compile(r"^\s*#\s*(NBVAL_\w+)\s*$", re.MULTILINE)


# --------------------------------------------------------------------------------------------- generation
def _regions(source: str, where: str, markers=((BEGIN, END),)) -> list[tuple[int, int]]:
    """(first, last) line index of each answer region's markers, for any of the marker pairs."""
    out, start, pair = [], None, None
    lines = source.splitlines()
    for i, line in enumerate(lines):
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


def _stub_source(source: str, where: str) -> str:
    """Each solution region -> BEGIN YOUR CODE / raise NotImplementedError() / END YOUR CODE."""
    lines = source.splitlines()
    out, prev = [], 0
    for b, e in _regions(source, where):
        indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
        out += lines[prev:b] + [f"{indent}{BEGIN_YOURS}", f"{indent}{STUB}", f"{indent}{END_YOURS}"]
        prev = e + 1
    return "\n".join(out + lines[prev:])


def _splice(solution_src: str, student_src: str, where: str) -> str:
    """The solution cell with each region's body replaced by the student's answer for that region."""
    sol_lines, stu_lines = solution_src.splitlines(), student_src.splitlines()
    sol_reg = _regions(solution_src, where)
    stu_reg = _regions(student_src, where, ((BEGIN_YOURS, END_YOURS), (BEGIN, END)))
    if len(stu_reg) != len(sol_reg):
        raise ValueError(f"{where}: expected {len(sol_reg)} answer region(s) between '{BEGIN_YOURS}' and "
                         f"'{END_YOURS}', found {len(stu_reg)}")
    out, prev = [], 0
    for (b, e), (sb, se) in zip(sol_reg, stu_reg):
        answer = [ln for ln in stu_lines[sb + 1:se] if not _ESCAPE_COMMENTS.fullmatch(ln)]
        out += sol_lines[prev:b + 1] + answer + [sol_lines[e]]
        prev = e + 1
    return "\n".join(out + sol_lines[prev:])


def is_task_cell(cell) -> bool:
    return cell.cell_type == "code" and any(line.strip() == BEGIN for line in cell.source.splitlines())


def is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def check_name(cell) -> str:
    first = cell.source.splitlines()[0] if cell.source else ""
    m = _CHECK_RE.match(first)
    return m.group(1) if m else "unnamed check"


def check_cells(nb) -> list[tuple[int, str]]:
    """(code-cell index as nbval counts it, check name) for every check cell of `nb`."""
    out, code_idx = [], 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if is_check_cell(cell):
            out.append((code_idx, check_name(cell)))
        code_idx += 1
    return out


def make_exercise(solution_nb):
    """Return the exercise notebook for a solution notebook (a deep copy with solution regions stubbed)."""
    nb = copy.deepcopy(solution_nb)
    for i, cell in enumerate(nb.cells):
        if is_task_cell(cell):
            cell.source = _stub_source(cell.source, f"cell {i}")
    nb.metadata["minite"] = {"generated_from": "solutions/ by `make exercises`; edit the solution, not this file"}
    return nb


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def generate_all(solutions: Path, exercises: Path, check: bool = False) -> list[str]:
    """Write exercises/X.ipynb for every solutions/X.ipynb. With `check`, write nothing and return the
    names of exercises that are missing or out of date."""
    stale = []
    exercises.mkdir(parents=True, exist_ok=True)
    for sol in sorted(solutions.glob("*.ipynb")):
        ex_nb = make_exercise(nbformat.read(sol, as_version=4))
        text = nbformat.writes(ex_nb) + "\n"
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


# ---------------------------------------------------------------------------------------------- grading
def assemble(student_nb, solution_nb, notes: list[str] | None = None):
    """The notebook that is actually graded: the solution notebook with the student's answers spliced in.

    A task cell missing from the student's notebook, or whose answer markers were removed, stays stubbed (it
    scores nothing) and a line saying so is appended to `notes`."""
    notes = [] if notes is None else notes
    student_cells = {c.get("id"): c for c in student_nb.cells if c.cell_type == "code" and c.get("id")}
    graded = copy.deepcopy(solution_nb)
    for i, cell in enumerate(graded.cells):
        if is_check_cell(cell):
            first, _, rest = cell.source.partition("\n")
            cell.source = f"{first}\n{_RELOAD}\n{rest}"
        if not is_task_cell(cell):
            continue
        where = f"task cell {cell.get('id')} (cell {i})"
        mine = student_cells.get(cell.get("id"))
        try:
            if mine is None:
                raise ValueError(f"{where} not found in your notebook (deleted, or re-created with a new id?)")
            cell.source = _splice(cell.source, mine.source, where)
        except ValueError as err:
            notes.append(str(err))
            cell.source = _splice(cell.source, _stub_source(cell.source, where), where)
        cell.outputs, cell.execution_count = [], None
    return graded


@dataclass
class GradeReport:
    notebook: str
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # failed check -> why (the exception's last line)
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


def grade(student: str | Path, solution: str | Path | None = None, *, timeout: int = 600) -> GradeReport:
    """Grade a student's notebook against the pristine solution notebook with nbval; see module doc."""
    student = Path(student)
    if not student.exists():
        raise FileNotFoundError(f"notebook to grade not found: {student}")
    solution = Path(solution) if solution else _default_solution(student)
    sol_nb = nbformat.read(solution, as_version=4)
    notes: list[str] = []
    graded = assemble(nbformat.read(student, as_version=4), sol_nb, notes)
    checks = dict(check_cells(graded))
    if not checks:
        raise ValueError(f"{solution} has no check cells (code cells tagged {CHECK_TAG!r})")
    with tempfile.TemporaryDirectory(prefix="minite-grade-") as tmp:
        nb_path = Path(tmp) / student.name
        nbformat.write(graded, nb_path)
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        junit = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", str(nb_path), "--nbval-lax", "--nbval-current-env",
               f"--nbval-cell-timeout={timeout}", "-p", "no:cacheprovider", "-q", "-c", str(Path(tmp) / "pytest.ini"),
               "--rootdir", tmp, f"--junitxml={junit}"]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTEST_ADDOPTS", None)
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        if not junit.exists():
            raise RuntimeError(f"nbval did not run (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            m = re.search(r"Cell (\d+)", case.get("name", ""))
            if m:
                bad = [el for t in ("failure", "error", "skipped") if (el := case.find(t)) is not None]
                results[int(m.group(1))] = (not bad, _reason(bad[0]) if bad else "")
    report = GradeReport(notebook=str(student), errors=notes)
    for idx, name in sorted(checks.items()):
        ok, why = results.get(idx, (False, "not run"))
        (report.passed if ok else report.failed).append(name)
        report.order.append(name)
        if not ok:
            report.reasons[name] = why
    for idx, (ok, msg) in sorted(results.items()):
        if not ok and idx not in checks:
            report.errors.append(f"code cell {idx} failed: {msg}")
    return report


_ANSI = re.compile(r"(?:#x1B|\x1b)\[[0-9;]*m")
_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)$")


def _reason(el) -> str:
    """One readable line from nbval's junit failure: the exception's last line, or 'output differs'."""
    text = _ANSI.sub("", (el.get("message") or "") + "\n" + (el.text or ""))
    if "Cell outputs differ" in text:
        return "its output differs from the expected one"
    excs = [m.group(1).strip() for line in text.splitlines() if (m := _EXC.match(line.strip()))]
    return (excs[-1].rstrip(":") if excs else el.tag)[:200]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minite.grading", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grade", help="score a student's notebook: prints 'score: k/n'")
    g.add_argument("notebook", nargs="+")
    g.add_argument("--solution", help="the pristine solution notebook (default: solutions/<same name>)")
    g.add_argument("--json", action="store_true", help="print the report as JSON")
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
    full = True
    for nb in args.notebook:
        rep = grade(nb, args.solution)
        print(json.dumps(rep.__dict__ | {"score": rep.score, "total": rep.total}) if args.json else rep.summary())
        full &= rep.score == rep.total
    return 0 if full else 1


if __name__ == "__main__":
    sys.exit(main())
