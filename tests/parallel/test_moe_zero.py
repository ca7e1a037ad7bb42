"""Chapter 16 x chapter 10: a mixture of experts under ZeRO on real torch.distributed (gloo on CPU). One torchrun
launch of world 4 runs the worker check moe_zero: ZeRO-1/2/3 with every expert on every rank (ep = 1), with ep = 2
and ep = 4 (the dense parameters sharded over dp, the experts over their edp replicas), and ZeRO-1/2 under tp = 2
(with and without ep = 2, SP): the global loss, the reduced gradients ZeRO steps with, the global norm, the dense
weights and AdamW state after 5 clipped steps, a one-process checkpoint resumed, against one process. A launch of
``minite.train`` at dp=4 ep=2 zero=2 trains one process's 20-step curve, and its checkpoint resumes in one process."""
import pytest
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.config import make_config
from minite.models.gpt import GPT, GPTConfig
from minite.parallel.dims import check_layout
from minite.parallel.workers.moe_zero import CASES, case_name
from minite.train import load_checkpoint, train

pytestmark = pytest.mark.distributed

MOE = {"model.moe_num_experts": 4, "model.moe_top_k": 2}


@pytest.fixture(scope="module")
def world4(workers):
    return workers(4, "moe_zero")


@pytest.mark.parametrize("name", [case_name(*c) for c in CASES])
def test_moe_under_zero_matches_one_process(world4, check, name):
    check(world4, name)


@pytest.mark.parametrize("over, world", [({"parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 3}, 4),
                                         ({"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 2}, 4),
                                         ({"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2, "parallel.zero": 1},
                                          4)])
def test_moe_with_zero_accepted(flags, over, world):
    cfg = make_config("cpu", {**flags, **MOE, **over})
    check_layout(cfg.parallel, cfg.model, world=world, seq_len=16, batch_size=8)


def test_cli_ep_zero_matches_single_process(corpus, cli, flags, curve):
    d, data = corpus
    base = {**flags, **data, **MOE, "train.grad_accum": 2}  # 2 micro-batches: the first under no_sync()
    train(cli({**base, "train.out_dir": str(d / "single")}, 4)[0])
    loss1, val1 = curve(d / "single")
    res = torchrun(4, [*cli({**base, "train.out_dir": str(d / "ep2z2")}, 4)[1], "--parallel.dp=4", "--parallel.ep=2",
                       "--parallel.zero=2"], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(d / "ep2z2")
    assert len(loss) == 20 and len(val) == 3
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (val, val1)
    state = load_checkpoint(d / "ep2z2" / "ckpt.pt")  # dense: every expert, the dense AdamW moments
    GPT(GPTConfig(**state["config"]["model"])).load_state_dict(state["model"])  # strict: every key, no more
    assert state["optimizer"]["exp_avg"]["blocks.1.mlp.w_down"].shape[0] == 4
    assert set(state["optimizer"]["exp_avg"]) == set(dict(GPT(GPTConfig(**state["config"]["model"]))
                                                          .named_parameters()))
    more = {"train.max_iters": 22}  # the checkpoint resumes in one process: 2 more steps, as the one-process run's
    ep_more = train(cli({**base, "train.out_dir": str(d / "ep2z2")}, 4)[0], resume=True,
                    resume_overrides={"train.out_dir": str(d / "ep2z2"), **more})
    one_more = train(cli({**base, "train.out_dir": str(d / "single")}, 4)[0], resume=True,
                     resume_overrides={"train.out_dir": str(d / "single"), **more})
    assert sorted(ep_more["losses"]) == [21, 22]
    assert max(abs(ep_more["losses"][s] - one_more["losses"][s]) for s in (21, 22)) < 1e-4
