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
    with pytest.raises(RuntimeError, match="no Triton kernel yet"):
        attention(q, q, q, backend="triton")
