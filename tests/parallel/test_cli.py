"""``torchrun --nproc-per-node N -m minite.train --parallel.*`` trains the curve of one process (DESIGN §6).

train.batch_size is the global batch and rank 0 logs the global-batch loss, so the same flags give the same
20-step loss curve in any layout, within float-reduction noise. The reference runs in this process on the workers'
device with the same preset (conftest.train_cli): on an H100 the command line took the "gpu" preset (dropout 0.1)
while the reference took "cpu", and the curves were 0.158 apart.
"""
import pytest
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.models.gpt import GPT, GPTConfig
from minite.parallel.launch import worker_device
from minite.train import load_checkpoint, train

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (processes, flags)
    "dp2": (2, []),  # no flag: data parallelism fills the world (issue 37: it was refused)
    "dp2_zero3": (2, ["--parallel.dp=2", "--parallel.zero=3"]),
    "tp2": (2, ["--parallel.tp=2"]),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=True"]),
    "tp2_cp2": (4, ["--parallel.tp=2", "--parallel.cp=2"]),
    "tp2_cp2_sp": (4, ["--parallel.tp=2", "--parallel.cp=2", "--parallel.sp=True"]),
}


@pytest.fixture(scope="module")
def setup(corpus, cli, flags, curve):
    """(directory, data flags, reference(nproc)): the one-process curve on the device of `nproc` workers."""
    d, data = corpus
    curves = {}

    def reference(nproc):
        dev = worker_device(nproc)
        if dev not in curves:
            train(cli({**flags, **data, "train.out_dir": str(d / f"single_{dev}")}, nproc)[0])
            curves[dev] = curve(d / f"single_{dev}")
        return curves[dev]
    return d, data, reference


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cli_matches_single_process(setup, cli, flags, curve, layout):
    d, data, reference = setup
    out = d / layout
    nproc, extra = LAYOUTS[layout]
    loss1, val1 = reference(nproc)
    res = torchrun(nproc, [*cli({**flags, **data, "train.out_dir": str(out)}, nproc)[1], *extra], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(out)
    assert len(loss) == 20 and len(val) == 3
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (val, val1)
    assert "val loss" in res.stdout and res.stdout.count("val loss") == 1  # rank 0 speaks, once
    state = load_checkpoint(out / "ckpt.pt")  # the consolidated dense model: loads into one-process GPT
    cfg = state["config"]["model"]
    GPT(GPTConfig(**cfg)).load_state_dict(state["model"])
