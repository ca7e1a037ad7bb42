"""An exercise bundle for learners, without the solutions: `make bundle` -> dist/minite-course.zip

    python tools/bundle.py [--out dist/minite-course.zip]

Holds the tracked files (`git ls-files`, or the folder walked when there is no git) except solutions/ and
tests/ (whose grading tests read the solutions), .ci/, the raw benchmark logs and this script, plus a marker file
that makes the bundle's Makefile stand alone: `make test` runs the lessons, `make grade NB=...` a self-check of
the notebook's own check cells, `make check-fast` ruff. It refuses to write a bundle in which a notebook or an
exercise still holds a solution region. Grading for credit stays with the instructor, who keeps solutions/:
`make grade NB=<a learner's exercise>` in the full repository.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = ("solutions/", "tests/", "dist/", ".git/", ".venv/", "build/", ".ci/", "benchmarks/results/logs_",
            "tools/bundle.py")
MARK = ".learner-bundle"  # the Makefile sees it: test = the lessons, grade = a self-check, check-fast = ruff
BEGIN = "### BEGIN SOLUTION"


def files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return sorted(n for n in names if not n.startswith(LEFT_OUT) and "__pycache__" not in n
                  and (root / n).is_file())


def _lines(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        try:
            cells = json.loads(text).get("cells", [])
            return [ln for c in cells for src in [c.get("source", "")]
                    for ln in ("".join(src) if isinstance(src, list) else src).splitlines()]
        except (ValueError, AttributeError):
            pass
    return text.splitlines()


def bundle(root: Path, out: Path) -> list[str]:
    names = files(root)
    leaks = [n for n in names if n.startswith(("notebooks/", "exercises/")) and n.endswith((".py", ".ipynb"))
             and any(line.strip() == BEGIN for line in _lines(root / n))]
    if leaks:
        raise SystemExit(f"refusing to bundle: solution regions in {leaks}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for n in names:
            z.write(root / n, f"minite-course/{n}")
        z.writestr(f"minite-course/{MARK}", "A learner's bundle: no solutions/, no tests/ (make test runs the lessons; "
                   "make grade NB=... runs a self-check; grading for credit is your instructor's).\n")
    return names


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(ROOT))
    p.add_argument("--out", default=str(ROOT / "dist" / "minite-course.zip"))
    a = p.parse_args()
    names = bundle(Path(a.root), Path(a.out))
    print(f"wrote {a.out}: {len(names)} files, no solutions/ (and no tests/)")
    sys.exit(0)
