"""attention reference (chapter 07 adds the kernel): against an explicit softmax(QK^T)V, GQA, and input errors."""
import math

import pytest
import torch

from minite.kernels.attention import attention, attention_ref
from minite.testing import assert_close


def _explicit(q, k, v, causal):
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v = k[:, torch.arange(H) // g], v[:, torch.arange(H) // g]  # (B, H, T, D): head h uses kv head h // g
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)    # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v.double()).to(q.dtype)


@pytest.mark.parametrize("H,KVH", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_explicit_formula(H, KVH, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, 7, 16, generator=g)
    k, v = torch.randn(2, KVH, 7, 16, generator=g), torch.randn(2, KVH, 7, 16, generator=g)
    assert_close(attention_ref(q, k, v, causal), _explicit(q, k, v, causal))
    assert_close(attention(q, k, v, causal=causal, backend="torch"), _explicit(q, k, v, causal))


def test_bad_inputs_name_the_values():
    q, k = torch.randn(1, 6, 5, 8), torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="H=6 must be a multiple of key/value heads KVH=4"):
        attention(q, k, k)
    with pytest.raises(ValueError, match=r"4-D \(B, H, T, D\)"):
        attention(q[0], k[0], k[0])
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k, k[..., :4])
    with pytest.raises(ValueError, match="unknown backend 'tritn'"):
        attention(q, q, q, backend="tritn")


@pytest.mark.triton
def test_forced_triton_warns_once_and_runs_the_reference(monkeypatch):
    # Until chapter 07 lands its kernel, a forced "triton" (argument, context or env) must not crash a model
    # that runs every other op in Triton: it warns once and returns the reference.
    import warnings

    import minite.kernels.attention as att
    from minite.backend import use_backend
    monkeypatch.setattr(att, "_warned", False)
    q = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"no Triton kernel yet \(chapter 07\).*runs the PyTorch reference"):
        y = attention(q, q, q, backend="triton")
    assert torch.equal(y, attention_ref(q, q, q))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second forced call (here through the context) is silent
        with use_backend("triton"):
            assert torch.equal(attention(q, q, q), y)
        assert torch.equal(attention(q, q, q, backend="auto"), y)
    monkeypatch.setattr(att, "_warned", False)
    monkeypatch.setenv("MINITE_BACKEND", "triton")
    with pytest.warns(UserWarning, match="no Triton kernel yet"):
        attention(q, q, q)
    monkeypatch.setattr(att, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" and "torch" never warn
        attention(q, q, q, backend="auto"), attention(q, q, q, backend="torch")


def test_forced_triton_where_triton_cannot_run_raises(monkeypatch):
    # The backend contract: a forced "triton" that cannot run raises, for attention too (interpreter off on CPU).
    import minite.backend
    monkeypatch.setattr(minite.backend, "interpreting", lambda: False)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="backend='triton' was forced but cannot run"):
        attention(q, q, q, backend="triton")
    assert torch.equal(attention(q, q, q), attention_ref(q, q, q))  # "auto" falls back silently
