"""Every grading attack of issue 15, played against a small notebook shaped like chapter 00 (a Triton kernel behind
a launcher, a Python function checked by raw asserts and assert_close, a top-level answer checked by check_op).

Two layers hold: the answer check (structure + lint, in `assemble`) rejects an answer that leaves its block or
reaches outside itself, and the verdict (records compared in the grader's process, the kernel's processes
killed first) holds even with that check switched off (`lint=False`), for every attack that has to *fake* a
result rather than compute it. Limits that remain (README): an answer may compute its result with what the
notebook imported (minite's public functions, torch), and a student who has `solutions/` can copy it.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
import pytest
from test_grading import solve, tiny_solution, write

from minite.grading import STUB, assemble, grade, make_exercise

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
], ids=["a-dedent", "f-reload", "g2-fake-package", "c-patch-torch", "ipython-hook", "l-detached", "h-read-solution",
        "b-import-library", "b-private-kernel"])
def test_the_answer_check_rejects_each_attack(task, answer, why):
    sol = tiny_solution()
    ex = make_exercise(sol)
    if answer is DEDENT:  # written at column 0 on purpose
        cell = next(c for c in ex.cells if c.metadata.get("minite", {}).get("task") == "add")
        first, rest = answer.split("\n", 1)
        cell.source = cell.source.replace(f"    {STUB}", f"    {first}\n{rest}")
    else:
        ex = solve(ex, {task: answer.format(mark="/nonexistent", solution="/nonexistent")})
    notes = []
    graded = assemble(ex, sol, notes)
    assert len(notes) == 1 and why in notes[0], notes
    assert sum(STUB in c.source for c in graded.cells) == 3, "the rejected answer must be replaced by the stub"


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
], ids=["f-reload", "g2-fake-package", "c-patch-torch", "ipython-hook", "tampered-check"])
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
    assert any(s in rep.reasons[attacked] for s in ("differ", "is false")), rep.reasons[attacked]


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
