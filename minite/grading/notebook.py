"""Notebook I/O: answer regions, task and check cells by name, and exercises generated from solutions."""
from __future__ import annotations

import copy
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
BEGIN_YOURS = "### BEGIN YOUR CODE"
END_YOURS = "### END YOUR CODE"
STUB = "raise NotImplementedError()"
CHECK_TAG = "nbval-check-output"


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


def check_cells(nb) -> list[tuple[int, str]]:
    """(cell index, NAME) of every check cell (``metadata.minite.check``), in notebook order."""
    return [(i, check_name(c)) for i, c in enumerate(nb.cells) if check_name(c)]


def make_exercise(solution_nb):
    """The exercise notebook of a solution notebook: regions stubbed, code outputs and execution counts cleared,
    jupytext pairing removed."""
    task_cells(solution_nb, "solution")
    nb = copy.deepcopy(solution_nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if task_name(cell):
            cell.source = stub_source(cell.source, f"cell {i}")
        cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("jupytext", None)
    nb.metadata["minite"] = {"generated_from": "solutions/ by `make exercises`; edit the solution, not this file"}
    return nb


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def generate_all(solutions: Path, exercises: Path, check: bool = False) -> list[str]:
    """Write exercises/X.ipynb for every solutions/X.ipynb. With `check`, write nothing and return the
    names of exercises that are missing or out of date."""
    stale = []
    if not check:
        exercises.mkdir(parents=True, exist_ok=True)
    for sol in sorted(solutions.glob("*.ipynb")):
        text = nbformat.writes(make_exercise(nbformat.read(sol, as_version=4))) + "\n"
        target = exercises / sol.name
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not check:
            target.write_text(text)
    if check:
        extra = {p.name for p in exercises.glob("*.ipynb")} - {p.name for p in solutions.glob("*.ipynb")}
        stale += sorted(f"{n} (no solution)" for n in extra)
    return stale


def _python(source: str) -> str:
    """Cell source as plain Python (IPython magics translated)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)
    except ImportError:
        return source
