"""KV cache and split-KV decode (chapter 08): cached logits equal full recomputation at every step (equal and
different prompt lengths, torch and Triton backends), the decode kernel and the LSE merge against references,
the split heuristic and the one-pass threshold, overflow errors, and generation with and without the cache."""
import pytest
import torch

from minite.kernels import decode as decode_mod
from minite.kernels.attention import attention
from minite.kernels.decode import (
    SINGLE_PASS_MAX_LEN,
    decode_attention,
    decode_attention_ref,
    lse_merge_ref,
    num_splits_heuristic,
)
from minite.layers.kv_cache import KVCache, cache_bytes_per_token
from minite.models.gpt import GPT, GPTConfig
from minite.testing import assert_close, dtype_tols

pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(*shape, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _model(backend, device, **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, block_size=24, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, backend=backend)
    return GPT(GPTConfig(**{**cfg, **kw})).to(device).eval()


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_logits_equal_recomputation_every_step(device, backend):
    m = _model(backend, device)
    idx = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    cache = KVCache.for_model(m, 2)
    with torch.no_grad():
        logits, _ = m(idx, kv_cache=cache)  # prefill
        for step in range(6):
            full, _ = m(idx)  # (B, 1, V): the whole context recomputed
            assert_close(logits, full, name=f"{backend} step {step}", atol=1e-4, rtol=1e-4)
            nxt = full[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            idx = torch.cat([idx, nxt], 1)
            logits, _ = m(nxt, kv_cache=cache)  # one token, written at position T + step
    assert cache.host_lengths == [11, 11] and cache.lengths.tolist() == [11, 11]


@pytest.mark.parametrize("backend", BACKENDS)
def test_different_prompt_lengths_in_one_batch(device, backend):
    # Prompts of 3, 7 and 1 tokens, right-padded to 7 for one prefill; then 4 decode steps where each sequence
    # writes at its own position. Every step's logits equal the sequence run alone without a cache.
    m = _model(backend, device)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (3, 7, 1)]
    padded = torch.tensor([p + [0] * (7 - len(p)) for p in prompts], device=device)  # (3, 7)
    cache = KVCache.for_model(m, 3)
    with torch.no_grad():
        logits, _ = m(padded, kv_cache=cache, lengths=[len(p) for p in prompts])  # (3, 1, V)
        for step in range(4):
            for b, p in enumerate(prompts):
                alone, _ = m(torch.tensor([p], device=device))  # (1, 1, V)
                assert_close(logits[b], alone[0], name=f"{backend} seq {b} step {step}", atol=1e-4, rtol=1e-4)
            nxt = logits[:, -1].argmax(-1)  # (3,)
            for b in range(3):
                prompts[b].append(int(nxt[b]))
            logits, _ = m(nxt[:, None], kv_cache=cache)
    assert cache.host_lengths == [7, 11, 5]


def test_overflow_and_bad_writes_raise_clear_errors():
    c = KVCache(1, 2, 2, 8, 16)
    c.write(0, torch.zeros(2, 2, 6, 16), torch.zeros(2, 2, 6, 16))
    c.advance(6)
    with pytest.raises(ValueError, match=r"overflow: appending 3 token\(s\) .* holding 6 needs 9 .* max_len=8"):
        c.write(0, torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16))
    with pytest.raises(ValueError, match="does not fit cache"):
        c.write(0, torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16))
    with pytest.raises(ValueError, match="max_len must be positive"):
        KVCache(1, 1, 1, 0, 16)
    m = _model("torch", "cpu")
    cache = KVCache.for_model(m, 1, max_len=4)
    with pytest.raises(ValueError, match="KVCache overflow"):
        m(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
    assert cache_bytes_per_token(32, 8, 128, 2) == 131072  # Llama-3-8B: 128 KiB per token in bf16


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_generate_with_cache_equals_without(device, use_triton):
    m = _model(use_triton, device, block_size=8, n_layer=1)
    idx = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(3)).to(device)
    a = m.generate(idx, 7, temperature=0, use_cache=True)  # runs past block_size: crop + prefill again
    b = m.generate(idx, 7, temperature=0, use_cache=False)
    assert torch.equal(a, b)



@pytest.mark.parametrize("use_triton", BACKENDS)
def test_generate_under_bf16_autocast_with_cache_equals_without(device, use_triton):
    # Training samples under bf16 autocast: the weights (and so the cache KVCache.for_model allocates) are fp32
    # while q/k/v come out of the projections in bf16. The cache must follow k's dtype, or attention gets
    # q bf16 with k/v fp32 ("q, k, v dtypes differ"); bf16 -> fp32 -> bf16 is exact, so the tokens are equal.
    m = _model(use_triton, device, block_size=8, n_layer=1, n_embd=32, n_head=2, n_kv_head=1)
    idx = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        a = m.generate(idx, 6, temperature=0, use_cache=True)  # prefill, decode steps, crop + prefill again
        b = m.generate(idx, 6, temperature=0, use_cache=False)
    assert torch.equal(a, b)
    cache = KVCache.for_model(m, 2)
    assert cache.k[0].dtype == torch.float32
    k = _randn(2, 1, 3, 16, seed=1, dtype=torch.bfloat16, device=device)
    cache.write(0, k, k)
    assert cache.k[0].dtype == cache.v[0].dtype == torch.bfloat16 and torch.equal(cache.k[0][:, :, :3], k)

# ------------------------------------------------------------------------------------------ decode kernel
@pytest.mark.triton
@pytest.mark.parametrize("H,KVH,D,dtype,splits", [(4, 4, 16, torch.float32, None), (8, 2, 64, torch.float16, 3),
                                                  (4, 1, 32, torch.float32, 7), (6, 2, 128, torch.float16, None),
                                                  (4, 2, 24, torch.bfloat16, 2), (4, 2, 24, torch.bfloat16, 1),
                                                  (3, 3, 40, torch.float16, 1)])
def test_decode_kernel_matches_reference(device, H, KVH, D, dtype, splits):
    B, T_max = 4, 150
    q = _randn(B, H, D, seed=1, dtype=dtype, device=device)
    k, v = _randn(B, KVH, T_max, D, seed=2, dtype=dtype, device=device), _randn(B, KVH, T_max, D, seed=3,
                                                                                 dtype=dtype, device=device)
    lengths = torch.tensor([150, 1, 0, 67], device=device)  # full, one key, empty, mid-block
    got = decode_attention(q, k, v, lengths, num_splits=splits, backend="triton")
    want = decode_attention_ref(q.double(), k.double(), v.double(), lengths)
    assert not torch.isnan(got).any() and torch.all(got[2] == 0)
    assert_close(got, want.to(dtype), name=f"decode H{H}/{KVH} D{D} S={splits}", **dtype_tols(dtype))
    # and against chapter 07's attention with one query (T_q = 1 sees every key, bottom-right causal)
    for b in (0, 3):
        n = int(lengths[b])
        full = attention(q[b:b + 1, :, None], k[b:b + 1, :, :n], v[b:b + 1, :, :n], backend="torch")[:, :, 0]
        assert_close(got[b:b + 1], full, name=f"decode vs attention seq {b}", **dtype_tols(dtype))


@pytest.mark.triton
def test_lse_merge_of_chunks_equals_full_attention(device):
    # Chapter 07's LSE makes partial results mergeable: attention over 4 key chunks, merged, is attention over all.
    q = _randn(2, 4, 3, 32, seed=1, device=device)
    k, v = _randn(2, 2, 100, 32, seed=2, device=device), _randn(2, 2, 100, 32, seed=3, device=device)
    parts = [attention(q, k[:, :, a:a + 25], v[:, :, a:a + 25], causal=False, return_lse=True, backend="triton")
             for a in range(0, 100, 25)]
    o, lse = lse_merge_ref(torch.stack([p[0] for p in parts], -2), torch.stack([p[1] for p in parts], -1))
    o_full, lse_full = attention(q, k, v, causal=False, return_lse=True, backend="triton")
    assert_close(o, o_full, name="merged out")
    assert_close(lse, lse_full, name="merged lse")


@pytest.mark.triton
def test_one_pass_up_to_the_threshold_split_past_it(device, monkeypatch):
    # num_splits=None: one pass (one kernel, which writes the output itself: no merge) while max_len is at most
    # SINGLE_PASS_MAX_LEN keys, the split-KV kernels (partials + merge) past it. Both equal the reference.
    launched = []
    real = decode_mod.launchable
    monkeypatch.setattr(decode_mod, "launchable", lambda k: launched.append(k.fn.__name__) or real(k))
    B, H, KVH, D, T_max = 1, 4, 2, 16, SINGLE_PASS_MAX_LEN + 100
    q = _randn(B, H, D, seed=1, device=device)
    k, v = _randn(B, KVH, T_max, D, seed=2, device=device), _randn(B, KVH, T_max, D, seed=3, device=device)
    for n, max_len, kernels in ((300, 300, ["_decode_partial_kernel"]),
                                (300, SINGLE_PASS_MAX_LEN, ["_decode_partial_kernel"]),
                                (T_max - 3, None, ["_decode_partial_kernel", "_lse_merge_kernel"])):
        launched.clear()
        lengths = torch.tensor([n], device=device)
        got = decode_attention(q, k, v, lengths, max_len=max_len, backend="triton")
        assert launched == kernels, (n, max_len, launched)
        assert_close(got, decode_attention_ref(q, k, v, lengths), name=f"L={n} max_len={max_len}")


def test_split_heuristic():
    assert num_splits_heuristic(264, 132, 64) == 1  # B * KVH fills the GPU: no split
    s = num_splits_heuristic(8, 132, 256)  # batch 1, 8 kv heads, 16k tokens: split
    assert s > 1 and 8 * s <= 132 * 2
    assert num_splits_heuristic(8, 132, 2) <= 2  # never more splits than key blocks
    assert num_splits_heuristic(1, 4, 100) == 4
