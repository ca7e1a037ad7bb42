"""What keeps a graded notebook's writes out of the course (minite/grading/confine.py, guard.py): confined by
Landlock, the kernel writes nothing outside its scratch folder; unconfined, the grader names every change it sees
and keeps it (it cannot tell whose it is): nothing is ever put back or moved aside."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minite.grading.confine import usable
from minite.grading.guard import Snapshot
from minite.grading.sandbox import _CONFINE_SOURCE

PROBE = """
import os, sys
scratch, course = sys.argv[1], sys.argv[2]
def attempt(what, f):
    try:
        f()
        print(what, "done")
    except Exception as err:  # OSError; the child's failure: CalledProcessError
        print(what, "refused", type(err).__name__)
attempt("scratch", lambda: open(os.path.join(scratch, "ok.txt"), "w").write("x"))
attempt("course", lambda: open(os.path.join(course, "argparse.py"), "w").write("x"))
attempt("overwrite", lambda: open(os.path.join(course, "README.md"), "w").write("x"))
attempt("delete", lambda: os.unlink(os.path.join(course, "README.md")))
attempt("rename", lambda: os.rename(os.path.join(course, "README.md"), os.path.join(scratch, "r")))
attempt("link", lambda: os.link(os.path.join(course, "README.md"), os.path.join(scratch, "hard")))
attempt("child", lambda: __import__("subprocess").run(["touch", os.path.join(course, "child")], check=True)
        and None)
attempt("devnull", lambda: open(os.devnull, "w").write("x"))
"""


@pytest.mark.skipif(usable() < 1, reason="no Landlock on this system: the grader names changes instead (tested below)")
def test_a_confined_process_writes_only_in_its_scratch_folder(tmp_path):
    scratch, course = tmp_path / "scratch", tmp_path / "course"
    scratch.mkdir()
    course.mkdir()
    (course / "README.md").write_text("# course\n")
    out = subprocess.run([sys.executable, "-c", _CONFINE_SOURCE, str(scratch), "--", sys.executable, "-c", PROBE,
                          str(scratch), str(course)], capture_output=True, text=True, timeout=60)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["scratch"] == "done" and lines["devnull"] == "done", out.stdout + out.stderr
    for what in ("course", "overwrite", "delete", "rename", "link", "child"):
        assert lines[what].startswith("refused"), (what, out.stdout, out.stderr)
    assert sorted(p.name for p in course.iterdir()) == ["README.md"]
    assert (course / "README.md").read_text() == "# course\n"


def test_the_snapshot_names_every_change_and_touches_nothing(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "b.py").write_text("B = 2\n")
    (pkg / "gone.py").write_text("G = 3\n")
    (pkg / "same.py").write_text("S = 5\n")
    snap = Snapshot([pkg], tmp_path)
    assert snap.changed() == []

    (pkg / "a.py").write_text("A = 'edited while grading'\n")   # changed
    (pkg / "gone.py").unlink()                                   # deleted
    (pkg / "new").mkdir()                                        # a created folder with a file
    (pkg / "new" / "c.py").write_text("C = 4\n")
    (pkg / "sub" / "b.py").unlink()                              # a file replaced by a folder
    (pkg / "sub" / "b.py").mkdir()
    (pkg / "link").symlink_to("/etc/passwd")                     # a link (never followed)
    (pkg / "__pycache__").mkdir()                                # bytecode: other processes write it
    (pkg / "__pycache__" / "a.pyc").write_bytes(b"\0")
    assert snap.changed() == ["pkg/a.py", "pkg/gone.py", "pkg/link", "pkg/new", "pkg/new/c.py", "pkg/sub/b.py"]
    assert (pkg / "a.py").read_text() == "A = 'edited while grading'\n" and (pkg / "new" / "c.py").exists()
    assert not (pkg / "gone.py").exists() and (pkg / "sub" / "b.py").is_dir() and (pkg / "same.py").exists()
    assert not (tmp_path / ".grading-put-back").exists()


def test_a_file_written_in_place_with_the_same_size_is_named(tmp_path):
    (tmp_path / "a.py").write_text("A = 1\n")
    snap = Snapshot([tmp_path], tmp_path)
    os.utime(tmp_path / "a.py", ns=(0, 0))
    (tmp_path / "a.py").write_text("A = 2\n")  # same size, new time
    assert snap.changed() == ["a.py"]


def test_the_grader_drops_its_working_directory_from_sys_path(tmp_path):
    """`python -m minite.grading` puts its working directory first on sys.path: a planted argparse.py there would
    run in the grader. The package drops it before importing anything more; `-I` (make grade) never adds it."""
    (tmp_path / "argparse.py").write_text("raise SystemExit('planted argparse imported')\n")
    for flags in ([], ["-I"]):
        out = subprocess.run([sys.executable, *flags, "-m", "minite.grading", "grade", "--help"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "planted" not in out.stdout + out.stderr, out.stdout + out.stderr
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert "-m minite.grading grade" in makefile and "$(PY) -m minite.grading grade" not in makefile
