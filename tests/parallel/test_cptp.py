"""Context x tensor (+ sequence) parallelism: ``CPGPT(TPGPT(dense))`` on a tp2 x cp2 grid equals the dense GPT
(loss, every gradient slice by the parameters' tags, state dict, num_params, generate, 5 AdamW steps): one torchrun
launch of minite.parallel.checks_cptp for the torch cases, one for the Triton kernels. The CLI curves of tp2_cp2
(+sp) are in test_cli.py. Bad layouts are rejected before any process group, naming the numbers."""
import pytest

from minite.config import make_config
from minite.parallel.dims import ParallelError
from minite.parallel.launch import results, torchrun
from minite.parallel.runtime import setup_parallel

CHECKS = ["state", "num_params", "loss", "grads", "generate", "5_steps"]


def _launch(tmp_path_factory, cases):
    out = tmp_path_factory.mktemp("cptp")
    res = torchrun(4, ["-m", "minite.parallel.checks_cptp", "--tp", "2", "--out", str(out), "--cases", *cases],
                   timeout=300)  # sp_triton: skipped on a GPU machine (no interpreter, CPU tensors)
    got = results(out)
    assert sorted(got) == [0, 1, 2, 3], f"missing rank reports (rc {res.returncode}):\n{res.stdout[-3000:]}"
    return got


@pytest.fixture(scope="module")
def torch_cases(tmp_path_factory):
    return _launch(tmp_path_factory, ["tp", "sp", "sp_kv1"])


@pytest.fixture(scope="module")
def triton_cases(tmp_path_factory):
    return _launch(tmp_path_factory, ["sp_triton"])


@pytest.mark.distributed
@pytest.mark.parametrize("name", [f"{c}_{k}" for c in ("tp", "sp", "sp_kv1") for k in CHECKS])
def test_tp2_cp2_equals_dense(torch_cases, check, name):
    check(torch_cases, name)


@pytest.mark.distributed
@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.parametrize("name", [f"sp_triton_{k}" for k in ("state", "loss", "grads")])
def test_tp2_cp2_sp_triton_equals_dense(triton_cases, check, name):
    check(triton_cases, name)


def test_sp_needs_tokens_per_cp_rank_divisible_by_tp():
    cfg = make_config("cpu", {"parallel.cp": 2, "parallel.tp": 4, "parallel.sp": True, "model.block_size": 12,
                              "model.n_head": 4})
    with pytest.raises(ParallelError, match=r"cp=2, tp=4: T/cp = 12/2 = 6 tokens per cp rank must be divisible "
                                            r"by tp=4"):
        setup_parallel(cfg)  # one process, no torchrun: raised before any process group (not a world-size error)
    cfg = make_config("cpu", {"parallel.cp": 2, "parallel.tp": 2, "parallel.sp": True, "model.block_size": 12})
    with pytest.raises(ParallelError, match=r"world size 1 != dp\*tp\*pp\*cp"):  # the layout itself is fine
        setup_parallel(cfg)
