"""The learner's bundle (`make bundle`, tools/bundle.py) works on its own, unzipped somewhere else (issue 26): its
own README, `make check NB=...` self-checks an exercise, and its `make test` runs the exercises, which may fail
only at their stubs (exercises/test_exercises.py, from tools/bundle_test_exercises.py)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)  # the environment running this test: the bundle's Makefile uses it, nothing is set up again


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    subprocess.run([sys.executable, str(ROOT / "tools" / "bundle.py"), "--out", str(out / "c.zip")], check=True,
                   capture_output=True)
    zipfile.ZipFile(out / "c.zip").extractall(out)
    return out / "minite-course"


def _env(course: Path) -> dict:
    # the notebook kernels import the bundle's minite, not the one installed in this environment
    return {**os.environ, "PYTHONPATH": str(course), "OMP_NUM_THREADS": "1"}


def test_the_bundle_has_a_learners_readme(course):
    text = (course / "README.md").read_text()
    assert text == text.replace("{{CHAPTERS}}", "")  # the chapter list was filled in
    assert "make check NB=exercises/00_triton_from_zero_exercise.ipynb" in text and "self-check" in text
    assert "[exercise](exercises/07_flash_attention_exercise.ipynb)" in text and "Flash attention" in text
    for word in ("solutions/", "instructor", "make grade", "BEGIN SOLUTION", "issue", "tests/"):
        assert word not in text, word  # nothing of the course's own upkeep or of grading others
    assert (course / "exercises" / "test_exercises.py").is_file()
    assert not (course / "tools" / "bundle_README.md").exists() and not (course / "docs").exists()
    # issue 37: the generated README.md and .learner-bundle were stored 0600 (unreadable to a shared group)
    with zipfile.ZipFile(course.parent / "c.zip") as z:
        modes = {i.filename.removeprefix("minite-course/"): (i.external_attr >> 16) & 0o777 for i in z.infolist()}
    assert modes["README.md"] == modes[".learner-bundle"] == 0o644, modes
    assert all(m & 0o044 == 0o044 for m in modes.values()), modes  # every file readable by group and others


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_bundles_make_test_runs_the_lessons_and_the_exercises(course):
    plan = subprocess.run(["make", "-n", "-o", str(VENV / ".minite-setup"), "test", f"VENV={VENV}"], cwd=course,
                          capture_output=True, text=True, check=True).stdout
    assert "-m pytest" in plan and " notebooks " in plan and "exercises/test_exercises.py" in plan, plan


@pytest.mark.notebook
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_check_self_checks_an_exercise_in_the_unzipped_bundle(course):
    stamp = VENV / ".minite-setup"  # -o: make never re-runs the set-up (pip) into this environment
    p = subprocess.run(["make", "-o", str(stamp), "check", f"VENV={VENV}",
                        "NB=exercises/00_triton_from_zero_exercise.ipynb"],
                       cwd=course, env=_env(course), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "pip install" not in p.stdout and f"{VENV}/bin/python -m minite.grading selfcheck" in p.stdout
    assert "self-check (this notebook's own check cells, not a grade): 0/4" in p.stdout, p.stdout
    # the blank tasks, each named and said to be untouched (issue 37: "InterpreterError: NotImplementedError()")
    untouched = "not attempted (its task cell is still the exercise's stub)"
    assert p.stdout.count("FAIL ") == 4 and p.stdout.count(f"0/1: {untouched}") == 4, p.stdout  # points per task


def _notebook(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for src, meta in cells:
        nb.cells.append(nbformat.v4.new_code_cell(src, metadata={"minite": meta} if meta else {}))
    return nb


STUBBED = "def area(r):\n    ### BEGIN YOUR CODE\n    raise NotImplementedError()\n    ### END YOUR CODE"
CHECK = "assert area(1.0) == 3.14\nprint('PASS: area')"


@pytest.mark.notebook
def test_the_bundles_exercise_test_fails_only_outside_the_stubs(course):
    ex = course / "exercises"
    cases = {  # name: cells (source, metadata); "98" and "99" sort after every chapter. (Solved: nothing fails.)
        "98_blank": [("import math", None), (STUBBED, {"task": "area"}), (CHECK, {"check": "area"}),
                     ("area(2.0)", None)],  # a lesson cell calling the unwritten function: the stub's error
        "99_broken": [("import math", None), (STUBBED, {"task": "area"}), (CHECK, {"check": "area"}),
                      ("1 / 0", None)],  # an error that is no stub's
        "99_check_first": [("import math", None), (CHECK.replace("area(1.0)", "math.pi"), {"check": "pi"}),
                           (STUBBED, {"task": "area"})],  # a check that fails before any unfinished task
    }
    for name, cells in cases.items():
        nbformat.write(_notebook(cells), ex / f"{name}.ipynb")
    p = subprocess.run([str(VENV / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0",
                        "exercises/test_exercises.py", "-k", " or ".join(cases)],
                       cwd=course, env=_env(course), capture_output=True, text=True, timeout=300)
    out = p.stdout
    assert "2 failed, 1 passed" in out, out[-4000:]
    assert "FAILED exercises/test_exercises.py::test_exercise_fails_only_at_its_stubs[99_broken]" in out
    assert "cell 3 (code): ZeroDivisionError" in out
    assert "FAILED exercises/test_exercises.py::test_exercise_fails_only_at_its_stubs[99_check_first]" in out
    assert "cell 1 (check 'pi'): AssertionError" in out
