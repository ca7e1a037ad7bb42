"""Chapter 16 x chapter 13: the mixture-of-experts GPT under context parallelism on real torch.distributed (gloo on
CPU). One torchrun launch of world 4 runs the moe_cp checks (minite/parallel/workers/moe_cp.py: cp x dp, cp = 4,
cp x dp x ep, cp x tp with and without SP, cp x dp under ZeRO-1/3, with the Switch loss or the DeepSeek bias, each
wrapped as minite.train wraps it: loss, every gradient, 5 clipped AdamW steps, the bias buffers, the dense checkpoint
and AdamW state against one process); ``minite.train`` at dp=2 x cp=2 x ep=2 trains one process's 20-step curve
(the routed load in its log line included) and its checkpoint resumes in one process."""
import json

import pytest
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.config import make_config
from minite.parallel.dims import check_layout
from minite.train import load_checkpoint, train

pytestmark = pytest.mark.distributed

MOE = {"model.moe_num_experts": 4, "model.moe_top_k": 2}


@pytest.fixture(scope="module")
def world4(workers):
    return workers(4, "moe_cp")


@pytest.mark.parametrize("name", ["moe_cp2_dp2_aux", "moe_cp4_bias", "moe_cp2_dp2_ep2_aux",
                                  "moe_cp2_dp2_ep2_bias", "moe_cp2_tp2_aux", "moe_cp2_tp2_sp_bias",
                                  "moe_cp2_dp2_zero1_bias", "moe_cp2_dp2_zero3_aux",
                                  "moe_cp2_dp2_ep2_zero2_aux"])
def test_moe_under_cp_matches_one_process(world4, check, name):
    check(world4, name)


@pytest.mark.parametrize("over, world", [({"parallel.cp": 2}, 2), ({"parallel.dp": 2, "parallel.cp": 2}, 4),
                                         ({"parallel.dp": 2, "parallel.cp": 2, "parallel.ep": 2}, 4),
                                         ({"parallel.cp": 2, "parallel.tp": 2, "parallel.sp": True}, 4),
                                         ({"parallel.dp": 2, "parallel.cp": 2, "parallel.zero": 3}, 4)])
def test_moe_under_cp_accepted(flags, over, world):
    cfg = make_config("cpu", {**flags, **MOE, **over})
    check_layout(cfg.parallel, cfg.model, world=world, seq_len=16, batch_size=8)


def _routed(out) -> list:
    return [r["moe_tokens_per_expert"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
            if "moe_tokens_per_expert" in r]


def test_cli_moe_cp_ep_matches_single_process(corpus, cli, flags, curve):
    d, data = corpus
    base = {**flags, **data, **MOE, "train.grad_accum": 2}  # 2 micro-batches: the first under no_sync()
    train(cli({**base, "train.out_dir": str(d / "single")}, 4)[0])
    loss1, val1 = curve(d / "single")
    res = torchrun(4, [*cli({**base, "train.out_dir": str(d / "cp2ep2")}, 4)[1], "--parallel.dp=2", "--parallel.cp=2",
                       "--parallel.ep=2"], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(d / "cp2ep2")
    assert len(loss) == 20 and len(val) == 3
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (val, val1)
    assert _routed(d / "cp2ep2") == _routed(d / "single")  # the global load: counts summed over dp x cp
    state = load_checkpoint(d / "cp2ep2" / "ckpt.pt")
    assert state["model"]["blocks.0.mlp.w_gate_up"].shape[0] == 4  # all the experts, gathered over ep
    assert state["optimizer"]["exp_avg"]["blocks.1.mlp.w_down"].shape[0] == 4
    more = {"train.max_iters": 22}  # the layout-free checkpoint resumes in one process: 2 more steps
    cp_more = train(cli({**base, "train.out_dir": str(d / "cp2ep2")}, 4)[0], resume=True,
                    resume_overrides={"train.out_dir": str(d / "cp2ep2"), **more})
    one_more = train(cli({**base, "train.out_dir": str(d / "single")}, 4)[0], resume=True,
                     resume_overrides={"train.out_dir": str(d / "single"), **more})
    assert sorted(cp_more["losses"]) == [21, 22]
    assert max(abs(cp_more["losses"][s] - one_more["losses"][s]) for s in (21, 22)) < 1e-4
