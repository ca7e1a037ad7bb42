"""Chapter 13: context parallelism. Single-process pieces (LSE merge, layout, work balance, cp=1 identity), then
one torchrun launch per world size (2 and 4) running chapter 13's checks (minite.parallel.workers), and the CLI run
``torchrun --nproc-per-node 2 -m minite.train --parallel.cp=2`` against the one-process loss curve."""
import pytest
import torch

from minite.ops import attention
from minite.parallel import context as cx
from minite.parallel.launch import torchrun


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------- one process
def test_lse_merge_equals_attention_over_all_keys():
    q, k, v = _randn(2, 3, 7, 16, seed=1), _randn(2, 3, 11, 16, seed=2), _randn(2, 3, 11, 16, seed=3)
    o, lse = attention(q, k, v, causal=False, return_lse=True, backend="torch")
    o1, l1 = attention(q, k[:, :, :4], v[:, :, :4], causal=False, return_lse=True, backend="torch")
    o2, l2 = attention(q, k[:, :, 4:], v[:, :, 4:], causal=False, return_lse=True, backend="torch")
    mo, ml = cx.lse_merge(o1, l1, o2, l2)
    assert mo.dtype == ml.dtype == torch.float32
    torch.testing.assert_close(mo, o, atol=1e-6, rtol=0)
    torch.testing.assert_close(ml, lse, atol=1e-6, rtol=0)
    bad, _ = cx.lse_merge(o1, l1, o2 * 0, l2)  # dropping a part's output must show
    assert (bad - o).abs().max() > 1e-2


def test_lse_merge_rows_without_keys():
    o1, o2 = _randn(1, 1, 3, 4, seed=4), torch.zeros(1, 1, 3, 4)
    l1 = torch.tensor([[[0.5, float("-inf"), 2.0]]])
    l2 = torch.full((1, 1, 3), float("-inf"))  # the second part saw no key at all
    o, lse = cx.lse_merge(o1, l1, o2, l2)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert lse[0, 0, 1] == float("-inf") and (o[0, 0, 1] == 0).all()  # no key anywhere: LSE -inf, output 0
    torch.testing.assert_close(o[0, 0, [0, 2]], o1[0, 0, [0, 2]])
    torch.testing.assert_close(lse[0, 0, [0, 2]], l1[0, 0, [0, 2]])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_balanced_layout(cp):
    T = 2 * cp * 3
    x = torch.arange(T)[None]
    parts = [cx.shard(x, cp, r) for r in range(cp)]
    for r, p in enumerate(parts):  # rank r holds chunks r and 2cp-1-r
        assert p[0].tolist() == list(range(3 * r, 3 * r + 3)) + list(range(3 * (2 * cp - 1 - r), 3 * (2 * cp - r)))
    assert torch.equal(cx.unshard(parts), x)
    assert torch.equal(cx.unshard([cx.shard(x, cp, r, balanced=False) for r in range(cp)], balanced=False), x)


def test_length_not_divisible_is_rejected_with_numbers():
    with pytest.raises(ValueError, match=r"T=18 must be divisible by 2\*cp=8"):
        cx.positions(18, 4, 0)
    from minite.config import make_config
    from minite.parallel.runtime import setup_parallel
    cfg = make_config("cpu", {"parallel.cp": 2, "model.block_size": 18})
    with pytest.raises(ValueError, match=r"T=18 must be divisible by 2\*cp=4"):
        setup_parallel(cfg)


def _work(cp, balanced):
    """Score entries per rank, from the ring's own plan (the same rule the kernel calls follow)."""
    Tl = 16
    out = []
    for r in range(cp):
        scores = 0
        for step in range(cp):
            plan = cx._plan(step, r, cp, True, balanced, Tl)
            if plan is not None:
                scores += cx._scores(torch.empty(1, 1), len(range(Tl)[plan[0]]), len(range(Tl)[plan[1]]), plan[2])
        out.append(scores)
    return out


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balancing_evens_the_work(cp):
    T = 16 * cp
    total = T * (T + 1) // 2  # the causal score entries of the whole sequence
    for balanced in (False, True):
        w = _work(cp, balanced)
        assert sum(w) == total
    flat, bal = _work(cp, False), _work(cp, True)
    assert max(flat) / min(flat) > cp  # contiguous: the last rank does ~2cp-1 times the first's work
    assert max(bal) - min(bal) == 0  # balanced: every rank the same


def test_cp1_is_the_dense_model():
    from minite.models.gpt import GPT, GPTConfig
    from minite.parallel.context_gpt import CPGPT
    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, backend="torch")
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**cfg))
    torch.manual_seed(0)
    model = CPGPT.from_dense(GPT(GPTConfig(**cfg)), None)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(x, x)[1], dense(x, x)[1])
    assert model.state_dict().keys() == dense.state_dict().keys()
    torch.testing.assert_close(model(x[:, :5])[0], dense(x[:, :5])[0])  # sampling path: dense
    assert torch.equal(model.generate(x[:, :4], 3, temperature=0), dense.generate(x[:, :4], 3, temperature=0))


# ----------------------------------------------------------------------------------- torchrun, world 2 and 4
ATTN = [f"{p}_{v}_{c}" for p in ("attn",) for v in ("ring", "allgather")
        for c in ("causal_balanced", "causal", "full")]
TRITON = ["triton_ring_causal_balanced", "triton_allgather_causal_balanced"]
GPT_CHECKS = ["gpt_ring_5_steps", "gpt_allgather_5_steps"]


@pytest.fixture(scope="module")
def world2(workers):
    return workers(2, "cp_attn", "cp_triton", "cp_gpt", timeout=300)  # Triton checks: skipped on a GPU machine


@pytest.fixture(scope="module")
def world4(workers):
    return workers(4, "cp_attn", "cp_triton", "cp_gpt", timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ATTN + [pytest.param(n, marks=pytest.mark.triton) for n in TRITON] + GPT_CHECKS)
def test_cp_equals_one_process(request, check, world, name):
    check(request.getfixturevalue(f"world{world}"), name)


# ----------------------------------------------------------------------------------- the CLI
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["cp2", "dp2_cp2"])
def test_cli_cp_matches_single_process(corpus, cli, flags, curve, layout):
    """torchrun -m minite.train --parallel.cp=2 (and dp=2 x cp=2 on 4 ranks): the one-process curve, 20 steps, on
    the workers' device with the same preset (conftest.train_cli)."""
    from minite.train import train
    d, data = corpus
    flags = {**flags, "train.batch_size": 4, **data}
    extra, world = (["--parallel.cp=2"], 2) if layout == "cp2" else (["--parallel.dp=2", "--parallel.cp=2"], 4)
    ref, _ = cli({**flags, "train.out_dir": str(d / f"single_{layout}")}, world)
    train(ref)
    loss1, val1 = curve(d / f"single_{layout}")
    res = torchrun(world, [*cli({**flags, "train.out_dir": str(d / layout)}, world)[1], *extra], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    loss, val = curve(d / layout)
    assert len(loss) == 20 and len(val) == 3
    assert max(abs(a - b) for a, b in zip(loss, loss1)) < 1e-4, (loss, loss1)
    assert max(abs(a - b) for a, b in zip(val, val1)) < 1e-4, (val, val1)
    assert res.stdout.count("val loss") == 1  # rank 0 speaks, once
