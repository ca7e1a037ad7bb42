"""One configuration of ``bench_scale.py``: ``minite.train.train`` with counters around a window of its steps.

    python benchmarks/scale_worker.py --result DIR [--window 2:4] -- <the flags of python -m minite.train>
    torchrun --nproc-per-node N benchmarks/scale_worker.py --result DIR -- --parallel.tp=2 ...

The flags after ``--`` are parsed exactly as ``python -m minite.train`` parses them (``parse_cli`` + ``make_config``),
and the run is ``train(cfg, callback=...)``: the same loop, layout and curve as the CLI. The callback (called after
every optimizer step) switches the counters on after step a and off after step b (``--window a:b``), so they see
steps a+1..b only, once the optimizer state exists and the first-step allocations are over. Every rank writes
``DIR/rank<r>.json``:

  resident_bytes   every tensor storage alive at the start of the window, found by walking Python's objects
                   (gc): parameters, AdamW moments (or ZeRO's shard of them), DP/ZeRO flat buffers, the batch
  transient_peak   minite.bytecount.PeakBytes over the window: the most bytes of storages *created inside it* and
                   alive at once (activations kept for the backward, gradients, recompute buffers, temporaries,
                   communication buffers); storages alive before the window are excluded (and held, so no new
                   storage can reuse one of their addresses)
  peak_bytes       resident_bytes + transient_peak: this rank's tensor memory at its peak (CPU: no allocator
                   caching or fragmentation counted, no Python/C++ objects other than tensors)
  sent_per_step    bytes this rank sends per step, minite.parallel.comm.CommLog's ring model over the window
  step_s           wall time of each step after the window + 1 (counters off: dispatch modes slow every op)
  losses           rank 0: the global batch's loss at every step (what log.jsonl holds)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (torchrun runs this file by path)

import torch  # noqa: E402

from minite.bytecount import PeakBytes  # noqa: E402
from minite.config import make_config  # noqa: E402
from minite.parallel.comm import CommLog  # noqa: E402
from minite.train import parse_cli, train  # noqa: E402


def alive_storages() -> dict[int, torch.Tensor]:
    """{storage key: one tensor on it} for every tensor Python can reach (meta tensors hold no memory)."""
    out = {}
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                out.setdefault(o.untyped_storage()._cdata, o)
    return out


def main() -> None:
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--result", required=True)
    ap.add_argument("--window", default="2:4", help="counters on after step a, off after step b")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    w0, w1 = map(int, a.window.split(":"))
    preset, overrides, _ = parse_cli(flags)
    cfg = make_config(preset or "cpu", overrides)
    rec: dict = {"times": {}}
    held: dict = {}

    def callback(step: int, loss: float) -> None:
        rec["times"][step] = time.perf_counter()
        if step == w0:
            held.update(alive_storages())
            rec["resident_bytes"] = sum(t.untyped_storage().nbytes() for t in held.values())
            rec["pb"], rec["log"] = PeakBytes(), CommLog()
            rec["pb"].live.update(held)
            rec["pb"].__enter__()
            rec["log"].__enter__()
        elif step == w1:
            rec["log"].__exit__(None, None, None)
            rec["pb"].__exit__(None, None, None)
            held.clear()

    summary = train(cfg, callback=callback)
    rank = int(os.environ.get("RANK", "0"))
    t = rec["times"]
    steps = [s for s in sorted(t) if s > w1 + 1 and s - 1 in t]
    log = rec["log"]
    out = {"rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")), "window": [w0, w1],
           "resident_bytes": rec["resident_bytes"], "transient_peak_bytes": rec["pb"].peak,
           "peak_bytes": rec["resident_bytes"] + rec["pb"].peak,
           "sent_per_step": log.total() / (w1 - w0), "sent_by_op_per_step": {k: v / (w1 - w0) for k, v in
                                                                            log.by_op().items()},
           "step_s": [t[s] - t[s - 1] for s in steps],
           "losses": {str(k): v for k, v in summary["losses"].items()} if rank == 0 else {},
           "threads": torch.get_num_threads()}
    Path(a.result).mkdir(parents=True, exist_ok=True)
    (Path(a.result) / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
