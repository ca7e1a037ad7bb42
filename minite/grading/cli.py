"""The command line: ``python -m minite.grading grade ...`` / ``selfcheck NB`` / ``generate [--check]``.

``grade`` prints nothing until every notebook is graded and every process their kernels started is dead. It then
writes the reports (JSON) to a file it creates itself (``--report PATH``, or report.json in a new temporary
folder), prints that file's path and each notebook's summary, and ends with the last notebook's ``score: k/n``
line. A line that appears on the grader's output before that (a process of a student's kernel may have written
it) is not the grader's: read the report file, or the last line.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import tempfile
from pathlib import Path

from . import __doc__ as _package_doc
from .grader import _read_student, grade, missing, unreadable
from .notebook import _repo_root, generate_all
from .sandbox import DEFAULT_TIMEOUT


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minite.grading", description=_package_doc.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grade", help="score a student's notebook: prints 'score: k/n' last")
    g.add_argument("notebook", nargs="+")
    g.add_argument("--solution", help="the pristine solution notebook (default: the course's solutions/<same name>)")
    g.add_argument("--json", action="store_true", help="print each report as JSON")
    g.add_argument("--strict", action="store_true", help="exit 1 unless every task scores (for CI); without it "
                   "a completed grading exits 0 whatever the score")
    g.add_argument("--report", help="write the reports (JSON) to this file (default: report.json in a new "
                                    "temporary folder; its path is printed)")
    g.add_argument("--csv", help="also write one row per task (notebook, solution, task, passed, points, earned, "
                                 "reason) and a TOTAL row per notebook to this CSV file")
    g.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT,
                   help=f"seconds each cell may run (a task's cell, its check) before it fails (default "
                        f"{DEFAULT_TIMEOUT})")
    sc = sub.add_parser("selfcheck", help="run a notebook and report its own check cells (a learner's bundle has "
                        "no solutions/ to grade against: this is a self-check, not a grade)")
    sc.add_argument("notebook")
    sc.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT)
    gen = sub.add_parser("generate", help="write exercises/ from solutions/")
    gen.add_argument("--solutions", default=str(_repo_root() / "solutions"))
    gen.add_argument("--exercises", default=str(_repo_root() / "exercises"))
    gen.add_argument("--check", action="store_true", help="only report exercises that are out of date (exit 1)")
    gen.add_argument("--force", action="store_true", help="also overwrite an exercise whose cells were edited "
                     "after it was generated (by default it is kept, and the command says so and exits 1)")
    return p


def _generate(args) -> int:
    notes: list[str] = []
    stale = generate_all(Path(args.solutions), Path(args.exercises), check=args.check, force=args.force,
                         notes=notes)
    if args.check:
        if stale:
            print("exercises out of sync with solutions (run `make exercises`): " + ", ".join(stale))
            return 1
        print("exercises in sync with solutions")
        return 0
    print(f"wrote {len(stale)} exercise notebook(s)" + (": " + ", ".join(stale) if stale else ""))
    for note in notes:
        print(f"  {note}")
    return 1 if any(n.startswith("not overwritten") for n in notes) else 0


def _selfcheck(args) -> int:
    """Run the notebook as it is and say which of its check cells passed. Its check cells are the student's own
    copy, so this is feedback, not a grade (grading swaps in the course's pristine checks: `grade`)."""
    from .grader import GradeReport, _num
    from .notebook import check_cells, stub_source, task_name, task_points
    from .sandbox import _execute
    nb, why = _read_student(Path(args.notebook))
    if nb is None and not Path(args.notebook).exists():
        why = missing(Path(args.notebook))
    if nb is None:
        print(f"error: {why}")
        return 2
    checks = check_cells(nb)
    stubs = set()  # tasks whose cell is still the exercise's stub (stubbing it again changes nothing)
    for cell in nb.cells:
        name = task_name(cell)
        if name and stub_source(cell.source, name) == cell.source:
            stubs.add(name)
    try:
        points = task_points(nb)  # this notebook's own metadata: feedback, as the checks are
    except ValueError:
        points = {}
    cells = _execute(nb, args.timeout)
    rep = GradeReport(notebook=args.notebook, points=points)
    for index, name in checks:
        (rep.passed if cells[index].ok else rep.failed).append(name)
        rep.order.append(name)
        if not cells[index].ok:
            rep.reasons[name] = ("not attempted (its task cell is still the exercise's stub)" if name in stubs
                                 else cells[index].error)
    for line in rep.summary().splitlines()[2:-1]:  # the task lines: PASS/FAIL, points, why
        print(line)
    print(f"self-check (this notebook's own check cells, not a grade): {_num(rep.score)}/{_num(rep.total)}")
    return 0


def _write_report(text: str, path: str | None) -> Path:
    """Write `text` to `path` (through a new file renamed over it: a link planted there is replaced, not
    followed), or to report.json in a new private temporary folder."""
    if path is None:
        target = Path(tempfile.mkdtemp(prefix="minite-grade-report-")) / "report.json"
    else:
        target = Path(path).resolve()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)
    return target


def _cell(value):
    """A CSV field a spreadsheet shows as text: a reason or name starting like a formula gets a quote first."""
    return "'" + value if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _csv(reports) -> str:
    """The reports as CSV: a row per task, then a TOTAL row per notebook (points earned of points possible)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["notebook", "solution", "task", "passed", "points", "earned", "reason"])
    for rep in reports:
        rows = [[r["task"], int(r["passed"]), r["points"], r["earned"], r["reason"]] for r in rep.tasks()]
        rows.append(["TOTAL", len(rep.passed), rep.total, rep.score, "; ".join(rep.errors)])
        for row in rows:
            w.writerow([_cell(v) for v in [rep.notebook, rep.solution, *row]])
    return out.getvalue()


def _grade_one(nb: str, args, lint: bool):
    """grade(), or a report with one line saying why this notebook cannot be graded (no traceback; score 0)."""
    try:
        return grade(nb, args.solution, timeout=args.timeout, lint=lint)
    except (OSError, ValueError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        _, why = _read_student(Path(nb)) if Path(nb).exists() else (None, "")
        return unreadable(nb, None, why or f"not graded: {first}")  # no solution found: the notebook may be why


def main(argv: list[str] | None = None, *, lint: bool = True) -> int:
    """The command line. `lint=False` skips the answer check (tests: the verdict holds without it)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.cmd == "generate":
        return _generate(args)
    if args.timeout <= 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.cmd == "selfcheck":
        return _selfcheck(args)
    if args.solution and len(args.notebook) > 1:
        p.error("--solution applies to a single notebook")
    reports = [_grade_one(nb, args, lint) for nb in args.notebook]
    dicts = [rep.__dict__ | {"score": rep.score, "total": rep.total, "tasks": rep.tasks()} for rep in reports]
    where = _write_report(json.dumps(dicts, indent=1) + "\n", args.report)
    if args.csv:
        _write_report(_csv(reports), args.csv)
    sys.stdout.flush()
    if args.json:
        print(f"report: {where}", file=sys.stderr)
        for d in dicts:
            print(json.dumps(d))
    else:
        print(f"report: {where}")
        for rep in reports:
            print(rep.summary())
    if args.strict:
        return 0 if all(rep.total and rep.score == rep.total for rep in reports) else 1  # 0/0: not graded
    return 0
