"""Shared by the distributed tests: a small corpus for the CLI-curve tests (test_cli.py, test_graduation.py,
test_context.py, test_pipeline.py), the command line that trains the reference's curve under torchrun, the reading
of the workers' reports, and a summary line saying where the workers ran (minite.parallel.launch decides)."""
import pytest
import torch

from minite._triton import HAS_TRITON
from minite.config import make_config
from minite.parallel.launch import worker_device, worker_env, workers_note

PRESET = "cpu"  # named on both sides: minite.train's default preset is "gpu" wherever CUDA is available
_ran = []  # a distributed test ran: say where the workers ran (for every world size the tests use)


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
