"""An exercise bundle for learners, without the solutions: `make bundle` -> dist/minite-course.zip

    python tools/bundle.py [--out dist/minite-course.zip]

Holds the tracked files (`git ls-files`, or the folder walked when there is no git) except solutions/ and
tests/ (whose grading tests read the solutions), .ci/, the raw benchmark logs and the tools a learner does not
run (this script and its templates, the wheel smoke test, the solutions/exercises sync check) and the
chapter authors' template (docs/), plus:
  README.md                   the learner's own (tools/bundle_README.md, the chapter list filled in), replacing the
                              course repository's, which is written for whoever maintains and grades the course
  exercises/test_exercises.py (tools/bundle_test_exercises.py) every exercise runs and fails only at its stubs
  .learner-bundle             the marker that makes the bundle's Makefile stand alone: `make test` runs the lessons
                              and the exercises, `make check NB=...` (and `make grade`) a self-check of the
                              notebook's own check cells, `make check-fast` ruff and the budgets
It refuses to write a bundle in which a notebook or an exercise still holds a solution region.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
LEFT_OUT = ("solutions/", "tests/", "dist/", ".git/", ".venv/", "build/", ".ci/", "benchmarks/results/logs_",
            "tools/bundle", "tools/wheel_smoke.py", "tools/check_notebooks.py", "docs/chapter_template.md")
MARK = ".learner-bundle"  # the Makefile sees it: test = lessons + exercises, grade = check = a self-check
BEGIN = "### BEGIN SOLUTION"
EXERCISE_TEST = "exercises/test_exercises.py"
EXERCISE = "_exercise.ipynb"  # lesson notebooks/NN_topic.ipynb -> exercise exercises/NN_topic_exercise.ipynb


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


def _title(path: Path) -> str:
    """The first markdown heading of a notebook (its chapter title), or its file name."""
    try:
        cells = json.loads(path.read_text()).get("cells", [])
    except (OSError, ValueError, AttributeError):
        return path.stem
    for c in cells:
        src = c.get("source", "")
        for line in ("".join(src) if isinstance(src, list) else src).splitlines():
            if c.get("cell_type") == "markdown" and line.startswith("#"):
                return line.lstrip("#").strip()
    return path.stem


def readme(root: Path, names: list[str]) -> str:
    """The learner's README: tools/bundle_README.md with its chapter list, one line per lesson in the bundle."""
    lines = []
    for n in names:
        if n.startswith("notebooks/") and n.endswith(".ipynb"):
            ex = "exercises/" + n.split("/", 1)[1].removesuffix(".ipynb") + EXERCISE  # its own JupyterLab tab
            lines.append(f"- {_title(root / n)}: [lesson]({n})" + (f", [exercise]({ex})" if ex in names else ""))
    return (TOOLS / "bundle_README.md").read_text().replace("{{CHAPTERS}}", "\n".join(lines))


def _writestr(z: zipfile.ZipFile, name: str, text: str) -> None:
    """A generated file, stored rw-r--r-- like the copied ones (writestr with a bare name stores it 0600)."""
    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
    info.external_attr = 0o100644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, text)


def bundle(root: Path, out: Path) -> list[str]:
    names = files(root)
    leaks = [n for n in names if n.startswith(("notebooks/", "exercises/")) and n.endswith((".py", ".ipynb"))
             and any(line.strip() == BEGIN for line in _lines(root / n))]
    if leaks:
        raise SystemExit(f"refusing to bundle: solution regions in {leaks}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for n in names:
            if n != "README.md":
                z.write(root / n, f"minite-course/{n}")
        _writestr(z, "minite-course/README.md", readme(root, names))
        z.write(TOOLS / "bundle_test_exercises.py", f"minite-course/{EXERCISE_TEST}")
        _writestr(z, f"minite-course/{MARK}", "A learner's bundle: make test runs the lessons and the exercises; "
                   "make check NB=... is a self-check of a notebook's own check cells.\n")
    return names


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(ROOT))
    p.add_argument("--out", default=str(ROOT / "dist" / "minite-course.zip"))
    a = p.parse_args()
    names = bundle(Path(a.root), Path(a.out))
    print(f"wrote {a.out}: {len(names)} files, no solutions/ (and no tests/)")
    sys.exit(0)
