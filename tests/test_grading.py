"""The exercise pipeline: generation, sync, task identity by name, and grading.

A tiny synthetic notebook exercises every rule quickly; the real course notebooks are then graded in full:
each solution must score n/n, each blank exercise 0/n, and an exercise solved before a rebuild of its solution
with fresh cell ids must still score n/n. The attacks on grading are in test_grading_attacks.py.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import nbformat
import pytest
from wrong_answers import DISTRIBUTED, WRONG, student_notebook, wrong_answers  # tests/ is on sys.path (rootdir)

from minite.grading import (
    BEGIN,
    BEGIN_YOURS,
    END,
    END_YOURS,
    STUB,
    GradeReport,
    assemble,
    check_cells,
    exercise_name,
    generate_all,
    grade,
    make_exercise,
    regions,
    task_cells,
    task_points,
)
from minite.grading.cli import _csv

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def _code(src, task=None, check=None):
    c = nbformat.v4.new_code_cell(src)
    if task:
        c.metadata["minite"] = {"task": task}
    if check:
        c.metadata["minite"] = {"check": check}
        c.metadata["tags"] = ["nbval-check-output"]
        c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"PASS: {check}\n")]
        c.execution_count = 3
    return c


def tiny_solution():
    """Three tasks: a Triton kernel (check_op through a launcher), a Python function (raw asserts and
    assert_close), a top-level constant (check_op with gradients)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny"),
        _code("import os, math, torch\nos.environ['TRITON_INTERPRET'] = '1'\n"
              "from minite._triton import triton, tl\nfrom minite.testing import check_op, assert_close"),
        _code(f"@triton.jit\ndef add_kernel(X, Y, Z, n, BLOCK: tl.constexpr):\n    {BEGIN}\n"
              "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n    mask = offs < n\n"
              "    tl.store(Z + offs, tl.load(X + offs, mask=mask) + tl.load(Y + offs, mask=mask), mask=mask)\n"
              f"    {END}\n\n\ndef add(x, y):\n    z = torch.empty_like(x)\n"
              "    add_kernel[(triton.cdiv(x.numel(), 16),)](x, y, z, x.numel(), BLOCK=16)\n    return z",
              task="add"),
        _code("# CHECK: add\ng = torch.Generator().manual_seed(0)\nfor n in (5, 40):\n"
              "    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)\n"
              "    assert check_op(f'add {n}', add, torch.add, x, y, grad=False)\nprint('PASS: add')", check="add"),
        _code(f"def area(r):\n    {BEGIN}\n    return math.pi * r * r\n    {END}", task="area"),
        _code("# CHECK: area\nr = torch.linspace(0.5, 2.0, 7, dtype=torch.float64)\na = area(r)\n"
              "assert torch.allclose(a, math.pi * r ** 2, rtol=1e-12), 'area'\n"
              "assert_close(a, torch.pi * r * r, name='area')\nprint('PASS: area')", check="area"),
        _code(f"{BEGIN}\nSCALE = 3.0\n{END}", task="scale"),
        _code("# CHECK: scale\nassert check_op('scale', lambda t: t * SCALE, lambda t: t * 3, torch.arange(4.0))\n"
              "print('PASS: scale')", check="scale"),
    ]
    return nb


def write(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def solve(ex, answers: dict[str, str]):
    """The exercise with each named task's stub replaced by `answers[name]` (indented like the stub)."""
    ex = nbformat.from_dict(ex)
    for cell in ex.cells:
        name = cell.get("metadata", {}).get("minite", {}).get("task")
        if name in answers:
            lines = cell.source.splitlines()
            i = next(k for k, ln in enumerate(lines) if ln.strip() == STUB)
            ind = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines[i:i + 1] = [ind + ln if ln else ln for ln in answers[name].splitlines()]
            cell.source = "\n".join(lines)
    return ex


@pytest.fixture()
def tiny(tmp_path):
    return write(tiny_solution(), tmp_path / "solutions" / "99_tiny.ipynb")


def test_make_exercise_stubs_regions_clears_outputs_and_pairing():
    sol = tiny_solution()
    ex = make_exercise(sol)
    assert f"    {BEGIN_YOURS}\n    {STUB}\n    {END_YOURS}\n" in ex.cells[2].source
    assert BEGIN not in ex.cells[4].source and STUB in ex.cells[4].source
    assert ex.cells[3].source == sol.cells[3].source
    assert all(c.outputs == [] and c.execution_count is None for c in ex.cells if c.cell_type == "code")
    assert "jupytext" not in ex.metadata
    assert [n for _, n in check_cells(ex)] == ["add", "area", "scale"]
    assert list(task_cells(ex)) == ["add", "area", "scale"]


def test_make_exercise_rejects_unbalanced_markers_and_unnamed_tasks():
    nb = tiny_solution()
    nb.cells[4].source = f"def f():\n    {BEGIN}\n    return 1"
    with pytest.raises(ValueError, match="never closed"):
        make_exercise(nb)
    nb = tiny_solution()
    del nb.cells[4].metadata["minite"]
    with pytest.raises(ValueError, match="no task name"):
        make_exercise(nb)


def test_generate_all_writes_and_detects_stale(tmp_path, tiny):
    ex_dir = tmp_path / "exercises"
    assert generate_all(tiny.parent, ex_dir) == ["99_tiny_exercise.ipynb"]  # its tab in JupyterLab says so
    assert generate_all(tiny.parent, ex_dir, check=True) == []
    ex = ex_dir / "99_tiny_exercise.ipynb"
    ex.write_text(ex.read_text().replace("area", "aera"))
    assert generate_all(tiny.parent, ex_dir, check=True) == ["99_tiny_exercise.ipynb"]


def _edit(path: Path, old: str, new: str) -> None:
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        c.source = c.source.replace(old, new)
    nbformat.write(nb, path)


def test_generate_never_overwrites_or_drops_a_learners_edits(tmp_path, tiny):
    """Run, regenerate after a change to the solution: an untouched exercise (outputs do not count) is replaced;
    one with edits is kept and named (--force replaces it); one under the old name NN_topic.ipynb is kept and
    named if edited (it still grades: test_old_and_new_exercise_names_grade_against_the_same_solution), removed
    if it holds nothing of anyone's."""
    ex_dir = tmp_path / "exercises"
    generate_all(tiny.parent, ex_dir)
    ex, old = ex_dir / "99_tiny_exercise.ipynb", ex_dir / "99_tiny.ipynb"
    ran = nbformat.read(ex, as_version=4)
    ran.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
    nbformat.write(ran, ex)
    _edit(tiny, "# tiny", "# tiny, revised")  # the instructor's change
    notes = []
    assert generate_all(tiny.parent, ex_dir, notes=notes) == ["99_tiny_exercise.ipynb"] and notes == []
    _edit(ex, f"    {STUB}", "    return 3.14 * r * r")  # a learner's answer ...
    nbformat.write(nbformat.read(ex, as_version=4), old)  # ... and the same work under the old name
    _edit(tiny, "# tiny, revised", "# tiny, again")
    mine = ex.read_bytes()
    assert generate_all(tiny.parent, ex_dir, notes=notes) == [] and ex.read_bytes() == mine and old.exists()
    assert notes[0].startswith(f"kept {old}: it holds edits") and f"make grade NB={old}" in notes[0], notes
    assert f"{ex} holds edits too" in notes[0] and notes[1].startswith(f"not overwritten: {ex}"), notes
    assert "--force" in notes[1]
    assert generate_all(tiny.parent, ex_dir, check=True) == [
        "99_tiny.ipynb (the old name of 99_tiny_exercise.ipynb: move it there, or delete it)", ex.name]
    notes = []
    assert generate_all(tiny.parent, ex_dir, force=True, notes=notes) == [ex.name] and old.exists()
    assert f"move it there: mv {old} {ex}" in notes[0], notes  # the new name holds no work now
    nbformat.write(make_exercise(nbformat.read(tiny, as_version=4)), old)  # an old copy nobody edited
    notes = []
    assert generate_all(tiny.parent, ex_dir, notes=notes) == [] and not old.exists()
    assert notes == [f"removed {old}: the old name of {ex.name}, with nothing edited in it"]
    ex.write_text("not a notebook")  # someone's file: never overwritten
    assert generate_all(tiny.parent, ex_dir, notes=[]) == [] and ex.read_text() == "not a notebook"


def test_old_and_new_exercise_names_grade_against_the_same_solution(tmp_path):
    from minite.grading import course_solution
    from minite.grading.grader import missing
    sol = ROOT / "solutions" / "03_rmsnorm.ipynb"
    for name in ("03_rmsnorm_exercise.ipynb", "03_rmsnorm.ipynb"):
        assert course_solution(tmp_path / name) == sol
    (tmp_path / "03_rmsnorm.ipynb").write_text("{}")
    why = missing(tmp_path / "03_rmsnorm_exercise.ipynb")
    assert why.startswith(f"notebook to grade not found: {tmp_path / '03_rmsnorm_exercise.ipynb'}; did you mean "
                          f"{tmp_path / '03_rmsnorm.ipynb'}?"), why
    assert missing(tmp_path / "04_rope.ipynb") == f"notebook to grade not found: {tmp_path / '04_rope.ipynb'}"


def test_points_per_task_come_from_the_solution(tiny):
    sol = tiny_solution()
    assert task_points(sol) == {"add": 1, "area": 1, "scale": 1}  # one each unless the task says
    sol.cells[4].metadata["minite"]["points"] = 2.5
    sol.cells[7].metadata["minite"]["points"] = 3  # a check cell's points stand only where no task cell has its name
    assert task_points(sol) == {"add": 1, "area": 2.5, "scale": 1}
    assert make_exercise(sol).cells[4].metadata["minite"]["points"] == 2.5
    for bad in (0, -1, "2", True, float("nan")):
        sol.cells[4].metadata["minite"]["points"] = bad
        with pytest.raises(ValueError, match=rf"cell 4 \('area'\): points must be a positive number, got {bad!r}"):
            make_exercise(sol)


def test_the_report_shows_points_per_task_and_the_total_and_the_csv_carries_them():
    rep = GradeReport(notebook="ex.ipynb", solution="sol.ipynb", passed=["add", "scale"], failed=["area"],
                      reasons={"area": "=HYPERLINK(\"x\") is false"}, order=["add", "area", "scale"],
                      points={"add": 2, "area": 3, "scale": 0.5}, errors=["a note"])
    assert (rep.score, rep.total) == (2.5, 5.5)
    assert rep.summary().splitlines()[2:] == ["  PASS  add    2/2", "  FAIL  area   0/3: =HYPERLINK(\"x\") is false",
                                              "  PASS  scale  0.5/0.5", "  note: a note", "score: 2.5/5.5"]
    assert [r["earned"] for r in rep.tasks()] == [2, 0, 0.5]
    assert _csv([rep]).splitlines() == [
        "notebook,solution,task,passed,points,earned,reason", "ex.ipynb,sol.ipynb,add,1,2,2,",
        "ex.ipynb,sol.ipynb,area,0,3,0,\"'=HYPERLINK(\"\"x\"\") is false\"",  # a spreadsheet shows it as text
        "ex.ipynb,sol.ipynb,scale,1,0.5,0.5,", "ex.ipynb,sol.ipynb,TOTAL,2,5.5,2.5,a note"]
    plain = GradeReport(notebook="n", passed=["a"], failed=["b"])  # no points declared: a check is one point
    assert (plain.score, plain.total, plain.summary().splitlines()[-1]) == (1, 2, "score: 1/2")


def test_course_exercises_are_in_sync_with_solutions():
    stale = generate_all(ROOT / "solutions", ROOT / "exercises", check=True)
    assert stale == [], f"run `make exercises`: {stale}"


def test_assemble_matches_tasks_by_name_and_takes_only_the_answers():
    sol = tiny_solution()
    student = solve(make_exercise(sol), {"area": "return math.pi * r ** 2"})
    student.cells[5].source = "# CHECK: area\nprint('PASS: area')"  # tampered check cell: ignored
    student.cells[4].metadata["tags"] = ["nbval-skip", "raises-exception"]
    student.cells.reverse()  # order and ids do not matter, names do
    for c in student.cells:
        c["id"] = uuid.uuid4().hex[:8]
    notes = []
    graded = assemble(student, sol, notes)
    assert notes == []
    assert graded.cells[4].source == f"def area(r):\n    {BEGIN}\n    return math.pi * r ** 2\n    {END}"
    assert "assert torch.allclose" in graded.cells[5].source and "tags" not in graded.cells[4].metadata
    # a task whose markers were deleted, and one that is gone: stubbed, with a note saying why
    student = make_exercise(sol)
    student.cells[4].source = "def area(r):\n    return 3.14159 * r * r"
    del student.cells[6]
    notes = []
    graded = assemble(student, sol, notes)
    assert STUB in graded.cells[4].source and STUB in graded.cells[6].source
    assert "expected 1 answer region(s)" in notes[0] and "no cell with this task name" in notes[1]


def test_assemble_reads_old_notebooks_without_names_by_order_or_says_why():
    sol = tiny_solution()
    old = solve(make_exercise(sol), {"area": "return 1.0"})
    for c in old.cells:
        c.metadata.pop("minite", None)
    notes = []
    graded = assemble(old, sol, notes)
    assert "return 1.0" in graded.cells[4].source and "matched to tasks by order" in notes[0]
    del old.cells[4]
    with pytest.raises(ValueError, match="carry no task names"):
        assemble(old, sol, [])


@pytest.mark.parametrize("answer, why", [
    ("return math.pi * r * r\narea = 1", None),  # stays inside the function: fine
    ("return 1\ndef area(r):\n    return math.pi * r * r", "must be code inside its own block"),
    ("import os\nreturn 1", "may import only"),
    ("return globals()['math'].pi * r * r", "may not use 'globals'"),
    ("math.pi = 3\nreturn 1", "did not create"),
    ("return r.__class__", "attribute '.__class__'"),
    ("global math\nreturn 1", "'global' is not allowed"),
    ("return (1", "does not parse"),
])
def test_answers_must_stay_in_their_block(answer, why):
    sol = tiny_solution()
    ex = make_exercise(sol)
    cell = ex.cells[4]
    if "def area" in answer:  # a dedent: written at column 0 on purpose
        first, rest = answer.split("\n", 1)
        cell.source = cell.source.replace(f"    {STUB}", f"    {first}\n{rest}")
    else:
        ex = solve(ex, {"area": answer})
    notes = []
    assemble(ex, sol, notes)
    if why is None:
        assert notes == []
    else:
        assert len(notes) == 1 and why in notes[0], notes


def test_top_level_answer_may_not_rebind_the_notebooks_names():
    sol = tiny_solution()
    notes = []
    assemble(solve(make_exercise(sol), {"scale": "SCALE = 3.0\ncheck_op = print"}), sol, notes)
    assert "may not rebind ['check_op']" in notes[0]


@pytest.mark.notebook
def test_grading_rules_on_a_tiny_notebook(tmp_path, tiny):
    sol = nbformat.read(tiny, as_version=4)
    sol.cells[4].metadata["minite"]["points"] = 2  # area: 2 points
    nbformat.write(sol, tiny)
    full = grade(tiny, tiny, timeout=120)
    assert (full.score, full.total, full.failed) == (4, 4, []), full.summary()
    assert "  PASS  area   2/2" in full.summary() and full.summary().endswith("score: 4/4")

    ex = make_exercise(sol)
    ex.cells[2].metadata["minite"]["points"] = 100  # the student's copy of the metadata counts for nothing
    blank = write(ex, tmp_path / "blank.ipynb")
    rep = grade(blank, tiny, timeout=120)
    assert (rep.score, rep.total, rep.failed) == (0, 4, ["add", "area", "scale"]), rep.summary()
    # issue 26: an untouched task says so (it said NotImplementedError)
    assert all(rep.reasons[n] == "not attempted (its task cell is still the exercise's stub)" for n in rep.failed)
    assert "FAIL  add    0/1: not attempted" in rep.summary()

    # wrong answers that run: the grader's own comparison fails them, with the worst error
    wrong = solve(make_exercise(sol), {
        "add": "offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\nmask = offs < n\n"
               "tl.store(Z + offs, tl.load(X + offs, mask=mask) - tl.load(Y + offs, mask=mask), mask=mask)",
        "area": "return 3.14 * r * r",
        "scale": "SCALE = 2.0",
    })
    rep = grade(write(wrong, tmp_path / "wrong.ipynb"), tiny, timeout=120)
    assert (rep.score, rep.total, rep.failed) == (0, 4, ["add", "area", "scale"]), rep.summary()
    assert "elements differ" in rep.reasons["add"] and "AssertionError: area" in rep.reasons["area"]


@pytest.mark.notebook
def test_exercise_solved_before_a_rebuild_with_fresh_ids_still_scores_full(tmp_path, tiny):
    """Task identity is the name in the cell metadata: rebuild the solution through jupytext (fresh cell ids,
    as a re-executed .py would get) and grade an exercise made from the old build."""
    jupytext = pytest.importorskip("jupytext")
    sol = nbformat.read(tiny, as_version=4)
    solved = solve(make_exercise(sol), {
        "add": "offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\nmask = offs < n\n"
               "tl.store(Z + offs, tl.load(X + offs, mask=mask) + tl.load(Y + offs, mask=mask), mask=mask)",
        "area": "return math.pi * r ** 2",
        "scale": "SCALE = 1.5 * 2",
    })
    student = write(solved, tmp_path / "student.ipynb")
    text = jupytext.writes(sol, fmt="py:percent")
    rebuilt = jupytext.reads(text, fmt="py:percent")
    for c in rebuilt.cells:
        c["id"] = uuid.uuid4().hex[:8]
    rebuilt.metadata["kernelspec"] = sol.metadata["kernelspec"]
    old_ids = {c.get("id") for c in sol.cells}
    assert not old_ids & {c["id"] for c in rebuilt.cells}
    new_sol = write(nbformat.from_dict(rebuilt), tmp_path / "rebuilt" / "99_tiny.ipynb")
    rep = grade(student, new_sol, timeout=120)
    assert (rep.score, rep.total) == (3, 3), rep.summary()


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_scores_full_and_blank_exercise_scores_zero(solution):
    rep = grade(solution, solution)
    assert rep.total >= 2, f"{solution.name}: a chapter needs at least two graded tasks"
    assert rep.score == rep.total, rep.summary()
    rep = grade(ROOT / "exercises" / exercise_name(solution.name), solution)
    assert rep.score == 0, f"a blank exercise must fail every check:\n{rep.summary()}"
    # ... and fail only at its stubs: every other cell that fails, fails with the stub's NotImplementedError
    assert all(e.startswith("task ") or "NotImplementedError" in e for e in rep.errors), rep.summary()


@pytest.mark.notebook
@pytest.mark.slow
def test_chapter_solved_before_a_rebuild_with_fresh_ids_still_scores_full(tmp_path):
    """An exercise solved against today's build, graded against the solution re-created from its .py (as
    `make notebooks` does) with a fresh cell id on every cell."""
    jupytext = pytest.importorskip("jupytext")
    solution = ROOT / "solutions" / "00_triton_from_zero.ipynb"
    old = nbformat.read(solution, as_version=4)
    answers = {}
    for name, i in task_cells(old).items():
        lines = old.cells[i].source.splitlines()
        answers[name] = ["\n".join(lines[b + 1:e]) for b, e in regions(old.cells[i].source, name)]
    student = nbformat.read(ROOT / "exercises" / exercise_name(solution.name), as_version=4)
    for c in student.cells:
        name = c.get("metadata", {}).get("minite", {}).get("task")
        if name:
            lines, todo = c.source.splitlines(), list(answers[name])
            c.source = "\n".join(todo.pop(0) if ln.strip() == STUB else ln for ln in lines)
    rebuilt = jupytext.read(solution.with_suffix(".py"))
    for c in rebuilt.cells:
        c["id"] = uuid.uuid4().hex[:8]
    assert not {c.get("id") for c in old.cells} & {c["id"] for c in rebuilt.cells}
    new_sol = write(nbformat.from_dict(rebuilt), tmp_path / "solutions" / solution.name)
    rep = grade(write(student, tmp_path / "exercises" / exercise_name(solution.name)), new_sol)
    assert rep.score == rep.total >= 2, rep.summary()


@pytest.mark.notebook
@pytest.mark.parametrize("chapter", [pytest.param(c, marks=[pytest.mark.slow, pytest.mark.distributed])
                                     if c in DISTRIBUTED else c for c in sorted(WRONG)])
def test_wrong_answers_pass_no_check(chapter, tmp_path):
    """Issue 21: one plausible wrong answer per task (tests/wrong_answers.py) and no check passes."""
    solution = ROOT / "solutions" / f"{chapter}.ipynb"
    sol = nbformat.read(solution, as_version=4)
    assert set(task_cells(sol)) == set(WRONG[chapter]), "one wrong answer per task"
    answers = wrong_answers(sol, WRONG[chapter])
    ex = student_notebook(nbformat.read(ROOT / "exercises" / exercise_name(solution.name), as_version=4), answers)
    student = tmp_path / "exercises" / exercise_name(solution.name)
    student.parent.mkdir(parents=True)
    nbformat.write(ex, student)
    rep = grade(student, solution, timeout=120)
    assert rep.total == len(WRONG[chapter]) and rep.passed == [], rep.summary()
