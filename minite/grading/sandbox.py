"""The kernel sandbox: a notebook run in a fresh kernel under per-cell timeouts, as the subreaper of everything it
starts (all killed afterwards), its check cells' records read back; the reference run of a solution.

The kernel starts in its own scratch folder (its working directory, temporary files, IPython/Jupyter
configuration, Triton and CUDA caches), as ``python -P -s`` (nothing of the working directory or the user's
site-packages on its import path), and, where Landlock is available (confine.py), confined: it can write nothing
outside that folder and /dev, and neither can anything it starts. The recorder's code (runtime.py) and the
launcher (confine.py) are read when the grader starts and sent to the kernel as source."""
from __future__ import annotations

import ast
import base64
import copy
import ctypes
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .flow import propagate
from .lint import _module_names
from .notebook import _python, check_cells, check_name, task_name
from .rewrite import rewrite_check

RECORD_MIME = "application/x-minite-record"
DEFAULT_TIMEOUT = 300  # seconds per task cell and per check cell (--timeout)
OTHER_CELLS_TIMEOUT = 600  # the notebook's other cells (set-up, imports)


_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_RUNTIME_SOURCE = Path(__file__).with_name("runtime.py").read_text()
_CONFINE_SOURCE = Path(__file__).with_name("confine.py").read_text()
_SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []  # -P: no working directory on sys.path


def _kernel_manager(scratch: str, confined: bool):
    """A KernelManager that starts ``python -P -s -m ipykernel_launcher`` (this interpreter), through the
    Landlock launcher when `confined`: writes only under `scratch` and /dev."""
    from jupyter_client.manager import AsyncKernelManager  # nbclient's own kind: its timeouts need an async client

    class ScratchKernel(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            kernel = [sys.executable, *_SAFE_PATH, "-s", "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f",
                      os.path.realpath(self.connection_file)]
            if not confined:
                return kernel
            return [sys.executable, *_SAFE_PATH, "-s", "-c", _CONFINE_SOURCE, scratch, "--", *kernel]
    return ScratchKernel


def _subreaper(on: bool) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _dumpable(on: bool) -> bool:
    """Make this process (not) dumpable; returns whether it was. A process that is not dumpable cannot be traced,
    nor its memory or file descriptors (/proc/PID/fd) opened, by other processes of the same (non-root) user."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        was = libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1
        libc.prctl(_PR_SET_DUMPABLE, int(on), 0, 0, 0)
        return was
    except (OSError, AttributeError):
        return True


def _children() -> set[int]:
    me, out = os.getpid(), set()
    for p in Path("/proc").glob("[0-9]*"):
        try:
            stat = (p / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(p.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _kill_new_children(before: set[int]) -> int:
    """SIGKILL and reap every child of this process that is not in `before` (orphans of the kernel are
    reparented to us while we are a subreaper), until none is left."""
    killed = 0
    for _ in range(100):
        new = _children() - before
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        for pid in new:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        time.sleep(0.05)
    return killed


@dataclass
class _Cell:
    ok: bool = True
    error: str = ""
    timed_out: bool = False
    records: list = field(default_factory=list)


def _records(outputs) -> list[dict]:
    import torch
    out = []
    for o in outputs:
        data = o.get("data", {}) if o.get("output_type") in ("display_data", "execute_result") else {}
        if RECORD_MIME in data:
            try:
                rec = torch.load(io.BytesIO(base64.b64decode(data[RECORD_MIME])), weights_only=True)
            except Exception:  # noqa: BLE001 - an unreadable record is no record
                continue
            out += [r for r in (rec if isinstance(rec, list) else [])
                    if isinstance(r, dict) and r.get("kind") in ("op", "close", "assert") and "rid" in r]
    return out


def _execute(nb, timeout: int, confined: bool = False) -> list[_Cell]:
    """Run `nb` in a fresh kernel (cwd: a scratch folder; `confined`: it writes nothing outside it), every cell
    even after errors: `timeout` s for each task and check cell, max(timeout, OTHER_CELLS_TIMEOUT) for the others
    (set-up, imports, ...). Afterwards kill the kernel and every process it left behind, then return what each
    cell did."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    results: list[_Cell] = [_Cell() for _ in nb.cells]
    replies = {}
    before = _children()
    reaper = _subreaper(True)
    try:
        with tempfile.TemporaryDirectory(prefix="minite-grade-") as tmp:
            tmp = os.path.realpath(tmp)
            other = max(timeout, OTHER_CELLS_TIMEOUT)
            client = NotebookClient(
                nb, kernel_manager_class=_kernel_manager(tmp, confined), timeout=timeout, kernel_name="python3",
                allow_errors=True, interrupt_on_timeout=True,
                timeout_func=lambda cell: timeout if task_name(cell) or check_name(cell) else other,
                error_on_timeout={"ename": "Timeout", "evalue": "timed out", "traceback": []},
                resources={"metadata": {"path": tmp}},
                on_cell_executed=lambda cell, cell_index, execute_reply: replies.__setitem__(cell_index,
                                                                                             execute_reply))
            os.mkdir(os.path.join(tmp, ".tmp"))
            env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
                   "IPYTHONDIR": os.path.join(tmp, ".ipython"), "JUPYTER_CONFIG_DIR": os.path.join(tmp, ".jupyter"),
                   "TMPDIR": os.path.join(tmp, ".tmp"), "TRITON_HOME": tmp,
                   "TRITON_CACHE_DIR": os.path.join(tmp, ".triton", "cache"),
                   "CUDA_CACHE_PATH": os.path.join(tmp, ".nv")}
            with client.setup_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
                for i, cell in enumerate(nb.cells):
                    if cell.cell_type != "code":
                        continue
                    res = results[i]
                    try:
                        client.execute_cell(cell, i)
                    except DeadKernelError:
                        res.ok, res.error = False, "the kernel died"
                        for j in range(i + 1, len(nb.cells)):
                            results[j] = _Cell(False, f"not run: the kernel died in cell {i}")
                        break
                    content = (replies.get(i) or {}).get("content", {})
                    if content.get("status") == "error":
                        res.ok = False
                        res.timed_out = content.get("ename") == "Timeout"
                        res.error = f"{content.get('ename')}: {content.get('evalue')}"[:300] \
                            if not res.timed_out else f"timed out after {client._get_timeout(cell)} s"
                    res.records = _records(cell.outputs)
                    if res.timed_out and not _responds(client, i, wait=min(20, 2 * timeout)):
                        for j in range(i + 1, len(nb.cells)):
                            results[j] = _Cell(False, f"not run: the kernel did not recover from the timeout in "
                                                      f"cell {i}")
                        break
    finally:
        _kill_new_children(before)
        if reaper:
            _subreaper(False)
    return results


def _responds(client, index: int, wait: int = 20) -> bool:
    """After interrupted cell `index`: does the kernel run a trivial cell again within `wait` seconds? The grader
    gives it twice the task's timeout, at most 20 s: a kernel that took the interrupt answers in well under one.
    (The probe takes that cell's place in the client's notebook; its results were read already.)"""
    probe = copy.deepcopy(client.nb.cells[index])
    probe.source = "pass"
    probe.outputs = []
    probing = {"timeout": wait, "interrupt_on_timeout": False, "error_on_timeout": None, "timeout_func": None}
    saved = {k: getattr(client, k) for k in probing}
    for k, v in probing.items():
        setattr(client, k, v)
    try:
        client.execute_cell(probe, index)
        return True
    except Exception:  # noqa: BLE001 - a dead or stuck kernel
        return False
    finally:
        for k, v in saved.items():
            setattr(client, k, v)


def _prepare(nb, mode: str, timeout: int):
    """The notebook as it runs: the recorder set up first, each check cell rewritten. Returns (nb, tests by
    check name)."""
    nb = copy.deepcopy(nb)
    tests = {}
    tainted: set[str] = set()  # names that depend on the answers so far (flow.py)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(_python(cell.source))
        except SyntaxError:
            continue
        if task_name(cell):
            tainted |= _module_names([tree])
        name = check_name(cell)
        if name:
            cell.source, tests[name] = rewrite_check(cell.source, name, mode, frozenset(tainted))
        tainted = propagate(tree.body, tainted)
    # Sent as source, not imported: importing the minite package here would decorate its Triton kernels before
    # the notebook's first cell has chosen the interpreter; and the file is read before any notebook runs.
    setup = nbformat.v4.new_code_cell(
        "import types as _t\n"
        "_rt = _t.ModuleType('minite_grade_runtime')\n"
        f"exec(compile({_RUNTIME_SOURCE!r}, 'minite_grade_runtime', 'exec'), _rt.__dict__)\n"
        f"_minite = _rt.Recorder({mode!r})\n"
        "del _t, _rt")
    nb.cells.insert(0, setup)
    return nb, tests


_REFERENCE_CACHE: dict[tuple, dict] = {}


def _reference(solution: Path, sol_nb, digest: str, timeout: int, confined: bool = False) -> dict[str, list[dict]]:
    """The reference run of a solution (cached per path and content `digest`): records of each check, by name.
    It runs under max(timeout, DEFAULT_TIMEOUT): a short --timeout is for the student's answers."""
    timeout = max(timeout, DEFAULT_TIMEOUT)
    key = (str(solution), digest)
    if key not in _REFERENCE_CACHE:
        nb, _ = _prepare(sol_nb, "reference", timeout)
        cells = _execute(nb, timeout, confined)
        out = {}
        for i, name in check_cells(nb):
            if not cells[i].ok:
                raise RuntimeError(f"{solution}: the solution's own check {name!r} fails in the reference run: "
                                   f"{cells[i].error}")
            out[name] = cells[i].records
        _REFERENCE_CACHE[key] = out
    return _REFERENCE_CACHE[key]
