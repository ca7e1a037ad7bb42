"""Chapter 01's loss scaler on real torch.distributed (gloo on CPU). One torchrun launch of world 2 runs the worker
checks of minite.parallel.workers.precision: under ZeRO-1/2/3 the shard's gradient is unscaled (the clip's norm,
AdamW's moments and the weights == one process's step with the same scaler); an inf or NaN in ONE rank's gradient
(its ZeRO shard, a JointShardedAdamW's second shard, its tp shards, its pipeline stage) makes EVERY rank skip the
step and back its scale off; the pipeline's own backward starts from the scaled loss (the gradients between
the stages are S times one process's). A launch of ``minite.train --train.precision=fp16`` at dp=2 zero=1 logs
one process's fp16 loss curve and gradient norm."""
import json

import pytest
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.train import train

pytestmark = pytest.mark.distributed

NAMES = [*[f"fp16_zero{s}{inf}" for s in (1, 2, 3) for inf in ("", "_inf")], "fp16_joint_zero2_nan", "fp16_tp_inf",
         "fp16_pp_inf", "fp16_pp_seed"]


@pytest.fixture(scope="module")
def world2(workers):
    return workers(2, "fp16_zero", "fp16_tp", "fp16_pp", "fp16_pp_seed")


@pytest.mark.parametrize("name", NAMES)
def test_fp16_scaler_on_two_ranks(world2, check, name):
    check(world2, name)


def _norms(out):
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


def test_cli_fp16_zero1_matches_single_process(corpus, cli, flags, curve):
    d, data = corpus
    base = {**flags, **data, "train.precision": "fp16", "train.max_iters": 6, "train.eval_interval": 6,
            "train.grad_clip": 1.0}  # (the norm is logged when clipping)
    train(cli({**base, "train.out_dir": str(d / "fp16_single")}, 2)[0])
    loss1, norm1 = curve(d / "fp16_single")[0], _norms(d / "fp16_single")
    res = torchrun(2, [*cli({**base, "train.out_dir": str(d / "fp16_z1")}, 2)[1], "--parallel.dp=2",
                       "--parallel.zero=1"], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, norm = curve(d / "fp16_z1")[0], _norms(d / "fp16_z1")
    assert len(loss) == len(loss1) == 6 and len(norm) == len(norm1) == 6
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-2, (loss, loss1)
    assert max(abs(a - b) / b for a, b in zip(norm, norm1)) < 1e-2, (norm, norm1)
