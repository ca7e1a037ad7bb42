"""What a student's notebook must not change in the grader: the course's files and the grader's own code.

Where Landlock is available the student's kernel cannot write outside its scratch folder (confine.py), so any
change to the course during a grade is someone else's (an instructor's edit): nothing is put back, nobody is
blamed. Elsewhere (no Landlock: an old Linux kernel, macOS) ``Snapshot`` records what the course, the virtual
environment, the solution's and the notebook's folders look like (type, size, time, inode of every path) before the
notebook runs, and names whatever changed once its processes are dead. It cannot tell the notebook's writes from a
concurrent edit, so it keeps the working copy as it is and the report names every such file: never a silent
rewrite, never a blame for a file the notebook may not have written.
``sealed_imports`` refuses every import of minite while a student's notebook runs and while it is judged: the
grader imported what it needs before, so no file the student's code wrote runs in the grader.
"""
from __future__ import annotations

import contextlib
import os
import stat
import sys
from pathlib import Path


def _stamp(path: str):
    """What a path is, without following links or reading it: ('link', target) or (mode, size, mtime, inode)."""
    st = os.lstat(path)
    if os.path.islink(path):
        return ("link", os.readlink(path))
    return (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)


class Snapshot:
    """Every path under `roots` (folders; links listed, never followed; bytecode caches skipped: other processes
    write them), to name what changed later."""

    def __init__(self, roots: list[Path], base: Path):
        self.roots = sorted({os.path.realpath(r) for r in roots if os.path.isdir(r)})
        self.base = base
        self.saved = self._now()

    def _now(self) -> dict[str, tuple]:
        out = {}
        for root in self.roots:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if d != "__pycache__"]
                for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                    try:
                        out[name] = _stamp(name)
                    except OSError:
                        pass
        return out

    def changed(self) -> list[str]:
        """Paths created, changed or deleted since the snapshot (a folder whose listing changed is not named:
        its new or deleted entries are), relative to `base` where they are under it."""
        now = self._now()
        out = []
        for path in sorted(set(now) | set(self.saved)):
            a, b = self.saved.get(path), now.get(path)
            if a == b or (a and b and a[0] == b[0] != "link" and stat.S_ISDIR(a[0]) and a[3] == b[3]):
                continue
            out.append(self._name(path))
        return out

    def _name(self, path: str) -> str:
        try:
            return str(Path(path).relative_to(os.path.realpath(self.base)))
        except ValueError:
            return path


def _cwd_modules() -> list[str]:
    """Modules this process imported from its working directory (`python -m` without -P puts it first on
    sys.path), other than the minite package itself and what lies in the virtual environment."""
    cwd, prefix = Path.cwd().resolve(), Path(sys.prefix).resolve()
    out = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not isinstance(f, str) or not os.path.isabs(f):  # torch.classes: '_classes.py'
            continue
        try:
            rel = Path(f).resolve().relative_to(cwd)
        except (ValueError, OSError):
            continue
        if rel.parts[0] != "minite" and not Path(f).resolve().is_relative_to(prefix):
            out.append(f"{name} ({f})")
    return sorted(out)


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
