"""The exercise pipeline: generation, sync, and tamper-proof grading.

A tiny synthetic notebook exercises every rule quickly; the real course notebooks are then graded in full:
each solution must score n/n, each blank exercise 0/n, and a saved wrong answer must fail.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from minite.grading import (
    BEGIN,
    BEGIN_YOURS,
    END,
    END_YOURS,
    STUB,
    assemble,
    check_cells,
    generate_all,
    grade,
    make_exercise,
)

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def _code(src, tags=None):
    c = nbformat.v4.new_code_cell(src)
    if tags:
        c.metadata["tags"] = tags
    return c


def _tiny_solution():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny"),
        _code("import math"),
        _code(f"def double(x):\n    {BEGIN}\n    return 2 * x\n    {END}"),
        _code("# CHECK: double\nassert double(21) == 42\nprint('PASS: double')", ["nbval-check-output"]),
        _code(f"def area(r):\n    {BEGIN}\n    return math.pi * r * r\n    {END}"),
        _code("# CHECK: area\nassert round(area(2.0), 6) == 12.566371\nprint('PASS: area')", ["nbval-check-output"]),
        _code(f"import torch\nfrom minite.testing import check_op\n{BEGIN}\nSCALE = 3.0\n{END}"),
        _code("# CHECK: scale\nassert check_op('scale', lambda t: t * SCALE, lambda t: t * 3, torch.arange(4.0))",
              ["nbval-check-output"]),
    ]
    for c in nb.cells:  # the stored outputs nbval compares against
        if c.cell_type == "code" and "CHECK" in c.source:
            name = c.source.splitlines()[0].split(":")[1].strip()
            text = f"PASS: {name}\n" if name != "scale" else "PASS: scale [float32 (4,)]: output, grad[0]\n"
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
            c.execution_count = 1
    return nb


@pytest.fixture()
def tiny(tmp_path):
    sol = tmp_path / "solutions" / "99_tiny.ipynb"
    sol.parent.mkdir()
    nbformat.write(_tiny_solution(), sol)
    return sol


def test_make_exercise_stubs_regions_and_keeps_the_rest():
    sol = _tiny_solution()
    ex = make_exercise(sol)
    assert ex.cells[2].source == f"def double(x):\n    {BEGIN_YOURS}\n    {STUB}\n    {END_YOURS}"
    assert BEGIN not in ex.cells[4].source and STUB in ex.cells[4].source
    assert ex.cells[3].source == sol.cells[3].source and ex.cells[3].outputs == sol.cells[3].outputs
    assert [n for _, n in check_cells(ex)] == ["double", "area", "scale"]


def test_make_exercise_rejects_unbalanced_markers():
    nb = _tiny_solution()
    nb.cells[2].source = f"def f():\n    {BEGIN}\n    return 1"
    with pytest.raises(ValueError, match="never closed"):
        make_exercise(nb)


def test_generate_all_writes_and_detects_stale(tmp_path, tiny):
    ex_dir = tmp_path / "exercises"
    assert generate_all(tiny.parent, ex_dir) == ["99_tiny.ipynb"]
    assert generate_all(tiny.parent, ex_dir, check=True) == []
    (ex_dir / "99_tiny.ipynb").write_text((ex_dir / "99_tiny.ipynb").read_text().replace("area", "aera"))
    assert generate_all(tiny.parent, ex_dir, check=True) == ["99_tiny.ipynb"]


def test_course_exercises_are_in_sync_with_solutions():
    stale = generate_all(ROOT / "solutions", ROOT / "exercises", check=True)
    assert stale == [], f"run `make exercises`: {stale}"


def test_assemble_takes_only_the_answers(tiny):
    sol = nbformat.read(tiny, as_version=4)
    student = make_exercise(sol)
    student.cells[3].source = "# CHECK: double\nprint('PASS: double')"  # tampered check cell
    student.cells[2].metadata["tags"] = ["nbval-skip", "raises-exception"]
    # an answer, a skip marker inside it, and a replacement of the function after the region
    student.cells[2].source = (f"def double(x):\n    {BEGIN_YOURS}\n    # NBVAL_SKIP\n    return x + x\n"
                               f"    {END_YOURS}\ndouble = lambda x: 42")
    notes = []
    graded = assemble(student, sol, notes)
    assert graded.cells[3].source.startswith("# CHECK: double\n")
    assert "assert double(21) == 42" in graded.cells[3].source
    assert graded.cells[2].metadata.get("tags", []) == []
    assert graded.cells[2].source == f"def double(x):\n    {BEGIN}\n    return x + x\n    {END}"
    assert notes == []
    # a task cell whose markers were deleted, and one that is gone: stubbed, with a note saying why
    student.cells[4].source = "def area(r):\n    return 3.14159 * r * r"
    del student.cells[6]
    notes = []
    graded = assemble(student, sol, notes)
    assert STUB in graded.cells[4].source and STUB in graded.cells[6].source
    assert "expected 1 answer region(s)" in notes[0] and "not found in your notebook" in notes[1]


@pytest.mark.notebook
def test_grading_rules_on_a_tiny_notebook(tmp_path, tiny):
    sol = nbformat.read(tiny, as_version=4)
    full = grade(tiny, tiny)
    assert (full.score, full.total, full.failed) == (3, 3, []), full.summary()

    blank = tmp_path / "blank.ipynb"
    nbformat.write(make_exercise(sol), blank)
    rep = grade(blank, tiny)
    assert (rep.score, rep.failed) == (0, ["double", "area", "scale"])
    assert rep.reasons["double"].startswith("NotImplementedError")
    assert "FAIL  double: NotImplementedError" in rep.summary()

    # A wrong answer whose (fake) PASS output was saved, a check cell rewritten to always pass, a skip marker on
    # the task, a wrapper that bypasses the answer, and an answer that patches check_op: none of it helps.
    wrong = make_exercise(sol)
    wrong.cells[2].source = (f"def double(x):\n    {BEGIN_YOURS}\n    return x + 1\n    {END_YOURS}\n"
                             "double = lambda x: 42")
    wrong.cells[2].metadata["tags"] = ["nbval-skip"]
    wrong.cells[3].source = "# CHECK: double\nprint('PASS: double')"
    wrong.cells[4].source = wrong.cells[4].source.replace(STUB, "return math.pi * r * r")
    wrong.cells[6].source = ("import torch\n"
                             f"{BEGIN_YOURS}\nimport minite.testing as mt\nSCALE = 2.0\n"
                             "mt.check_op = check_op = lambda *a, **k: "
                             f"print('PASS: scale [float32 (4,)]: output, grad[0]') or True\n{END_YOURS}")
    tampered = tmp_path / "tampered.ipynb"
    nbformat.write(wrong, tampered)
    rep = grade(tampered, tiny)
    assert (rep.score, rep.failed) == (1, ["double", "scale"]), rep.summary()
    assert rep.reasons["double"].startswith("AssertionError")


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_scores_full_and_blank_exercise_scores_zero(solution):
    rep = grade(solution, solution)
    assert rep.total >= 2, f"{solution.name}: a chapter needs at least two graded tasks"
    assert rep.score == rep.total, rep.summary()
    exercise = ROOT / "exercises" / solution.name
    rep = grade(exercise, solution)
    assert rep.score == 0, f"a blank exercise must fail every check:\n{rep.summary()}"


@pytest.mark.notebook
@pytest.mark.slow
def test_saved_wrong_answer_fails_on_chapter_00(tmp_path):
    solution = ROOT / "solutions" / "00_triton_from_zero.ipynb"
    if not solution.exists():
        pytest.fail("solutions/00_triton_from_zero.ipynb is missing")
    nb = nbformat.read(solution, as_version=4)
    # Break the first task's answer but keep every stored output (including the check's PASS line).
    task = next(c for c in nb.cells if c.cell_type == "code" and BEGIN in c.source)
    lines = task.source.splitlines()
    b = next(i for i, x in enumerate(lines) if x.strip() == BEGIN)
    e = next(i for i, x in enumerate(lines) if x.strip() == END)
    indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
    body = lines[b + 1:e]
    # the same answer storing x - y instead of x + y: wrong, but it runs
    wrong = [ln.replace("x + y", "x - y") for ln in body]
    assert wrong != body, "test needs 'x + y' in the first task's answer (the vector add)"
    task.source = "\n".join(lines[: b + 1] + wrong + [f"{indent}{END}"] + lines[e + 1:])
    # ... and rewrite the check cell that follows to print its stored PASS output without checking anything.
    i = nb.cells.index(task)
    chk = next(c for c in nb.cells[i + 1:] if "nbval-check-output" in c.metadata.get("tags", []))
    stored = "".join(o.get("text", "") for o in chk.outputs)
    assert "PASS" in stored
    chk.source = chk.source.splitlines()[0] + f"\nprint({stored!r}, end='')"
    path = tmp_path / solution.name
    nbformat.write(nb, path)
    rep = grade(path, solution)
    assert rep.score == rep.total - 1 and len(rep.failed) == 1, rep.summary()
