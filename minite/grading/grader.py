"""grade(): score a student's notebook against the pristine solution notebook of the course.

In order: assemble the graded notebook (the solution with the student's answers spliced in); import what judging
needs; run the solution (the reference run, cached) and judge it against itself; run the student's notebook in a
scratch folder, confined where Landlock is available, with every import of minite refused in the grader; once its
kernel and processes are dead, judge its records.

Threat model. The student's notebook is arbitrary code run with the grader's user id. It must not be able to
(1) change its own score other than by computing right answers, (2) change a later grade, or the grader, through
a file it writes (a module planted where a later Python process imports it, an edited solution, checker, grader
or package in the virtual environment), (3) have another person's work undone or be blamed for it. Hence:
* The kernel runs ``python -P -s`` in its own scratch folder: nothing it can write is on its import path before
  it writes it, and the folder is deleted after the run. The grader's own process does not import from its working
  directory: ``make grade`` runs ``python -I``; ``python -m minite.grading`` drops the working directory from
  sys.path first and refuses to grade if something was imported from there before it could (cli.py).
* Confined (Landlock, confine.py): the kernel and everything it starts can write nothing outside the scratch
  folder and /dev. A write to the course, the virtual environment, the home folder or /tmp fails with
  PermissionError and the report names it. Nothing of the course changes, so nothing is put back, and a change
  made meanwhile (an instructor's edit) is someone else's: it stays, the notebook is not blamed.
* Not confined (no Landlock: an old kernel, macOS): the grader cannot stop a write and cannot tell the notebook's
  writes from a concurrent edit. It names every path of the course, the virtual environment, the solution's and
  the notebook's folders that changed during the run, keeps them as they are, and says so: grade for credit where
  Landlock is available (the report's ``confinement`` line says which), or as another user, in a container.
* Out of scope: a process outside the kernel that acts for it (a same-user service it can reach over a socket),
  reading what the user can read (solutions/: ship ``make bundle``), and answers computed with the library.
"""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from . import confine
from .assembly import assemble
from .guard import Snapshot, sealed_imports
from .judge import _judge, ready
from .notebook import (
    EXERCISE_SUFFIX,
    _repo_root,
    check_cells,
    exercise_name,
    solution_name,
    stub_source,
    task_cells,
    task_name,
    task_points,
)
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
    confinement: str = ""  # how the student's process was kept from writing (threat model: grader.py)
    points: dict[str, int | float] = field(default_factory=dict)  # check -> its worth (the solution's; default 1)

    def worth(self, name: str) -> int | float:
        return self.points.get(name, 1)

    @property
    def score(self) -> int | float:
        """Points earned: the worth of every passed check (one each unless the solution's task says)."""
        return sum(self.worth(n) for n in self.passed)

    @property
    def total(self) -> int | float:
        return sum(self.worth(n) for n in self.passed + self.failed)

    def tasks(self) -> list[dict]:
        """One row per check, in notebook order: name, passed, points, earned, reason (the JSON/CSV rows)."""
        return [{"task": n, "passed": n in self.passed, "points": self.worth(n),
                 "earned": self.worth(n) if n in self.passed else 0, "reason": self.reasons.get(n, "")}
                for n in self.order or self.passed + self.failed]

    def summary(self) -> str:
        lines = [f"{self.notebook}", f"  solution: {self.solution}"] + \
            ([f"  confinement: {self.confinement}"] if self.confinement else [])
        rows = self.tasks()
        width = max([len(r["task"]) for r in rows], default=0)
        for r in rows:
            why = f": {r['reason']}" if r["reason"] else ""
            pts = f"{_num(r['earned'])}/{_num(r['points'])}"
            lines.append(f"  {'PASS' if r['passed'] else 'FAIL'}  {r['task']:<{width}}  {pts}{why}")
        lines += [f"  note: {e}" for e in self.errors]
        lines.append(f"score: {_num(self.score)}/{_num(self.total)}")
        return "\n".join(lines)


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def course_solution(student: Path) -> Path:
    """solutions/<the notebook's name> of the course this grader belongs to (the repository, for an editable
    install): never a file beside the submitted notebook, which its author controls. A renamed copy
    (work/00_mine.ipynb) gets the one course solution whose task names are the notebook's."""
    solutions = _repo_root() / "solutions"
    path = solutions / solution_name(student.name)  # 03_rmsnorm_exercise.ipynb, or its old name 03_rmsnorm.ipynb
    if path.exists():
        return path
    names = _task_names(student)
    matches = [p for p in sorted(solutions.glob("*.ipynb")) if names and _task_names(p) == names]
    if len(matches) == 1:
        return matches[0]
    found = f"{len(matches)} course solutions have" if matches else "no course solution has"
    raise FileNotFoundError(f"no solutions/{solution_name(student.name)} in the course at {_repo_root()}, and "
                            f"{found} this notebook's tasks {sorted(names)}; pass --solution (make grade SOLUTION=...)")


def missing(student: Path) -> str:
    """Why `student` cannot be graded when it does not exist, naming the file under the exercise's other name
    (exercises are NN_topic_exercise.ipynb; they were NN_topic.ipynb) when that one exists."""
    stem = student.stem
    other = student.with_name(solution_name(student.name) if stem.endswith(EXERCISE_SUFFIX)
                              else exercise_name(student.name))
    if other.exists() and other.suffix == ".ipynb":
        return (f"notebook to grade not found: {student}; did you mean {other}? (exercises are named "
                f"NN_topic{EXERCISE_SUFFIX}.ipynb now; one saved under the old name NN_topic.ipynb grades as well)")
    return f"notebook to grade not found: {student}"


def _task_names(path: Path) -> set[str]:
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:  # not a notebook: the grader reports it when it reads it
        return set()
    return {name for cell in nb.cells if (name := task_name(cell))}


def _confinement() -> int:
    """The Landlock ABI the student's kernel is confined with (0: not confined; MINITE_GRADE_CONFINE=0 turns it
    off, for the tests of the unconfined path)."""
    return 0 if os.environ.get("MINITE_GRADE_CONFINE") == "0" else confine.usable()


def unreadable(student, solution, why: str) -> GradeReport:
    """The report of a notebook that cannot be graded: one line saying why, every check of the solution (when
    it is known) failed."""
    report = GradeReport(notebook=str(student), solution=str(solution or ""), errors=[why])
    try:
        sol = nbformat.read(solution, as_version=4) if solution else None
        names = [name for _, name in check_cells(sol)] if sol else []
        report.points = task_points(sol, str(solution)) if sol else {}
    except Exception:  # noqa: BLE001 - the solution's own problem is reported when it is graded against
        names = []
    for name in names:
        report.failed.append(name)
        report.order.append(name)
        report.reasons[name] = "not graded: the notebook could not be read"
    return report


def _read_student(student: Path):
    """The student's notebook, or the one line that says why it cannot be read."""
    try:
        return nbformat.read(student, as_version=4), ""
    except OSError as err:
        return None, f"cannot read {student}: {err.strerror or err}"
    except UnicodeDecodeError as err:
        return None, f"{student} is not a notebook: not UTF-8 text ({err.reason} at byte {err.start})"
    except Exception as err:  # noqa: BLE001 - nbformat's NotJSONError, ValidationError, a JSON list...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        return None, f"{student} is not a readable notebook (.ipynb JSON): {type(err).__name__}: {first}"


def grade(student: str | Path, solution: str | Path | None = None, *, timeout: int = DEFAULT_TIMEOUT,
          lint: bool = True) -> GradeReport:
    """Grade a student's notebook against the pristine solution notebook; see the package doc and the threat
    model above. `lint=False` skips the answer lint (tests use it to show that the records alone hold)."""
    student = Path(student)
    if not student.exists():
        raise FileNotFoundError(missing(student))
    if timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    solution = (Path(solution) if solution else course_solution(student)).resolve()
    data = solution.read_bytes()
    sol_nb = nbformat.reads(data.decode(), as_version=4)
    if not check_cells(sol_nb):
        raise ValueError(f"{solution} has no check cells (code cells with metadata minite={{'check': NAME}})")
    tasks = task_cells(sol_nb, str(solution))
    points = task_points(sol_nb, str(solution))  # the course's, never the student's copy of the metadata
    student_nb, why = _read_student(student)
    if student_nb is None:
        return unreadable(student, solution, why)
    notes: list[str] = []
    untouched = _untouched(student_nb, sol_nb, tasks)
    graded = assemble(student_nb, sol_nb, notes, lint=lint)
    nb, tests = _prepare(graded, "student", timeout)
    abi = _confinement()
    was_dumpable = _dumpable(False)
    try:
        ready()
        reference = _reference(solution, sol_nb, hashlib.sha256(data).hexdigest(), timeout, abi > 0)
        for name, records in reference.items():  # the solution against itself: also loads every judging path
            why = _judge(name, tests[name], records, records)
            if why:
                raise RuntimeError(f"{solution}: the solution's own check {name!r} fails against itself: {why}")
        watched = None if abi else Snapshot([_repo_root(), Path(sys.prefix), solution.parent, student.parent],
                                            _repo_root())
        with sealed_imports():
            cells = _execute(nb, timeout, confined=abi > 0)  # the kernel and its processes are dead when it returns
            report = GradeReport(notebook=str(student), solution=str(solution), errors=notes, points=points)
            if abi:
                report.confinement = (f"Landlock (ABI {abi}): the notebook could write only in its own scratch "
                                      "folder")
            else:
                report.confinement = ("none (no Landlock here): every file that changed in the course while the "
                                      "notebook ran is named below and kept as it is")
                _changed_meanwhile(report, watched.changed())
            _score(report, nb, cells, tests, reference, tasks, timeout, untouched)
    finally:
        _dumpable(was_dumpable)
    return report


def _changed_meanwhile(report: GradeReport, changed: list[str]) -> None:
    if changed:
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        report.errors.append(f"changed while this notebook ran, by it or by another process (unconfined: the grader "
                             f"cannot tell which), kept as they are, check them before the next grade: {shown}")


def _untouched(student_nb, sol_nb, tasks: dict[str, int]) -> set[str]:
    """Tasks whose (one) cell in the student's notebook is still the exercise's stub, character for character."""
    mine: dict[str, list[str]] = {}
    for cell in student_nb.cells:
        if name := task_name(cell):
            mine.setdefault(name, []).append(cell.source)
    return {name for name, i in tasks.items() if mine.get(name) == [stub_source(sol_nb.cells[i].source, name)]}


def _refused(error: str) -> bool:
    return error.startswith("PermissionError") or "[Errno 13]" in error or "[Errno 1] Operation not permitted" in error


def _score(report, nb, cells, tests, reference, tasks, timeout, untouched=frozenset()) -> None:
    """Judge every check of the student's run into `report`."""
    check_idx = {i for i, _ in check_cells(nb)}
    task_idx = {tasks[n] + 1: n for n in tasks}
    for i, name in check_cells(nb):
        task_cell = tasks.get(name)
        if task_cell is not None and cells[task_cell + 1].timed_out:
            why = f"timed out after {timeout} s (in the task cell)"
        elif not cells[i].ok:
            why = cells[i].error
        else:
            why = _judge(name, tests[name], cells[i].records, reference.get(name, []))
        if why and name in untouched:
            why = "not attempted (its task cell is still the exercise's stub)"
        if why:
            report.failed.append(name)
            report.reasons[name] = why
        else:
            report.passed.append(name)
        report.order.append(name)
    for i, c in enumerate(cells):
        if i and not c.ok and not c.error.startswith("not run") and (i not in check_idx or _refused(c.error)):
            what = f"task {task_idx[i]!r}" if i in task_idx else f"code cell {i - 1}"
            if _refused(c.error) and report.confinement.startswith("Landlock"):
                report.errors.append(f"{what} tried to write outside its scratch folder (refused, nothing "
                                     f"changed): {c.error}")
            else:
                report.errors.append(f"{what} failed: {c.error}")
