"""Authoring helpers for notebooks (not part of the package).

    python tools/nbtool.py execute notebooks/00_triton_from_zero.py [more.py|.ipynb ...]

executes each notebook in place (fresh kernel from this environment, cwd = the notebook's folder) and stores its
outputs, printing the wall time. In a build script::

    from tools.nbtool import md, code, check, setup_cell, write
    SETUP = setup_cell("import inspect", "from minite.testing import check_op")   # the first code cell
    write("solutions/03_rmsnorm.ipynb", [md("# ..."), SETUP, check("rmsnorm_kernel", "assert ...")])
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNEL = {"display_name": "Python 3 (minite)", "language": "python", "name": "python3"}


def md(text: str):
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, tags: list[str] | None = None):
    cell = nbformat.v4.new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def check(name: str, text: str):
    """A graded check cell: first line '# CHECK: name', tagged nbval-check-output."""
    return code(f"# CHECK: {name}\n" + text.strip("\n"), tags=["nbval-check-output"])


def setup_text(*lines: str, device: bool = True, seed: bool = True,
               note: str = "before anything imports triton or minite kernels") -> str:
    """The text of a notebook's first code cell: turn the Triton CPU interpreter on when there is no GPU (before
    anything imports triton or minite kernels), then `lines` (imports), then DEVICE and a fixed seed."""
    head = ["import os, torch", "if not torch.cuda.is_available():",
            f'    os.environ["TRITON_INTERPRET"] = "1"  # {note}']
    tail = []
    if device:
        tail.append('DEVICE = "cuda" if torch.cuda.is_available() else "cpu"')
    if seed:
        tail.append("_ = torch.manual_seed(0)")
    return "\n".join([*head, *lines, *tail])


def setup_cell(*lines: str, **kwargs):
    """A code cell with `setup_text(*lines, **kwargs)`."""
    return code(setup_text(*lines, **kwargs))


def write(path: str | Path, cells: list) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata["language_info"] = {"name": "python"}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def execute(path: str | Path, timeout: int = 600) -> float:
    """Execute a notebook in place. Given the .py of a jupytext pair, first re-create its .ipynb from the .py
    (the .py is the source of truth for the cells), then execute that."""
    path = Path(path)
    if path.suffix == ".py":
        import jupytext
        nb = jupytext.read(path)
        nb.metadata.setdefault("jupytext", {})["formats"] = "ipynb,py:percent"
        nb.metadata["kernelspec"] = KERNEL
        path = path.with_suffix(".ipynb")
        jupytext.write(nb, path)
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    dt = time.perf_counter() - t0
    nbformat.write(nb, path)
    return dt


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "execute":
        sys.exit(__doc__)
    for p in sys.argv[2:]:
        print(f"{p}: executed in {execute(p):.1f} s")
