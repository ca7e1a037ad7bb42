"""Every grading attack of issues 15 and 25, played against a small notebook shaped like chapter 00 (a Triton kernel
behind a launcher, a Python function checked by raw asserts and assert_close, a top-level answer checked by
check_op).

Two layers hold: the answer check (structure + lint, in `assemble`) rejects an answer that leaves its block or
reaches outside itself, and the verdict holds even with that check switched off (`lint=False`), for every attack
that has to *fake* a result rather than compute it: records are compared in the grader's process against the
reference run's, after the kernel's processes are killed; the kernel runs in its own scratch folder, confined by
Landlock where the system has it (it can write nothing else), and the grader imports nothing the notebook could
have written. Limits that remain (README): an answer may compute its result
with what the notebook imported (minite's public functions, torch), and a student who has `solutions/` can copy it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from test_grading import ROOT, solve, tiny_solution, write

from minite.grading import STUB, assemble, grade, make_exercise
from minite.grading.confine import usable

CONFINED = usable() > 0 and os.environ.get("MINITE_GRADE_CONFINE") != "0"  # Landlock: the kernel writes no course file

ADD_OK = ("offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\nmask = offs < n\n"
          "tl.store(Z + offs, tl.load(X + offs, mask=mask) + tl.load(Y + offs, mask=mask), mask=mask)")

# a. dedent out of the @triton.jit body and rebind the kernel to an object whose [grid] call does the work
DEDENT = ("pass\nclass K:\n    def __getitem__(self, grid):\n"
          "        return lambda X, Y, Z, n, BLOCK: Z.copy_(X + Y)\nadd_kernel = K()")
# f. make importlib.reload a no-op, then patch check_op (and print what the check would)
RELOAD_PATCH = ("import importlib, minite.testing as mt\nimportlib.reload = lambda m: m\n"
                "mt.check_op = check_op = lambda *a, **k: print('PASS: scale') or True\nSCALE = 2.0")
# g2. a fake minite.testing first on minite.__path__
FAKE_PACKAGE = ("import minite, sys, tempfile, pathlib\nd = tempfile.mkdtemp()\n"
                "pathlib.Path(d, 'testing.py').write_text('def check_op(*a, **k):\\n    return True\\n'\n"
                "                                       'def assert_close(*a, **k):\\n    pass\\n')\n"
                "minite.__path__.insert(0, d)\nsys.modules.pop('minite.testing', None)\n"
                "from minite.testing import check_op, assert_close\nSCALE = 2.0")
# c. patch torch.allclose / torch.isclose so that every comparison passes
PATCH_TORCH = ("torch.allclose = lambda *a, **k: True\n"
               "torch.isclose = lambda a, b, **k: torch.ones_like(a, dtype=torch.bool)\nreturn 3.0 * r * r")
# rewrite every later cell (the check cells) through IPython's input transformers
IPYTHON_HOOK = ("get_ipython().input_transformers_post.append(lambda lines: ['print(\"PASS: scale\")\\n'])\n"
                "SCALE = 2.0")
# l. a detached process that outlives the kernel and tampers with what it finds (here: it leaves a mark)
DETACHED = ("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time, pathlib; time.sleep(6); "
            "pathlib.Path(r\"{mark}\").write_text(\"alive\")'], start_new_session=True)\nSCALE = 2.0")
# h. read the solution from disk and run it
READ_SOLUTION = "src = open(r'{solution}').read()\nexec(src)\nSCALE = 3.0"
# b. call the library's private kernel from the answer
LIBRARY_PRIVATE = "import minite.kernels.softmax as S\nreturn S._softmax_fwd_kernel"
# stored PASS outputs, a rewritten check cell, skip/raises tags on the task
TAMPERED = "tampered"

# Issue 25: reach the notebook's globals through operator.attrgetter, then take over the recorder (as an answer
# inside `area`, which the area check calls before its asserts): every assert leaf "unrecordable" and the assert
# itself true, assert_close fed the check's own expected value, check_op fed a function computing the reference.
OPERATOR_GLOBALS = """\
import operator
rec = operator.attrgetter("__globals__")(area)["_minite"]
keep = rec.op
def a(rid, test):
    rec.buffer.append({"kind": "assert", "rid": rid, "leaves": {"1": {"__unrecordable__": "x"}}})
    return True
def close(rid, actual, expected, *args, **kwargs):
    rec.buffer.append({"kind": "close", "rid": rid, "actual": expected, "expected": expected, "kwargs": kwargs})
def op(rid, name, fn, ref, *args, **kwargs):
    return keep(rid, name, lambda t: t * 3, None, *args, **kwargs)
rec.a = a
rec.close = close
rec.op = op
return 3.0 * r * r"""
# the same take-over without the check_op part: the area answer is wrong, its records say "not recordable"
UNRECORDABLE = OPERATOR_GLOBALS.replace("rec.op = op\n", "")
# aliasing: patch a torch.Tensor method through a name of one's own, so that the check's expected side
# (math.pi * r ** 2, torch.pi * r * r) is computed wrongly too, as 3 * r ** 2
ALIAS_PATCH = """\
T = torch.Tensor
mul = T.__mul__
T.__rmul__ = lambda self, other: mul(self, 3.0)
return 3.0 * r * r"""
# persistence: rewrite the check cells of the solution notebook, so that the next notebook graded passes them
REWRITE_SOLUTION = """\
import json
with open(r"{solution}") as f:
    nb = json.load(f)
for c in nb["cells"]:
    if c["metadata"].get("minite", {{}}).get("check"):
        c["source"] = "print('PASS')"
with open(r"{solution}", "w") as f:
    json.dump(nb, f)
SCALE = 2.0"""
# code run inside the grader: append to minite/testing.py (an editable install), which a grader that imports it
# after the student's kernel ran would execute; and a detached process that writes a fake score line straight
# into the grader's stdout (/proc/<grader>/fd/1)
GRADER_CODE = """
import sys as _s
for _n, _m in list(_s.modules.items()):
    if _n.startswith("minite.grading") and hasattr(_m, "GradeReport"):
        _m.GradeReport.score = property(lambda self: self.total)
"""
FAKE_SCORE = ("import os, time; fd = os.open('/proc/%d/fd/1', os.O_WRONLY); os.write(fd, b'score: 3/3\\n'); "
              "time.sleep(60)")
IN_THE_GRADER = """\
import os, subprocess, sys, time
with open(r"{testing}", "a") as f:
    f.write({code!r})
subprocess.Popen([sys.executable, "-c", {fake!r} % os.getppid()], start_new_session=True)
time.sleep(1)
SCALE = 2.0"""

@pytest.fixture(scope="module")
def sol_path(tmp_path_factory):
    return write(tiny_solution(), tmp_path_factory.mktemp("attacks") / "solutions" / "99_tiny.ipynb")


@pytest.mark.parametrize("task, answer, why", [
    ("add", DEDENT, "must be code inside its own block"),
    ("scale", RELOAD_PATCH, "may import only"),
    ("scale", FAKE_PACKAGE, "may import only"),
    ("area", PATCH_TORCH, "did not create"),
    ("scale", IPYTHON_HOOK, "may not use 'get_ipython'"),
    ("scale", DETACHED, "may import only"),
    ("scale", READ_SOLUTION, "may not use 'open'"),
    ("area", LIBRARY_PRIVATE, "may import only"),
    ("area", "return S._softmax_fwd_kernel", "attribute '._softmax_fwd_kernel'"),
    ("area", OPERATOR_GLOBALS, "'.attrgetter'"),
    ("scale", "from operator import attrgetter as ag\nSCALE = ag('real')(3.0)", "'attrgetter'"),
    ("area", "import operator\nreturn operator.methodcaller('conjugate')(math.pi * r * r)", "'.methodcaller'"),
    ("area", "k = '__glob' 'als__'\nreturn math.pi * r * r", "'__globals__'"),
    ("area", "T = torch.Tensor\nT.t = lambda self: self\nreturn math.pi * r * r", "assigning to 'T.t'"),
    ("area", "T = type(r)\nreturn math.pi * r * r", "may not use 'type'"),
    ("area", "torch.load('x.pt', weights_only=False)\nreturn math.pi * r * r", "attribute '.load'"),
    ("scale", "import numpy\nnumpy.savetxt('argparse.py', numpy.zeros(0))\nSCALE = 3.0", "attribute '.savetxt'"),
], ids=["a-dedent", "f-reload", "g2-fake-package", "c-patch-torch", "ipython-hook", "l-detached", "h-read-solution",
        "b-import-library", "b-private-kernel", "operator-globals", "from-operator-import", "methodcaller",
        "dunder-string", "alias-store", "type-of", "torch-load", "numpy-savetxt"])
def test_the_answer_check_rejects_each_attack(task, answer, why):
    sol = tiny_solution()
    ex = make_exercise(sol)
    if answer is DEDENT:  # written at column 0 on purpose
        cell = next(c for c in ex.cells if c.metadata.get("minite", {}).get("task") == "add")
        first, rest = answer.split("\n", 1)
        cell.source = cell.source.replace(f"    {STUB}", f"    {first}\n{rest}")
    else:
        ex = solve(ex, {task: answer.replace("{mark}", "/nonexistent").replace("{solution}", "/nonexistent")})
    notes = []
    graded = assemble(ex, sol, notes)
    assert len(notes) == 1 and why in notes[0], notes
    assert sum(STUB in c.source for c in graded.cells) == 3, "the rejected answer must be replaced by the stub"


def test_the_judge_takes_the_expected_side_from_the_reference_run():
    """Records as a student's process that ran any code could make them: the area check's expected side computed
    wrongly (as the answer), an assert value that is not recordable. Only values that depend on the answers (by
    the check cell's data flow: `a = area(r)`, not `math.pi * r ** 2`) are taken from the student's run."""
    import torch

    from minite.grading.judge import _judge, ready
    from minite.grading.sandbox import _prepare
    ready()
    _, tests = _prepare(tiny_solution(), "student", 10)
    assert [sorted(t.answer_leaves) for t in tests["area"].values()] == [["1"]]
    r = torch.linspace(0.5, 2.0, 7, dtype=torch.float64)
    right, wrong = torch.pi * r * r, 3 * r * r

    def records(a, expected):
        return [{"kind": "assert", "rid": 1, "leaves": {"1": a, "2": expected}},
                {"kind": "close", "rid": 2, "actual": a, "expected": expected, "kwargs": {"name": "area"}}]
    ref = records(right, right)
    assert _judge("area", tests["area"], records(right, right), ref) is None
    assert "is false" in _judge("area", tests["area"], records(wrong, wrong), ref)
    assert "elements differ" in _judge("area", tests["area"], records(wrong, right)[1:], ref[1:])
    unrecordable = records({"__unrecordable__": "Recorder"}, right)
    assert "not recordable" in _judge("area", tests["area"], unrecordable, ref)


@pytest.mark.notebook
def test_every_attack_scores_zero_with_the_answer_check_on(tmp_path, sol_path):
    sol = nbformat.read(sol_path, as_version=4)
    ex = solve(make_exercise(sol), {"area": PATCH_TORCH, "scale": RELOAD_PATCH})
    cell = next(c for c in ex.cells if c.metadata.get("minite", {}).get("task") == "add")
    first, rest = DEDENT.split("\n", 1)
    cell.source = cell.source.replace(f"    {STUB}", f"    {first}\n{rest}")
    rep = grade(write(ex, tmp_path / "attack.ipynb"), sol_path, timeout=120)
    assert (rep.score, rep.total) == (0, 3), rep.summary()
    assert len(rep.errors) >= 3, rep.summary()


@pytest.mark.notebook
@pytest.mark.parametrize("answers", [
    {"scale": RELOAD_PATCH},
    {"scale": FAKE_PACKAGE},
    {"area": PATCH_TORCH},
    {"scale": IPYTHON_HOOK},
    {"add": ADD_OK.replace("tl.load(X + offs, mask=mask) +", "2 *")},  # wrong, with its check cell rewritten
    {"area": UNRECORDABLE},
    {"area": ALIAS_PATCH},
], ids=["f-reload", "g2-fake-package", "c-patch-torch", "ipython-hook", "tampered-check", "unrecordable-leaves",
        "alias-patch-expected-side"])
def test_faking_a_result_scores_zero_even_without_the_answer_check(tmp_path, sol_path, answers):
    """The verdict does not depend on the student's process judging anything: patched checkers, a fake
    minite.testing, patched torch comparisons and rewritten check cells all still score 0."""
    sol = nbformat.read(sol_path, as_version=4)
    ex = solve(make_exercise(sol), answers)
    for c in ex.cells:  # the student's own check cells and stored outputs are never used
        if c.metadata.get("minite", {}).get("check"):
            name = c.metadata["minite"]["check"]
            c.source = f"# CHECK: {name}\nprint('PASS: {name}')"
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"PASS: {name}\n")]
        if c.metadata.get("minite", {}).get("task"):
            c.metadata["tags"] = ["nbval-skip", "raises-exception"]
    rep = grade(write(ex, tmp_path / "attack.ipynb"), sol_path, timeout=120, lint=False)
    attacked = next(iter(answers))
    assert attacked in rep.failed and rep.score == 0, rep.summary()
    # failed by the grader's own comparison, not by an error in the student's process
    assert any(s in rep.reasons[attacked] for s in ("differ", "is false", "not recordable")), rep.reasons[attacked]


@pytest.mark.notebook
def test_the_operator_route_to_the_notebook_globals_scores_zero(tmp_path, sol_path):
    """Issue 25: with the answer check on, an answer reached the notebook's globals through
    operator.attrgetter('__globals__') and took the recorder over: 2/3 here without solving `area` or `scale`."""
    sol = nbformat.read(sol_path, as_version=4)
    rep = grade(write(solve(make_exercise(sol), {"area": OPERATOR_GLOBALS}), tmp_path / "attack.ipynb"), sol_path,
                timeout=120)
    assert (rep.score, rep.total) == (0, 3), rep.summary()
    assert "attrgetter" in rep.errors[0], rep.summary()


def _named(rep, path) -> bool:
    """Does the report name `path` as written (refused, confined) or changed during the run (unconfined)?"""
    return any(str(path) in e or os.path.basename(str(path)) in e for e in rep.errors
               if "outside its scratch folder" in e or "changed while this notebook ran" in e)


@pytest.mark.notebook
def test_an_answer_that_rewrites_the_solution_does_not_change_the_next_grade(tmp_path):
    """Persistence: a task cell rewrote the check cells of the solution notebook, and the next (blank) notebook
    graded against it passed them. Confined, the write is refused and named; the notebook scores 0."""
    sol_path = write(tiny_solution(), tmp_path / "solutions" / "99_tiny.ipynb")
    pristine = sol_path.read_bytes()
    sol = nbformat.read(sol_path, as_version=4)
    attack = solve(make_exercise(sol), {"scale": REWRITE_SOLUTION.format(solution=sol_path)})
    rep = grade(write(attack, tmp_path / "attack.ipynb"), sol_path, timeout=120, lint=False)
    assert rep.score == 0 and _named(rep, sol_path), rep.summary()
    if not CONFINED:
        return  # unconfined, the grader names the change and keeps it (threat model): not for credit
    assert sol_path.read_bytes() == pristine, "the solution notebook was written"
    blank = grade(write(make_exercise(sol), tmp_path / "blank.ipynb"), sol_path, timeout=120)
    assert blank.score == 0, blank.summary()


@pytest.mark.notebook
def test_the_solution_comes_from_the_course_never_from_beside_the_notebook(tmp_path):
    """A solutions/ planted next to the submitted notebook, with check cells that pass anything, scored a blank
    exercise 4/4. Only the course's own solutions/ is used, and the report names the file."""
    name = "00_triton_from_zero.ipynb"
    planted = nbformat.read(ROOT / "solutions" / name, as_version=4)
    for c in planted.cells:
        if c.metadata.get("minite", {}).get("check"):
            c.source = "print('PASS')"
    write(planted, tmp_path / "solutions" / name)
    ex = name.replace(".ipynb", "_exercise.ipynb")
    blank = write(nbformat.read(ROOT / "exercises" / ex, as_version=4), tmp_path / "exercises" / ex)
    rep = grade(blank)
    assert rep.score == 0 and rep.total >= 2, rep.summary()
    assert rep.solution == str(ROOT / "solutions" / name) and f"solution: {ROOT / 'solutions' / name}" in rep.summary()


@pytest.mark.notebook
def test_nothing_the_notebook_writes_runs_in_the_grader_or_spoofs_its_report(tmp_path):
    """An editable install: the student's kernel can write the course's minite/ files. An answer appended code to
    minite/testing.py (imported by the grader only when it judged: it printed 3/3), and a detached process wrote a
    fake score line into the grader's stdout. The grader imports nothing of minite once the notebook runs, puts
    the files back, and writes its report to a file it creates itself; its score line is printed last."""
    course = tmp_path / "course"
    package = Path(grade.__code__.co_filename).resolve().parents[1]  # the minite under test
    shutil.copytree(package, course / "minite", ignore=shutil.ignore_patterns("__pycache__"))
    sol_path = write(tiny_solution(), course / "solutions" / "99_tiny.ipynb")
    testing = course / "minite" / "testing.py"
    pristine = testing.read_bytes()
    answer = IN_THE_GRADER.format(testing=testing, code=GRADER_CODE, fake=FAKE_SCORE)
    student = write(solve(make_exercise(tiny_solution()), {"scale": answer}), tmp_path / "work" / "99_tiny.ipynb")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(course)}
    run = "import sys; from minite.grading import main; sys.exit(main(sys.argv[1:], lint=False))"
    cmd = [sys.executable, "-c", run, "grade", str(student), "--timeout", "120", "--report", str(report),
           "--csv", str(tmp_path / "grades.csv")]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    lines = out.stdout.strip().splitlines()
    assert lines and lines[-1] == "score: 0/3", out.stdout + out.stderr
    assert testing.read_bytes() == pristine or not CONFINED, "minite/testing.py was written"
    assert "minite/testing.py" in out.stdout, out.stdout
    (rep,) = json.loads(report.read_text())
    assert (rep["score"], rep["total"], rep["solution"]) == (0, 3, str(sol_path.resolve())), rep
    assert [(t["task"], t["points"], t["earned"]) for t in rep["tasks"]] == [("add", 1, 0), ("area", 1, 0),
                                                                             ("scale", 1, 0)], rep
    rows = (tmp_path / "grades.csv").read_text().splitlines()  # the instructor's sheet: a row per task, a total
    assert len(rows) == 5 and rows[4].startswith(f"{student},{sol_path.resolve()},TOTAL,0,3,0,"), rows


@pytest.mark.notebook
def test_processes_the_kernel_started_are_killed_before_judging(tmp_path, sol_path):
    """l: a detached process (its own session) would outlive the kernel and tamper with the results; the grader
    is the subreaper of everything the kernel starts and kills it all before it reads anything."""
    mark = tmp_path / "still_alive.txt"
    sol = nbformat.read(sol_path, as_version=4)
    ex = solve(make_exercise(sol), {"scale": DETACHED.format(mark=mark)})
    t0 = time.monotonic()
    rep = grade(write(ex, tmp_path / "attack.ipynb"), sol_path, timeout=120, lint=False)
    assert "scale" in rep.failed and rep.score == 0, rep.summary()
    time.sleep(max(0.0, 8 - (time.monotonic() - t0)))
    assert not mark.exists(), "a process started by the student's kernel survived grading"


@pytest.mark.notebook
def test_an_infinite_loop_is_stopped_by_the_per_task_timeout(tmp_path, sol_path):
    sol = nbformat.read(sol_path, as_version=4)
    loop = solve(make_exercise(sol), {"area": "while True:\n    pass", "scale": "SCALE = 3.0"})
    t0 = time.monotonic()
    rep = grade(write(loop, tmp_path / "loop.ipynb"), sol_path, timeout=6)
    assert rep.reasons["area"] == "timed out after 6 s", rep.summary()
    assert "scale" in rep.passed, "the cells after a timed-out task still run"
    assert time.monotonic() - t0 < 120


@pytest.mark.notebook
def test_a_loop_that_ignores_interrupts_does_not_hang_grading(tmp_path, sol_path):
    """The kernel is interrupted at the timeout; if it does not come back, the rest is not run (and the kernel is
    killed), instead of every later cell waiting out its own timeout."""
    sol = nbformat.read(sol_path, as_version=4)
    stuck = solve(make_exercise(sol), {"area": "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                               "while True:\n    pass", "scale": "SCALE = 3.0"})
    t0 = time.monotonic()
    rep = grade(write(stuck, tmp_path / "stuck.ipynb"), sol_path, timeout=5, lint=False)
    assert rep.reasons["area"] == "timed out after 5 s", rep.summary()
    assert "did not recover" in rep.reasons["scale"], rep.summary()
    assert time.monotonic() - t0 < 150


def test_cli_takes_a_timeout(capsys):
    from minite.grading import main
    with pytest.raises(SystemExit):
        main(["grade", "x.ipynb", "--timeout", "0"])
    assert "--timeout must be a positive" in capsys.readouterr().err
    assert sys.platform != "linux" or __import__("minite.grading").grading._subreaper(False)


def test_make_bundle_ships_exercises_without_solutions(tmp_path):
    """h (and the solutions it could read): what an instructor hands out has no solutions/ to read."""
    import zipfile
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import bundle
    root = tmp_path / "repo"
    for name, text in {"README.md": "x", "minite/__init__.py": "", "exercises/00_x.ipynb": "{}",
                       "solutions/00_x.ipynb": "{}", "solutions/00_x.py": "### BEGIN SOLUTION",
                       "tests/test_x.py": ""}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    out = tmp_path / "course.zip"
    bundle.bundle(root, out)
    names = zipfile.ZipFile(out).namelist()
    assert "minite-course/exercises/00_x.ipynb" in names and "minite-course/README.md" in names
    assert not [n for n in names if "/solutions/" in n or "/tests/" in n], names
    leaked = nbformat.v4.new_notebook()
    leaked.cells = [nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")]
    nbformat.write(leaked, root / "exercises" / "00_x.ipynb")
    with pytest.raises(SystemExit, match="solution regions"):
        bundle.bundle(root, out)


def test_a_renamed_copy_is_graded_against_the_solution_with_its_tasks(tmp_path):
    # issue 26: make grade NB=work/00_mine.ipynb ended in "no solutions/00_mine.ipynb ... pass --solution"
    from minite.grading import course_solution
    from minite.grading.notebook import _repo_root
    mine = tmp_path / "00_mine.ipynb"
    mine.write_bytes((_repo_root() / "exercises" / "00_triton_from_zero_exercise.ipynb").read_bytes())
    assert course_solution(mine) == _repo_root() / "solutions" / "00_triton_from_zero.ipynb"
    stray = tmp_path / "notes.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), stray)
    with pytest.raises(FileNotFoundError, match=r"no course solution has this notebook's tasks \[\]; pass "
                                                 r"--solution \(make grade SOLUTION=\.\.\.\)"):
        course_solution(stray)


def test_the_learner_bundle_stands_alone(tmp_path):
    # issue 26: the bundle's make grade/test/check-fast assumed solutions/ and tests/; it shipped .ci/ and logs
    import subprocess
    import zipfile

    from minite.grading.notebook import _repo_root
    out = tmp_path / "c.zip"
    subprocess.run([sys.executable, str(_repo_root() / "tools" / "bundle.py"), "--out", str(out)], check=True,
                   capture_output=True)
    names = zipfile.ZipFile(out).namelist()
    assert "minite-course/.learner-bundle" in names and "minite-course/Makefile" in names
    assert not [n for n in names if n.startswith(("minite-course/solutions/", "minite-course/tests/",
                                                  "minite-course/.ci/", "minite-course/benchmarks/results/logs_",
                                                  "minite-course/tools/bundle.py"))]
    zipfile.ZipFile(out).extractall(tmp_path)
    course = tmp_path / "minite-course"
    plans = {t: subprocess.run(["make", "-n", t, "NB=exercises/00_triton_from_zero_exercise.ipynb"], cwd=course,
                               capture_output=True, text=True).stdout for t in ("test", "grade", "check", "check-fast")}
    assert "pytest" in plans["test"] and " notebooks " in plans["test"] and " tests " not in plans["test"]
    assert "minite.grading selfcheck exercises/00_triton_from_zero_exercise.ipynb" in plans["grade"]
    assert "minite.grading selfcheck exercises/00_triton_from_zero_exercise.ipynb" in plans["check"]
    assert "check_notebooks" not in plans["check-fast"] and "ruff check minite tools" in plans["check-fast"]


# Issue 36. A module planted where the next grader imports it: numpy.savetxt writes any text (here a shim of
# argparse that moves every failed check to "passed" once the grader parses its command line).
SHIM = '''\
import importlib.util, sys, sysconfig
spec = importlib.util.spec_from_file_location("argparse", sysconfig.get_paths()["stdlib"] + "/argparse.py")
real = importlib.util.module_from_spec(spec)
sys.modules["argparse"] = real
spec.loader.exec_module(real)
parse = real.ArgumentParser.parse_args
def parse_args(self, *a, **k):
    g = sys.modules.get("minite.grading.grader")
    if g is not None:
        score = getattr(g, "_score")
        def passing(report, *a2, **k2):
            score(report, *a2, **k2)
            report.passed += report.failed
            report.failed.clear()
        setattr(g, "_score", passing)
    return parse(self, *a, **k)
real.ArgumentParser.parse_args = parse_args
'''
PLANT = "import numpy\n" + "\n".join(
    f"numpy.savetxt(r'{{{key}}}', numpy.zeros(0), header={{text!r}}, comments='')" for key in ("a", "b", "c"))
HONEST = {"add": ADD_OK, "area": "return math.pi * r * r", "scale": "SCALE = 3.0"}
RUN_MAIN = "import sys; from minite.grading import main; sys.exit(main(sys.argv[1:], lint=False))"


def _course(tmp_path):
    """A course of its own (the grader under test copied, a README, an exercise, the tiny solution), importable
    through a folder that holds only its minite/: the course root is not on sys.path, as with `pip install -e`."""
    course = tmp_path / "course"
    package = Path(grade.__code__.co_filename).resolve().parents[1]
    shutil.copytree(package, course / "minite", ignore=shutil.ignore_patterns("__pycache__"))
    (course / "README.md").write_text("# the course\n")
    write(make_exercise(tiny_solution()), course / "exercises" / "01_floating_point.ipynb")
    sol = write(tiny_solution(), course / "solutions" / "99_tiny.ipynb")
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "minite").symlink_to(course / "minite")
    return course, sol, {**os.environ, "PYTHONPATH": str(tmp_path / "path")}


def _grade_cli(args, cwd, env, module=False, isolated=False):
    head = [sys.executable] + (["-I"] if isolated else []) + (["-m", "minite.grading"] if module else ["-c", RUN_MAIN])
    return subprocess.run(head + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.notebook
def test_a_planted_argparse_changes_no_grade(tmp_path):
    """Issue 36: a blank notebook planted <course>/argparse.py through numpy.savetxt (not a file-writing call of
    the lint); the next `python -m minite.grading grade` from the course root imported it and scored a blank
    notebook 4/4. Now the planting notebook scores 0 and the report names the write; and a planted argparse.py
    in the working directory (put there any other way) is never imported by the grader."""
    course, sol, env = _course(tmp_path)
    target = course / "argparse.py"
    plant = solve(make_exercise(tiny_solution()), {"scale": PLANT.format(a=target, b=target, c=target, text=SHIM)})
    student = write(plant, tmp_path / "work" / "99_tiny.ipynb")
    out = _grade_cli(["grade", str(student), "--solution", str(sol), "--timeout", "120"], course, env)
    assert out.stdout.strip().splitlines()[-1] == "score: 0/3", out.stdout + out.stderr
    assert "argparse.py" in out.stdout and ("outside its scratch folder" in out.stdout
                                            or "changed while this notebook ran" in out.stdout), out.stdout
    if CONFINED:
        assert not target.exists(), "the notebook planted argparse.py in the course"
    target.write_text(SHIM)  # planted some other way: the grader must still not import it
    blank = write(make_exercise(tiny_solution()), tmp_path / "work" / "blank.ipynb")
    for isolated in (False, True):  # `python -m minite.grading` as typed, and as `make grade` runs it (-I)
        out = _grade_cli(["grade", str(blank), "--solution", str(sol), "--timeout", "120"], course, env,
                         module=True, isolated=isolated)
        lines = out.stdout.strip().splitlines()
        refused = out.returncode == 2 and "not grading" in out.stderr
        assert refused or (lines and lines[-1] == "score: 0/3"), out.stdout + out.stderr


@pytest.mark.notebook
def test_a_write_anywhere_in_the_course_is_named_and_changes_nothing(tmp_path):
    """Issue 36: the same call overwrote README.md and an exercise notebook: 0/4, no note, nothing put back."""
    course, sol, env = _course(tmp_path)
    readme, exercise = course / "README.md", course / "exercises" / "01_floating_point.ipynb"
    before = {p: p.read_bytes() for p in (readme, exercise)}
    attack = solve(make_exercise(tiny_solution()), {"scale": PLANT.format(a=readme, b=exercise, c=readme,
                                                                           text="overwritten")})
    report = tmp_path / "report.json"
    student = write(attack, tmp_path / "work" / "99_tiny.ipynb")
    out = _grade_cli(["grade", str(student), "--solution", str(sol), "--timeout", "120", "--report", str(report)],
                     course, env)
    (rep,) = json.loads(report.read_text())
    assert (rep["score"], rep["total"]) == (0, 3), out.stdout + out.stderr
    notes = "\n".join(rep["errors"])
    if CONFINED:
        assert "README.md" in notes and "outside its scratch folder" in notes, notes
        assert {p: p.read_bytes() for p in before} == before, "a course file was overwritten"
    else:
        assert "README.md" in notes and "01_floating_point.ipynb" in notes, notes


@pytest.mark.notebook
def test_an_instructors_edit_during_a_grade_is_kept_and_blames_nobody(tmp_path):
    """Issue 36: editing minite/ops.py and solutions/... and creating minite/instructor_new_file.py while an
    honest notebook was graded moved the edits aside, reverted the working tree and scored the student 0/4."""
    import threading
    course, sol, env = _course(tmp_path)
    ops, new, other = course / "minite" / "ops.py", course / "minite" / "instructor_new_file.py", \
        course / "solutions" / "98_other.md"
    student = write(solve(make_exercise(tiny_solution()), HONEST), tmp_path / "work" / "99_tiny.ipynb")
    done, edits = threading.Event(), []

    def instructor():
        n = 0
        while not done.is_set():
            n += 1
            with open(ops, "a") as f:
                f.write(f"# instructor's edit {n}\n")
            new.write_text(f"EDIT = {n}\n")
            other.write_text(f"notes, version {n}\n")
            edits.append(n)
            done.wait(0.5)
    editor = threading.Thread(target=instructor)
    editor.start()
    try:
        out = _grade_cli(["grade", str(student), "--solution", str(sol), "--timeout", "120"], tmp_path, env)
    finally:
        done.set()
        editor.join()
    assert out.stdout.strip().splitlines()[-1] == "score: 3/3", out.stdout + out.stderr
    n = edits[-1]
    assert ops.read_text().endswith(f"# instructor's edit {n}\n") and new.read_text() == f"EDIT = {n}\n"
    assert other.read_text() == f"notes, version {n}\n"
    assert not (course / ".grading-put-back").exists() and "changed files of the course" not in out.stdout


@pytest.mark.notebook
def test_unconfined_the_grader_names_what_changed_and_keeps_it(tmp_path, sol_path, monkeypatch):
    """Without Landlock (MINITE_GRADE_CONFINE=0 plays it) the grader cannot tell the notebook's writes from someone
    else's: it names every change, keeps it, and does not fail the notebook for it."""
    monkeypatch.setenv("MINITE_GRADE_CONFINE", "0")
    planted = tmp_path / "planted.py"
    answer = PLANT.format(a=planted, b=planted, c=planted, text="X = 1") + "\nSCALE = 3.0"
    rep = grade(write(solve(make_exercise(tiny_solution()), {"scale": answer}), tmp_path / "attack.ipynb"), sol_path,
                timeout=120, lint=False)
    assert rep.passed == ["scale"] and rep.confinement.startswith("none"), rep.summary()
    assert any("changed while this notebook ran" in e and "planted.py" in e for e in rep.errors), rep.summary()
    assert planted.read_text() == "X = 1\n"


def test_a_notebook_that_cannot_be_read_scores_zero_in_one_line(tmp_path, sol_path, capsys):
    """Issue 36: a notebook that is not JSON gave a 41-line NotJSONError traceback."""
    from minite.grading import main
    bad = {"text.ipynb": b"this is not json", "latin1.ipynb": b"{\"cells\": \"\xe9\"}", "list.ipynb": b"[1, 2]"}
    paths = [tmp_path / name for name in bad]
    for p in paths:
        p.write_bytes(bad[p.name])
    (tmp_path / "folder.ipynb").mkdir()
    paths.append(tmp_path / "folder.ipynb")
    printed = ""
    for p in paths:
        assert main(["grade", str(p), "--solution", str(sol_path)]) == 0
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err
        printed += out.out
        block = out.out.split(f"{p}\n", 1)[1].split("score:", 1)
        notes = [ln for ln in block[0].splitlines() if ln.startswith("  note:")]
        assert len(notes) == 1 and str(p) in notes[0], block[0]
        assert block[1].startswith(" 0/3"), block
    assert "not a readable notebook" in printed and "not UTF-8" in printed and "cannot read" in printed
    garbage = tmp_path / "garbage.ipynb"  # no --solution: the notebook, not a missing solution, is named
    garbage.write_text("garbage")
    assert main(["grade", str(garbage), "--strict"]) == 1
    out = capsys.readouterr().out
    assert "is not a readable notebook (.ipynb JSON): NotJSONError" in out and out.endswith("score: 0/0\n"), out


def test_two_cells_with_one_task_name_are_not_graded_and_say_why():
    """Issue 36: two cells with the same task id: the first (blank) won silently."""
    sol = tiny_solution()
    ex = solve(make_exercise(sol), HONEST)
    dup = next(c for c in make_exercise(sol).cells if c.metadata.get("minite", {}).get("task") == "scale")
    ex.cells.insert(1, dup)
    notes = []
    graded = assemble(ex, sol, notes)
    assert len(notes) == 1 and "task 'scale': 2 cells of your notebook carry this task name (cells 1, " in notes[0]
    scale = next(c for c in graded.cells if c.metadata.get("minite", {}).get("task") == "scale")
    assert STUB in scale.source and "SCALE = 3.0" not in scale.source
