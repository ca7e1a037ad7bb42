"""Launch ``torchrun`` as a subprocess (tests and notebook cells): output captured, a hard timeout, one thread.

    res = torchrun(2, ["-m", "minite.parallel.checks", "dp", "--out", d])   # subprocess.CompletedProcess
    res.returncode, res.stdout (stdout and stderr, merged)

Notebooks cannot mp.spawn a function defined in a cell (it cannot be pickled from __main__): the workers live in
``minite/`` and the cell shows what rank 0 wrote. Child stderr is captured here, never left to leak into the
cell's output. The workers hold CPU tensors over gloo on any machine (one GPU cannot host 2-4 NCCL ranks), so
their Triton kernels run in the interpreter: TRITON_INTERPRET=1 unless the environment or `env` sets it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["torchrun", "results"]


def torchrun(nproc: int, args: list[str], *, timeout: float = 180.0, env: dict | None = None,
             cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc *args``; raises TimeoutExpired."""
    root = str(Path(__file__).resolve().parents[2])
    e = {"TRITON_INTERPRET": "1", **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    e["PYTHONPATH"] = os.pathsep.join([root] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=e, cwd=cwd)


def results(out_dir: str | os.PathLike) -> dict[int, dict]:
    """{rank: {check: result}} from the rank<r>.json files minite.parallel.checks wrote."""
    import json
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))}
