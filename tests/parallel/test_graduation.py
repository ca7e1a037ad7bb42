"""Chapter 14: the layouts compose, and a checkpoint written under one layout resumes under any other.

Every run trains the same 20 steps (same seed, same global batches) as one process, so each curve must lie on the
single-process curve within float-reduction noise:
  * world 4: tp2 x pp2 (sp, full recompute), dp2 x tp2 with ZeRO-1 (selective recompute), dp2 x pp2 (AFAB),
    dp2 x cp2, pp2 x cp2; world 8: tp2 x pp2 x cp2 with sp (three dimensions at once);
  * stop at step 10 under one layout (``--train.stop_at=10``, the schedule still that of 20 steps), then
    ``--resume`` under another: tp2 x pp2 -> one process, dp2 ZeRO-1 -> tp2, one process -> dp2 ZeRO-2.
Every run, the reference included, takes the preset and the device of its workers (conftest.train_cli).
"""
import json

import pytest
import torch
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.config import ConfigError, make_config
from minite.parallel.dims import ParallelError
from minite.parallel.launch import worker_device
from minite.train import load_checkpoint, train

pytestmark = pytest.mark.distributed

WORLD4 = {"tp2_pp2_sp_recompute_full": ["--parallel.tp=2", "--parallel.pp=2", "--parallel.sp=True",
                                         "--train.recompute=full"],
          "dp2_tp2_zero1_recompute_selective": ["--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=1",
                                                "--train.recompute=selective"],
          "dp2_pp2_afab": ["--parallel.dp=2", "--parallel.pp=2", "--parallel.pp_schedule=afab"],
          "dp2_cp2": ["--parallel.dp=2", "--parallel.cp=2"],
          "pp2_cp2": ["--parallel.pp=2", "--parallel.cp=2"],
          "world8_tp2_pp2_cp2_sp": ["--parallel.tp=2", "--parallel.pp=2", "--parallel.cp=2", "--parallel.sp=True"]}
TOL = 1e-4


@pytest.fixture(scope="module")
def flags4(flags):
    """conftest's tiny run with 4 layers (pp=2 gets 2 each)."""
    return {**flags, "model.n_layer": 4}


def _curve(out) -> dict[int, float]:  # by step: a resumed run's log holds both jobs' steps
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _close(curve, ref, steps):
    assert sorted(curve) == list(steps), sorted(curve)
    err = max(abs(curve[s] - ref[s]) for s in steps)
    assert err < TOL, (err, curve, ref)


@pytest.fixture(scope="module")
def setup(corpus, cli, flags4):
    """(directory, run(nproc, out, **over) -> (config, torchrun args), reference(nproc) -> the one-process curve
    on the device of `nproc` workers)."""
    d, data = corpus
    curves = {}

    def run(nproc, out, **over):
        return cli({**flags4, **data, "train.out_dir": str(out), **over}, nproc)

    def reference(nproc):
        dev = worker_device(nproc)
        if dev not in curves:
            train(run(nproc, d / f"single_{dev}")[0])
            curves[dev] = _curve(d / f"single_{dev}")
        return curves[dev]
    return d, run, reference


@pytest.mark.parametrize("layout", list(WORLD4))
def test_world4_layout_matches_single_process(setup, layout):
    d, run, reference = setup
    out = d / layout
    world = 8 if layout.startswith("world8") else 4
    res = torchrun(world, [*run(world, out)[1], *WORLD4[layout]], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    _close(_curve(out), reference(world), range(1, 21))
    state = load_checkpoint(out / "ckpt.pt")
    assert state["optimizer"]["format"] == "minite.dense_adamw/1" and state["step"] == 20


def _stop_then_resume(setup, name, first, second):
    """Steps 1-10 under layout `first` (None: one process), steps 11-20 resumed under `second`; every leg on the
    device of the larger world (a resumed run keeps its checkpoint's train.device)."""
    d, run, reference = setup
    out, world = d / name, max(leg[0] if leg else 1 for leg in (first, second))
    cfg, args = run(world, out, **{"train.stop_at": 10})
    if first is None:
        train(cfg)
    else:
        res = torchrun(first[0], [*args, *first[1]], timeout=300)
        assert res.returncode == 0, res.stdout[-3000:]
    assert load_checkpoint(out / "ckpt.pt")["step"] == 10 and max(_curve(out)) == 10
    if second is None:
        train(run(world, out)[0], resume=True, resume_overrides={"train.threads": 1})
    else:
        res = torchrun(second[0], ["-m", "minite.train", "--resume", f"--out_dir={out}", *second[1]], timeout=300)
        assert res.returncode == 0, res.stdout[-3000:]
    _close(_curve(out), reference(world), range(1, 21))  # steps 1-10 kept from the first job, 11-20 from the second


def test_resume_tp2_pp2_checkpoint_in_one_process(setup):
    _stop_then_resume(setup, "tp2pp2_to_single", (4, ["--parallel.tp=2", "--parallel.pp=2"]), None)


def test_resume_dp2_zero1_checkpoint_under_tp2(setup):
    _stop_then_resume(setup, "dp2zero1_to_tp2", (2, ["--parallel.dp=2", "--parallel.zero=1"]),
                      (2, ["--parallel.tp=2", "--train.threads=1"]))


def test_resume_single_process_checkpoint_under_dp2_zero2(setup):
    _stop_then_resume(setup, "single_to_dp2zero2", None, (2, ["--parallel.dp=2", "--parallel.zero=2"]))


# ------------------------------------------------------------------ rejected before any process group
@pytest.mark.parametrize("over,words", [
    ({"parallel.tp": 3}, ["world size 1", "1*3*1*1 = 3", "n_head=4 is not divisible by tp=3"]),
    ({"parallel.pp": 8, "parallel.tp": 1}, ["pp=8 stages but only n_layer=4"]),
    ({"parallel.cp": 3}, ["T=16 must be divisible by 2*cp=6"]),
    ({"parallel.dp": 3}, ["batch_size=8 (the global batch) is not divisible by dp=3"]),
    ({"parallel.pp": 2, "parallel.zero": 1}, ["pp=2 with zero=1"]),
    ({"parallel.pp": 2, "parallel.microbatches": 3}, ["8 sequences per dp rank does not split into 3"]),
])
def test_bad_layout_is_rejected_with_its_numbers(tmp_path, flags4, over, words):
    cfg = make_config("cpu", {**flags4, **over, "train.out_dir": str(tmp_path)})
    with pytest.raises(ParallelError) as e:
        train(cfg)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert not torch.distributed.is_initialized()


def test_stop_at_is_checked(flags4):
    with pytest.raises(ConfigError, match=r"stop_at=30.*max_iters=20"):
        make_config("cpu", {**flags4, "train.stop_at": 30})
