"""Confinement of a graded notebook's kernel: Landlock (Linux >= 5.13), which any unprivileged process can apply
to itself and to everything it starts later, and which no process can lift.

The grader starts each kernel through this file's source (``python -P -s -c SOURCE SCRATCH -- ARGV...``, read
when the grader starts, never imported by the kernel): it forbids every write to the file system except under
the run's own scratch folder and /dev (devices, /dev/shm), then execs the real kernel. Creating, changing,
truncating, renaming, linking or deleting a file anywhere else (the course, the virtual environment, the
user's home and caches, /tmp) fails with PermissionError; signals to processes outside the kernel's domain and
abstract unix sockets are refused too where the kernel supports it (ABI >= 6).

Self-contained (standard library only): it runs before the kernel imports anything.
"""
from __future__ import annotations

import ctypes
import os
import struct
import sys

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same numbers on every architecture
_VERSION = 1  # landlock_create_ruleset flag: return the ABI version
_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_SCOPES = 0b11  # ABI 6: abstract unix sockets, signals


def _syscall(*args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])


def abi() -> int:
    """The Landlock ABI version this kernel offers (0: none, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        return max(int(_syscall(_CREATE_RULESET, None, 0, _VERSION)), 0)
    except (OSError, AttributeError):
        return 0


def restrict(writable: list[str]) -> int:
    """Forbid this process and every process it starts from now on to write anywhere but under `writable`
    (folders). Returns the ABI used; raises OSError where Landlock is unavailable."""
    version = abi()
    if version < 1:
        raise OSError("Landlock is not available on this system")
    handled = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    handled |= (_REFER if version >= 2 else 0) | (_TRUNCATE if version >= 3 else 0)
    scoped = _SCOPES if version >= 6 else 0
    attr = struct.pack("=QQQ", handled, 0, scoped) if version >= 6 else \
        struct.pack("=QQ", handled, 0) if version >= 4 else struct.pack("=Q", handled)
    fd = int(_syscall(_CREATE_RULESET, ctypes.c_char_p(attr), len(attr), 0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for folder in writable:
            parent = os.open(folder, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", handled, parent)  # struct landlock_path_beneath_attr (packed)
                if _syscall(_ADD_RULE, fd, _PATH_BENEATH, ctypes.c_char_p(rule), 0) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {folder}")
            finally:
                os.close(parent)
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if _syscall(_RESTRICT_SELF, fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)
    return version


_WORKS: dict[str, int] = {}


def usable() -> int:
    """The ABI, if a process here can really confine itself (a container's seccomp may refuse the last step):
    tried once in a forked child. 0: no."""
    if "abi" not in _WORKS:
        version = abi()
        if version > 0:
            pid = os.fork()
            if pid == 0:  # the child: confine itself, report, exit without running anything of the parent's
                try:
                    restrict(["/dev"])
                    os._exit(0)
                except BaseException:  # noqa: BLE001 - any failure means "no"
                    os._exit(1)
            _, status = os.waitpid(pid, 0)
            version = version if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else 0
        _WORKS["abi"] = version
    return _WORKS["abi"]


def _launch(argv: list[str]) -> None:
    """``SCRATCH [SCRATCH...] -- PROGRAM ARGS...``: confine to the scratch folders (and /dev), then exec."""
    cut = argv.index("--")
    restrict([*argv[:cut], "/dev"])
    os.execv(argv[cut + 1], argv[cut + 1:])


if __name__ == "__main__":
    _launch(sys.argv[1:])
