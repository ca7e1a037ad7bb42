"""The grader's put-back of the course's files (minite/grading/guard.py): everything is restored, and nothing that
stood in place of a file is lost (it is moved to the put-back folder, by its path under the course)."""
import os

from minite.grading.guard import CourseFiles


def test_restore_puts_back_and_keeps_what_it_replaced(tmp_path, monkeypatch):
    course = tmp_path / "course"
    pkg = course / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "b.py").write_text("B = 2\n")
    (pkg / "gone.py").write_text("G = 3\n")
    monkeypatch.setenv("MINITE_PUT_BACK_DIR", str(tmp_path / "kept"))
    files = CourseFiles([pkg], [], course)

    (pkg / "a.py").write_text("A = 'edited while grading'\n")   # changed
    (pkg / "gone.py").unlink()                                   # deleted
    (pkg / "new").mkdir()                                        # a created folder with a file
    (pkg / "new" / "c.py").write_text("C = 4\n")
    (pkg / "sub" / "b.py").unlink()                              # a file replaced by a folder
    (pkg / "sub" / "b.py").mkdir()
    (pkg / "__pycache__").mkdir()                                # bytecode: put back, never named nor kept
    (pkg / "__pycache__" / "a.pyc").write_bytes(b"\0")

    changed = files.restore()
    assert changed == ["pkg/a.py", "pkg/gone.py", "pkg/new", "pkg/new/c.py", "pkg/sub/b.py"]
    assert (pkg / "a.py").read_text() == "A = 1\n" and (pkg / "gone.py").read_text() == "G = 3\n"
    assert (pkg / "sub" / "b.py").read_text() == "B = 2\n"
    assert not (pkg / "new").exists() and not (pkg / "__pycache__").exists()
    kept = files.kept
    assert kept is not None and kept.parent == tmp_path / "kept"
    assert (kept / "pkg" / "a.py").read_text() == "A = 'edited while grading'\n"
    assert (kept / "pkg" / "new" / "c.py").read_text() == "C = 4\n"
    assert (kept / "pkg" / "sub" / "b.py").is_dir()
    assert not (kept / "pkg" / "gone.py").exists() and not (kept / "pkg" / "__pycache__").exists()


def test_nothing_changed_keeps_nothing(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    monkeypatch.setenv("MINITE_PUT_BACK_DIR", str(tmp_path / "kept"))
    files = CourseFiles([tmp_path / "pkg"], [], tmp_path)
    assert files.restore() == [] and files.kept is None and not os.path.exists(tmp_path / "kept")


def test_an_unwritable_put_back_folder_falls_back_to_a_temporary_one(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "not_a_folder").write_text("")
    monkeypatch.setenv("MINITE_PUT_BACK_DIR", str(tmp_path / "not_a_folder" / "kept"))  # mkdir fails there
    files = CourseFiles([tmp_path / "pkg"], [], tmp_path)
    (tmp_path / "pkg" / "a.py").write_text("A = 2\n")
    assert files.restore() == ["pkg/a.py"] and (tmp_path / "pkg" / "a.py").read_text() == "A = 1\n"
    assert files.kept.name.startswith("minite-put-back-") and (files.kept / "pkg" / "a.py").read_text() == "A = 2\n"
