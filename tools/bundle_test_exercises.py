"""Every exercise runs, and fails only at its stubs (`make test` in the course; pytest collects this file).

A task you have not written yet still holds ``raise NotImplementedError()``: it raises that (at once, or when a
kernel or function it defines is called), and the check cells after it fail. That is all a blank exercise may do.
Any other failure fails this test, naming the notebook, the cell and the error: a check cell failing before any
unfinished task, a cell of the notebook's own code failing with anything but the stub's NotImplementedError, a
task cell raising another error. A solved exercise passes too.

    .venv/bin/python -m pytest exercises/test_exercises.py [-k 03_rmsnorm_exercise]
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
EXERCISES = sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT = int(os.environ.get("MINITE_EXERCISE_TIMEOUT", "600"))  # seconds per cell


def unexpected_failures(nb, cells) -> list[str]:
    """The failures of an executed notebook that are not a stub's: (nb, its cells' results) -> one line each."""
    from minite.grading.notebook import STUB, check_name, task_name
    out, stubbed = [], False  # stubbed: a task cell up to here still holds its stub
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        blank = bool(task_name(cell)) and any(line.strip() == STUB for line in cell.source.splitlines())
        stubbed = stubbed or blank
        if cells[i].ok:
            continue
        error = cells[i].error or "failed"
        stub = "NotImplementedError" in error  # the stub's, raised there or inside a kernel it left unwritten
        if not (stubbed and (check_name(cell) or stub)):
            what = f"task {task_name(cell)!r}" if task_name(cell) else \
                f"check {check_name(cell)!r}" if check_name(cell) else "code"
            out.append(f"cell {i} ({what}): {error}")
    return out


@pytest.mark.parametrize("path", EXERCISES, ids=[p.stem for p in EXERCISES])
def test_exercise_fails_only_at_its_stubs(path):
    import nbformat

    from minite.grading.sandbox import _execute  # the self-check's runner: a fresh kernel, every cell run
    nb = nbformat.read(path, as_version=4)
    bad = unexpected_failures(nb, _execute(nb, TIMEOUT))
    assert not bad, f"{path.name} fails outside its unfinished tasks:\n  " + "\n  ".join(bad)
