"""Chapters 10-11 on real torch.distributed (gloo on CPU), world 2 and 4, as torchrun launches. The workers run the
CE kernel in the interpreter on a CPU-only machine; on a GPU machine (no interpreter) they skip it (launch.worker_env).

One launch per world size runs every check (minite.parallel.workers, conftest's `workers`) and each rank reports
per check; the tests below read those reports. World 2 also saves a ZeRO-1 checkpoint that world 4 loads (a
different world size).
"""
import os
import socket
import subprocess
import sys

import pytest

from minite.parallel.launch import torchrun

pytestmark = pytest.mark.distributed

DP = ["naive", "zero0", "zero1", "zero2", "zero3", "fsdp2", *[f"no_sync_zero{stage}" for stage in range(4)]]
TP = [f"{m}_{c}" for m in ("tp", "sp") for c in ("logits", "loss", "input_grad", "weight_grads", "5_steps")] + \
    ["vce_triton", "vce_torch"]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero_ckpt")


CHECKS = ["dp", "no_sync", "fsdp2", "tp", "sp", "vce", "zero_ckpt"]


@pytest.fixture(scope="module")
def world2(workers, ckpt_dir):
    return workers(2, *CHECKS, "--ckpt", str(ckpt_dir))


@pytest.fixture(scope="module")
def world4(workers, ckpt_dir, world2):  # loads the checkpoint world 2 saved
    return workers(4, *CHECKS, "--ckpt", str(ckpt_dir), "--ckpt_load")


@pytest.mark.parametrize("name", DP + TP)
def test_world2(world2, check, name):
    check(world2, name)


@pytest.mark.parametrize("name", DP + TP + ["ckpt_load"])
def test_world4(world4, check, name):
    check(world4, name)


def test_bytes_per_step_match_formula(world2, world4):
    """Measured bytes per step (CommLog, ring algorithm) against zero.bytes_per_step (padding aside)."""
    from minite.models.gpt import GPT, GPTConfig
    from minite.parallel.workers.common import TINY
    from minite.parallel.zero import bytes_per_step
    model = GPT(GPTConfig(**TINY))
    n, root = model.num_params(), model.wte.weight.numel() + model.norm_f.weight.numel()
    for world, rep in ((2, world2[0]), (4, world4[0])):
        assert rep["naive"]["bytes_sent"] == pytest.approx(bytes_per_step(n, world, 0), rel=1e-6)
        for stage in range(4):
            want = bytes_per_step(n, world, stage, resident=root)
            clip = 8 * 2 * (world - 1) / world if stage else 0  # the sharded norm's one all-reduce of a float64
            got = rep[f"zero{stage}"]["bytes_sent"] - clip
            assert want <= got <= want * 1.01, (world, stage, got, want)  # above: each unit padded to W pieces


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_dead_rank_ends_the_run_naming_it(tmp_path, how):
    """Rank 1 raises / is SIGKILLed while rank 0 waits in an all-reduce: the launch fails (no hang), names rank 1."""
    res = torchrun(2, ["-m", "minite.parallel.workers", "die", "--die", how, "--timeout", "30", "--out",
                       str(tmp_path)], timeout=90)
    assert res.returncode != 0
    assert "rank      : 1" in res.stdout and "Root Cause" in res.stdout, res.stdout[-2000:]
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.parametrize("dead", [1, 0])
def test_dead_rank_is_named_without_torchruns_agent(tmp_path, dead):
    """issue 25: a rank per process, launched by hand (no agent to name the dead): rank `dead` is SIGKILLed while
    the other waits in an all-reduce; the survivor names it (was: a raw gloo traceback naming no rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import os, signal, time, torch, torch.distributed as dist\n"
            "from minite.parallel.dims import init_distributed\n"
            "rank, world = init_distributed(30, backend='gloo')\n"
            "time.sleep(1.5)\n"
            f"if rank == {dead}:\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "dist.all_reduce(torch.ones(1))\n")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    err = [p.communicate(timeout=90)[1] for p in procs]
    survivor = 1 - dead
    assert procs[dead].returncode == -9 and procs[survivor].returncode != 0
    want = ("rank(s) 1 stopped: their heartbeat ended" if dead == 1 else
            "rank 0 is gone (it hosts the run's rendezvous store, which no longer answers)")
    assert f"[rank{survivor}] minite: this rank failed with RuntimeError; {want}" in err[survivor], err[survivor]


def test_hung_rank_times_out_and_is_named(tmp_path):
    """Rank 1 is alive but silent: rank 0's all-reduce times out (5 s) and a monitored barrier names rank 1."""
    res = torchrun(2, ["-m", "minite.parallel.workers", "die", "--die", "hang", "--timeout", "5", "--out",
                       str(tmp_path)], timeout=90)
    assert res.returncode != 0
    assert "Ranks 1 failed to pass monitoredBarrier" in res.stdout, res.stdout[-2000:]
