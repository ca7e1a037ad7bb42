"""Chapter 12: pipeline parallelism on real torch.distributed (gloo), world 2 and 4, one torchrun launch each.

Every rank compares its stage's loss and gradients with the dense GPT from the same seed (AFAB, 1F1B and ZB-H1 at
micro-batch counts 1, 2, 3, 4, 6: at world 4 the first three are below the stage count; interleaved 1F1B, 2 chunks
a rank, at 4 and 12), the train path (grad accumulation, global clipping, AdamW, consolidated state dict; 1F1B and
interleaved), the peak activation memory per stage (and the events in the op list's order) and the rejections. The
CLI test trains 20 steps with ``--parallel.pp=2`` (ZB-H1, interleaved) and compares the curve with one process.
The schedules as data (ZB-H1, interleaved): test_pp_schedules.py.
"""
import itertools

import pytest
import torch
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.models.gpt import GPT, GPTConfig
from minite.parallel.pipeline_schedule import SCHEDULES, afab, bubble_fraction, check_schedule, one_f_one_b, simulate
from minite.parallel.schedules import SCHEDULES as ALL
from minite.parallel.workers.pipeline import micro_counts

CHECKS = [f"grads_{s}_m{m}" for s in ALL for m in micro_counts(s)] + \
    ["grads_zbh1_moe", "reject", "train_3_steps", "train_interleaved"] + [f"memory_{s}" for s in ALL]


# ------------------------------------------------------------------ single process: schedules and partition
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 3), (4, 8)])
def test_schedules_are_valid_and_bubble_matches_formula(p, m):
    for name, sched in SCHEDULES.items():
        for s in range(p):
            check_schedule(sched(p, m, s), m, s)
        ev = simulate(sched, p, m)
        span = max(e[3] for v in ev.values() for e in v)
        busy = sum(e[3] - e[2] for e in ev[0])
        assert (span - busy) / span == pytest.approx(bubble_fraction(p, m)), name


def test_one_f_one_b_order_and_in_flight():
    assert one_f_one_b(4, 6, 1) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4),
                                    ("B", 2), ("F", 5), ("B", 3), ("B", 4), ("B", 5)]
    assert one_f_one_b(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # m < p: warm-up is cut at m
    for p, m in ((4, 8), (4, 2)):
        for s in range(p):
            live = peak = 0
            for kind, _ in one_f_one_b(p, m, s):
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak == min(p - s, m)
            assert max(i for k, i in afab(p, m, s)) == m - 1
    with pytest.raises(ValueError, match="backward of micro-batch 1 before its forward"):
        check_schedule([("F", 0), ("B", 1), ("F", 1), ("B", 0)], 2)


def test_partition_balances_parameters():
    from minite.parallel.pipeline import partition
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=8, n_head=4, n_embd=32, mlp_hidden=64, backend="torch"))
    for p in (1, 2, 4, 8):
        parts = partition(model, p)
        assert [i for r in parts for i in r] == list(range(8)) and all(len(r) for r in parts)
    big = GPT(GPTConfig(vocab_size=640, n_layer=8, n_head=4, n_embd=32, mlp_hidden=64, backend="torch"))
    block, emb = sum(q.numel() for q in big.blocks[0].parameters()), big.wte.weight.numel()

    def worst(cuts):  # the largest stage's parameters, cut points 0 < c1 < c2 < c3 < 8
        b = [0, *cuts, 8]
        return max((b[k + 1] - b[k]) * block + emb * (k in (0, 3)) + 32 * (k == 3) for k in range(4))
    parts = partition(big, 4)  # a 20k-parameter embedding (~2 blocks) on each end: the end stages get fewer blocks
    best = min(worst(c) for c in itertools.combinations(range(1, 8), 3))
    assert worst([r.start for r in parts[1:]]) == best
    assert len(parts[0]) < len(parts[1]) and len(parts[-1]) < len(parts[2]), parts


# ------------------------------------------------------------------ distributed
@pytest.fixture(scope="module")
def world2(workers):
    return workers(2, "pp_grads", "pp_reject", "pp_train", "pp_memory")


@pytest.fixture(scope="module")
def world4(workers):
    return workers(4, "pp_grads", "pp_reject", "pp_train", "pp_memory")


@pytest.mark.distributed
@pytest.mark.parametrize("name", CHECKS)
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_dense(request, world, name):
    for rank, rep in request.getfixturevalue(f"world{world}").items():
        assert rep[name]["ok"], f"{name} on rank {rank} of {world}: {rep[name]}"


@pytest.mark.distributed
def test_dead_stage_ends_the_run_naming_it(tmp_path):
    """Stage 1 raises while stage 0 waits for its gradient: the launch fails (no hang) and names rank 1."""
    res = torchrun(2, ["-m", "minite.parallel.workers", "pp_die", "--timeout", "30", "--out", str(tmp_path)],
                   timeout=90)
    assert res.returncode != 0
    assert "rank      : 1" in res.stdout and "dies on purpose" in res.stdout, res.stdout[-2000:]
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["zbh1", "interleaved"])  # 1F1B: test_moe_pp's CLI run
def test_cli_pp2_matches_single_process(corpus, cli, flags, curve, schedule):
    """The one-process curve (run once for both schedules), on the workers' device with the same preset
    (conftest.train_cli). The two newest schedules; the default 1F1B runs from the CLI in test_moe_pp (pp x dp x ep),
    and minite.train's path (grad accumulation, clipping, AdamW, state dict) with 1F1B in the workers' train check."""
    from minite.train import load_checkpoint, train
    d, data = corpus
    flags = {**flags, "model.n_layer": 4, **data}
    if not (d / "single_pp" / "ckpt.pt").exists():
        train(cli({**flags, "train.out_dir": str(d / "single_pp")}, 2)[0])
    loss1, val1 = curve(d / "single_pp")
    out = d / f"pp2_{schedule}"
    args = cli({**flags, "train.out_dir": str(out), "train.sample_tokens": 8}, 2)[1]
    res = torchrun(2, [*args, "--parallel.pp=2", "--parallel.microbatches=4", f"--parallel.pp_schedule={schedule}"],
                   timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(out)
    assert len(loss) == 20 and len(val) == 3
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (val, val1)
    assert res.stdout.count("val loss") == 1  # rank 0 speaks, once
    state = load_checkpoint(out / "ckpt.pt")  # the consolidated dense model loads into a one-process GPT
    GPT(GPTConfig(**state["config"]["model"])).load_state_dict(state["model"])
