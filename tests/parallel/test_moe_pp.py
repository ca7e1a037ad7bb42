"""Chapter 16 x chapter 12: the MoE GPT under pipeline parallelism on real torch.distributed (gloo). One torchrun
launch of world 4 runs minite.parallel.workers.moe_pp: pp2 x dp2 (balance aux against one process micro-batch by
micro-batch, bias against the whole batch), pp2 x dp2 x ep2 (and a one-process checkpoint resumed there),
pp2 x tp2 with SP and pp2 x cp2 (aux, bias): the loss, every gradient, the routing statistics, 5 AdamW steps and
the dense checkpoint. A launch of ``minite.train --parallel.pp=2 --parallel.dp=2 --parallel.ep=2`` trains one
process's 20-step curve and its checkpoint resumes in one process. The bias of "bias" balancing moves once per
optimizer step, by the load of every micro-batch (tests/layers/test_moe.py: test_bias_moves_once_per_step_by_the_
summed_load). A MoE with pp and cp together is accepted."""
import json

import pytest
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.config import make_config
from minite.models.gpt import GPT, GPTConfig
from minite.parallel.dims import check_layout
from minite.train import load_checkpoint, train

MOE = {"model.moe_num_experts": 4, "model.moe_top_k": 2}
CASES = ["moe_pp2_dp2_aux", "moe_pp2_dp2_bias", "moe_pp2_dp2_ep2_aux", "moe_pp2_dp2_ep2_aux_resume",
         "moe_pp2_tp2_sp_aux", "moe_pp2_cp2_aux", "moe_pp2_cp2_bias"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", CASES)
def test_moe_under_pipeline_matches_one_process(world4_moe_pp, check, name):
    check(world4_moe_pp, name)


@pytest.fixture(scope="module")
def world4_moe_pp(workers):
    return workers(4, "moe_pp")


@pytest.mark.distributed
def test_cli_pp_ep_matches_single_process(corpus, cli, flags, curve):
    d, data = corpus
    base = {**flags, **data, **MOE, "model.moe_balance": "bias", "train.grad_accum": 2}
    train(cli({**base, "train.out_dir": str(d / "single")}, 4)[0])
    loss1, val1 = curve(d / "single")
    res = torchrun(4, [*cli({**base, "train.out_dir": str(d / "pp")}, 4)[1], "--parallel.pp=2", "--parallel.dp=2",
                       "--parallel.ep=2"], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(d / "pp")
    assert len(loss) == 20 and len(val) == 3
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (val, val1)
    rows = [[json.loads(r) for r in (d / out / "log.jsonl").read_text().splitlines()] for out in ("single", "pp")]
    tokens = [[r["moe_tokens_per_expert"] for r in rs if "moe_tokens_per_expert" in r] for rs in rows]
    assert len(tokens[1]) == 20 and tokens[1][0] == tokens[0][0]  # every stage's routing, summed over micro-batches
    state = load_checkpoint(d / "pp" / "ckpt.pt")
    GPT(GPTConfig(**state["config"]["model"])).load_state_dict(state["model"])  # strict: the bias buffers too
    assert state["model"]["blocks.1.mlp.w_down"].shape[0] == 4  # the experts gathered over ep and the stages
    assert state["optimizer"]["exp_avg"]["blocks.0.mlp.w_gate_up"].shape[0] == 4
    more = {"train.max_iters": 22}
    pp_more = train(cli({**base, "train.out_dir": str(d / "pp")}, 4)[0], resume=True,
                    resume_overrides={"train.out_dir": str(d / "pp"), **more})
    one_more = train(cli({**base, "train.out_dir": str(d / "single")}, 4)[0], resume=True,
                     resume_overrides={"train.out_dir": str(d / "single"), **more})
    assert sorted(pp_more["losses"]) == [21, 22]
    assert max(abs(pp_more["losses"][s] - one_more["losses"][s]) for s in (21, 22)) < 1e-4


@pytest.mark.parametrize("over, world", [({"parallel.pp": 2, "parallel.cp": 2}, 4),
                                         ({"parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2}, 4),
                                         ({"parallel.pp": 2, "parallel.dp": 2, "parallel.cp": 2, "parallel.ep": 2}, 8)])
def test_moe_pp_layouts_accepted(flags, over, world):
    cfg = make_config("cpu", {**flags, **MOE, **over})
    check_layout(cfg.parallel, cfg.model, world=world, seq_len=16, batch_size=8)
