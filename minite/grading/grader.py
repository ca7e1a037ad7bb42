"""grade(): score a student's notebook against the pristine solution notebook."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .assemble import assemble
from .judge import _judge
from .notebook import _repo_root, check_cells, task_cells
from .sandbox import DEFAULT_TIMEOUT, _execute, _prepare, _reference


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
