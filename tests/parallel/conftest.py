"""Shared by the distributed tests: the torchrun launch of the workers (minite.parallel.workers) and the reading
of their reports; for the CLI-curve tests (test_cli.py, test_graduation.py, test_context.py, test_pipeline.py) a
small corpus, the flags of a tiny run, the command line that trains the reference's curve under torchrun and the
curve it logged; and a summary line saying where the workers ran (minite.parallel.launch decides)."""
import json

import pytest
import torch
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite._triton import HAS_TRITON
from minite.config import make_config
from minite.parallel.launch import results, worker_device, worker_env, workers_note

PRESET = "cpu"  # named on both sides: minite.train's default preset is "gpu" wherever CUDA is available
FLAGS = {"model.n_layer": 2, "model.n_head": 4, "model.n_kv_head": 2, "model.n_embd": 32, "model.mlp_hidden": 64,
         "model.block_size": 16, "model.backend": "torch", "train.batch_size": 8, "train.max_iters": 20,
         "train.log_interval": 1, "train.eval_interval": 10, "train.eval_iters": 2, "train.warmup_iters": 2,
         "train.lr": 1e-2, "train.sample_tokens": 0, "train.progress": False, "train.threads": 1,
         "train.precision": "fp32", "train.compile": "off"}  # train.device: launch.worker_device (train_cli)
_ran = []  # a distributed test ran: say where the workers ran (for every world size the tests use)


@pytest.fixture(scope="session")
def workers(tmp_path_factory):
    """workers(world, *argv, timeout=240) -> {rank: report}: torchrun `world` workers running ``argv`` (check
    names and options of minite.parallel.workers) into a fresh directory; every rank must have reported."""
    def launch(world: int, *argv: str, timeout: float = 240) -> dict:
        out = tmp_path_factory.mktemp(f"workers{world}")
        res = torchrun(world, ["-m", "minite.parallel.workers", *argv, "--out", str(out)], timeout=timeout)
        got = results(out)
        assert sorted(got) == list(range(world)), f"missing rank reports (rc {res.returncode}):\n{res.stdout[-3000:]}"
        return got
    return launch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(directory, {"data.path", "data.data_dir"}): 200 seeded sentences from a 17-word vocabulary."""
    d = tmp_path_factory.mktemp("corpus")
    words = "the king and queen of night shall speak to thee my lord what art thou sweet love".split()
    g = torch.Generator().manual_seed(0)
    text = "".join(" ".join(words[i] for i in torch.randint(0, len(words), (6,), generator=g)) + ".\n"
                   for _ in range(200))
    (d / "corpus.txt").write_text(text)
    torch.set_num_threads(1)
    return d, {"data.path": str(d / "corpus.txt"), "data.data_dir": str(d / "data")}


def train_cli(flags: dict, nproc: int):
    """(config of the one-process reference, ``torchrun`` args of ``minite.train``) for `nproc` workers: the same
    preset, flags and device (worker_device: NCCL with a GPU per rank, else CPU/gloo) on both sides."""
    over = {**flags, "train.device": worker_device(nproc)}
    return make_config(PRESET, over), ["-m", "minite.train", f"--preset={PRESET}",
                                       *[f"--{k}={v}" for k, v in over.items()]]


@pytest.fixture(scope="session")
def cli():
    return train_cli


@pytest.fixture(scope="session")
def flags():
    """The flags of a tiny 20-step run (2 layers, global batch 8); a test updates what it changes."""
    return dict(FLAGS)


def logged_curve(out) -> tuple[list[float], list[float]]:
    """(train losses, val losses) in the order minite.train logged them to out/log.jsonl."""
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.fixture(scope="session")
def curve():
    return logged_curve


def expect_ok(reports: dict, name: str) -> None:
    """Every rank's report of check `name` is ok. A Triton check the workers skipped (CPU tensors without the
    interpreter) is a skip only where the launcher turned the interpreter off (a GPU machine) or Triton is not
    installed, a failure elsewhere."""
    for rank, rep in sorted(reports.items()):
        r = rep[name]
        if "skipped" in r:
            interpreted = HAS_TRITON and worker_env(len(reports)).get("TRITON_INTERPRET", "0") == "1"
            assert not interpreted, f"{name} on rank {rank}: {r}"
            pytest.skip(r["skipped"])
        assert r["ok"], f"{name} on rank {rank} of {len(reports)}: {r}"


@pytest.fixture(scope="session")
def check():
    return expect_ok


def pytest_runtest_logreport(report):
    if report.when == "call" and "distributed" in report.keywords:
        _ran.append(1)


def pytest_terminal_summary(terminalreporter):
    if _ran:
        notes = {}
        for world in (2, 4, 8):
            notes.setdefault(workers_note(world), []).append(str(world))
        for note, worlds in notes.items():
            terminalreporter.write_line(f"Distributed tests, world {' / '.join(worlds)}: {note}")
