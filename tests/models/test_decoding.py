"""The graph-capturable decode step (minite/decoding.py): the same tokens and logits as the ordinary cached forward,
per-sequence positions, one compiled graph for every step (what a CUDA graph needs), and clear errors."""
import copy

import pytest
import torch

from minite.decoding import Decoder, decode_step
from minite.layers.kv_cache import KVCache
from minite.models.gpt import GPT, GPTConfig
from minite.testing import assert_close


def _gpt(backend="torch", **over):
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, block_size=24, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, backend=backend)
    m = GPT(GPTConfig(**{**cfg, **over})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4)  # sharp distributions: a wrong position or a stale key changes the greedy tokens
    return m


def _prompt(B=2, T=5, seed=1):
    return torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_step_matches_the_cached_forward_at_uneven_positions(backend, device):
    # A right-padded prefill leaves the sequences at positions 3 and 7: the step rotates, stores and attends each
    # at its own position, like the ordinary path (which takes host positions).
    m = _gpt(backend).to(device)
    cache = KVCache.for_model(m, 2)
    with torch.no_grad():
        m(_prompt(T=7).to(device), kv_cache=cache, lengths=[3, 7])
        ref_cache = copy.deepcopy(cache)
        for step in range(4):
            tok = _prompt(T=1, seed=10 + step).to(device)
            want = m(tok, kv_cache=ref_cache)[0]
            got = decode_step(m, tok, cache)
            assert_close(got, want, name=f"logits, step {step}")
            assert cache.lengths.tolist() == ref_cache.lengths.tolist() == [4 + step, 8 + step]
            cache.host_lengths = list(ref_cache.host_lengths)
    for a, b in zip(cache.k + cache.v, ref_cache.k + ref_cache.v):
        assert_close(a, b, name="cache contents")


def test_generate_with_a_decoder_gives_the_same_tokens():
    # Greedy, through a crop-and-prefill (block_size 24: 5 + 40 tokens) and sampled with a seeded generator.
    m = _gpt()
    idx = _prompt()
    for kw in (dict(temperature=0), dict(temperature=0.9, top_k=7)):
        ref = m.generate(idx, 40, generator=torch.Generator().manual_seed(3), **kw)
        got = m.generate(idx, 40, generator=torch.Generator().manual_seed(3), decoder=Decoder(m), **kw)
        assert torch.equal(got, ref), kw


def test_compiled_step_is_one_graph_for_every_step():
    # fullgraph=True: no host read anywhere in the step (a position read on the host would fail the trace, or
    # recompile at every new position). 12 steps, positions 5..16: one frame, no recompile; tokens as eager's.
    from torch._dynamo.testing import CompileCounterWithBackend

    m = _gpt(moe_num_experts=0)
    idx = _prompt()
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    dec = Decoder(m, compile="default", backend=cnt)
    got = m.generate(idx, 12, temperature=0, decoder=dec)
    assert torch.equal(got, m.generate(idx, 12, temperature=0))
    assert cnt.frame_count == 1, cnt.frame_count


def test_bad_calls_are_refused_by_name():
    m = _gpt()
    cache = KVCache.for_model(m, 2)
    dec = Decoder(m)
    with pytest.raises(ValueError, match=r"tok must be \(2, 1\) integer token ids, got \(2, 2\)"):
        dec(_prompt(T=2), cache)
    with pytest.raises(ValueError, match="compile must be None"):
        Decoder(m, compile="fast")
    with torch.no_grad():
        m(_prompt(T=24), kv_cache=cache)  # the cache is full
    with pytest.raises(ValueError, match="KVCache overflow"):
        dec(_prompt(T=1), cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decoding_gives_the_eager_tokens():
    # reduce-overhead: the step captured as a CUDA graph (the Triton ops registered, the cache marked static) and
    # replayed at every position, through a crop-and-prefill; greedy tokens as the ordinary cached loop's.
    m = _gpt("triton").cuda()
    idx = _prompt().cuda()
    torch._dynamo.reset()
    got = m.generate(idx, 40, temperature=0, decoder=Decoder(m, compile="reduce-overhead"))
    assert torch.equal(got, m.generate(idx, 40, temperature=0))
