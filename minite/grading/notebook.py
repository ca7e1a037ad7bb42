"""Notebook I/O: answer regions, task and check cells by name, and exercises generated from solutions.

An exercise is named after its solution with ``_exercise`` added (solutions/03_rmsnorm.ipynb ->
exercises/03_rmsnorm_exercise.ipynb), so that JupyterLab's tab tells it from the lesson (notebooks/03_rmsnorm.ipynb).
An exercise records a hash of its cells' sources: ``generate`` overwrites one only while its sources are still
those it wrote (outputs do not count: running it loses no work), and never deletes a learner's edited file."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
BEGIN_YOURS = "### BEGIN YOUR CODE"
END_YOURS = "### END YOUR CODE"
STUB = "raise NotImplementedError()"
CHECK_TAG = "nbval-check-output"
EXERCISE_SUFFIX = "_exercise"  # exercises/NN_topic_exercise.ipynb: a tab in JupyterLab says which file it is


def exercise_name(solution_name: str) -> str:
    """03_rmsnorm.ipynb -> 03_rmsnorm_exercise.ipynb (the exercise generated from solutions/03_rmsnorm.ipynb)."""
    stem = Path(solution_name).stem
    return f"{stem}{EXERCISE_SUFFIX}.ipynb"


def solution_name(notebook_name: str) -> str:
    """The course solution's file name for an exercise's: 03_rmsnorm_exercise.ipynb (or the name it had before,
    03_rmsnorm.ipynb) -> 03_rmsnorm.ipynb."""
    stem = Path(notebook_name).stem
    return f"{stem.removesuffix(EXERCISE_SUFFIX)}.ipynb"


def regions(source: str, where: str, markers=((BEGIN, END),)) -> list[tuple[int, int]]:
    """(first, last) line index of each answer region's markers, for any of the marker pairs."""
    out, start, pair = [], None, None
    for i, line in enumerate(source.splitlines()):
        stripped = line.strip()
        for b, e in markers:
            if stripped == b:
                if start is not None:
                    raise ValueError(f"{where}: line {i + 1}: '{b}' inside another region")
                start, pair = i, (b, e)
            elif stripped == e:
                if start is None or pair[1] != e:
                    raise ValueError(f"{where}: line {i + 1}: '{e}' without '{b}'")
                out.append((start, i))
                start = None
    if start is not None:
        raise ValueError(f"{where}: '{pair[0]}' is never closed")
    return out


def stub_source(source: str, where: str) -> str:
    """Each solution region -> BEGIN YOUR CODE / raise NotImplementedError() / END YOUR CODE."""
    lines = source.splitlines()
    out, prev = [], 0
    for b, e in regions(source, where):
        indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
        out += lines[prev:b] + [f"{indent}{BEGIN_YOURS}", f"{indent}{STUB}", f"{indent}{END_YOURS}"]
        prev = e + 1
    return "\n".join(out + lines[prev:])


def _meta(cell, key: str):
    m = cell.get("metadata", {}).get("minite", {})
    return m.get(key) if isinstance(m, dict) else None


def task_name(cell) -> str | None:
    return _meta(cell, "task") if cell.cell_type == "code" else None


def check_name(cell) -> str | None:
    return _meta(cell, "check") if cell.cell_type == "code" else None


def task_cells(nb, where: str = "notebook") -> dict[str, int]:
    """NAME -> cell index of every task cell. A code cell with solution markers but no task name is an error."""
    out = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        name = task_name(cell)
        has = any(ln.strip() == BEGIN for ln in cell.source.splitlines())
        if has and not name:
            raise ValueError(f"{where}: cell {i} has '{BEGIN}' but no task name: add the cell metadata "
                             'minite={"task": NAME} (docs/chapter_template.md)')
        if name:
            if name in out:
                raise ValueError(f"{where}: task name {name!r} is used by cells {out[name]} and {i}")
            out[name] = i
    return out


def _valid_points(value, where: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value \
            or value == float("inf"):
        raise ValueError(f"{where}: points must be a positive number, got {value!r} (cell metadata "
                         'minite={"task": NAME, "points": 2})')
    return value


def task_points(nb, where: str = "notebook") -> dict[str, int | float]:
    """NAME -> the points its check is worth: ``metadata.minite.points`` of the task cell (a check without a task
    cell: of the check cell), 1 when absent. The grader reads them from the course's solution, never from the
    student's notebook."""
    tasks = {task_name(c) for c in nb.cells} - {None}
    out = {}
    for i, cell in enumerate(nb.cells):
        name = task_name(cell) or (check_name(cell) if check_name(cell) not in tasks else None)
        if name and (value := _meta(cell, "points")) is not None:
            out[name] = _valid_points(value, f"{where}: cell {i} ({name!r})")
    return {name: out.get(name, 1) for _, name in check_cells(nb)}


def sources_hash(nb) -> str:
    """sha256 of the cells' types and sources: what a learner writes (outputs and metadata are not work)."""
    cells = [[c.cell_type, c.source] for c in nb.cells]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def check_cells(nb) -> list[tuple[int, str]]:
    """(cell index, NAME) of every check cell (``metadata.minite.check``), in notebook order."""
    return [(i, check_name(c)) for i, c in enumerate(nb.cells) if check_name(c)]


def make_exercise(solution_nb):
    """The exercise notebook of a solution notebook: regions stubbed, code outputs and execution counts cleared,
    jupytext pairing removed."""
    task_cells(solution_nb, "solution")
    task_points(solution_nb, "solution")
    nb = copy.deepcopy(solution_nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if task_name(cell):
            cell.source = stub_source(cell.source, f"cell {i}")
        cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("jupytext", None)
    nb.metadata["minite"] = {"generated_from": "solutions/ by `make exercises`; edit the solution, not this file",
                             "sources_sha256": sources_hash(nb)}
    return nb


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _read(path: Path):
    try:
        return nbformat.read(path, as_version=4)
    except Exception:  # noqa: BLE001 - not a notebook (any more): it is someone's file, never overwritten
        return None


def _unedited(path: Path, generated) -> bool:
    """Is the notebook at `path` free of anyone's work: its sources are still those `generate` wrote (its
    recorded hash), or those it would write now? Outputs do not count; an unreadable file is someone's."""
    nb = _read(path)
    if nb is None:
        return False
    mine = sources_hash(nb)
    recorded = nb.metadata.get("minite", {})
    recorded = recorded.get("sources_sha256") if isinstance(recorded, dict) else None
    return mine in (recorded, sources_hash(generated))


def generate_all(solutions: Path, exercises: Path, check: bool = False, *, force: bool = False,
                 notes: list[str] | None = None) -> list[str]:
    """Write exercises/NN_topic_exercise.ipynb for every solutions/NN_topic.ipynb; return the names written.

    An exercise whose cell sources changed since it was generated (a learner's answers) is not overwritten
    (`force`: it is), and one under the name exercises had before (NN_topic.ipynb) is left where it is: each gets
    a line in `notes` saying what to do; an old-named copy that holds no edits is removed. With `check`, write
    nothing and return the names of exercises that are missing, out of date, under the old name, or without a
    solution."""
    notes = [] if notes is None else notes
    stale = []
    if not check:
        exercises.mkdir(parents=True, exist_ok=True)
    sols = sorted(solutions.glob("*.ipynb"))
    for sol in sols:
        generated = make_exercise(nbformat.read(sol, as_version=4))
        text = nbformat.writes(generated) + "\n"
        target = exercises / exercise_name(sol.name)
        old = exercises / sol.name
        if old.exists():
            if check:
                stale.append(f"{old.name} (the old name of {target.name}: move it there, or delete it)")
            elif _unedited(old, generated):
                old.unlink()
                notes.append(f"removed {old}: the old name of {target.name}, with nothing edited in it")
            else:
                how = (f"to carry on under the new name, move it there: mv {old} {target}"
                       if force or not target.exists() or _unedited(target, generated) else
                       f"{target} holds edits too: keep the one you want (either grades), delete the other")
                notes.append(f"kept {old}: it holds edits (yours?) under the exercise's old name, now {target.name}."
                             f" It still grades as it is (make grade NB={old}); {how}")
        if target.exists() and target.read_text() == text:
            continue
        if check:
            stale.append(target.name)
            continue
        if target.exists() and not force and not _unedited(target, generated):
            notes.append(f"not overwritten: {target} holds edits made after it was generated (a learner's "
                         f"answers?); move it away and run again, or regenerate it anyway with --force")
            continue
        stale.append(target.name)
        target.write_text(text)
    if check:
        known = {exercise_name(p.name) for p in sols} | {p.name for p in sols}
        stale += sorted(f"{p.name} (no solution)" for p in exercises.glob("*.ipynb") if p.name not in known)
    return stale


def _python(source: str) -> str:
    """Cell source as plain Python (IPython magics translated)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)
    except ImportError:
        return source
