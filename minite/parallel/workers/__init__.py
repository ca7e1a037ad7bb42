"""The torchrun workers of the tests, the lessons' measurements and the exercise graders (chapters 10-13).

    torchrun --nproc-per-node N -m minite.parallel.workers CHECK [CHECK ...] --out DIR [options]

Every rank runs every named check, in order (they are collective), and writes DIR/rank<r>.json: {result: {"ok":
bool, ...}}, which ``launch.results`` reads back. A check is ``check(dims, args) -> {result: {...}}``, registered
by name in its chapter's file with the axis of ``ParallelDims`` that takes the whole world (tp_cp: tp = --tp, cp =
the rest). A check compares a parallel run with the dense single-process one from the same seed, computed on every
rank, or measures what a lesson plots, or grades an exercise (``grade.run_graded``):

    data.py      chapter 10   naive DP, DDP, ZeRO-1/2/3, FSDP2; the sharded checkpoint; a dying rank; timeline, memory
    tensor.py    chapter 11   the TP (+SP) GPT, the vocab-parallel CE; activation memory with and without SP
    pipeline.py  chapter 12   each schedule's gradients, the train path, rejections, a dying stage; memory, timeline
    context.py   chapter 13   ring and all-gather attention, the CP GPT, CP x TP (+SP); work, bytes, memory per rank
    ulysses.py   chapter 13   Ulysses (all-to-all) CP and its hybrid with the ring: attention and the GPT
    lessons.py   chapter 11   the lesson's TP MLP on real ranks, the exercise's graded tasks
    moe.py       chapter 16   expert parallelism (ep 2 and 4) vs one process; the all-to-all's bytes; bad layouts
    moe_cp.py    chapter 16   the MoE GPT under cp, with dp, ep, tp (+SP) and ZeRO (ep = 1) vs one process
    moe_pp.py    chapter 16   the MoE GPT under pp (x dp, ep, tp + SP, cp): aux per micro-batch, bias once per step
    moe_zero.py  chapter 16   the MoE GPT under ZeRO-1/2/3 with ep 1, 2, 4 and under tp x ZeRO vs one process
    precision.py chapter 01   the FP16 loss scaler under ZeRO, tp, pp: the shard's grad unscaled, an inf skips all ranks
    grade.py     exercises    ``@graded`` tasks (one per chapter file), ``run_graded`` for the check cells
    common.py                 the tiny GPT from a seed, its batches, AdamW, the tolerance

The workers hold CPU tensors over gloo on any machine (``--device cuda``: NCCL, a GPU per rank).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minite.parallel import watch
from minite.parallel.dims import ParallelDims, init_distributed
from minite.parallel.workers import (
    context,
    data,
    lessons,
    moe,
    moe_cp,
    moe_pp,
    moe_zero,
    pipeline,
    precision,
    tensor,
    ulysses,
)

__all__ = ["CHECKS", "main", "report"]

CHECKS = {**data.CHECKS, **tensor.CHECKS, **pipeline.CHECKS, **context.CHECKS, **lessons.CHECKS, **moe.CHECKS,
          **moe_cp.CHECKS, **moe_pp.CHECKS, **moe_zero.CHECKS, **precision.CHECKS, **ulysses.CHECKS}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m minite.parallel.workers")
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--out", default=tempfile.gettempdir(), help="where each rank writes rank<r>.json")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may wait")
    ap.add_argument("--device", default="cpu", help="cpu (gloo, the tests) or cuda (NCCL, a GPU per rank)")
    ap.add_argument("--tp", type=int, default=2, help="tp degree of the tp_cp checks (cp = world / tp)")
    ap.add_argument("--file", default="", help="the learner's file (exercise tasks)")
    ap.add_argument("--ckpt", default="", help="zero_ckpt: the checkpoint directory")
    ap.add_argument("--ckpt_load", action="store_true", help="zero_ckpt: load it (saved at another world size)")
    ap.add_argument("--die", default="raise", choices=["raise", "kill", "hang"], help="die: how rank 1 goes")
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8], help="pp_timeline: micro-batch counts")
    ap.add_argument("--mb", type=int, default=2, help="pp_timeline: sequences per micro-batch")
    ap.add_argument("--repeat", type=int, default=3, help="pp_timeline: timed steps per configuration")
    ap.add_argument("--width", type=int, default=96, help="pp_timeline: model width")
    ap.add_argument("--T", type=int, default=1024, help="cp_measure: sequence length")
    ap.add_argument("--backend", default="torch", help="cp_measure: attention backend")
    return ap


def layout(axis: str, world: int, args) -> ParallelDims:
    """The degrees a check runs under: the whole world along `axis`, or a tp x cp grid."""
    if axis == "tp_cp":
        return ParallelDims(tp=args.tp, cp=world // args.tp)
    return ParallelDims(**{axis: world})


def report(out_dir, rank: int, res: dict) -> int:
    """A worker's end: write rank<r>.json (what ``launch.results`` reads), leave the process group together, and
    return the exit code (0 when every result is ok or skipped)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    if dist.is_initialized():
        dist.barrier()
        watch.stop()  # the heartbeat talks to the group's store: end it first
        dist.destroy_process_group()
    return 0 if all(v.get("ok") or "skipped" in v for v in res.values()) else 1


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(args.timeout, device=args.device)  # cuda with too few GPUs: fails fast
    grids = {}  # axis -> its built ParallelDims, shared by the checks that run along it
    results = {}
    for name in args.checks:
        check, axis = CHECKS[name]
        if axis not in grids:
            grids[axis] = layout(axis, world, args).build(rank, world, args.timeout)
        t0 = time.perf_counter()
        res = check(grids[axis], args)
        for v in res.values():
            v["rank"] = rank
            v["seconds"] = round(time.perf_counter() - t0, 2)
        results.update(res)
    return report(args.out, rank, results)
