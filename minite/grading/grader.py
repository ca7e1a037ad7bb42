"""grade(): score a student's notebook against the pristine solution notebook of the course.

In order: assemble the graded notebook (the solution with the student's answers spliced in); import what judging
needs; run the solution (the reference run, cached) and judge it against itself; copy the course's files; run the
student's notebook with every import of minite refused; once its kernel and processes are dead, put back any
course file it changed (the notebook then scores 0) and judge its records. Nothing the student's code wrote runs in
the grader or reaches a later grade.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .assembly import assemble
from .guard import CourseFiles, sealed_imports
from .judge import _judge, ready
from .notebook import _repo_root, check_cells, stub_source, task_cells, task_name
from .sandbox import DEFAULT_TIMEOUT, _dumpable, _execute, _prepare, _reference


@dataclass
class GradeReport:
    notebook: str
    solution: str = ""  # the solution notebook graded against
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
        lines = [f"{self.notebook}", f"  solution: {self.solution}"]
        for n in self.order or self.passed + self.failed:
            why = f": {self.reasons[n]}" if self.reasons.get(n) else ""
            lines.append(f"  PASS  {n}" if n in self.passed else f"  FAIL  {n}{why}")
        lines += [f"  note: {e}" for e in self.errors]
        lines.append(f"score: {self.score}/{self.total}")
        return "\n".join(lines)


def course_solution(student: Path) -> Path:
    """solutions/<the notebook's name> of the course this grader belongs to (the repository, for an editable
    install): never a file beside the submitted notebook, which its author controls. A renamed copy
    (work/00_mine.ipynb) gets the one course solution whose task names are the notebook's."""
    solutions = _repo_root() / "solutions"
    path = solutions / student.name
    if path.exists():
        return path
    names = _task_names(student)
    matches = [p for p in sorted(solutions.glob("*.ipynb")) if names and _task_names(p) == names]
    if len(matches) == 1:
        return matches[0]
    found = f"{len(matches)} course solutions have" if matches else "no course solution has"
    raise FileNotFoundError(f"no solutions/{student.name} in the course at {_repo_root()}, and {found} this "
                            f"notebook's tasks {sorted(names)}; pass --solution (make grade SOLUTION=...)")


def _task_names(path: Path) -> set[str]:
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:  # not a notebook: the grader reports it when it reads it
        return set()
    return {name for cell in nb.cells if (name := task_name(cell))}


def grade(student: str | Path, solution: str | Path | None = None, *, timeout: int = DEFAULT_TIMEOUT,
          lint: bool = True) -> GradeReport:
    """Grade a student's notebook against the pristine solution notebook; see the package doc.
    `lint=False` skips the answer lint (tests use it to show that the records alone hold)."""
    student = Path(student)
    if not student.exists():
        raise FileNotFoundError(f"notebook to grade not found: {student}")
    if timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    solution = (Path(solution) if solution else course_solution(student)).resolve()
    data = solution.read_bytes()
    sol_nb = nbformat.reads(data.decode(), as_version=4)
    if not check_cells(sol_nb):
        raise ValueError(f"{solution} has no check cells (code cells with metadata minite={{'check': NAME}})")
    tasks = task_cells(sol_nb, str(solution))
    notes: list[str] = []
    student_nb = nbformat.read(student, as_version=4)
    untouched = _untouched(student_nb, sol_nb, tasks)
    graded = assemble(student_nb, sol_nb, notes, lint=lint)
    nb, tests = _prepare(graded, "student", timeout)
    was_dumpable = _dumpable(False)
    try:
        ready()
        reference = _reference(solution, sol_nb, hashlib.sha256(data).hexdigest(), timeout)
        for name, records in reference.items():  # the solution against itself: also loads every judging path
            why = _judge(name, tests[name], records, records)
            if why:
                raise RuntimeError(f"{solution}: the solution's own check {name!r} fails against itself: {why}")
        files = CourseFiles([Path(__file__).resolve().parents[1], _repo_root() / "solutions"], [solution],
                            _repo_root())
        with sealed_imports():
            cells = _execute(nb, timeout)  # the kernel and its processes are dead when this returns
            changed = files.restore()
            report = GradeReport(notebook=str(student), solution=str(solution), errors=notes)
            _score(report, nb, cells, tests, reference, tasks, timeout, changed, untouched, files.kept)
    finally:
        _dumpable(was_dumpable)
    return report


def _untouched(student_nb, sol_nb, tasks: dict[str, int]) -> set[str]:
    """Tasks whose cell in the student's notebook is still the exercise's stub, character for character."""
    mine = {name: cell.source for cell in student_nb.cells if (name := task_name(cell))}
    return {name for name, i in tasks.items() if mine.get(name) == stub_source(sol_nb.cells[i].source, name)}


def _score(report, nb, cells, tests, reference, tasks, timeout, changed: list[str], untouched=frozenset(),
           kept=None) -> None:
    """Judge every check of the student's run into `report`."""
    tampered = ""
    if changed:
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        tampered = f"your notebook changed files of the course (they were put back): {shown}"
        if kept:
            tampered += f"; what it left there is kept in {kept}"
        report.errors.append(tampered)
    check_idx = {i for i, _ in check_cells(nb)}
    task_idx = {tasks[n] + 1: n for n in tasks}
    for i, name in check_cells(nb):
        task_cell = tasks.get(name)
        if tampered:
            why = tampered
        elif task_cell is not None and cells[task_cell + 1].timed_out:
            why = f"timed out after {timeout} s (in the task cell)"
        elif not cells[i].ok:
            why = cells[i].error
        else:
            why = _judge(name, tests[name], cells[i].records, reference.get(name, []))
        if why and name in untouched and not tampered:
            why = "not attempted (its task cell is still the exercise's stub)"
        if why:
            report.failed.append(name)
            report.reasons[name] = why
        else:
            report.passed.append(name)
        report.order.append(name)
    for i, c in enumerate(cells):
        if i and not c.ok and i not in check_idx and not c.error.startswith("not run"):
            what = f"task {task_idx[i]!r}" if i in task_idx else f"code cell {i - 1}"
            report.errors.append(f"{what} failed: {c.error}")
