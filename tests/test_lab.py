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
