"""Chapter 16: expert parallelism on real torch.distributed (gloo on CPU). One torchrun launch of world 4 runs the
workers' checks (ep = 2 and ep = 4: loss, every gradient, 5 AdamW steps against one process; a one-process
checkpoint resumed at ep = 4; bad layouts; the MoE GPT under tp = 2, with and without SP, alone, with dp = 2 and
with dp = ep = 2);
launches of ``minite.train`` at dp=4 ep=2, dp=4 and dp=2 ep=2 tp=2 sp train one process's 20-step curve, and
the dense checkpoints resume in one process; a rank killed in the dispatch ends the run, named. Bad layouts are
refused before any process starts. A MoE with ZeRO: test_moe_zero.py; with pp: test_moe_pp.py; with cp:
test_moe_cp.py."""
import pytest
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.config import make_config
from minite.errors import ParallelError
from minite.models.gpt import GPT, GPTConfig
from minite.parallel.dims import check_layout
from minite.train import load_checkpoint, train

pytestmark = pytest.mark.distributed

MOE = {"model.moe_num_experts": 4, "model.moe_top_k": 2}


@pytest.fixture(scope="module")
def world4(workers):
    return workers(4, "ep", "ep_layouts", "ep_resume", "moe_tp", "moe_stats")


@pytest.mark.parametrize("name", ["ep2_aux", "ep4_aux", "ep2_bias", "ep4_bias", "ep_layouts", "ep_resume",
                                  "moe_stats_cap0", "moe_stats_cap1",
                                  "moe_tp_aux", "moe_tp_sp_aux", "moe_tp_sp_bias",
                                  "moe_dp2_tp_aux", "moe_dp2_tp_sp_aux", "moe_dp2_tp_sp_bias",
                                  "moe_dp2_ep2_tp_sp_aux"])
def test_expert_parallel_matches_one_process(world4, check, name):
    check(world4, name)


def test_all_to_all_bytes_grow_with_ep(world4):
    r = world4[0]
    assert 0 < r["ep2_aux"]["a2a_bytes"] < r["ep4_aux"]["a2a_bytes"]  # more ranks: fewer rows stay at home


def test_dead_rank_in_the_all_to_all_ends_the_run_naming_it(tmp_path):
    res = torchrun(2, ["-m", "minite.parallel.workers", "ep_die", "--timeout", "30", "--out", str(tmp_path)],
                   timeout=90)
    assert res.returncode != 0
    assert "rank      : 1" in res.stdout and "Root Cause" in res.stdout, res.stdout[-2000:]
    assert not list(tmp_path.glob("rank*.json"))


def test_cli_ep_matches_single_process(corpus, cli, flags, curve):
    d, data = corpus
    base = {**flags, **data, **MOE, "train.grad_accum": 2}  # 2 micro-batches: the first under no_sync()
    train(cli({**base, "train.out_dir": str(d / "single_moe")}, 4)[0])
    loss1, val1 = curve(d / "single_moe")
    res = torchrun(4, [*cli({**base, "train.out_dir": str(d / "ep2")}, 4)[1], "--parallel.dp=4", "--parallel.ep=2"],
                   timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(d / "ep2")
    assert len(loss) == 20 and len(val) == 3
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (val, val1)
    # and with every expert on every rank (dp=4, no ep): the balance sees the global load, DDP averages the rest
    res = torchrun(4, [*cli({**base, "train.out_dir": str(d / "dp4")}, 4)[1], "--parallel.dp=4"], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(d / "dp4")
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    state = load_checkpoint(d / "ep2" / "ckpt.pt")
    assert state["model"]["blocks.0.mlp.w_gate_up"].shape[0] == 4  # all the experts, gathered
    GPT(GPTConfig(**state["config"]["model"])).load_state_dict(state["model"])
    assert set(state["optimizer"]["exp_avg"]) >= {"blocks.0.mlp.w_gate_up", "blocks.1.mlp.w_down"}
    assert state["optimizer"]["exp_avg"]["blocks.1.mlp.w_down"].shape[0] == 4
    # the layout-free checkpoint resumes in one process: 2 more steps, as the one-process run's own resume takes
    more = {"train.max_iters": 22}
    ep_more = train(cli({**base, "train.out_dir": str(d / "ep2")}, 4)[0], resume=True,
                    resume_overrides={"train.out_dir": str(d / "ep2"), **more})
    one_more = train(cli({**base, "train.out_dir": str(d / "single_moe")}, 4)[0], resume=True,
                     resume_overrides={"train.out_dir": str(d / "single_moe"), **more})
    assert sorted(ep_more["losses"]) == [21, 22]
    assert max(abs(ep_more["losses"][s] - one_more["losses"][s]) for s in (21, 22)) < 1e-4
    # under tensor parallelism, every tp rank runs its ep shard of the MoE on the same tokens: dp=2 x ep=2 x tp=2
    # with SP (tp=2 alone is the workers' moe_tp_* checks: loss, every gradient, 5 steps)
    for out, world, layout in (("ep2tp2", 4, ["--parallel.dp=2", "--parallel.ep=2", "--parallel.tp=2",
                                              "--parallel.sp=True"]),):
        res = torchrun(world, [*cli({**base, "train.out_dir": str(d / out)}, world)[1], *layout], timeout=180)
        assert res.returncode == 0, res.stdout[-3000:]
        loss, val = curve(d / out)
        assert len(loss) == 20 and len(val) == 3
        assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (out, loss, loss1)
        assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (out, val, val1)
        state = load_checkpoint(d / out / "ckpt.pt")
        assert state["model"]["blocks.1.mlp.w_down"].shape[0] == 4  # the experts whole (dense names and shapes)
        assert state["optimizer"]["exp_avg"]["blocks.0.mlp.w_gate_up"].shape[0] == 4
        GPT(GPTConfig(**state["config"]["model"])).load_state_dict(state["model"])  # strict: every key, no more
        tp_more = train(cli({**base, "train.out_dir": str(d / out)}, 4)[0], resume=True,
                        resume_overrides={"train.out_dir": str(d / out), **more})
        assert max(abs(tp_more["losses"][s] - one_more["losses"][s]) for s in (21, 22)) < 1e-4, out


@pytest.mark.parametrize("over, world, match", [
    ({"parallel.dp": 4, "parallel.ep": 3}, 4, "ep=3 must be a positive integer dividing dp=4"),
    ({"parallel.dp": 2, "parallel.ep": 2, "model.moe_num_experts": 3}, 2, "got moe_num_experts=3"),
    ({"parallel.dp": 2, "parallel.ep": 2, "model.moe_num_experts": 0}, 2, "got moe_num_experts=0"),
])
def test_layouts_refused(flags, over, world, match):
    # new_run=False: the layout check alone (a new run's CLI would already refuse moe_top_k on a dense model)
    cfg = make_config("cpu", {**flags, **MOE, **over}, new_run=False)
    with pytest.raises(ParallelError, match=match):
        check_layout(cfg.parallel, cfg.model, world=world, seq_len=16, batch_size=8)


@pytest.mark.parametrize("over, world", [({"parallel.tp": 2}, 2), ({"parallel.tp": 2, "parallel.sp": True}, 2),
                                         ({"parallel.dp": 2, "parallel.tp": 2, "model.mlp_hidden": 33}, 4),
                                         ({"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2}, 4)])
def test_moe_under_tp_accepted(flags, over, world):
    cfg = make_config("cpu", {**flags, **MOE, **over})  # the experts are not cut over tp: any mlp_hidden
    check_layout(cfg.parallel, cfg.model, world=world, seq_len=16, batch_size=8)
