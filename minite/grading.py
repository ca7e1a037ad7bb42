"""Exercise notebooks: generate them from solutions, and grade a student's copy tamper-proof.

Conventions (DESIGN.md §8)
--------------------------
* ``solutions/NN_topic.ipynb`` is the solved, executed notebook. Each answer sits between the lines
  ``### BEGIN SOLUTION`` and ``### END SOLUTION`` in a code cell.
* A *check cell* is a code cell tagged ``nbval-check-output`` whose first line is ``# CHECK: <name>``.
  It ends with an ``assert`` and prints ``PASS: ...``; nbval compares that output with the stored one.
* ``exercises/NN_topic.ipynb`` is generated: every solution region becomes ``raise NotImplementedError()``
  at the same indentation; stored outputs are kept.

Grading
-------
nbval compares against the outputs stored *in the file it runs*, so a student could save a wrong answer with a
PASS output, or edit a check cell. ``grade`` therefore rebuilds the notebook: the solution notebook's cells
(narrative, set-up and check cells, with their pristine outputs) plus the student's *task cells* only (the cells
that hold a solution region, matched by cell id), with nbval's skip / raises-exception markers stripped from
them. It runs that with ``pytest --nbval-lax`` in a fresh kernel and scores the check cells: ``score: k/n``.

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
STUB = "raise NotImplementedError()"
CHECK_TAG = "nbval-check-output"
_CHECK_RE = re.compile(r"^\s*#\s*CHECK:\s*(.+?)\s*$")
# Tags / comment markers that would let a task cell opt out of being run or checked.
_ESCAPE_TAGS = {"nbval-skip", "raises-exception", "nbval-raises-exception", "nbval-ignore-output", CHECK_TAG}
_ESCAPE_COMMENTS = re.compile(r"^\s*#\s*(NBVAL_\w+)\s*$", re.MULTILINE)


# --------------------------------------------------------------------------------------------- generation
def _stub_source(source: str, where: str) -> str:
    out, inside, indent = [], False, ""
    for lineno, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"{where}: line {lineno}: nested '{BEGIN}'")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB}")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{where}: line {lineno}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: '{BEGIN}' is never closed")
    return "\n".join(out)


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
def _sanitize_task_cell(cell):
    cell = copy.deepcopy(cell)
    tags = [t for t in cell.get("metadata", {}).get("tags", []) if t not in _ESCAPE_TAGS]
    cell.setdefault("metadata", {})["tags"] = tags
    cell.source = _ESCAPE_COMMENTS.sub("", cell.source)
    cell.outputs = []
    return cell


def assemble(student_nb, solution_nb):
    """The notebook that is actually graded: the solution's cells, with the student's task cells swapped in.

    A task cell missing from the student's notebook stays stubbed (it scores nothing)."""
    student_tasks = {c.get("id"): c for c in student_nb.cells if c.cell_type == "code" and c.get("id")}
    graded = copy.deepcopy(solution_nb)
    for i, cell in enumerate(graded.cells):
        if not is_task_cell(cell):
            continue
        mine = student_tasks.get(cell.get("id"))
        if mine is None:
            mine = copy.deepcopy(cell)
            mine.source = _stub_source(cell.source, f"cell {i}")
        graded.cells[i] = _sanitize_task_cell(mine)
        graded.cells[i]["id"] = cell.get("id")
    return graded


@dataclass
class GradeReport:
    notebook: str
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # non-check cells that raised (hints for the student)

    @property
    def score(self) -> int:
        return len(self.passed)

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.failed)

    def summary(self) -> str:
        lines = [f"{self.notebook}"]
        lines += [f"  PASS  {n}" for n in self.passed]
        lines += [f"  FAIL  {n}" for n in self.failed]
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
    graded = assemble(nbformat.read(student, as_version=4), sol_nb)
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
                bad = any(case.find(t) is not None for t in ("failure", "error", "skipped"))
                msg = ""
                for tag in ("failure", "error"):
                    el = case.find(tag)
                    if el is not None:
                        msg = (el.get("message") or "").splitlines()[0][:200] if el.get("message") else tag
                results[int(m.group(1))] = (not bad, msg)
    report = GradeReport(notebook=str(student))
    for idx, name in sorted(checks.items()):
        ok, _ = results.get(idx, (False, "not run"))
        (report.passed if ok else report.failed).append(name)
    for idx, (ok, msg) in sorted(results.items()):
        if not ok and idx not in checks:
            report.errors.append(f"code cell {idx} failed: {msg}")
    return report


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
