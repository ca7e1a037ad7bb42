"""RoPE: Triton kernel vs reference (both layouts), complex-number formula, relative positions, errors."""
import pytest
import torch

from minite.kernels.rope import RoPEFunction, RotaryEmbedding, rope, rope_bwd, rope_cos_sin, rope_fwd, rope_ref
from minite.testing import assert_close, check_op

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, H, T, D): D/2 = 3 odd (masked lanes) and H = 3 not a power of two; then everything a power of two.
SHAPES = [(1, 3, 5, 6), (2, 4, 8, 16)]


def _randn(*shape, seed=0, dtype=torch.float32, device="cpu"):
    """Seeded on the CPU (the same numbers on every device), then moved to `device`."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _complex_rope(x, positions, base=10000.0):
    """Independent formula: pair i is z_i = x[i] + j x[i + D/2]; multiply by exp(j * t * base^(-2i/D))."""
    D = x.shape[-1]
    z = torch.view_as_complex(torch.stack(x.double().chunk(2, dim=-1), dim=-1).contiguous())  # (..., T, D/2)
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    rot = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.float64),
                      positions.double()[:, None] * theta[None, :])  # (T, D/2) complex
    y = torch.view_as_real(z * rot)  # (..., T, D/2, 2)
    return torch.cat([y[..., 0], y[..., 1]], dim=-1)  # back to the halves layout (..., T, D)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference_bhtd(shape, dtype, device):
    B, H, T, D = shape
    cos, sin = rope_cos_sin(T, D, offset=3, device=device)
    x = _randn(*shape, seed=0, dtype=dtype, device=device)
    # output and grad x (cos/sin are a fixed cache, not differentiated)
    assert check_op("rope bhtd", lambda x: rope(x, cos, sin, backend="triton"), lambda x: rope_ref(x, cos, sin), x)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference_bthd(shape, dtype, device):
    B, H, T, D = shape
    cos, sin = rope_cos_sin(T, D, device=device)
    x = _randn(B, T, H, D, seed=1, dtype=dtype, device=device)  # (B, T, H, D)
    assert check_op("rope bthd", lambda x: rope(x, cos, sin, layout="bthd", backend="triton"),
                    lambda x: rope_ref(x.transpose(1, 2), cos, sin).transpose(1, 2), x)


@pytest.mark.triton
def test_gradcheck_fp64(device):
    x = _randn(1, 2, 3, 8, dtype=torch.float64, device=device).requires_grad_()
    cos, sin = rope_cos_sin(3, 8, offset=5, device=device)
    for layout in ("bhtd", "bthd"):
        assert torch.autograd.gradcheck(lambda x: RoPEFunction.apply(x, cos, sin, layout), (x,), fast_mode=True)


@pytest.mark.triton
def test_backward_is_inverse_rotation(device):
    x = _randn(2, 3, 4, 8, seed=2, device=device)
    cos, sin = rope_cos_sin(4, 8, device=device)
    assert_close(rope_bwd(rope_fwd(x, cos, sin), cos, sin), x, name="R(-t) R(t) x")
    assert_close(rope_bwd(x, cos, sin), rope_ref(x, cos, -sin), name="bwd = rotation with sin negated")


@pytest.mark.triton
def test_strided_input_from_qkv_split(device):
    B = 2
    T = 5
    H = 3
    D = 8
    qkv = _randn(B, T, 3 * H * D, seed=3, device=device)
    q = qkv.view(B, T, 3, H, D)[:, :, 0].transpose(1, 2)  # (B, H, T, D) view, not contiguous
    cos, sin = rope_cos_sin(T, D, device=device)
    assert not q.is_contiguous()
    assert_close(rope(q, cos, sin, backend="triton"), rope_ref(q, cos, sin), name="strided q")
    q_bthd = qkv.view(B, T, 3, H, D)[:, :, 0]  # (B, T, H, D) view
    assert_close(rope(q_bthd, cos, sin, layout="bthd", backend="triton"),
                 rope_ref(q, cos, sin).transpose(1, 2), name="strided bthd")


@pytest.mark.triton
def test_offset_matches_full_cache_slice(device):
    """A KV-cache decode step at position 7 == the full-sequence result at row 7."""
    x = _randn(1, 2, 10, 8, seed=4, device=device)
    rot = RotaryEmbedding(8, 16, backend="triton").to(device)
    full = rot(x)
    step = rot(x[:, :, 7:8], offset=7)
    assert_close(step, full[:, :, 7:8], name="offset 7")
    cos, sin = rope_cos_sin(3, 8, offset=7)
    c_all, s_all = rope_cos_sin(10, 8)
    assert_close(cos, c_all[7:], name="cos offset")
    assert_close(sin, s_all[7:], name="sin offset")


def test_reference_matches_complex_formula():
    x = torch.randn(2, 3, 6, 10, dtype=torch.float64)
    cos, sin = rope_cos_sin(6, 10, offset=4, base=500.0)
    expected = _complex_rope(x, torch.arange(4, 10), base=500.0)
    assert_close(rope_ref(x, cos, sin), expected, atol=1e-6, rtol=1e-6, name="complex")  # cos/sin cached in fp32


def test_relative_position_property():
    """<R(m) q, R(n) k> depends only on m - n."""
    D = 16
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    cos, sin = rope_cos_sin(40, D)
    rq = rope_ref(q.expand(1, 1, 40, D), cos, sin)[0, 0]  # (40, D): q at every position
    rk = rope_ref(k.expand(1, 1, 40, D), cos, sin)[0, 0]
    scores = rq @ rk.T  # (40, 40): scores[m, n] = q_m . k_n
    for delta in (0, 3, -5):
        diag = torch.diagonal(scores, offset=-delta)  # entries with m - n = delta
        assert_close(diag, diag[:1].expand_as(diag), atol=1e-6, rtol=1e-6, name=f"m-n={delta}")
    assert not torch.allclose(torch.diagonal(scores, 0)[:1], torch.diagonal(scores, -3)[:1])


def test_module_buffers_and_state_dict():
    rot = RotaryEmbedding(8, 32)
    assert rot.cos.shape == rot.sin.shape == (32, 4)
    assert list(rot.state_dict()) == []  # non-persistent cache
    assert "head_dim=8" in repr(rot)


def test_torch_backend_is_reference():
    x = torch.randn(1, 2, 3, 4)
    cos, sin = rope_cos_sin(3, 4)
    assert torch.equal(rope(x, cos, sin, backend="torch"), rope_ref(x, cos, sin))


def test_bad_inputs():
    cos, sin = rope_cos_sin(4, 8)
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="D must be even.*D=7"):
        rope(torch.randn(1, 2, 4, 7), cos, sin)
    with pytest.raises(ValueError, match="D must be even"):
        rope_cos_sin(4, 5)
    with pytest.raises(ValueError, match=r"cos must have shape \(T, D/2\) = \(4, 4\).*\(3, 4\)"):
        rope(x, cos[:3], sin[:3])
    with pytest.raises(ValueError, match=r"sin must have shape .*\(4, 3\)"):
        rope(x, cos, sin[:, :3])
    with pytest.raises(ValueError, match=r"cos must have shape \(T, D/2\) = \(2, 4\)"):
        rope(x, cos, sin, layout="bthd")  # T is dim 1 in (B, T, H, D)
    with pytest.raises(ValueError, match="layout must be one of"):
        rope(x, cos, sin, layout="bshd")
    with pytest.raises(ValueError, match="must be 4-D"):
        rope(torch.randn(2, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="floating point"):
        rope(torch.ones(1, 2, 4, 8, dtype=torch.long), cos, sin)
    with pytest.raises(ValueError, match="outside the cache"):
        RotaryEmbedding(8, 16)(torch.randn(1, 1, 4, 8), offset=14)


# ------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_gpu_large_shape_both_layouts(layout):
    # A realistic attention shape (too slow for the interpreter): output and grad x vs the reference. Speed is
    # measured by benchmarks/, never asserted in a test.
    B = 4
    H = 16
    T = 1024
    D = 128
    cos, sin = rope_cos_sin(T, D, device="cuda")
    shape = (B, H, T, D) if layout == "bhtd" else (B, T, H, D)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    assert check_op(f"rope {layout} large", lambda x: rope(x, cos, sin, layout=layout, backend="triton"),
                    lambda x: rope_ref(x, cos, sin, layout=layout), x)
