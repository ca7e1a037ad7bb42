"""minite inside Hugging Face (minite/hf.py): a transformers Llama converted to minite's GPT and back, and run in
place on minite's kernels. Tiny LlamaConfigs with random weights, built here (nothing comes from the Hub)."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="minite.hf needs transformers (pip install -e '.[hf]')")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import minite.hf as mhf  # noqa: E402
from minite import use_backend  # noqa: E402
from minite.formats import CurrentScaling, fp8_autocast  # noqa: E402
from minite.hf import MiniteLlamaAttention, MiniteLlamaMLP, from_hf_llama, swap_llama_layers, to_hf_llama  # noqa: E402
from minite.models.gpt import GPT, GPTConfig  # noqa: E402
from minite.nn import Linear, RMSNorm, RotaryEmbedding  # noqa: E402
from minite.testing import assert_close, dtype_tols  # noqa: E402

V = 61  # odd: the GPT pads it to 64
# Not the defaults (1e-6, 10000): a mapping that dropped either would still give plausible logits.
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=5e5,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {"tied": dict(tie_word_embeddings=True), "untied": dict(tie_word_embeddings=False),
            "bias": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
            "eager": dict(tie_word_embeddings=True, attn_implementation="eager"),  # HF passes float masks
            "rope_linear": dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
            "head_dim_32": dict(tie_word_embeddings=True, head_dim=32)}


def llama(device, variant="tied", *, seed=0, **over) -> LlamaForCausalLM:
    """A random tiny Llama. Weights larger than HF's init (std 0.02) so that logits and greedy tokens differ from
    one position to the next, and norm weights away from 1 so that swapping two norms shows."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **VARIANTS[variant], **over}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.5 if "embed" in name else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if "norm" in name else 0.0))
    return model.to(device).eval()


def ids(device, B=2, T=8, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


def gpt_logits(gpt, x):
    """All positions' logits (the GPT returns only the last one without targets), the V real columns."""
    return gpt(x, x)[0][..., :V]


# ------------------------------------------------------------------------------------------ from_hf_llama
@pytest.mark.triton
@pytest.mark.parametrize("variant", ["tied", "bias", "untied"])
def test_from_hf_logits_match(device, variant):
    hf, x = llama(device, variant), ids(device)
    gpt = from_hf_llama(hf).eval()
    assert gpt.config.padded_vocab_size == 64 and gpt.config.n_kv_head == 2 and gpt.config.bias == (variant == "bias")
    assert gpt.config.tie_embeddings == (variant != "untied") and hasattr(gpt, "lm_head") == (variant == "untied")
    assert torch.count_nonzero(gpt.wte.weight[V:]) == 0  # padded rows: zero, never sampled
    if variant == "untied":  # was refused (issue 37): the head's own weights, not the embedding's
        assert torch.count_nonzero(gpt.lm_head.weight[V:]) == 0 and not torch.equal(gpt.lm_head.weight, gpt.wte.weight)
    with torch.no_grad():
        assert_close(gpt_logits(gpt, x), hf(x).logits, name="GPT vs HF logits")


@pytest.mark.triton
def test_from_hf_loss_matches_without_padding(device):
    # Padded rows enter the GPT's softmax, so the loss equals HF's only with vocab_multiple=1 (then V_pad = V).
    hf, x = llama(device), ids(device)
    gpt = from_hf_llama(hf, vocab_multiple=1).eval()
    with torch.no_grad():
        _, loss = gpt(x[:, :-1], x[:, 1:])
        assert_close(loss, hf(x, labels=x).loss, name="GPT vs HF loss")


def _interleave(w, n_heads, D):  # rows of each head from rotate-half order to Meta's interleaved order
    perm = torch.arange(D).view(2, D // 2).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
    return w.view(n_heads, D, -1)[:, perm].reshape(w.shape)


def _mutate(gpt, what):
    H, KVH, D = gpt.config.n_head, gpt.config.n_kv_head, gpt.config.n_embd // gpt.config.n_head
    for blk in gpt.blocks:
        w = blk.attn.qkv.weight.data  # rows [q: H*D | k: KVH*D | v: KVH*D]
        q, k, v = w[:H * D], w[H * D:(H + KVH) * D], w[(H + KVH) * D:]
        if what == "qk_permuted":  # what an unneeded (or missing) Meta <-> HF permutation of q/k does
            q.copy_(_interleave(q.clone(), H, D))
            k.copy_(_interleave(k.clone(), KVH, D))
        elif what == "kv_heads_swapped":
            for t in (k, v):
                t.copy_(t.clone().view(KVH, D, -1).flip(0).reshape(t.shape))
        elif what == "gqa_groups":  # query head h reading kv head h % KVH instead of h // (H / KVH)
            order = torch.arange(H).view(KVH, H // KVH).t().reshape(-1)
            q.copy_(q.clone().view(H, D, -1)[order].reshape(q.shape))
            o = blk.attn.proj.weight.data
            o.copy_(o.clone().view(-1, H, D)[:, order].reshape(o.shape))
        elif what == "rope_base_default":
            blk.attn.rotary = RotaryEmbedding(D, gpt.config.block_size, base=10000.0).to(w.device)
        elif what == "norm_eps_default":
            blk.norm1.eps = blk.norm2.eps = 1e-6
        elif what == "norms_swapped":
            n1 = blk.norm1.weight.data.clone()
            blk.norm1.weight.data.copy_(blk.norm2.weight.data)
            blk.norm2.weight.data.copy_(n1)


@pytest.mark.triton
@pytest.mark.parametrize("what", ["qk_permuted", "kv_heads_swapped", "gqa_groups", "rope_base_default",
                                  "norm_eps_default", "norms_swapped"])
def test_a_wrong_mapping_fails_the_logits_check(device, what):
    # The comparison above can fail: each classic conversion bug moves the logits far outside the tolerance.
    hf, x = llama(device), ids(device)
    gpt = from_hf_llama(hf).eval()
    _mutate(gpt, what)
    with torch.no_grad(), pytest.raises(AssertionError, match="GPT vs HF logits"):
        assert_close(gpt_logits(gpt, x), hf(x).logits, name="GPT vs HF logits")


@pytest.mark.triton
@pytest.mark.parametrize("variant", ["tied", "bias", "untied"])
def test_round_trip_hf_gpt_hf_is_exact(device, variant):
    hf = llama(device, variant)
    back = to_hf_llama(from_hf_llama(hf))
    tied = variant != "untied"
    assert back.config.tie_word_embeddings == tied and (back.lm_head.weight is back.model.embed_tokens.weight) == tied
    a, b = hf.state_dict(), back.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("variant, over, field", [
    ("tied", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("tied", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("rope_linear", {}, "rope_type='linear'"),
    ("tied", {"attention_bias": True}, "attention_bias=True"),  # mlp_bias False: GPTConfig.bias is one switch
    ("head_dim_32", {}, "head_dim=32"),
])
def test_from_hf_refuses_what_does_not_map(variant, over, field):
    with pytest.raises(ValueError, match=f"minite.hf: {field} cannot be mapped"):
        from_hf_llama(llama("cpu", variant, **over))


def test_refuses_other_models():
    with pytest.raises(TypeError, match="expected a transformers LlamaForCausalLM"):
        from_hf_llama(GPT(GPTConfig(vocab_size=V, n_layer=1, n_embd=32, block_size=8)))
    with pytest.raises(TypeError, match="expected a transformers LlamaForCausalLM, got LlamaModel"):
        from_hf_llama(llama("cpu").model)


def test_to_hf_refuses_a_mixture_of_experts():
    # was: KeyError deep in the weight mapping (a Llama has one dense MLP per block)
    gpt = GPT(GPTConfig(vocab_size=V, n_layer=1, n_embd=32, n_head=2, block_size=8, moe_num_experts=4))
    with pytest.raises(ValueError, match="moe_num_experts=4"):
        to_hf_llama(gpt)


# ------------------------------------------------------------------------------------------ to_hf_llama
@pytest.mark.triton
@pytest.mark.parametrize("tie", [True, False])
def test_save_pretrained_round_trips_a_trained_gpt(device, tmp_path, tie):
    cfg = GPTConfig(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128,
                    rope_base=5e5, norm_eps=1e-5, tie_embeddings=tie)
    torch.manual_seed(0)
    gpt = GPT(cfg).to(device)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-2)
    x = ids(device, T=16)
    with use_backend("torch"):  # training is not under test: the reference ops are quicker in the interpreter
        for _ in range(4):
            opt.zero_grad()
            gpt(x[:, :-1], x[:, 1:])[1].backward()
            opt.step()
    gpt.eval()
    to_hf_llama(gpt).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).to(device).eval()
    assert loaded.config.tie_word_embeddings == tie
    with torch.no_grad():
        assert_close(loaded(x).logits, gpt_logits(gpt, x), name="HF (loaded) vs GPT logits")
    again = from_hf_llama(loaded)
    ref = gpt.state_dict()
    assert list(again.state_dict()) == list(ref)  # lm_head.weight exactly when untied
    vocab = ("wte.weight", "lm_head.weight")
    for name, t in again.state_dict().items():
        assert torch.equal(t[:V] if name in vocab else t, ref[name][:V] if name in vocab else ref[name]), name


# ------------------------------------------------------------------------------------------ swap_llama_layers
def _swapped(hf, **kw):
    """A swapped deep copy (the original stays HF's reference), after checking that no Parameter was copied."""
    model = copy.deepcopy(hf)
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    swap_llama_layers(model, **kw)
    after = dict(model.named_parameters())
    assert list(after) == list(before)  # same names: save_pretrained writes an ordinary HF checkpoint
    for n, (p, ptr) in before.items():
        assert after[n] is p and after[n].data_ptr() == ptr, n
    for layer in model.model.layers:
        assert isinstance(layer.self_attn, MiniteLlamaAttention) and isinstance(layer.mlp, MiniteLlamaMLP)
        assert isinstance(layer.input_layernorm, RMSNorm) and isinstance(layer.post_attention_layernorm, RMSNorm)
        assert all(isinstance(getattr(layer.self_attn, f"{n}_proj"), Linear) for n in "qkvo")
    return model


def assert_as_accurate_as_hf(got, hf, x, name, *, real=None, **kw):
    """DESIGN §7's rule for a different order of fp32 sums: `got` is at most 2x as far from HF's model run in fp64 as
    HF's own fp32 logits are (+1e-6). Both land ~1e-5 from it here, so a plain 1e-5 comparison of the two was a coin
    toss (1.33e-5 with transformers 5.24), while a wrong mapping is off by > 1e-2. `real`: compare those positions
    only; kw: passed to the model (an attention_mask)."""
    pick = (lambda t: t) if real is None else (lambda t: t[real])
    ref_model = copy.deepcopy(hf).double()
    ref_model.set_attn_implementation("sdpa")  # eager's fp64 mask min + score overflows to NaN in padding rows
    with torch.no_grad():
        ref = pick(ref_model(x, **kw).logits)
        err_hf = (pick(hf(x, **kw).logits).double() - ref).abs().max().item()
        err = (pick(got).double() - ref).abs().max().item()
    assert err <= 2 * err_hf + 1e-6, f"{name}: max error vs fp64 {err:.3g} > 2 x HF fp32's {err_hf:.3g}"


@pytest.mark.triton
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_swapped_logits_match(device, variant):
    hf, x = llama(device, variant), ids(device)
    sw = _swapped(hf)
    with torch.no_grad():
        got = sw(x).logits
    assert_as_accurate_as_hf(got, hf, x, "swapped vs HF logits")


@pytest.mark.triton
def test_swapped_per_sequence_positions(device):
    # Each sequence with its own positions: HF's cos/sin then differ per row, and so must the rotation. (Not a
    # mere offset per row: RoPE scores depend only on position differences, an offset would change nothing.)
    hf, x = llama(device), ids(device)
    pos = torch.arange(x.shape[1], device=device) * torch.tensor([[1], [3]], device=device)  # (B, T)
    with torch.no_grad():
        assert_close(_swapped(hf)(x, position_ids=pos).logits, hf(x, position_ids=pos).logits,
                     name="swapped vs HF logits, per-sequence positions")


def _count_calls(monkeypatch):
    calls = {}
    for name in ("rope", "attention", "decode_attention", "swiglu"):
        fn = getattr(mhf, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(mhf, name, counted)
    return calls


@pytest.mark.triton
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_same_tokens(device, monkeypatch, cache):
    hf, x = llama(device), ids(device)
    sw, gpt = _swapped(hf), from_hf_llama(hf).eval()
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    ref = hf.generate(x, **kw)
    calls = _count_calls(monkeypatch)
    out = sw.generate(x, **kw, **({"cache_implementation": "static"} if cache == "static" else {}))
    # one prefill (flash kernel) then 5 one-token steps (split-KV decode kernel over HF's cache), per layer
    assert calls == {"rope": 2 * 6 * 2, "attention": 2, "decode_attention": 5 * 2, "swiglu": 6 * 2}
    new = ref.sequences[:, x.shape[1]:]
    assert len(set(new.flatten().tolist())) > 3  # the test model does not just repeat one token
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.scores, ref.scores)):
        assert_close(a, b, name=f"scores of new token {step}")
    assert torch.equal(gpt.generate(x, 6, temperature=0), ref.sequences)


@pytest.mark.triton
def test_swapped_training_step_matches(device):
    hf, x = llama(device), ids(device)
    sw = _swapped(hf)
    for m in (hf, sw):
        m(x, labels=x).loss.backward()
    for (n, a), b in zip(hf.named_parameters(), sw.parameters()):
        assert_close(b.grad, a.grad, name=f"grad {n}")


def _fake_fp8(t):
    """Current scaling to E4M3 and back, in plain PyTorch: scale = 448 / amax, round to nearest, dequantize."""
    s = 448.0 / t.detach().abs().amax().float()
    return (t.float() * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() / s


def _truncating_fp8_gemm(a, b, *, out_dtype, accumulate, backend=None):
    """fp8_gemm as Hopper's FP8 tensor cores run it in the forward ("fast" accumulation, K <= 128 here): k32 steps
    of exact products added into an accumulator of 14 significant bits, rounded toward zero."""
    def trunc(v):
        m, e = torch.frexp(v)
        return torch.ldexp(torch.trunc(torch.ldexp(m, torch.full_like(e, 14))), e - 14)
    A, B = a.data.double(), b.data.double()
    acc = torch.zeros(A.shape[0], B.shape[1], dtype=torch.float64, device=A.device)
    for k in range(0, A.shape[1], 32):
        acc = trunc(acc + A[:, k:k + 32] @ B[k:k + 32])
    return (acc.float() * (a.scale_inv * b.scale_inv)).to(out_dtype)


@pytest.mark.triton
@pytest.mark.parametrize("gemm", ["device", "hopper_model"])
def test_swapped_fp8_autocast(device, gemm, monkeypatch):
    # Each swapped projection must compute what an FP8 linear computes on the input it receives: HF's projection
    # on fake-quantized operands (current scaling), up to the GEMM's accumulation. End to end the logits cannot be
    # compared element-wise on a GPU: Hopper's FP8 accumulator (~14 bits in the forward) flips a few fp8
    # roundings in layer 1, and 2 layers of these weights amplify them to ~1 in the logits (CUDA, 2026-11-28:
    # "235/976 elements differ; max abs err 1.24"). gemm="hopper_model" runs that accumulator on the CPU: the
    # old element-wise check fails there as it did on CUDA, the per-projection check holds.
    import minite.kernels.fp8_linear as FL
    from minite.testing import fp8_dot_tolerance

    if gemm == "hopper_model":
        monkeypatch.setattr(FL, "fp8_gemm", _truncating_fp8_gemm)
    tensor_cores = device.type == "cuda" or gemm == "hopper_model"
    hf, x = llama(device), ids(device)
    sw = _swapped(hf)
    sim = copy.deepcopy(hf)  # an independent FP8 model: HF's projections on fake-quantized operands
    for m in sim.model.modules():
        if type(m) is nn.Linear:
            m.forward = lambda inp, m=m: nn.functional.linear(_fake_fp8(inp), _fake_fp8(m.weight), m.bias)
    linears = [m for m in sw.model.modules() if isinstance(m, Linear)]
    seen = []
    for m in linears:
        m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0].detach(), out.detach())))
    with torch.no_grad():
        ref, expect = hf(x).logits, sim(x).logits
        with fp8_autocast(recipe=CurrentScaling()):
            out = sw(x).logits
    assert len(linears) == 2 * 7 and all(m.fp8_states is not None for m in linears)  # every projection ran in FP8
    assert not isinstance(sw.lm_head, Linear)  # the LM head stays in higher precision, as in minite's GPT
    assert len(seen) == len(linears)
    for m, inp, y in seen:
        a, w = _fake_fp8(inp).reshape(-1, inp.shape[-1]), _fake_fp8(m.weight).t()
        want = nn.functional.linear(a, w.t(), m.bias).view(y.shape)
        # CPU: the same products in fp32 (summation order only); tensor cores: + the unpromoted FP8 accumulator
        tol = {}
        if tensor_cores:
            tol = fp8_dot_tolerance(a, w, device="cuda", atol=1e-4, rtol=1e-5, promote_every=None)
            tol["atol"] = tol["atol"].view(y.shape)
        assert_close(y, want, name=f"FP8 projection {tuple(m.weight.shape)} vs fake-quantized", **tol)
    assert (out - ref).abs().max() > 0.05 * ref.abs().max()  # FP8 did change the numbers (E4M3: 3 mantissa bits)
    if not tensor_cores:  # the same fp32 products end to end: the same logits
        assert_close(out, expect, name="FP8 swapped vs simulated FP8 logits")
    else:  # as far from the exact logits as the simulated FP8 model is, not element for element
        ratio = ((out - ref).norm() / (expect - ref).norm()).item()
        assert 0.7 < ratio < 1.4, ratio
    if gemm == "hopper_model":  # the check that failed on CUDA fails on this model too
        with pytest.raises(AssertionError, match="elements differ"):
            assert_close(out, expect, name="FP8 swapped vs simulated FP8 logits", atol=5e-2, rtol=5e-2)


@pytest.mark.triton
def test_swapped_bf16_error_within_hf_own(device):
    # In bf16 the swapped model may err against the fp32 model by at most ~2x what HF's own bf16 run errs
    # (FlagAttention's rule, DESIGN §7), plus the bf16 tolerance.
    hf, x = llama(device), ids(device)
    hb = copy.deepcopy(hf).to(torch.bfloat16)
    sb = _swapped(hb)
    with torch.no_grad():
        ref = hf(x).logits
        e_hf = (hb(x).logits.float() - ref).abs().max()
        e_sw = (sb(x).logits.float() - ref).abs().max()
    assert e_sw <= 2 * e_hf + dtype_tols(torch.bfloat16)["atol"], (e_sw, e_hf)


PADDINGS = {"left": [[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], "right": [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]}


@pytest.mark.triton
@pytest.mark.parametrize("variant", ["tied", "eager"])  # HF's masks: boolean (SDPA) and additive floats (eager)
@pytest.mark.parametrize("padding", list(PADDINGS))
def test_swapped_padded_batch_matches_hf(device, variant, padding):
    # was: refused. Each sequence's real tokens attend to its real tokens only, as in HF; padding positions'
    # logits are HF's own garbage and not compared.
    hf, x = llama(device, variant), ids(device)
    mask = torch.tensor(PADDINGS[padding], device=device)
    with torch.no_grad():
        out, ref = _swapped(hf)(x, attention_mask=mask).logits, hf(x, attention_mask=mask).logits
        plain = hf(x).logits  # what ignoring the padding would give
    real = mask.bool()
    if padding != "right":  # padding before real tokens changes them (causal: padding after them cannot)
        assert (plain - ref)[real].abs().max() > 0.1
    # DESIGN §7's rule (was a plain 1e-5 comparison: 2.1e-5 on one element of 854, left padding, 2026-11-28)
    assert_as_accurate_as_hf(out, hf, x, f"swapped vs HF logits of the real tokens, {padding} padding", real=real,
                             attention_mask=mask)


@pytest.mark.triton
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_swapped_greedy_generate_on_a_left_padded_batch(device, cache):
    hf, x = llama(device), ids(device)
    mask = torch.tensor(PADDINGS["left"], device=device)  # as a tokenizer with padding_side="left" makes it
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
              **({"cache_implementation": "static"} if cache == "static" else {}))
    ref = hf.generate(x, **kw)
    assert torch.equal(_swapped(hf).generate(x, **kw), ref)
    assert not torch.equal(ref[0], hf.generate(x, **{**kw, "attention_mask": torch.ones_like(mask)})[0])


@pytest.mark.triton
def test_swapped_refuses_a_mask_that_is_not_causal_padding(device):
    hf, x = llama(device), ids(device)
    T = x.shape[1]
    i = torch.arange(T, device=device)
    window = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3))[None, None].expand(2, 1, T, T)  # 3 keys
    with pytest.raises(NotImplementedError, match="neither causal attention nor causal attention over a padded "
                                                  "batch"):
        _swapped(hf)(x, attention_mask=window)


@pytest.mark.parametrize("over, field", [({"hidden_act": "gelu"}, "hidden_act='gelu'"),
                                         ({"attention_dropout": 0.1}, "attention_dropout=0.1")])
def test_swap_refuses_what_it_cannot_run(over, field):
    with pytest.raises(ValueError, match=f"minite.hf: {field} cannot be mapped"):
        swap_llama_layers(llama("cpu", **over))


def test_swap_refuses_foreign_linears():
    class LoRA(nn.Linear):
        pass
    hf = llama("cpu")
    q = hf.model.layers[1].self_attn.q_proj
    hf.model.layers[1].self_attn.q_proj = LoRA(q.in_features, q.out_features, bias=False)
    with pytest.raises(ValueError, match="layers.1.self_attn.q_proj type='LoRA' cannot be mapped"):
        swap_llama_layers(hf)


# ------------------------------------------------------------------------------------------ families, switches
def family(name, device, *, seed=0, **over):
    """A random tiny model of a Llama-shaped family: Llama untied, Mistral with a sliding window longer than the
    test's sequences (T + new tokens <= 16), Qwen2 (q/k/v biases, untied by default)."""
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[name]
    extra = {"llama": dict(tie_word_embeddings=False), "mistral": dict(sliding_window=16, tie_word_embeddings=False),
             "qwen2": {}}[name]
    torch.manual_seed(seed)
    model = cls(cls.config_class(**{**TINY, **extra, **over}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            std = 0.5 if "embed" in n else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if "norm" in n else 0.0))
    return model.to(device).eval()


FAMILY_NAMES = ["llama", "mistral", "qwen2"]


@pytest.mark.triton
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_apply_minite_to_each_family(device, name):
    hf, x = family(name, device), ids(device)
    if name == "qwen2":  # the biases must be there (and nonzero) to be mapped
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0 and hf.model.layers[0].mlp.up_proj.bias is None
    sw = mhf.apply_minite(copy.deepcopy(hf))
    assert all(isinstance(layer.self_attn, MiniteLlamaAttention) and isinstance(layer.mlp, MiniteLlamaMLP)
               for layer in sw.model.layers)
    assert [n for n, _ in sw.named_parameters()] == [n for n, _ in hf.named_parameters()]
    with torch.no_grad():
        got = sw(x).logits
    assert_as_accurate_as_hf(got, hf, x, f"{name}: swapped vs HF logits")
    kw = dict(max_new_tokens=4, do_sample=False)
    ref = hf.generate(x, **kw)
    assert len(set(ref[:, x.shape[1]:].flatten().tolist())) > 2 and torch.equal(sw.generate(x, **kw), ref)
    with torch.no_grad():  # the loss (minite's cross-entropy) equals HF's
        assert_close(sw(x, labels=x).loss, hf(x, labels=x).loss, name=f"{name}: loss")


_OP_OF = {"rms_norm": "rmsnorm", "rope": "rope", "swiglu": "swiglu", "attention": "attention",
          "cross_entropy": "cross_entropy"}


def _count_ops(monkeypatch):
    calls = dict.fromkeys(_OP_OF.values(), 0)
    for name in ("rope", "attention", "swiglu", "cross_entropy"):
        fn = getattr(mhf, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(mhf, name, counted)
    fwd = RMSNorm.forward

    def norm(self, *a, **k):
        calls["rmsnorm"] += 1
        return fwd(self, *a, **k)
    monkeypatch.setattr(RMSNorm, "forward", norm)
    return calls


@pytest.mark.triton
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("off", list(_OP_OF))
def test_each_switch_switches(device, monkeypatch, name, off):
    # One switch off: its op is HF's (minite's never runs), every other op is minite's, and the model still
    # computes HF's logits and loss (so the HF fallback of that op is wired right).
    hf, x = family(name, device), ids(device)
    calls = _count_ops(monkeypatch)
    sw = mhf.apply_minite(copy.deepcopy(hf), **{off: False})
    with torch.no_grad():
        out = sw(x, labels=x)
    assert calls[_OP_OF[off]] == 0, calls
    assert all(n > 0 for op, n in calls.items() if op != _OP_OF[off]), calls
    assert_as_accurate_as_hf(out.logits, hf, x, f"{name} with {off}=False: logits")
    with torch.no_grad():
        assert_close(out.loss, hf(x, labels=x).loss, name=f"{name} with {off}=False: loss")


def test_switches_refuse_unknown_names():
    with pytest.raises(TypeError, match="unknown switch 'rmsnorm'"):
        mhf.apply_minite(llama("cpu"), rmsnorm=False)
    with pytest.raises(TypeError, match="apply_minite_to_mistral got a LlamaForCausalLM"):
        mhf.apply_minite_to_mistral(llama("cpu"))


@pytest.mark.triton
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_apply_to_the_class_before_from_pretrained(device, tmp_path, monkeypatch, name):
    hf, x = family(name, device), ids(device)
    hf.save_pretrained(tmp_path)
    cls = type(hf)
    getattr(mhf, f"apply_minite_to_{name}")(rope=False)  # Liger's shape: patch the classes, then load
    try:
        loaded = cls.from_pretrained(tmp_path).to(device).eval()
        fresh = cls(hf.config)
    finally:
        mhf.revert_minite(name)
    for m in (loaded, fresh):
        attn = m.model.layers[0].self_attn
        assert isinstance(attn, MiniteLlamaAttention) and not attn.minite_rope and attn.minite_attention
        assert isinstance(m.model.norm, RMSNorm) and isinstance(m.model.layers[1].mlp, MiniteLlamaMLP)
    with torch.no_grad():
        got = loaded(x).logits
    assert_as_accurate_as_hf(got, hf, x, f"{name}: patched class, from_pretrained: logits")
    calls = _count_ops(monkeypatch)  # a model built under the patch keeps minite's cross-entropy as its loss
    with torch.no_grad():
        assert_close(loaded(x, labels=x).loss, hf(x, labels=x).loss, name="loss")
    assert calls["cross_entropy"] == 1
    after = cls(hf.config)  # reverted: plain HF again
    assert not isinstance(after.model.layers[0].self_attn, MiniteLlamaAttention)
    assert not isinstance(after.model.norm, RMSNorm) and not hasattr(after, "_loss_function")


@pytest.mark.triton
def test_sliding_window_runs_inside_it_and_is_refused_beyond(device):
    x = ids(device)  # T = 8
    hf = family("mistral", device, sliding_window=8)  # every position inside the window: plain causal
    sw = mhf.apply_minite(copy.deepcopy(hf))
    with torch.no_grad():
        assert_as_accurate_as_hf(sw(x).logits, hf, x, "window = T: logits")
        short = family("mistral", device, sliding_window=4)
        with pytest.raises(NotImplementedError, match="sliding_window=4 is shorter than the sequence"):
            mhf.apply_minite(copy.deepcopy(short))(x)
        assert (short(x).logits - hf(x).logits).abs().max() > 0.1  # the window does change HF's result there
    with pytest.raises(NotImplementedError, match="sliding_window=8 is shorter than the sequence \\(9 positions"):
        sw.generate(x, max_new_tokens=2, do_sample=False)  # the first new token's step sees 9 positions


@pytest.mark.triton
def test_from_hf_converts_a_mistral_and_refuses_qwen2_and_a_window(device):
    hf, x = family("mistral", device, sliding_window=None), ids(device)
    gpt = from_hf_llama(hf).eval()
    with torch.no_grad():
        assert_close(gpt_logits(gpt, x), hf(x).logits, name="GPT vs HF Mistral logits")
    with pytest.raises(ValueError, match="sliding_window=16 cannot be mapped"):
        from_hf_llama(family("mistral", "cpu"))
    with pytest.raises(ValueError, match="model_type='qwen2' cannot be mapped"):
        from_hf_llama(family("qwen2", "cpu"))
