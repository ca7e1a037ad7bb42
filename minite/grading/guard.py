"""What a student's notebook must not change in the grader: the course's files and the grader's own code.

The student's kernel runs with the grader's user id, so it can write the course's files: the minite package (an
editable install is the repository's minite/) and solutions/. ``CourseFiles`` takes a copy of them before the
notebook runs and, once the kernel and its processes are dead, puts back every file that was changed, created or
deleted (a notebook that changed one scores 0), so that no notebook changes the next one's grade. Nothing is thrown
away: what was found in place of each file (an instructor's edit made while a batch was grading, say) is moved to
a put-back folder first, ``.grading-put-back/<time>-<pid>/`` under the course (``$MINITE_PUT_BACK_DIR`` to move
it), and the report names it.
``sealed_imports`` refuses every import of minite while a student's notebook runs and while it is judged: the
grader imported what it needs before, so no file the student's code wrote runs in the grader.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _state(path: str):
    """('link', target), ('dir',), ('file', bytes) or None (absent), without following links."""
    if os.path.islink(path):
        return ("link", os.readlink(path))
    if os.path.isdir(path):
        return ("dir",)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return ("file", f.read())
    return None


def _unchanged(path: str, state) -> bool:
    """Is `path` still in `state`? (A file of another size is not read.)"""
    if state is None:
        return not os.path.lexists(path)
    if state[0] == "link":
        return os.path.islink(path) and os.readlink(path) == state[1]
    if os.path.islink(path):
        return False
    if state[0] == "dir":
        return os.path.isdir(path)
    if not os.path.isfile(path) or os.path.getsize(path) != len(state[1]):
        return False
    with open(path, "rb") as f:
        return f.read() == state[1]


def _listing(root: Path) -> list[str]:
    """`root` and every path under it; links are listed, never followed."""
    out = [str(root)]
    if os.path.islink(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        out += [os.path.join(dirpath, name) for name in dirnames + filenames]
    return out


def _put_back(path: str, state) -> None:
    if _unchanged(path, state):
        return
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    if state is None:
        return
    if state[0] == "dir":
        os.makedirs(path)
    elif state[0] == "link":
        os.symlink(state[1], path)
    else:
        with open(path, "wb") as f:
            f.write(state[1])


class CourseFiles:
    """A copy of the files under `trees` (folders) and of `files`, to put back after a student's notebook ran."""

    def __init__(self, trees: list[Path], files: list[Path], root: Path):
        self.trees = [t for t in trees if t.is_dir()]
        self.files = files
        self.root = root
        self.kept: Path | None = None  # the put-back folder of the last restore(), if it moved anything there
        self.saved = self._now()

    def _now(self) -> dict[str, tuple]:
        paths = [p for t in self.trees for p in _listing(t)] + [str(f) for f in self.files]
        return {p: _state(p) for p in paths}

    def restore(self) -> list[str]:
        """Put every changed, created or deleted file back as it was; return the changed ones (compiled-bytecode
        caches are put back too, and not named: other processes write those). What stood in place of a named file
        is moved to ``self.kept`` first (None when nothing was): nothing written there is lost."""
        created = {p for t in self.trees for p in _listing(t)} - set(self.saved)
        changed = sorted({p for p, state in self.saved.items() if not _unchanged(p, state)} | created)
        self.kept = None
        for path in changed:  # parents first: a folder replaced by a link is unlinked before its files are put back
            if "__pycache__" not in Path(path).parts and os.path.lexists(path) and not (
                    os.path.isdir(path) and not os.path.islink(path) and (self.saved.get(path) or ("",))[0] == "dir"):
                self._keep(path)
            _put_back(path, self.saved.get(path))
        return [self._name(p) for p in changed if "__pycache__" not in Path(p).parts]

    def _keep(self, path: str) -> None:
        """Move `path` (a file, a link, or a folder that was not one) under the put-back folder, by its name."""
        if self.kept is None:
            base = Path(os.environ.get("MINITE_PUT_BACK_DIR") or self.root / ".grading-put-back")
            self.kept = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            try:
                self.kept.mkdir(parents=True, exist_ok=True)
            except OSError:  # a read-only course: the system's temporary folder, still named in the report
                self.kept = Path(tempfile.mkdtemp(prefix="minite-put-back-"))
        dest = self.kept / self._name(path).lstrip(os.sep)
        if os.path.lexists(dest):  # already moved with its folder
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, dest)

    def _name(self, path: str) -> str:
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return path


class _Sealed:
    """A meta-path finder that refuses to import minite."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "minite" or fullname.startswith("minite."):
            raise ImportError(f"the grader imports nothing of minite once a student's notebook runs: {fullname}")
        return None


@contextlib.contextmanager
def sealed_imports():
    finder = _Sealed()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
