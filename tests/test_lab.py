"""`make lab`: JupyterLab saves both files of a jupytext pair. Played with the contents manager the jupytext
server extension installs (no browser), on a copy of a real solution pair and the repository's jupytext.toml."""
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_notebooks as cn  # noqa: E402


def test_jupytext_server_extension_is_enabled():
    jupyter = Path(sys.executable).with_name("jupyter")
    if not jupyter.exists():
        pytest.skip("jupyter is not installed next to this interpreter")
    out = subprocess.run([str(jupyter), "server", "extension", "list"], capture_output=True, text=True)
    text = out.stdout + out.stderr
    assert "jupyterlab_jupytext" in text and "enabled" in text.split("jupyterlab_jupytext", 1)[1][:40], text


def test_saving_in_the_lab_writes_both_files_of_a_pair(tmp_path):
    pytest.importorskip("jupyter_server")
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from jupytext.sync_contentsmanager import build_sync_jupytext_contents_manager_class

    sol = next(iter(sorted((ROOT / "solutions").glob("*.py"))), None)
    if sol is None:
        pytest.skip("no solution pair")
    (tmp_path / "solutions").mkdir()
    shutil.copy(ROOT / "jupytext.toml", tmp_path / "jupytext.toml")
    for suffix in (".py", ".ipynb"):
        shutil.copy(sol.with_suffix(suffix), tmp_path / "solutions" / sol.with_suffix(suffix).name)
    cm = build_sync_jupytext_contents_manager_class(FileContentsManager)(root_dir=str(tmp_path))
    path = f"solutions/{sol.stem}.ipynb"
    model = cm.get(path)
    nb = model["content"]
    task = next(c for c in nb.cells if c.get("metadata", {}).get("minite", {}).get("task"))
    task.source += "\n# edited in JupyterLab"
    cm.save({"type": "notebook", "format": "json", "content": nb}, path)
    text = (tmp_path / "solutions" / f"{sol.stem}.py").read_text()
    assert "# edited in JupyterLab" in text
    assert 'minite={"task": "' in text, "the task name must survive a save (cell_metadata_filter in jupytext.toml)"
    saved = nbformat.read(tmp_path / path, as_version=4)
    assert any("# edited in JupyterLab" in c.source for c in saved.cells)
    (tmp_path / "notebooks").mkdir()
    assert cn.pairs_out_of_sync(tmp_path) == []
    # and the other way: an edit of the .py shows when the notebook is opened
    (tmp_path / "solutions" / f"{sol.stem}.py").write_text(text.replace("# edited in JupyterLab", "# edited in vim"))
    assert any("# edited in vim" in c.source for c in cm.get(path)["content"].cells)


def _lab(tmp_path, lesson: str):
    """A copy of a lesson pair under tmp_path/notebooks, and the contents manager `make lab` runs (jupytext's,
    with tools/lab_hooks.py's save hook)."""
    pytest.importorskip("jupyter_server")
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from jupytext.sync_contentsmanager import build_sync_jupytext_contents_manager_class

    from tools.lab_hooks import keep_lesson_outputs
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "jupytext.toml", tmp_path / "jupytext.toml")
    for suffix in (".py", ".ipynb"):
        shutil.copy(ROOT / "notebooks" / f"{lesson}{suffix}", tmp_path / "notebooks" / f"{lesson}{suffix}")
    cls = build_sync_jupytext_contents_manager_class(FileContentsManager)
    cm = cls(root_dir=str(tmp_path))
    cm.pre_save_hook = keep_lesson_outputs  # as --ContentsManager.pre_save_hook sets it
    return cm


def _run(nb):
    """What a run in JupyterLab does to a notebook: new outputs and counts, no nbclient timings, another kernel."""
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"my run {i}\n")]
            c.execution_count = i
            c.metadata.pop("execution", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def test_a_lesson_run_and_saved_in_the_lab_leaves_git_clean(tmp_path):
    """Issue 37 item 7: running a lesson in JupyterLab rewrote its tracked .ipynb and .py. A save with no cell
    changed writes both files back byte for byte; an edited cell is saved as usual; other folders are left alone."""
    lesson = "11_tensor_parallel"
    cm = _lab(tmp_path, lesson)
    files = [tmp_path / "notebooks" / f"{lesson}{s}" for s in (".ipynb", ".py")]
    before = [f.read_bytes() for f in files]
    path = f"notebooks/{lesson}.ipynb"
    nb = cm.get(path)["content"]
    _run(nb)
    cm.save({"type": "notebook", "format": "json", "content": nb}, path)
    assert [f.read_bytes() for f in files] == before, "a run and a save changed the lesson's files"
    nb.cells[-1].source += "\n# my note"  # an edit: saved, with the run's outputs
    cm.save({"type": "notebook", "format": "json", "content": nb}, path)
    assert "# my note" in files[1].read_text() and "my run" in files[0].read_text()
    (tmp_path / "solutions").mkdir()  # outside notebooks/: saved as it comes
    for f in files:
        shutil.copy(f, tmp_path / "solutions" / f.name)
    cm.save({"type": "notebook", "format": "json", "content": nb}, f"solutions/{lesson}.ipynb")
    assert "Python 3 (ipykernel)" in (tmp_path / "solutions" / f"{lesson}.py").read_text()


def test_make_lab_runs_the_lab_with_the_save_hook():
    if shutil.which("make") is None:
        pytest.skip("needs make")
    plan = subprocess.run(["make", "-n", "-o", str(Path(sys.prefix) / ".minite-setup"), "lab",
                           f"VENV={sys.prefix}"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "-m jupyterlab " in plan and "--ContentsManager.pre_save_hook=tools.lab_hooks.keep_lesson_outputs" in plan
    from traitlets.utils.importstring import import_item  # what the server does with the string, from the root
    assert callable(import_item("tools.lab_hooks.keep_lesson_outputs"))
