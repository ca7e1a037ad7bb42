"""Chapters 10-11 in one process: layouts rejected with their numbers, tp=1 / dp=1 are the identity, formulas."""
import pytest
import torch

from minite.models.gpt import GPT, GPTConfig
from minite.parallel import ParallelDims, ParallelError, comm
from minite.parallel.data import DataParallel
from minite.parallel.sequence import TPGPT, activation_bytes
from minite.parallel.zero import ShardedAdamW, memory_per_rank

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, backend="torch")


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw}))


def _batch(B=4, T=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


def test_world_size_must_be_the_product():
    with pytest.raises(ParallelError, match=r"world size 6 != dp\*tp\*pp\*cp = 2\*2\*1\*1 = 4"):
        ParallelDims(dp=2, tp=2).build(rank=0, world=6)
    with pytest.raises(ParallelError, match="tp=0 must be a positive integer"):
        ParallelDims(tp=0)


def test_dims_from_config_and_the_layout_check():
    from minite.config import make_config
    from minite.parallel.dims import check_layout
    p = make_config("cpu", {"parallel.dp": 2, "parallel.pp": 2}).parallel
    dims = ParallelDims.from_config(p, 4)
    assert (dims.dp, dims.tp, dims.pp, dims.cp, dims.groups) == (2, 1, 2, 1, {})  # degrees only: no group yet
    with pytest.raises(ParallelError, match=r"world size 3 != dp\*tp\*pp\*cp = 2\*1\*2\*1 = 4"):
        ParallelDims.from_config(p, 3)
    model = GPTConfig(**TINY)
    check_layout(p, model, world=4, seq_len=16, batch_size=8)
    with pytest.raises(ParallelError) as e:
        check_layout(p, model, world=4, seq_len=16, batch_size=5, lora_r=4)
    for words in ("batch_size=5 (the global batch) is not divisible by dp=2", "LoRA (lora.r=4)"):
        assert words in str(e.value)


def test_clip_grad_norm_counts_each_element_once():
    from minite.parallel.comm import clip_grad_norm_
    ref, tp1 = _gpt(), _gpt()
    for m in (ref, tp1):
        m(*_batch())[1].backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = clip_grad_norm_(tp1.parameters(), 0.1, [None])
    assert got.dtype == torch.float64 and float(got) == pytest.approx(float(want), rel=1e-6)
    for p, q in zip(ref.parameters(), tp1.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=0)
    w = tp1.norm_f.weight  # held by 2 tp ranks: counted half on each
    norm = float(clip_grad_norm_([w], 1e9))
    w.tp_replicas = 2
    assert float(clip_grad_norm_([w], 1e9)) == pytest.approx(norm / 2 ** 0.5)


def test_trace_records_only_under_a_recorder():
    from minite.parallel import trace
    from minite.parallel.pipeline import PipelineGPT
    pipe = PipelineGPT(_gpt(), ParallelDims().build(), 2, "1f1b")
    x, y = _batch()
    pipe.step(x, y)  # nothing recorded, and nothing kept on the model
    assert not any(hasattr(pipe, a) for a in ("events", "mb_bytes", "peak_act_bytes", "sync"))
    with trace.Recorder() as rec:
        pipe.step(x, y)
    steps = [(r["step"], r["mb"]) for r in rec.rows("pp")]
    assert steps == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert all(r["saved_bytes"] > 0 and r["t1"] >= r["t0"] for r in rec.rows("pp") if r["step"] == "F")


@pytest.mark.parametrize("kw, msg", [
    (dict(tp=3), r"n_head=4 is not divisible by tp=3.*n_kv_head=2 and tp=3.*padded vocab 64 is not divisible by tp=3"),
    (dict(tp=8), r"n_head=4 is not divisible by tp=8"),
    (dict(pp=3), r"pp=3 stages but only n_layer=2 layers"),
])
def test_tp_that_does_not_divide_is_rejected_with_numbers(kw, msg):
    with pytest.raises(ParallelError, match=msg):
        ParallelDims(**kw).check_model(GPTConfig(**TINY))
    with pytest.raises(ParallelError, match="mlp_hidden=96 is not divisible by tp=64"):
        ParallelDims(tp=64).check_model(GPTConfig(**{**TINY, "mlp_hidden": 96}))


def test_grid_groups_single_process():
    d = ParallelDims().build()
    assert (d.dp_rank, d.tp_rank, d.pp_rank, d.cp_rank) == (0, 0, 0, 0) and d.group("tp") is None
    assert d.neighbour("pp", 1) == 0


@pytest.mark.parametrize("sp", [False, True])
def test_tp1_is_the_dense_model(sp):
    x, y = _batch()
    dense, tpm = _gpt(), TPGPT.from_dense(_gpt(), None, sequence_parallel=sp)
    (dl, dloss), (tl, tloss) = dense(x, y), tpm(x, y)
    dloss.backward()
    tloss.backward()
    assert torch.equal(dl, tl) and torch.equal(dloss, tloss)
    grads = {n: p.grad for n, p in dense.named_parameters()}
    for p in tpm.parameters():
        assert torch.equal(p.grad, grads[p.dense_name])
    assert tpm.num_params() == dense.num_params()
    assert all(torch.equal(v, dense.state_dict()[k]) for k, v in tpm.dense_state_dict().items())
    assert torch.equal(tpm.generate(x[:, :4], 3, temperature=0), dense.generate(x[:, :4], 3, temperature=0))


def test_comm_is_identity_without_a_group():
    x = torch.randn(2, 4, 6)
    for f in (comm.copy_to_parallel, comm.reduce_from_parallel, comm.gather_from_sequence, comm.gather_split,
              comm.scatter_to_sequence, comm.reduce_scatter_to_sequence):
        assert f(x, None, 1) is x if f not in (comm.copy_to_parallel, comm.reduce_from_parallel) else f(x, None) is x
    for name, fn in vars(comm).items():
        if isinstance(fn, type) and issubclass(fn, torch.autograd.Function) and fn is not torch.autograd.Function:
            assert "forward:" in fn.__doc__ and "/ backward:" in fn.__doc__, name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dataparallel_world1_matches_plain_adamw(stage, tmp_path):
    data = [_batch(seed=s) for s in range(3)]
    ref = _gpt()
    opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)
    model = _gpt()
    dp = DataParallel(model, None, stage=stage)
    zopt = ShardedAdamW(dp, lr=1e-2, weight_decay=0.1) if stage else torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)
    for x, y in data:
        ref(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        model(x, y)[1].backward()
        dp.finish()
        zopt.step()
        zopt.zero_grad()
    got = dp.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0)
    if stage:  # the sharded checkpoint round-trips
        zopt.save_sharded(tmp_path)
        m2 = _gpt()
        z2 = ShardedAdamW(DataParallel(m2, None, stage=stage), lr=0.5)
        z2.load_sharded(tmp_path)
        assert torch.equal(z2.dp.shard_param, dp.shard_param) and z2.param_groups[0]["lr"] == 1e-2
        assert torch.equal(z2.inner.state[z2.dp.shard_param]["exp_avg"], zopt.inner.state[dp.shard_param]["exp_avg"])


def test_dataparallel_rejects_bad_stage():
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3, got 4"):
        DataParallel(_gpt(), None, stage=4)


def test_memory_formulas():
    m = [memory_per_rank(1000, 4, s)["total"] for s in range(4)]
    assert m[0] == 16000 and m[0] > m[1] > m[2] > m[3] == 16000 / 4
    assert memory_per_rank(1000, 1, 3)["total"] == 16000
    s, b = 2048, 1  # sequence, batch
    h, a = 4096, 32  # width, heads
    assert activation_bytes(s, b, h, a, t=1) == activation_bytes(s, b, h, a, t=1, sp=True)  # tp=1: the same
    assert activation_bytes(s, b, h, a, t=8, sp=True) == pytest.approx(activation_bytes(s, b, h, a) / 8)


def test_global_batch_is_cut_into_dp_slices():
    from minite.config import make_config
    from minite.parallel.runtime import Parallel
    x, y = torch.arange(8)[:, None].repeat(1, 3), torch.arange(8)[:, None]
    cut = [Parallel(ParallelDims(dp=4).build(rank=r, world=4)).shard_batch(x, y) for r in range(4)]
    assert torch.equal(torch.cat([c[0] for c in cut]), x) and all(c[0].shape == (2, 3) for c in cut)
    with pytest.raises(ParallelError, match="batch_size=6 .* not divisible by dp=4"):
        Parallel(ParallelDims(dp=4).build(rank=0, world=4)).shard_batch(x[:6], y[:6])
    assert make_config("cpu", {"parallel.zero": "3", "parallel.tp": "2", "parallel.sp": "true"}).parallel.zero == 3


def test_data_parallelism_fills_the_world_by_default():
    # issue 37: `torchrun --nproc-per-node 2 -m minite.train` was refused ("world size 2 != dp*tp*pp*cp = 1");
    # an unspecified dp now fills the world (torchtitan's dp_shard=-1), and a layout that cannot is still refused
    from minite.config import make_config
    from minite.parallel.dims import check_layout, fill_dp
    model = GPTConfig(**TINY)
    for over, world, dp in (({}, 2, 2), ({}, 1, 1), ({"parallel.tp": 2}, 4, 2),
                            ({"parallel.pp": 2, "parallel.cp": 2}, 8, 2), ({"parallel.dp": 1}, 1, 1)):
        p = make_config("cpu", over).parallel
        assert fill_dp(p, world) == dp, (over, world)
        assert ParallelDims.from_config(p, world).dp == dp
        check_layout(p, model, world=world, seq_len=16, batch_size=8)
    p = make_config("cpu", {"parallel.ep": 2, "model.moe_num_experts": 4}).parallel  # ep=2 alone: dp=4 holds it
    check_layout(p, GPTConfig(**TINY, moe_num_experts=4), world=4, seq_len=16, batch_size=8)
    p = make_config("cpu", {"parallel.tp": 2}).parallel
    with pytest.raises(ParallelError, match=r"world size 3 != dp\*tp\*pp\*cp = 1\*2\*1\*1 = 2"):
        check_layout(p, model, world=3, seq_len=16, batch_size=8)
    p = make_config("cpu", {"parallel.dp": 1}).parallel  # an explicit degree is kept: refused, not refilled
    with pytest.raises(ParallelError, match=r"world size 2 != dp\*tp\*pp\*cp = 1\*1\*1\*1 = 1"):
        ParallelDims.from_config(p, 2)
