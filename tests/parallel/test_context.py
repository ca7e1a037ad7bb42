"""Chapter 13: context parallelism. Single-process pieces (LSE merge, layout, work balance, cp=1 identity), then
one torchrun launch per world size (2 and 4) running chapter 13's checks (minite.parallel.workers; the ring's and
Ulysses'), and the CLI runs ``torchrun --nproc-per-node 2 -m minite.train --parallel.cp=2 [--parallel.cp_mode=a2a]``
against the one-process loss curve."""
import pytest
import torch
from relaunch import torchrun  # tests/parallel/relaunch.py

from minite.ops import attention
from minite.parallel import context as cx


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


@pytest.mark.parametrize("flags, match", [
    ({"parallel.cp": 4, "parallel.cp_mode": "a2a", "model.n_head": 6, "model.n_kv_head": 2},
     r"n_head=6 is not divisible by cp=4"),
    ({"parallel.cp": 4, "parallel.cp_mode": "a2a", "model.n_head": 12, "model.n_kv_head": 6},
     r"n_kv_head=6 and cp=4: one must divide the other"),
    ({"parallel.cp": 4, "parallel.tp": 2, "parallel.cp_mode": "a2a", "model.n_head": 4},
     r"n_head=2 is not divisible by cp=4 \(per tp rank, tp=2\)"),
    ({"parallel.cp": 4, "parallel.cp_mode": "hybrid", "parallel.cp_a2a": 2, "model.n_head": 6, "model.n_kv_head": 3},
     r"n_kv_head=3 and cp_a2a=2"),
])
def test_a2a_bad_heads_are_refused_by_name(flags, match):
    """Ulysses splits each (tp rank's) heads over the all-to-all: a layout that cannot is refused before any launch."""
    from minite.config import make_config
    from minite.parallel.dims import ParallelError, check_layout
    cfg = make_config("cpu", {"model.block_size": 16, "model.n_embd": 96, **flags})
    p = cfg.parallel
    with pytest.raises(ParallelError, match=match):
        check_layout(p, cfg.model, world=p.cp * p.tp, seq_len=16, batch_size=8)
    if p.tp == 1:
        from minite.parallel.ulysses import check_heads
        with pytest.raises(ValueError, match=match):
            check_heads(cfg.model.n_head, cfg.model.n_kv_head, p.cp_a2a or p.cp, "cp_a2a" if p.cp_a2a else "cp")
    ok = make_config("cpu", {"model.block_size": 16, "model.n_embd": 96, **flags, "model.n_head": 8,
                             "model.n_kv_head": 2})
    check_layout(ok.parallel, ok.model, world=p.cp * p.tp, seq_len=16, batch_size=8)  # kv heads 2 < 4: replicated


@pytest.mark.parametrize("flags, match", [
    ({"parallel.cp_mode": "a2a"}, r"cp_mode=a2a .* but --parallel.cp=1"),
    ({"parallel.cp": 4, "parallel.cp_mode": "hybrid"}, r"cp_a2a=0 with --parallel.cp_mode=hybrid"),
    ({"parallel.cp": 4, "parallel.cp_mode": "hybrid", "parallel.cp_a2a": 4}, r"1 < cp_a2a < cp"),
    ({"parallel.cp": 6, "parallel.cp_mode": "hybrid", "parallel.cp_a2a": 4}, r"dividing cp"),
    ({"parallel.cp": 4, "parallel.cp_a2a": 2}, r"cp_a2a=2 with --parallel.cp_mode=ring"),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses"}, r"ring, a2a or hybrid"),
])
def test_cp_mode_flags_are_checked(flags, match):
    from minite.config import ConfigError, make_config
    with pytest.raises(ConfigError, match=match):
        make_config("cpu", flags)


def test_a2a_layout_order_is_the_ring_shard():
    """The hybrid's premise: the tokens of a2a group i (cp ranks i*a..i*a+a-1), sorted, are the ring's balanced
    shard i of R = cp/a ranks; cp = a: the whole sequence in order."""
    from minite.parallel.ulysses import _order
    for cp, a in ((4, 2), (8, 2), (8, 4), (4, 4)):
        R, Tl = cp // a, 6
        for i in range(R):
            got = torch.cat([cx.positions(Tl * cp, cp, i * a + j) for j in range(a)])[_order(Tl, a, i, R, True)]
            assert torch.equal(got, cx.positions(Tl * cp, R, i)), (cp, a, i)


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
# Ulysses (workers/ulysses.py): kv heads 2 split (world 2) or replicated (world 4), 1 replicated; hybrid: world 4
A2A = [f"a2a_{c}" for c in ("causal_balanced_kv2", "causal_kv2", "full_kv2", "causal_balanced_kv1")] + \
    [f"gpt_a2a_{c}" for c in ("grads", "5_steps")]
HYBRID = [f"hybrid_{c}" for c in ("causal_balanced_kv2", "causal_kv2", "causal_balanced_kv1")] + \
    [f"gpt_hybrid_{c}" for c in ("grads", "5_steps")]


@pytest.fixture(scope="module")
def world2(workers):  # Triton checks: skipped on a GPU machine
    return workers(2, "cp_attn", "cp_triton", "cp_gpt", "cp_ulysses", timeout=300)


@pytest.fixture(scope="module")
def world4(workers):
    return workers(4, "cp_attn", "cp_triton", "cp_gpt", "cp_ulysses", timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ATTN + [pytest.param(n, marks=pytest.mark.triton) for n in TRITON] + GPT_CHECKS)
def test_cp_equals_one_process(request, check, world, name):
    check(request.getfixturevalue(f"world{world}"), name)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", A2A + HYBRID + [pytest.param("triton_a2a_causal_balanced", marks=pytest.mark.triton)])
def test_a2a_equals_one_process(request, check, world, name):
    """Ulysses CP (and at world 4 the hybrid, a2a in pairs x the ring): o, lse, dq, dk, dv of my shard and the GPT's
    loss, weight gradients and 5 AdamW steps, against one process."""
    if name.startswith(("hybrid", "gpt_hybrid")) and world < 4:
        pytest.skip("the hybrid needs cp = 4 (a2a pairs x a ring of 2)")
    check(request.getfixturevalue(f"world{world}"), name)


# ----------------------------------------------------------------------------------- the CLI
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["cp2", "dp2_cp2", "cp2_a2a"])
def test_cli_cp_matches_single_process(corpus, cli, flags, curve, layout):
    """torchrun -m minite.train --parallel.cp=2 (and dp=2 x cp=2 on 4 ranks): the one-process curve, 20 steps, on
    the workers' device with the same preset (conftest.train_cli)."""
    from minite.train import train
    d, data = corpus
    flags = {**flags, "train.batch_size": 4, **data}
    extra, world = {"cp2": (["--parallel.cp=2"], 2), "dp2_cp2": (["--parallel.dp=2", "--parallel.cp=2"], 4),
                    "cp2_a2a": (["--parallel.cp=2", "--parallel.cp_mode=a2a"], 2)}[layout]
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
