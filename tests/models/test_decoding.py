"""The graph-capturable decode step (minite/decoding.py): the same tokens and logits as the ordinary cached forward,
per-sequence positions, one compiled graph for every step (what a CUDA graph needs), the kernels Inductor makes of
it, and clear errors."""
import copy
import re

import pytest
import torch

import minite
from minite.decoding import Decoder, decode_step
from minite.kernels._common import OPS, calling_ops
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


@pytest.mark.parametrize("backend,split_kv", [("torch", False), pytest.param("triton", False, marks=pytest.mark.triton),
                                              pytest.param("triton", True, marks=pytest.mark.triton)])
def test_step_matches_the_cached_forward_at_uneven_positions(backend, split_kv, device):
    # A right-padded prefill leaves the sequences at positions 3 and 7: the step rotates, stores and attends each
    # at its own position, like the ordinary path (which takes host positions). Triton: the one-pass decode kernel,
    # and the split-KV one (a cache past SINGLE_PASS_MAX_LEN, one kv head: split on the CPU's 4 pretend SMs).
    m = _gpt(backend, **(dict(block_size=600, n_kv_head=1) if split_kv else {})).to(device)
    cache = KVCache.for_model(m, 2)
    with torch.no_grad():
        m(_prompt(T=7).to(device), kv_cache=cache, lengths=[3, 7])
        ref_cache = copy.deepcopy(cache)
        for step in range(4):
            tok = _prompt(T=1, seed=10 + step).to(device)
            want = m(tok, kv_cache=ref_cache)[0]
            got = decode_step(m, tok, cache, split_kv)
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


def _launches(code: str) -> dict:
    """What the step launches, read from Inductor's output code (its call()): calls of the kernels it generated,
    extern_kernels.* (the GEMMs it leaves to the BLAS) and torch.ops.* (custom ops and other fallbacks)."""
    body = code[code.index("def call(self, args)"):]
    body = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))
    names = set(re.findall(r"^(\w+) = async_compile\.", code, re.M))
    return {"generated": sum(n in names for n in re.findall(r"^\s+(\w+)(?:\.run)?\(", body, re.M)),
            "extern": len(re.findall(r"\bextern_kernels\.\w+\(", body)),
            "custom": len(re.findall(r"\btorch\.ops\.[\w.]+\(", body))}


@pytest.mark.triton
def test_inductor_makes_at_most_110_launches_of_a_12_layer_step(device):
    """The graph a GPU replays per token, built by Inductor on the CPU and counted (issue 33: <= 110 at 12 layers).

    The step is the Triton backend's, traced as on a GPU: minite's decode kernel is one registered op a layer (on a
    GPU torch.ops.minite.decode_attention; here the same body registered as a CPU op); norms, RoPE, the cache write
    and SwiGLU are torch ops for Inductor to fuse. Counted with _launches on get_code's output (no C++ compiled):
    before this step was written for Inductor (parent of the commit that adds this test), 135 = 62 generated + 73
    external (the torch backend, the only one Inductor could compile on a CPU then: 2 norms, RoPE + cache write,
    masked softmax, SwiGLU generated and 4 GEMMs + 2 attention bmm external a layer; on the H200 the Triton
    backend's eager step dispatched 244 kernels). Now 110 = 49 generated (embedding + norm, per layer RoPE + cache
    write, residual add + norm twice, silu * up; the length update fused into the last) + 49 external GEMMs + 12
    decode ops; the torch backend (SDPA) gives 111 = 50 + 49 + 12."""
    if device.type != "cpu" or not minite.interpreting():
        pytest.skip("counted on the CPU, where the decode kernel runs as a CPU op under the interpreter")
    from torch._inductor.utils import get_code

    ns = "minite_decode_count"
    if not hasattr(getattr(torch.ops, ns), "decode_attention"):
        body, mutates = OPS["decode_attention"]
        custom = torch.library.custom_op(f"{ns}::decode_attention", body, mutates_args=mutates, device_types="cpu")
        custom.register_fake(lambda q, *_: torch.empty_like(q))
    m = _gpt("triton", n_layer=12)
    cache = KVCache.for_model(m, 1)  # empty: the step at position 0 (nothing runs: get_code only generates)
    step = torch.compile(decode_step, fullgraph=True, backend="inductor")
    # op() inside calling_ops(ns) is torch.ops.<ns>.*, as torch.ops.minite.* on a GPU; no cache (get_code's graph
    # has no source to save)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        codes = calling_ops(ns, lambda _ctx: get_code(step, m, _prompt(B=1, T=1), cache))(None)
    n = _launches("\n".join(codes))
    assert n["custom"] == 12 and n["extern"] == 4 * 12 + 1, n  # one decode op and 4 GEMMs a layer, the LM head
    assert sum(n.values()) <= 110, n


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
