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

__all__ = ["torchrun", "results", "report"]


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


def report(out_dir: str | os.PathLike, rank: int, res: dict, keep_group: bool = False) -> int:
    """A check worker's end: write rank<r>.json (what ``results`` reads), leave the process group together
    (unless keep_group), and return the exit code (0 when every check is ok)."""
    import json

    import torch.distributed as dist
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    if dist.is_initialized() and not keep_group:
        dist.barrier()
        dist.destroy_process_group()
    return 0 if all(v.get("ok") for v in res.values()) else 1
