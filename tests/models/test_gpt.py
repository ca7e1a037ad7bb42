"""The GPT built from minite parts: shapes, loss, GQA, padded vocabulary, tied head, init, generation, backends."""
import math

import pytest
import torch

from minite import use_backend
from minite.layers.attention import CausalSelfAttention
from minite.models.gpt import GPT, GPTConfig
from minite.testing import assert_close, dtype_tols

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, tiny ops on shared cores


# The reference backend everywhere except the Triton test: under TRITON_INTERPRET=1 "auto" would pick the
# (slow) interpreted kernels.
TINY = dict(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, backend="torch")


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw}))


def test_forward_shapes_and_initial_loss():
    m = tiny()
    idx, tgt = torch.randint(0, 65, (2, 3, 16))  # targets unrelated to inputs (tied weights favour tgt == idx)
    logits, loss = m(idx, tgt)
    assert logits.shape == (3, 16, 128)  # vocab 65 padded to 128
    # At init the logits are near zero: the loss is close to ln(V_pad) (uniform over the padded vocabulary).
    assert abs(loss.item() - math.log(128)) < 0.1
    logits, loss = m(idx[:, :5])
    assert logits.shape == (3, 1, 128) and loss is None  # inference: the last position only


def test_config_defaults_and_errors():
    c = GPTConfig(n_embd=96, n_head=6, n_kv_head=0, vocab_size=50257)
    assert c.n_kv_head == 6 and c.mlp_hidden == 256  # 8/3 * 96 = 256
    assert c.padded_vocab_size == 50304  # the GPT-2 lesson
    with pytest.raises(ValueError, match="n_embd=100 must be divisible by n_head=3"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="n_head=4 must be divisible by n_kv_head=3"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="backend"):
        GPTConfig(backend="cuda")


def test_padded_vocab_never_sampled():
    m = tiny()
    assert m.wte.weight.shape == (128, 32) and m.config.padded_vocab_size == 128
    with torch.no_grad():  # make the padded ids the most likely by far: generate must still skip them
        m.wte.weight[65:] = 5.0
    out = m.generate(torch.zeros(2, 1, dtype=torch.long), 20, temperature=1.0)
    assert out.shape == (2, 21) and int(out.max()) < 65


def test_tied_lm_head():
    m = tiny()
    names = [n for n, _ in m.named_parameters()]
    assert not any("head" in n for n in names)  # no separate output matrix
    hidden = {}
    m.norm_f.register_forward_hook(lambda mod, inp, out: hidden.setdefault("x", out))
    idx = torch.randint(0, 65, (2, 16))
    logits, loss = m(idx, idx)
    assert_close(logits, hidden["x"] @ m.wte.weight.T, name="logits vs x @ wte^T")
    loss.backward()
    assert m.wte.weight.grad[65:].abs().sum() > 0  # the head's gradient reaches the embedding matrix (all rows)


def test_gqa_matches_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    C = 32
    H = 4
    KVH = 2
    T = 8
    D = C // H
    gqa = CausalSelfAttention(C, H, KVH, max_seq_len=T)
    assert gqa.qkv.weight.shape == ((H + 2 * KVH) * D, C)
    mha = CausalSelfAttention(C, H, H, max_seq_len=T)
    wq, wk, wv = gqa.qkv.weight.split([H * D, KVH * D, KVH * D])
    rep = lambda w: w.view(KVH, D, C).repeat_interleave(H // KVH, dim=0).reshape(H * D, C)  # (H*D, C)
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        mha.proj.weight.copy_(gqa.proj.weight)
    x = torch.randn(2, T, C)
    y = gqa(x)
    assert y.shape == (2, T, C)
    assert_close(y, mha(x), name="GQA vs MHA with duplicated K/V heads")


def test_attention_is_causal():
    m = tiny()
    idx = torch.randint(0, 65, (1, 16))
    idx2 = idx.clone()
    idx2[0, 10:] = (idx2[0, 10:] + 1) % 65  # change the future
    h = []
    m.norm_f.register_forward_hook(lambda mod, inp, out: h.append(out))
    m(idx, idx)
    m(idx2, idx2)
    assert_close(h[0][:, :10], h[1][:, :10], name="past positions")
    assert not torch.allclose(h[0][:, 10:], h[1][:, 10:])


def test_sequence_longer_than_block_size():
    m = tiny()
    with pytest.raises(ValueError, match="length 17: block_size is only 16"):
        m(torch.zeros(1, 17, dtype=torch.long))
    out = m.generate(torch.zeros(1, 16, dtype=torch.long), 3)  # generate crops the context instead
    assert out.shape == (1, 19)


def test_scaled_residual_init():
    m = tiny(n_layer=8)
    std = lambda name: dict(m.named_parameters())[name].std().item()
    assert abs(std("blocks.0.attn.qkv.weight") - 0.02) < 0.003
    assert abs(std("blocks.0.mlp.down.weight") - 0.02 / math.sqrt(16)) < 0.001
    assert abs(std("blocks.0.attn.proj.weight") - 0.02 / math.sqrt(16)) < 0.001


def test_generate_options():
    m = tiny()
    p = torch.zeros(1, 2, dtype=torch.long)
    g1 = m.generate(p, 10, temperature=0)
    assert torch.equal(g1, m.generate(p, 10, temperature=0))  # greedy is deterministic
    gen = lambda s: m.generate(p, 10, top_k=3, generator=torch.Generator().manual_seed(s))
    assert torch.equal(gen(1), gen(1))
    with pytest.raises(ValueError, match="top_k"):
        m.generate(p, 1, top_k=0)


def _train_losses(backend, steps=3, device="cpu"):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                      backend=backend)).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 50, (2, 8), generator=g).to(device)  # drawn on the CPU: the same batches everywhere
        _, loss = m(x, torch.roll(x, -1, dims=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_loss_decreases_over_30_steps():
    torch.manual_seed(0)
    m = tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x = torch.randint(0, 65, (4, 16))
    y = (x * 7 + 3) % 65  # a learnable per-token mapping
    losses = []
    for _ in range(30):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses



def test_loss_decreases_over_30_steps_on_a_generated_corpus(tmp_path, make_corpus):
    # The real data path: a generated corpus -> minite.data.prepare (char tokenizer, train/val .bin) ->
    # BatchSampler's random shifted windows. The loss is measured on one fixed val batch before and after.
    from minite.data import BatchSampler, prepare

    make_corpus(tmp_path / "c.txt", n_chars=6000)
    d = prepare(tmp_path / "c.txt", data_dir=tmp_path / "data", verbose=False)
    V = d.tokenizer.vocab_size
    m = tiny(vocab_size=V)
    train = BatchSampler(d.split("train"), 16, 8, seed=0)
    xv, yv = BatchSampler(d.split("val"), 16, 8, seed=1, split="val").get_batch()
    assert xv.shape == (8, 16) and torch.equal(xv[:, 1:], yv[:, :-1])  # shifted windows
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with torch.no_grad():
        val0 = m(xv, yv)[1].item()
    losses = []
    for _ in range(30):
        x, y = train.get_batch()
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        val1 = m(xv, yv)[1].item()
    assert abs(val0 - math.log(m.config.padded_vocab_size)) < 0.1  # uniform at init
    # Clearly below: at least 1 nat (a model that only learns which ids exist would reach ln(V) already).
    assert val1 < val0 - 1.0 and val1 < math.log(V) - 0.3, (val0, val1, losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def _tiny_keys(n_layer):
    per_block = ["norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight", "mlp.gate_up.weight",
                 "mlp.down.weight"]
    return {"wte.weight", "norm_f.weight"} | {f"blocks.{i}.{k}" for i in range(n_layer) for k in per_block}


def test_state_dict_keys_tied_head_and_round_trip():
    m = tiny()
    sd = m.state_dict()
    # The exact key set: a renamed module breaks every checkpoint. No lm_head key (tied), no RoPE cache (a
    # non-persistent buffer rebuilt from the config).
    assert set(sd) == _tiny_keys(2), sorted(set(sd) ^ _tiny_keys(2))
    assert sd["wte.weight"].shape == (128, 32)
    assert m.num_params() == sum(v.numel() for v in sd.values())  # the tied matrix counted once
    # The head reads the embedding's storage: change row c of wte.weight for a token c absent from the input,
    # and exactly logit column c moves.
    idx = torch.randint(0, 60, (2, 16))
    logits0, _ = m(idx, idx)
    with torch.no_grad():
        m.wte.weight[63] += 1.0
    logits1, _ = m(idx, idx)
    assert not torch.allclose(logits1[..., 63], logits0[..., 63])
    assert torch.equal(torch.cat([logits1[..., :63], logits1[..., 64:]], -1),
                       torch.cat([logits0[..., :63], logits0[..., 64:]], -1))
    # Round trip into a fresh model (another seed) gives identical outputs, and the head stays tied after loading.
    torch.manual_seed(123)
    fresh = GPT(GPTConfig(**TINY))
    assert not torch.equal(fresh(idx, idx)[0], logits1)
    fresh.load_state_dict(m.state_dict())
    logits2, loss2 = fresh(idx, idx)
    _, loss1 = m(idx, idx)
    assert torch.equal(logits2, logits1) and torch.equal(loss2, loss1)
    assert not any("head" in n for n, _ in fresh.named_parameters())


@pytest.mark.triton
def test_triton_backend_matches_torch_over_3_training_steps(monkeypatch, device):
    # backend="triton" forces every op through its Triton kernel, attention included (chapter 07). Count the
    # launchers' calls so a silent fall-back to the reference fails.
    from minite.kernels import attention, cross_entropy, rmsnorm, swiglu
    calls = {}

    def count(mod, name):
        real = getattr(mod, name)

        def wrapper(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **k)
        monkeypatch.setattr(mod, name, wrapper)
    for mod, names in ((rmsnorm, ("rmsnorm_fwd", "rmsnorm_bwd")), (swiglu, ("swiglu_fwd", "swiglu_bwd")),
                       (cross_entropy, ("cross_entropy_fwd", "cross_entropy_bwd")),
                       (attention, ("attention_qkv_fwd", "attention_qkv_bwd"))):
        for name in names:
            count(mod, name)
    ref = _train_losses("torch", device=device)
    assert calls == {}  # the reference run launches no kernel
    tri = _train_losses("triton", device=device)
    expected = ["rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd", "cross_entropy_fwd", "cross_entropy_bwd",
                "attention_qkv_fwd", "attention_qkv_bwd"]
    assert all(calls.get(n, 0) > 0 for n in expected), calls
    # 3 steps x (3 norms + 1 swiglu + 1 cross-entropy) forward, and as many backward
    assert calls["rmsnorm_fwd"] == calls["rmsnorm_bwd"] == 9, calls
    # 1 layer x 3 steps: RoPE and attention on the fused qkv, one op each way (RoPE of q and k inside)
    assert calls["attention_qkv_fwd"] == calls["attention_qkv_bwd"] == 3, calls
    # Three AdamW steps amplify per-op fp32 rounding differences a little (Adam divides by sqrt(v)),
    # so allow 10x the fp32 single-op tolerance.
    tol = {k: 10 * v for k, v in dtype_tols(torch.float32).items()}
    assert_close(tri, ref, name="losses triton vs torch", **tol)


def test_gpt_runs_minite_nn_swiglu_and_rotary_embedding(monkeypatch):
    """The GPT's MLP is minite.nn.SwiGLU and its attention rotates with minite.nn.RotaryEmbedding: editing either
    module changes what the GPT computes (the state_dict keys above stay as they were)."""
    import minite.nn as mnn
    m = tiny()
    assert all(isinstance(b.mlp, mnn.SwiGLU) and isinstance(b.attn.rotary, mnn.RotaryEmbedding) for b in m.blocks)
    idx = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    base = m(idx)[0]
    with monkeypatch.context() as mp:
        mp.setattr(mnn.SwiGLU, "forward", lambda self, x: torch.zeros_like(x))
        no_mlp = m(idx)[0]
    saved = [(b.attn.rotary.cos.clone(), b.attn.rotary.sin.clone()) for b in m.blocks]
    for b in m.blocks:  # the rotation by angle 0 everywhere: the tables the attention reads
        b.attn.rotary.cos.fill_(1.0)
        b.attn.rotary.sin.zero_()
    no_rope = m(idx)[0]
    for b, (c, s) in zip(m.blocks, saved):
        b.attn.rotary.cos.copy_(c)
        b.attn.rotary.sin.copy_(s)
    assert not torch.equal(no_mlp, base) and not torch.equal(no_rope, base)
    assert torch.equal(m(idx)[0], base)


def test_the_gpt_traces_as_one_graph_on_the_cpu():
    # issue 37: `--train.compile=default` on a CPU broke the graph at the target range check (`bool(bad.any())` in
    # minite/_validate.py: 16 "Graph break from Tensor.item()" lines); the check now runs in eager calls only
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    with use_backend("torch"):  # what a CPU run without the interpreter takes (the suite runs interpreted)
        logits, loss = torch.compile(m, backend="eager", fullgraph=True)(x, y)
        ref_logits, ref_loss = m(x, y)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    with pytest.raises(ValueError, match=r"target\[3\] = 64 is out of range \[0, 64\)"):
        m(x, torch.where(torch.arange(32).view(2, 16) == 3, 64, y))  # eager calls still check the range


# ------------------------------------------------------------------------------------------ untied LM head
def test_untied_head_has_its_own_weight_and_key():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert "lm_head.weight" not in tied.state_dict() and not hasattr(tied, "lm_head")
    keys = list(untied.state_dict())
    assert keys == list(tied.state_dict()) + ["lm_head.weight"] and untied.lm_head.weight.shape == (128, 32)
    assert untied.num_params() == tied.num_params() + 128 * 32
    idx = torch.randint(0, 65, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = untied(idx, idx)[0]
        untied.wte.weight[100:] += 1.0  # embedding rows no token uses: the untied head must not read them
        assert torch.equal(untied(idx, idx)[0], before)
        untied.lm_head.weight[3] += 1.0  # the head's own row moves logit 3 only
        after = untied(idx, idx)[0]
    changed = (after != before).any(0).any(0).nonzero().flatten().tolist()
    assert changed == [3]
    _, loss = untied(idx, idx)
    loss.backward()
    assert untied.lm_head.weight.grad.abs().sum() > 0


def test_a_tied_checkpoint_still_loads_and_an_untied_one_needs_its_head():
    tied = tiny()
    state = tied.state_dict()
    again = GPT(GPTConfig(**{k: v for k, v in tied.config.to_dict().items() if k != "tie_embeddings"}))
    again.load_state_dict(state, strict=True)  # an older config dict (no tie_embeddings field): tied, as it was
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        tiny(tie_embeddings=False).load_state_dict(state, strict=True)


@pytest.mark.parametrize("decoder", [False, True])
def test_untied_head_generates_with_the_cache_as_without(decoder):
    from minite.decoding import Decoder
    m = tiny(tie_embeddings=False).eval()
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))  # far from the embedding
    idx = torch.randint(0, 65, (2, 4), generator=torch.Generator().manual_seed(3))
    ref = m.generate(idx, 6, temperature=0, use_cache=False)
    got = m.generate(idx, 6, temperature=0, decoder=Decoder(m) if decoder else None)
    assert torch.equal(got, ref)
    tied_like = GPT(GPTConfig(**{**m.config.to_dict(), "tie_embeddings": True}))
    tied_like.load_state_dict({k: v for k, v in m.state_dict().items() if k != "lm_head.weight"})
    assert not torch.equal(tied_like.generate(idx, 6, temperature=0, use_cache=False), ref)  # the head mattered


def test_untied_head_is_refused_by_the_layouts_that_split_the_vocabulary():
    from minite.errors import ParallelError
    from minite.parallel.dims import ParallelDims
    cfg = GPTConfig(**{**TINY, "tie_embeddings": False})
    ParallelDims(dp=2).check_model(cfg)  # data parallelism replicates the head: fine
    for kw in ({"tp": 2}, {"pp": 2}, {"cp": 2}):
        with pytest.raises(ParallelError, match=f"tie_embeddings=False .* not supported with {list(kw)[0]}=2"):
            ParallelDims(**kw).check_model(cfg)
    # the launch's own check (minite.train, before any process group): the flag and the layout by name
    from minite.config import make_config
    from minite.parallel.dims import check_layout
    untied = {f"model.{k}": v for k, v in TINY.items()} | {"model.tie_embeddings": False}
    for flags in ({"parallel.tp": 2}, {"parallel.pp": 2}, {"parallel.cp": 2}, {"parallel.tp": 2, "parallel.cp": 2}):
        run = make_config("cpu", {**untied, **flags})
        layout = ", ".join(f"{k.split('.')[1]}=2" for k in flags)
        with pytest.raises(ParallelError, match=rf"^parallel layout rejected: model\.tie_embeddings=False \(an untied "
                                                rf"LM head\) is not supported with {layout}: "):
            check_layout(run.parallel, run.model, world=2 * len(flags), seq_len=16, batch_size=8)
    dp = make_config("cpu", untied)
    check_layout(dp.parallel, dp.model, world=2, seq_len=16, batch_size=8)  # dp fills the world: accepted
