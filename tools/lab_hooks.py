"""`make lab`'s save hook: a lesson saved with no cell changed is written back as it was, so opening a lesson,
running it and saving it (JupyterLab autosaves) leaves `git status` clean.

    python -m jupyterlab --ContentsManager.pre_save_hook=tools.lab_hooks.keep_lesson_outputs   (make lab does)

A lesson is a jupytext pair, notebooks/NN_topic.ipynb + .py, and the outputs its .ipynb carries are the ones
`make notebooks` recorded (CI checks them). A learner's run differs from them (timings, the cells' execution
metadata, the kernel's name): saved, every lesson would show as modified. So when the saved notebook's cells (type,
source, minite/tags metadata) are those of the file on disk, the file on disk is written back unchanged, for the
.ipynb and for its .py. A save that changes a cell (an edit) is written as usual, outputs and all; so is everything
outside notebooks/ (exercises: the learner's work; solutions: the authors'). To keep a run's outputs, save a copy
under another name (File > Save Notebook As)."""
from __future__ import annotations

from pathlib import Path

LESSONS = "notebooks/"


def _cells(nb) -> list[tuple]:
    return [(c.cell_type, c.source, {k: c.metadata[k] for k in ("minite", "tags") if k in c.metadata})
            for c in nb.cells]


def keep_lesson_outputs(model: dict, path: str, contents_manager, **kwargs) -> None:
    """ContentsManager.pre_save_hook: replace the content of a lesson's save by the file on disk when no cell
    changed (see the module doc)."""
    path = path.strip("/")
    if not path.startswith(LESSONS) or "/" in path[len(LESSONS):]:
        return
    on_disk = Path(contents_manager.root_dir) / path
    if not on_disk.is_file():
        return  # a new file (Save As): written as it comes
    if model.get("type") == "notebook" and path.endswith(".ipynb"):
        import nbformat
        mine = nbformat.read(on_disk, as_version=4)
        if _cells(nbformat.from_dict(model["content"])) == _cells(mine):
            model["content"] = mine
    elif model.get("type") == "file" and model.get("format") == "text" and path.endswith(".py"):
        import jupytext
        if _cells(jupytext.reads(model["content"], fmt="py:percent")) == _cells(jupytext.read(on_disk)):
            model["content"] = on_disk.read_text()
