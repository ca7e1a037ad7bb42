"""Grade a learner's distributed function through torchrun (chapters 10-11 exercises).

    torchrun --nproc-per-node 2 -m minite.parallel.grade --file student.py --task sharded_sgd_step --out DIR

The check cell writes the learner's function to `student.py`; every rank imports it, runs it on its own data
and compares with what the single-process computation gives. Each rank writes DIR/rank<r>.json: {"ok", "err"}.
``run_graded(...)`` is what a notebook cell calls (it launches, waits and collects).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

from minite.parallel.dims import init_distributed


def _load(path: str):
    spec = importlib.util.spec_from_file_location("student", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def task_sharded_sgd_step(mod, rank, world) -> float:
    """flat_param (same on every rank), flat_grad (different per rank) -> flat_param - lr * mean of the grads."""
    worst = 0.0
    for n in (world * 5, world * 64):
        g = torch.Generator().manual_seed(n)
        param = torch.randn(n, generator=g)
        grads = torch.randn(world, n, generator=g)
        want = param - 0.1 * grads.mean(0)
        p = param.clone()
        mod.sharded_sgd_step(p, grads[rank].clone(), None if world == 1 else dist.group.WORLD, 0.1)
        worst = max(worst, float((p - want).abs().max()))
    return worst


def task_row_parallel_linear(mod, rank, world) -> float:
    """y = x W^T with W's columns (and x's last dim) split over ranks: y, dx_local and dW_local vs dense."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 5, 8 * world, generator=g), torch.randn(6, 8 * world, generator=g)
    dy = torch.randn(3, 5, 6, generator=g)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xd @ wd.t()).backward(dy)
    xl = x.chunk(world, -1)[rank].clone().requires_grad_()
    wl = w.chunk(world, -1)[rank].clone().requires_grad_()
    y = mod.row_parallel_linear(xl, wl, None if world == 1 else dist.group.WORLD)
    y.backward(dy)
    errs = [(y - xd @ wd.t()).abs().max(), (xl.grad - xd.grad.chunk(world, -1)[rank]).abs().max(),
            (wl.grad - wd.grad.chunk(world, -1)[rank]).abs().max()]
    return float(max(errs))


TASKS = {"sharded_sgd_step": task_sharded_sgd_step, "row_parallel_linear": task_row_parallel_linear}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minite.parallel.grade")
    ap.add_argument("--file", required=True)
    ap.add_argument("--task", required=True, choices=sorted(TASKS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(60)
    err = TASKS[args.task](_load(args.file), rank, world)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"ok": err < 1e-5, "err": err}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def run_graded(source: str, task: str, world: int = 2, timeout: float = 120) -> tuple[bool, str]:
    """Write `source` (the learner's function and its imports) to a file, torchrun the grader; (ok, message)."""
    from minite.parallel.launch import results, torchrun
    d = Path(tempfile.mkdtemp(prefix="minite_grade_"))
    (d / "student.py").write_text("import torch\nimport torch.distributed as dist\n" + textwrap.dedent(source))
    res = torchrun(world, ["-m", "minite.parallel.grade", "--file", str(d / "student.py"), "--task", task,
                           "--out", str(d)], timeout=timeout)
    got = results(d)
    if len(got) != world:
        import re
        errs = [ln for ln in res.stdout.splitlines() if re.match(r"\[rank\d+\]: \w*(Error|Exception)\b", ln)]
        return False, f"{task}: the torchrun run failed (exit {res.returncode}): " + (errs[0] if errs else "")
    worst = max(r["err"] for r in got.values())
    ok = all(r["ok"] for r in got.values())
    return ok, f"{task} on {world} ranks: max error {worst:.1e} ({'ok' if ok else 'too large'})"


if __name__ == "__main__":
    raise SystemExit(main())
