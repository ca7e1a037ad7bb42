"""Launch ``torchrun`` as a subprocess (tests and notebook cells): output captured, a hard timeout, one thread.

    res = torchrun(2, ["-m", "minite.parallel.workers", "dp", "--out", d])   # subprocess.CompletedProcess
    res.returncode, res.stdout (stdout and stderr, merged)
    results(d)                                                              # {rank: {result: {"ok": ...}}}

Notebooks cannot mp.spawn a function defined in a cell (it cannot be pickled from __main__): the workers live in
``minite/`` and the cell shows what rank 0 wrote. Child stderr is captured here, never left to leak into the
cell's output. Where the workers run is one decision, ``worker_device``/``worker_env`` (pure given a GPU count):
  * a CPU-only machine (CI): CPU tensors over gloo, the Triton kernels in the interpreter (TRITON_INTERPRET=1):
    the Triton path in workers is covered there;
  * a GPU machine never runs the interpreter (TRITON_INTERPRET is removed). With a GPU per rank, ``minite.train``
    workers take NCCL, one GPU each (``worker_device``); with fewer GPUs the workers hold CPU tensors over gloo
    on the torch reference ops (MINITE_BACKEND=torch). The check workers (CPU tensors by design) report their
    Triton checks as {"skipped": why} there (``triton_skipped``) instead of forcing backend="triton".
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["torchrun", "results", "worker_device", "worker_env", "workers_note", "triton_skipped"]
COVERED = "the Triton path in workers is covered by the CPU-only run"


def _gpus(cuda_devices: int | None) -> int:
    import torch
    return cuda_devices if cuda_devices is not None else torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_device(nproc: int, cuda_devices: int | None = None) -> str:
    """The device of `nproc` workers: "cuda" (NCCL, one GPU per rank) when this node has a GPU per rank, else "cpu"
    (gloo): dims.select_device's rule for train.device=auto. The tests' one-process reference runs there too."""
    from minite.parallel.dims import select_device
    return select_device("auto", nproc, _gpus(cuda_devices))


def worker_env(nproc: int, cuda_devices: int | None = None, env: dict | None = None,
               base: dict | None = None) -> dict[str, str]:
    """The environment of `nproc` torchrun workers: `base` (os.environ), `env`, then the machine's rule (above):
    no GPU: TRITON_INTERPRET=1 unless set; a GPU: no TRITON_INTERPRET, whoever set it, and MINITE_BACKEND=torch
    when the workers are on the CPU. One OpenMP thread, unbuffered output, this checkout on PYTHONPATH."""
    gpus = _gpus(cuda_devices)
    e = {**(os.environ if base is None else base), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if gpus == 0:
        e.setdefault("TRITON_INTERPRET", "1")
    else:
        e.pop("TRITON_INTERPRET", None)
        if worker_device(nproc, gpus) == "cpu":
            e["MINITE_BACKEND"] = "torch"
    root = str(Path(__file__).resolve().parents[2])
    e["PYTHONPATH"] = os.pathsep.join([root] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    return e


def workers_note(nproc: int, cuda_devices: int | None = None) -> str:
    """Where `nproc` workers run here, in words (the tests print it in their summary)."""
    gpus = _gpus(cuda_devices)
    if gpus == 0:
        return "workers on CPU/gloo with the Triton kernels in the interpreter (TRITON_INTERPRET=1, no GPU)"
    if worker_device(nproc, gpus) == "cpu":
        return (f"workers on CPU/gloo with the torch reference ops ({gpus} GPU(s), fewer than the ranks; no "
                f"interpreter on a GPU machine); {COVERED}")
    return (f"minite.train workers on NCCL, one GPU per rank; the check workers (CPU tensors) on gloo with the torch "
            f"reference ops; {COVERED}")


def triton_skipped(x) -> dict | None:
    """In a worker: {"skipped": why} when no Triton kernel can run on tensor `x` here (a CPU tensor on a GPU
    machine, where the interpreter is off), None when one can. A check reports this instead of forcing Triton."""
    from minite._triton import HAS_TRITON
    from minite.backend import triton_available_for
    ok, why = triton_available_for(x)
    if HAS_TRITON and x.device.type == "cpu":
        why = "the Triton interpreter is off (a GPU machine never uses it)"
    return None if ok else {"skipped": f"{why}: workers on CPU/gloo with the torch reference ops; {COVERED}"}


def torchrun(nproc: int, args: list[str], *, timeout: float = 180.0, env: dict | None = None,
             cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc *args``; raises TimeoutExpired.
    The workers' environment is ``worker_env(nproc, env=env)``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=worker_env(nproc, env=env), cwd=cwd)


def results(out_dir: str | os.PathLike) -> dict[int, dict]:
    """{rank: {result: {...}}} from the rank<r>.json files the workers (minite.parallel.workers) wrote."""
    import json
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))}
