"""Assembly: the graded notebook is the pristine solution with only the student's answers spliced in."""
from __future__ import annotations

import ast
import copy

from .lint import _module_names, _verify_answers
from .notebook import BEGIN, BEGIN_YOURS, END, END_YOURS, _python, regions, stub_source, task_cells, task_name


def _splice(solution_src: str, student_src: str, where: str) -> str:
    """The solution cell with each region's body replaced by the student's answer for that region."""
    sol_lines, stu_lines = solution_src.splitlines(), student_src.splitlines()
    sol_reg = regions(solution_src, where)
    stu_reg = regions(student_src, where, ((BEGIN_YOURS, END_YOURS), (BEGIN, END)))
    if len(stu_reg) != len(sol_reg):
        raise ValueError(f"{where}: expected {len(sol_reg)} answer region(s) between '{BEGIN_YOURS}' and "
                         f"'{END_YOURS}', found {len(stu_reg)}")
    out, prev = [], 0
    for (b, e), (sb, se) in zip(sol_reg, stu_reg):
        out += sol_lines[prev:b + 1] + stu_lines[sb + 1:se] + [sol_lines[e]]
        prev = e + 1
    return "\n".join(out + sol_lines[prev:])


def _student_tasks(student_nb, names: list[str], notes: list[str]) -> dict[str, str | ValueError]:
    """NAME -> source of the student's task cell (an error for a name that several cells carry). Notebooks from
    before task names (no minite metadata at all) are matched by order when they have exactly as many answer
    cells as the solution has tasks."""
    by_name, cells = {}, {}
    for i, c in enumerate(student_nb.cells):
        if task_name(c):
            by_name.setdefault(task_name(c), c.source)
            cells.setdefault(task_name(c), []).append(i)
    for name, where in cells.items():  # which one is the answer? neither is graded
        if len(where) > 1:
            by_name[name] = ValueError(f"task {name!r}: {len(where)} cells of your notebook carry this task name "
                                       f"(cells {', '.join(map(str, where))}): keep one; it is not graded")
    if by_name or not names:
        return by_name
    old = [c.source for c in student_nb.cells if c.cell_type == "code"
           and any(ln.strip() in (BEGIN_YOURS, BEGIN) for ln in c.source.splitlines())]
    if len(old) != len(names):
        raise ValueError(f"this notebook's cells carry no task names (minite metadata), and it has {len(old)} "
                         f"answer cell(s) for {len(names)} task(s): regenerate it with `make exercises` and "
                         "copy your answers over")
    notes.append("this notebook's cells carry no task names: its answer cells were matched to tasks by order")
    return dict(zip(names, old))


def _notebook_names(nb) -> set[str]:
    out = set()
    for c in nb.cells:
        if c.cell_type == "code" and not task_name(c):
            try:
                out |= _module_names([ast.parse(_python(c.source))])
            except SyntaxError:
                pass
    return out


def assemble(student_nb, solution_nb, notes: list[str] | None = None, lint: bool = True):
    """The notebook that is actually graded: the solution notebook with the student's answers spliced in, task
    cells matched by NAME. A missing task, a broken region or a rejected answer stays stubbed (it scores
    nothing) and a line saying why is appended to `notes`."""
    notes = [] if notes is None else notes
    names = task_cells(solution_nb, "solution")
    mine = _student_tasks(student_nb, list(names), notes)
    nb_names = _notebook_names(solution_nb) if lint else set()
    graded = copy.deepcopy(solution_nb)
    for name, i in names.items():
        cell = graded.cells[i]
        where = f"task {name!r}"
        try:
            if name not in mine:
                raise ValueError(f"{where}: no cell with this task name in your notebook (deleted?)")
            if isinstance(mine[name], ValueError):
                raise mine[name]
            spliced = _splice(cell.source, mine[name], where)
            if lint:
                _verify_answers(cell.source, spliced, nb_names, where)
            cell.source = spliced
        except ValueError as err:
            notes.append(str(err))
            cell.source = _splice(cell.source, stub_source(cell.source, where), where)
    for cell in graded.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("tags", None)
    return graded
