"""Activation recompute (minite/recompute.py): every mode trains the same numbers as no recompute, keeps less."""
import copy

import pytest
import torch
from torch import nn

from minite.config import ConfigError, TrainConfig
from minite.models.gpt import GPT, Block, GPTConfig
from minite.recompute import MODES, apply_recompute, measure, recompute_mode, selective_policy


def _cfg(**kw):
    base = dict(n_layer=2, n_embd=48, n_head=6, n_kv_head=2, block_size=16, vocab_size=70, backend="torch")
    return GPTConfig(**{**base, **kw})


def _batch(cfg, B=3, T=13, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return idx.to(device), tgt.to(device)


def _step(model, idx, tgt, seed=5):
    torch.manual_seed(seed)  # the dropout masks
    _, loss = model(idx, tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model(cfg, mode, device="cpu"):
    torch.manual_seed(0)
    m = GPT(cfg).to(device)
    assert apply_recompute(m, mode) == (0 if mode == "none" else cfg.n_layer)
    return m


def _assert_same(a, b, rtol=1e-6, atol=1e-7):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"grad of {k}: {m}")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_loss_and_every_grad_match_no_recompute(mode, dropout):
    cfg = _cfg(dropout=dropout)
    idx, tgt = _batch(cfg)
    ref = _step(_model(cfg, "none"), idx, tgt)
    got = _step(_model(cfg, mode), idx, tgt)
    _assert_same(got, ref)
    if dropout:  # the masks matter: another seed gives other gradients (so the comparison above can fail)
        other = _step(_model(cfg, "none"), idx, tgt, seed=6)
        assert not torch.allclose(other[1]["blocks.0.mlp.down.weight"], ref[1]["blocks.0.mlp.down.weight"])


@pytest.mark.triton
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_triton_kernels_under_recompute(mode, device):
    # The Triton Functions launch outside the dispatcher: SAC recomputes them (a fresh output buffer each time).
    cfg = _cfg(n_layer=1, n_embd=32, n_head=2, n_kv_head=1, vocab_size=60, backend="triton", dropout=0.1)
    idx, tgt = _batch(cfg, B=2, T=5, device=device)
    _assert_same(_step(_model(cfg, mode, device), idx, tgt), _step(_model(cfg, "none", device), idx, tgt))


def test_state_dict_unchanged_and_modes_switch():
    cfg = _cfg()
    m = _model(cfg, "none")
    before = m.state_dict()
    assert apply_recompute(m, "full") == cfg.n_layer
    after = m.state_dict()
    assert list(after) == list(before) and all(after[k] is before[k] or torch.equal(after[k], before[k])
                                               for k in before)
    assert [recompute_mode(b) for b in m.blocks] == ["full"] * cfg.n_layer
    assert apply_recompute(m, "full") == 0  # already so
    assert apply_recompute(m, "selective") == cfg.n_layer
    assert apply_recompute(m, "none") == cfg.n_layer
    assert all("forward" not in vars(b) for b in m.blocks)  # the class's forward again, nothing left behind
    m2 = GPT(cfg)
    apply_recompute(m2, "selective")
    m2.load_state_dict(before)  # a checkpoint loads across modes


def test_eval_no_grad_and_kv_cache_generation_after_apply():
    cfg = _cfg(dropout=0.1)
    idx, _ = _batch(cfg, B=2, T=5)
    plain, rec = _model(cfg, "none").eval(), _model(cfg, "selective").eval()
    with torch.no_grad():
        torch.testing.assert_close(rec(idx)[0], plain(idx)[0], rtol=0, atol=0)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    out = rec.generate(idx, 6, generator=g())
    assert torch.equal(out, plain.generate(idx, 6, generator=g()))
    assert torch.equal(out, rec.generate(idx, 6, generator=g(), use_cache=False))


def test_blocks_in_moduledict_and_after_deepcopy():
    # Pipeline stages keep their blocks in an nn.ModuleDict and deep-copy them from the dense model.
    cfg = _cfg()
    torch.manual_seed(0)
    stage = nn.ModuleDict({"3": Block(cfg), "7": Block(cfg)})
    x = torch.randn(3, 13, cfg.n_embd, generator=torch.Generator().manual_seed(2))

    def run(mod):
        h = x.clone().requires_grad_()
        for b in mod.values():
            h = b(h)
        h.square().sum().backward()
        return {n: p.grad.clone() for n, p in mod.named_parameters()}

    ref = run(copy.deepcopy(stage))
    assert apply_recompute(stage, "full") == 2
    twin = copy.deepcopy(stage)  # its forward must run the copy, not the original
    got = run(twin)
    assert all(p.grad is None for p in stage.parameters())
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7)


def test_tensor_parallel_blocks_are_found():
    from minite.parallel.sequence import TPGPT
    cfg = _cfg()
    idx, tgt = _batch(cfg)
    torch.manual_seed(0)
    ref = TPGPT.from_dense(GPT(cfg), None)
    torch.manual_seed(0)
    tp = TPGPT.from_dense(GPT(cfg), None)
    assert apply_recompute(tp, "selective") == cfg.n_layer
    _assert_same(_step(tp, idx, tgt), _step(ref, idx, tgt))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_zero3_frees_and_regathers_params_around_recompute(mode):
    # ZeRO-3 frees each block's parameters after its forward and gathers them again in a hook on its output's grad,
    # before the backward (and so before the recompute) reaches the block. World 1: no process group needed.
    from minite.parallel.data import DataParallel
    cfg = _cfg()
    idx, tgt = _batch(cfg)
    grads = []
    for m in ("none", mode):
        torch.manual_seed(0)
        model = GPT(cfg)
        dp = DataParallel(model, None, stage=3)
        apply_recompute(model, m)  # after the wrapper, as minite.train does
        model(idx, tgt)[1].backward()
        dp.finish()
        grads.append(dp.shard_grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)


def test_bad_mode_and_fp8_are_rejected():
    with pytest.raises(ConfigError, match=r"'partial'.*none, selective, full"):
        apply_recompute(GPT(_cfg()), "partial")
    with pytest.raises(ConfigError, match=r"--train.recompute='some'.*none, selective or full"):
        TrainConfig(recompute="some")
    with pytest.raises(ConfigError, match="fp8"):
        TrainConfig(recompute="full", precision="fp8")
    assert TrainConfig(recompute="selective").recompute == "selective"
    from minite.formats import fp8_autocast
    m = _model(_cfg(), "full")
    with fp8_autocast(), pytest.raises(RuntimeError, match="fp8_autocast"):
        m(*_batch(m.config))


def test_policy_saves_gemms_and_attention_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    save = {op for op in (aten.mm.default, aten.addmm.default, aten.bmm.default)
            if selective_policy(None, op) == CheckpointPolicy.MUST_SAVE}
    assert save == {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for op in (aten.mul.Tensor, aten.add.Tensor, aten.rsqrt.default, aten.bernoulli_.float, aten.sigmoid.default):
        assert selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_memory_ordering_full_selective_none():
    # A structural property: full keeps one tensor per block, selective the GEMM/attention outputs, none everything.
    cfg = GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=65, backend="torch")
    idx, _ = _batch(cfg, B=8, T=128)
    got = {m: measure(_model(cfg, m), idx, idx) for m in MODES}
    print({m: {k: f"{v / 2**20:.1f} MiB" for k, v in d.items()} for m, d in got.items()})
    assert got["full"]["held"] < got["selective"]["held"] < got["none"]["held"]
    assert got["full"]["peak"] < got["selective"]["peak"] < got["none"]["peak"]
    # full keeps a block's input (B, T, C) fp32 per block, plus what the layers outside the blocks keep
    B, T, C = 8, 128, 128
    outside = measure(_model(GPTConfig(**{**cfg.to_dict(), "n_layer": 1}), "full"), idx, idx)["held"] - B * T * C * 4
    assert got["full"]["held"] == outside + cfg.n_layer * B * T * C * 4
    # selective adds, per block, the outputs of the 4 GEMMs (qkv 3C, proj C, gate_up 2F, down C) and of attention
    # (C, plus its logsumexp: H per token); a few KiB of slack for backends whose attention returns more.
    per_token = C + 3 * C + C + 2 * cfg.mlp_hidden + C + C + cfg.n_head
    expect = outside + cfg.n_layer * B * T * per_token * 4
    assert expect <= got["selective"]["held"] <= expect + 64 * 1024, (got["selective"]["held"], expect)
