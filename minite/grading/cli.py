"""The command line: ``python -m minite.grading grade ...`` / ``generate [--check]``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import __doc__ as _package_doc
from .grader import grade
from .notebook import _repo_root, generate_all
from .sandbox import DEFAULT_TIMEOUT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minite.grading", description=_package_doc.split("\n\n")[0])
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

