"""Issue 25, item 2: bad inputs to decode, attention, the KV cache, LoRA, generate and cross-entropy.

Every bad input gets a clear error naming the argument and its value, on both backends, or the answer torch
gives. Never a crash deep in a kernel, a silent NaN, or an out-of-bounds read. Each test failed on the code as
it was found (the note per test says what it did then).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from minite.kernels.attention import attention
from minite.kernels.cross_entropy import cross_entropy
from minite.kernels.decode import decode_attention, decode_attention_ref, decode_attention_triton
from minite.kernels.lora import lora_linear
from minite.layers.kv_cache import KVCache
from minite.layers.lora import (
    LoRAConfig,
    LoRAError,
    LoRALinear,
    apply_lora,
    load_lora,
    lora_layers,
    lora_state_dict,
    merge_lora,
    unmerge_lora,
)
from minite.models.gpt import GPT, GPTConfig

BOTH = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
NAN, INF = float("nan"), float("inf")
pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(*shape, seed=0, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _same(a, b, atol=1e-5):
    """Equal up to atol, NaN where the other is NaN, inf where the other is inf (of the same sign)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return torch.allclose(a, b, atol=atol, rtol=1e-5, equal_nan=True)


# ------------------------------------------------------------------------------------------ decode_attention
def _decode_inputs(device, T_max=8):
    q = _randn(2, 4, 16, seed=1, device=device)  # (B, H, D)
    return q, _randn(2, 2, T_max, 16, seed=2, device=device), _randn(2, 2, T_max, 16, seed=3, device=device)


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("lengths,err", [([3, 12], "lengths.*12.*T_max=8"), ([-1, 3], "lengths.*-1"),
                                         ([1.5, 3.0], "lengths.*float"), ([True, True], "lengths.*bool")])
def test_decode_lengths_outside_the_cache_are_refused(backend, device, lengths, err):
    # was: [3, 12] read past the cache on the Triton path (NaN, or 1.4e37); -1 and 1.5 were accepted
    q, k, v = _decode_inputs(device)
    with pytest.raises((ValueError, TypeError), match=err):
        decode_attention(q, k, v, torch.tensor(lengths), backend=backend)


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("kw,err", [(dict(num_splits=-3), "num_splits.*-3"), (dict(num_splits=0), "num_splits.*0"),
                                    (dict(num_splits=2.0), "num_splits.*float"), (dict(max_len=2), "max_len=2.*5"),
                                    (dict(max_len=9), "max_len.*9"), (dict(scale=NAN), "scale.*nan")])
def test_decode_options_are_checked(backend, device, kw, err):
    # was: all accepted; max_len=2 < lengths silently dropped keys 2..4 on the Triton path
    q, k, v = _decode_inputs(device)
    with pytest.raises((ValueError, TypeError), match=err):
        decode_attention(q, k, v, torch.tensor([3, 5]), backend=backend, **kw)
    got = decode_attention(q, k, v, torch.tensor([3, 5]), backend=backend, num_splits=2, max_len=5)
    assert _same(got, decode_attention_ref(q, k, v, torch.tensor([3, 5])))


@pytest.mark.triton
def test_decode_kernel_never_reads_past_the_cache(device):
    # The launcher has no checks (torch.compile and CUDA graphs call it directly, and a CUDA lengths tensor is not
    # checked: a host sync per step): a length past T_max is clamped in the kernel, and a max_len below a length
    # costs parallelism, not keys. was: NaN (read past the buffer), and keys past max_len dropped.
    T_max = 8
    buf = torch.full((2 * 2 * T_max * 16 + 4096,), NAN, device=device)  # NaN right after the cache
    k = buf[: 2 * 2 * T_max * 16].view(2, 2, T_max, 16)
    k.copy_(_randn(2, 2, T_max, 16, seed=2, device=device))
    q, _, v = _decode_inputs(device)
    v = v.clone()
    got = decode_attention_triton(q, k, v, torch.tensor([3, 40], device=device))
    assert _same(got, decode_attention_ref(q, k, v, torch.tensor([3, 8])))
    q, k, v = _decode_inputs(device, T_max=150)  # three key blocks of 64
    lengths = torch.tensor([3, 150], device=device)
    got = decode_attention_triton(q, k, v, lengths, None, 4, 10)  # max_len 10 < 150: one split of one block
    assert _same(got, decode_attention_ref(q, k, v, lengths))


@pytest.mark.parametrize("backend", BOTH)
def test_decode_ignores_nan_past_each_length(backend, device):
    # A reused cache may hold anything past a sequence's length. was: NaN on the torch path (0 * NaN in p @ v)
    q, k, v = _decode_inputs(device)
    lengths = torch.tensor([3, 5])
    want = decode_attention_ref(q, k, v, lengths)
    k, v = k.clone(), v.clone()
    k[0, :, 3:], v[0, :, 3:], k[1, :, 5:], v[1, :, 5:] = NAN, NAN, INF, NAN
    got = decode_attention(q, k, v, lengths, backend=backend)
    assert torch.isfinite(got).all() and _same(got, want)


# --------------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("scale,err", [(NAN, ValueError), (INF, ValueError), (0.0, ValueError),
                                       (-0.5, ValueError), ("0.5", TypeError)])
def test_attention_scale_must_be_finite_and_positive(backend, device, scale, err):
    # was: scale=nan gave zeros on the torch path and NaN on the Triton path
    q = _randn(1, 2, 8, 16, device=device)
    with pytest.raises(err, match="scale"):
        attention(q, q, q, scale=scale, backend=backend)


@pytest.mark.parametrize("backend", BOTH)
def test_zero_head_dim_is_refused(backend, device):
    # was: ZeroDivisionError (1 / sqrt(D)) on both paths
    q = torch.empty(1, 2, 4, 0, device=device)
    with pytest.raises(ValueError, match="head dim D=0"):
        attention(q, q, q, backend=backend)
    with pytest.raises(ValueError, match="head dim D=0"):
        decode_attention(q[:, :, 0], q, q, torch.tensor([1]), backend=backend)


# The Triton kernel cleans the tiles of its diagonal key blocks only (minite/kernels/attention.py, _fwd_block).
@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("where,bad", [("k", NAN), ("v", NAN), ("k", INF), ("v", -INF), ("kv", NAN)])
@pytest.mark.parametrize("T", [80, 200])  # 200: two query tiles of 128, key 70 in a full tile of the second
def test_nan_in_masked_future_keys_does_not_leak(backend, device, where, bad, T):
    # Causal attention: query i never sees key 70, so whatever key 70 holds cannot change rows 0..69, their
    # values or their dq. was: every row NaN on both paths (0 * NaN in P V, and in dS K of the backward).
    p = 70
    q, k, v = (_randn(1, 2, T, 16, seed=s, device=device) for s in (1, 2, 3))
    kb, vb = k.clone(), v.clone()
    if "k" in where:
        kb[:, :, p, 3] = bad
    if "v" in where:
        vb[:, :, p, 5] = bad
    grads = []
    for kk, vv in ((k, v), (kb, vb)):
        qq = q.clone().requires_grad_()
        o = attention(qq, kk, vv, causal=True, backend=backend)
        o[:, :, :p].sum().backward()
        grads.append((o.detach(), qq.grad))
    (o_ok, dq_ok), (o_bad, dq_bad) = grads
    assert torch.isfinite(o_bad[:, :, :p]).all() and _same(o_bad[:, :, :p], o_ok[:, :, :p])
    if math.isnan(bad):  # rows that do see a NaN key or value: NaN, as torch says (inf: IEEE, backend-dependent)
        assert torch.isnan(o_bad[:, :, p:]).any(-1).all()
    assert torch.isfinite(dq_bad[:, :, :p]).all() and _same(dq_bad[:, :, :p], dq_ok[:, :, :p], atol=1e-4)


# ------------------------------------------------------------------------------------------------ cross-entropy
@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_with_inf_logits_matches_torch(backend, device):
    # was: +inf gave loss inf on the torch path, where F.cross_entropy (and the Triton path) give NaN
    x = _randn(5, 10, seed=4, device=device)
    x[0, 2] = INF  # +inf away from the target
    x[1, 3] = INF  # +inf at the target
    x[2, 4] = -INF  # -inf at the target: loss +inf
    x[3] = -INF  # a row of -inf: NaN
    t = torch.tensor([1, 3, 4, 0, 9], device=device)
    for reduction in ("none", "sum"):
        xr, xt = x.clone().requires_grad_(), x.cpu().clone().requires_grad_()
        got, want = cross_entropy(xr, t, reduction=reduction, backend=backend), F.cross_entropy(xt, t.cpu(),
                                                                                                reduction=reduction)
        (got.sum() if reduction == "none" else got).backward()
        (want.sum() if reduction == "none" else want).backward()
        assert _same(got, want), (reduction, got, want)
        assert _same(xr.grad, xt.grad)  # NaN where torch has NaN, the finite row's softmax - one_hot
    got = cross_entropy(x[:, :], t, reduction="none", label_smoothing=0.1, backend=backend)
    want = F.cross_entropy(x.cpu(), t.cpu(), reduction="none", label_smoothing=0.1)
    assert _same(got, want), (got, want)


# --------------------------------------------------------------------------------------------------- KV cache
def test_kv_cache_failed_advance_changes_nothing():
    # was: advance(3) past max_len raised, leaving host lengths [5] and device lengths [2]
    c = KVCache(1, 1, 1, 4, 8)
    c.advance(2)
    with pytest.raises(ValueError, match="overflow"):
        c.advance(3)
    with pytest.raises(ValueError, match="overflow"):
        c.advance([3])
    assert c.host_lengths == [2] and c.lengths.tolist() == [2]


@pytest.mark.parametrize("n,err", [(1.7, "n.*float 1.7"), (True, "n.*bool True"), ("2", "n.*str '2'"),
                                   ([1.5, 1], r"n\[0\].*float 1.5"), ([1], "2 counts.*1"), ([1, -1], "n.*-1")])
def test_kv_cache_advance_takes_ints(n, err):
    # was: advance(1.7) raised "'float' object is not iterable"; [1.5, 1] advanced by 1
    c = KVCache(1, 2, 1, 4, 8)
    with pytest.raises((TypeError, ValueError), match=err):
        c.advance(n)
    assert c.host_lengths == [0, 0] and c.lengths.tolist() == [0, 0]
    c.advance(torch.tensor([1, 2]))  # a tensor of counts is fine
    assert c.host_lengths == [1, 2] and c.lengths.tolist() == [1, 2]


def test_kv_cache_write_checks_layer_and_dtype():
    # was: layer=-1 wrote the last layer, layer=2 an IndexError, and int64 k/v turned the cache into int64
    c = KVCache(2, 1, 1, 4, 8)
    k = torch.ones(1, 1, 1, 8)
    for layer in (-1, 2, 1.0):
        with pytest.raises((ValueError, TypeError), match=f"layer.*{layer}"):
            c.write(layer, k, k)
    with pytest.raises(ValueError, match="floating-point.*int64"):
        c.write(0, k.long(), k.long())
    with pytest.raises(ValueError, match="v .* does not match k"):
        c.write(0, k, torch.ones(1, 1, 2, 8))
    assert c.k[0].dtype == torch.float32 and not c.k[1].any()


# ----------------------------------------------------------------------------------------------- generate
def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16, backend="torch"))


@pytest.mark.parametrize("args,kw,err", [((-1,), {}, "max_new_tokens.*-1"), ((1.5,), {}, "max_new_tokens.*1.5"),
                                         ((2,), dict(temperature=NAN), "temperature.*nan"),
                                         ((2,), dict(top_k=0), "top_k.*0")])
def test_generate_options_are_checked(args, kw, err):
    # was: generate(-1) returned the prompt, temperature=nan sampled from NaN probabilities
    m = _gpt()
    with pytest.raises((ValueError, TypeError), match=err):
        m.generate(torch.tensor([[1, 2]]), *args, **kw)
    assert m.generate(torch.tensor([[1, 2]]), 0).tolist() == [[1, 2]]


@pytest.mark.parametrize("ids,err", [([[1, 10]], "idx.*10.*vocab_size=10"), ([[-1, 2]], "idx.*-1"),
                                     ([[1.0, 2.0]], "idx.*float")])
def test_token_ids_outside_the_vocabulary_are_refused(ids, err):
    # was: id 10 (a padded row of the embedding, never trained) was accepted by forward and generate
    m = _gpt()
    with pytest.raises((ValueError, TypeError), match=err):
        m.generate(torch.tensor(ids), 2)
    with pytest.raises((ValueError, TypeError), match=err):
        m(torch.tensor(ids))


# ----------------------------------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("kw,err", [(dict(alpha=-1.0), "alpha.*-1"), (dict(alpha=NAN), "alpha.*nan"),
                                    (dict(r=0), "r.*0"), (dict(r=2.0), "r.*float"), (dict(dropout=1.0), "dropout")])
def test_lora_linear_hyperparameters_are_checked(kw, err):
    # was: alpha=-1 and nan accepted; r=0 raised ZeroDivisionError
    with pytest.raises((ValueError, TypeError), match=err):
        LoRALinear(4, 4, **kw)


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("scaling", [NAN, INF, "1"])
def test_lora_linear_scaling_must_be_finite(backend, device, scaling):
    # was: scaling=nan accepted (NaN output)
    x, w, a, b = _randn(3, 8, device=device), _randn(4, 8, device=device), _randn(2, 8, device=device), \
        _randn(4, 2, device=device)
    with pytest.raises((ValueError, TypeError), match="scaling"):
        lora_linear(x, w, a, b, scaling=scaling, backend=backend)


def _lora_gpt():
    m = _gpt()
    apply_lora(m, LoRAConfig(r=2, alpha=4.0))
    for layer in lora_layers(m).values():
        with torch.no_grad():
            layer.lora_B.normal_(generator=torch.Generator().manual_seed(5))
    return m


def test_load_lora_into_a_merged_model_is_refused():
    # was: accepted; unmerge_lora then subtracted the new adapter from weights that held the old one (|dW| 7.4)
    m = _lora_gpt()
    w0 = {n: layer.weight.detach().clone() for n, layer in lora_layers(m).items()}
    other = {k: 3 * v + 1 for k, v in lora_state_dict(m).items()}
    merge_lora(m)
    with pytest.raises(LoRAError, match="merged.*unmerge_lora"):
        load_lora(m, other)
    unmerge_lora(m)
    for n, layer in lora_layers(m).items():
        assert torch.allclose(layer.weight, w0[n], atol=1e-6), n


def test_merged_model_runs_forward_with_grad_enabled():
    # PEFT: after a merge the adapter is skipped. was: RuntimeError unless under torch.no_grad()
    m = _lora_gpt()
    idx = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = m(idx)[0]
    merge_lora(m)
    assert torch.is_grad_enabled()
    logits, loss = m(idx, idx)
    assert torch.allclose(logits[:, -1:], want, atol=1e-5) and math.isfinite(loss.item())
    with pytest.raises(LoRAError, match=r"merged LoRA layer.*unmerge_lora\(model\) first"):  # issue 36: was torch's
        loss.backward()                                        # "does not require grad"; nothing trains until unmerged
