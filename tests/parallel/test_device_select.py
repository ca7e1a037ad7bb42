"""Which backend and device a torchrun rank gets (dims.select_device): NCCL + cuda:LOCAL_RANK only with a GPU per
local rank; an explicit CUDA run with too few GPUs fails fast naming the numbers; gloo on the CPU otherwise.
The CUDA machines are emulated here by patching torch.cuda.is_available / device_count."""
import sys

import pytest
import torch
import torch.distributed as dist

from minite.config import make_config
from minite.parallel import ParallelError
from minite.parallel.dims import ParallelDims, init_distributed, select_device
from minite.parallel.launch import torchrun
from minite.parallel.runtime import Parallel, setup_parallel


def _gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def _torchrun_env(monkeypatch, world, local_world=None):
    for k, v in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": local_world or world,
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(k, str(v))


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("local", [1, 2, 4])
def test_rule(monkeypatch, gpus, local):
    _gpus(monkeypatch, gpus)
    enough = gpus >= local
    assert select_device("cpu", local) == "cpu"
    assert select_device("auto", local) == ("cuda" if enough else "cpu")  # auto falls back to gloo
    for dev in ("cuda", "cuda:0"):
        if enough:
            assert select_device(dev, local) == "cuda"
        else:
            with pytest.raises(ParallelError, match=f"nproc-per-node {local} needs {local} GPUs on this node, "
                                                    f"found {gpus} .*; use --train.device=cpu"):
                select_device(dev, local)


def test_local_world_from_torchrun_env(monkeypatch):
    _gpus(monkeypatch, 2)
    _torchrun_env(monkeypatch, world=8, local_world=2)  # 4 nodes of 2 GPUs: the node's count is what matters
    assert select_device("cuda") == "cuda"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ParallelError, match="needs 4 GPUs on this node.*found 2"):
        select_device("cuda")
    with pytest.raises(ParallelError, match="'tpu'"):
        select_device("tpu")


def test_one_gpu_two_ranks_never_reaches_nccl(monkeypatch):
    """The H100 case: 2 ranks, 1 GPU. cuda fails before init_process_group; cpu and auto initialise gloo."""
    _gpus(monkeypatch, 1)
    _torchrun_env(monkeypatch, world=2)
    calls = []
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init_distributed chains a hook: restore it after
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(f"cuda:{i}"))
    with pytest.raises(ParallelError, match="needs 2 GPUs on this node, found 1"):
        init_distributed(5, device="cuda")
    assert calls == []
    init_distributed(5, device="cpu")
    init_distributed(5, device="auto")
    init_distributed(5)  # the default is auto
    assert calls == ["gloo"] * 3
    _gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    init_distributed(5, device="cuda")
    assert calls[3:] == ["cuda:1", "nccl"]


def test_setup_parallel_fails_fast_with_train_device(monkeypatch):
    _gpus(monkeypatch, 1)
    _torchrun_env(monkeypatch, world=2)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("must not initialise"))
    cfg = make_config("cpu", {"parallel.dp": 2, "train.device": "cuda"})
    with pytest.raises(ParallelError, match="--nproc-per-node 2 needs 2 GPUs on this node, found 1"):
        setup_parallel(cfg)


def test_parallel_device_follows_the_backend(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    par = Parallel(ParallelDims(dp=2, world=2))
    par.run_device = "cpu"  # auto with too few GPUs: gloo, so the tensors must live on the CPU
    assert par.device(torch.device("cuda")) == torch.device("cpu")
    par.run_device = "cuda"
    assert par.device(torch.device("cuda")) == torch.device("cuda", 1)
    assert Parallel(ParallelDims()).device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.distributed
def test_cli_cuda_without_enough_gpus_fails_fast(tmp_path):
    """torchrun -m minite.train --train.device=cuda on a node with fewer GPUs than ranks: an error, no hang."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("this node has a GPU per rank")
    res = torchrun(2, ["-m", "minite.train", "--parallel.dp=2", "--train.device=cuda", "--train.max_iters=1",
                       f"--train.out_dir={tmp_path}"], timeout=120)
    assert res.returncode != 0
    assert f"needs 2 GPUs on this node, found {torch.cuda.device_count()}" in res.stdout, res.stdout[-2000:]
