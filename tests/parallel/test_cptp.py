"""Context x tensor (+ sequence) parallelism: ``CPGPT(TPGPT(dense))`` on a tp2 x cp2 grid equals the dense GPT
(loss, every gradient slice by the parameters' tags, state dict, num_params, generate, 5 AdamW steps): one torchrun
launch of the cp_tp, cp_sp, cp_sp_kv1 checks (minite.parallel.workers) on the torch ops, one of cp_sp_triton for
the Triton kernels. The CLI curves of tp2_cp2 (+sp) are in test_cli.py. Bad layouts are rejected before any process
group, naming the numbers."""
import pytest

from minite.config import make_config
from minite.parallel.dims import ParallelError
from minite.parallel.runtime import setup_parallel

CHECKS = ["state", "num_params", "loss", "grads", "generate", "5_steps"]


@pytest.fixture(scope="module")
def torch_cases(workers):
    return workers(4, "cp_tp", "cp_sp", "cp_sp_kv1", "--tp", "2", timeout=300)


@pytest.fixture(scope="module")
def triton_cases(workers):  # skipped on a GPU machine (no interpreter, CPU tensors)
    return workers(4, "cp_sp_triton", "--tp", "2", timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [f"{c}_{k}" for c in ("cp_tp", "cp_sp", "cp_sp_kv1") for k in CHECKS])
def test_tp2_cp2_equals_dense(torch_cases, check, name):
    check(torch_cases, name)


@pytest.mark.distributed
@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.parametrize("name", [f"cp_sp_triton_{k}" for k in ("state", "loss", "grads")])
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
