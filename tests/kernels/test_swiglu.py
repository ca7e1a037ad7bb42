"""SwiGLU (chapter 05): Triton kernel vs reference, reference vs torch, gradcheck, memory saved, bad input."""
import pytest
import torch
import torch.nn.functional as F

from minite.kernels import swiglu as K
from minite.kernels.swiglu import _rows, swiglu, swiglu_bwd, swiglu_ref
from minite.nn import SwiGLU
from minite.testing import assert_close, check_op

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(3, 37), (4, 64), (2, 3, 129), (1, 1024)]  # odd and power-of-two widths, 2-D and 3-D


def _triton(gate, up):
    return swiglu(gate, up, backend="triton")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, dtype, device):
    g = torch.Generator().manual_seed(0)  # seeded on the CPU (the same numbers on every device), then moved
    gate = (3 * torch.randn(shape, generator=g)).to(dtype).to(device)  # wide range: both tails of the sigmoid
    up = torch.randn(shape, generator=g).to(dtype).to(device)
    assert check_op("swiglu", _triton, swiglu_ref, gate, up)  # output, dgate, dup


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's exp -> inf, on purpose
def test_kernel_extreme_gates_no_nan(device):
    # exp(-g) overflows to inf for g << 0: sigmoid must become 0, not NaN, in forward and backward.
    gate = torch.tensor([[-1000.0, -90.0, -20.0, 0.0, 20.0, 90.0, 1000.0]], device=device)
    up = torch.ones_like(gate)
    assert check_op("swiglu extremes", _triton, swiglu_ref, gate, up)


@pytest.mark.triton
def test_kernel_noncontiguous_inputs(device):
    # gate and up as the two halves of one fused (N, 2H) projection: strided views.
    gu = torch.randn(5, 2 * 33, generator=torch.Generator().manual_seed(1)).to(device)
    gate, up = gu.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    assert _rows(gate).data_ptr() == gate.data_ptr()  # the launcher reads the strided rows in place, no copy
    assert_close(_triton(gate, up), swiglu_ref(gate, up), name="swiglu(chunked views)")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "chunked"])
def test_kernel_several_blocks_per_row(fused, dtype, device, monkeypatch):
    """16 columns per program: rows of 37 take 3 programs (the last one masked), strided rows (halves of a fused
    (N, 2H) projection) and contiguous ones (launched as ONE row of N * H). Output, dgate, dup."""
    monkeypatch.setattr(K, "BLOCK_CPU", 16)
    g = torch.Generator().manual_seed(5)
    if fused:  # check_op clones its inputs (contiguous): chunk inside, so the kernel sees the strided views
        gu = (3 * torch.randn(2, 3, 2 * 37, generator=g)).to(dtype).to(device)
        assert not gu.chunk(2, dim=-1)[0].is_contiguous()
        assert check_op("swiglu blocks", lambda gu: _triton(*gu.chunk(2, dim=-1)),
                        lambda gu: swiglu_ref(*gu.chunk(2, dim=-1)), gu)  # output, d(gate|up) in one grad
    else:
        gate, up = (3 * torch.randn(2, 2, 3, 37, generator=g)).to(dtype).to(device).unbind(0)
        assert check_op("swiglu blocks", _triton, swiglu_ref, gate, up)


@pytest.mark.triton
def test_gradcheck_fp64(device):
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(3, 7, dtype=torch.float64, generator=g).to(device).requires_grad_()
    up = torch.randn(3, 7, dtype=torch.float64, generator=g).to(device).requires_grad_()
    assert torch.autograd.gradcheck(_triton, (gate, up))


def test_reference_matches_torch():
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(6, 50, generator=g), torch.randn(6, 50, generator=g)
    assert_close(swiglu_ref(gate, up), F.silu(gate) * up, name="swiglu_ref vs F.silu(gate) * up")
    h = swiglu_ref(gate.half(), up.half())
    assert h.dtype == torch.float16  # returns the input dtype


@pytest.mark.triton
def test_backward_formula_matches_autograd_of_silu(device):
    # The hand-derived silu'(g) = sig(g) * (1 + g * (1 - sig(g))) in the kernel vs autograd through F.silu.
    g = torch.linspace(-8, 8, 97, dtype=torch.float64, device=device).reshape(1, -1).requires_grad_()
    up = torch.ones_like(g)
    (auto,) = torch.autograd.grad(F.silu(g).sum(), g)
    dgate, dup = swiglu_bwd(torch.ones_like(g), g.detach(), up)
    assert_close(dgate, auto, name="silu'(g)")
    assert_close(dup, F.silu(g.detach()), name="dL/dup = silu(g)")


def _saved_bytes(fn, *args) -> int:
    """Bytes autograd keeps for the backward of fn(*args) (distinct storages, counted via saved_tensors_hooks)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.mark.triton
def test_fused_saves_one_activation_less(device):
    N, H = 8, 256
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(N, H, generator=g).to(device).requires_grad_()
    up = torch.randn(N, H, generator=g).to(device).requires_grad_()
    naive = _saved_bytes(lambda g, u: F.silu(g) * u, gate, up)  # gate, silu(gate), up
    fused = _saved_bytes(_triton, gate, up)  # gate, up
    assert naive == 3 * N * H * 4
    assert fused == 2 * N * H * 4


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_triton_vs_torch(dtype, device):
    torch.manual_seed(4)
    m_ref = SwiGLU(24, 40, backend="torch").to(device, dtype)
    m_tri = SwiGLU(24, 40, backend="triton").to(device, dtype)
    m_tri.load_state_dict(m_ref.state_dict())
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 24, generator=g).to(device, dtype)
    x_ref, x_tri = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tri = m_ref(x_ref), m_tri(x_tri)
    assert_close(y_tri, y_ref, name="SwiGLU output")
    dy = torch.randn(y_ref.shape, generator=g).to(device, dtype)
    y_ref.backward(dy)
    y_tri.backward(dy)
    assert_close(x_tri.grad, x_ref.grad, name="dx")
    for (name, p_ref), p_tri in zip(m_ref.named_parameters(), m_tri.parameters()):
        assert_close(p_tri.grad, p_ref.grad, name=f"d{name}")
    assert "hidden=40" in repr(m_tri)


@pytest.mark.parametrize("bad, match", [
    (lambda: swiglu(torch.randn(3, 4), torch.randn(3, 5)), r"gate shape \(3, 4\) != up shape \(3, 5\)"),
    (lambda: swiglu(torch.randn(3, 4), torch.randn(3, 4).half()), "gate dtype torch.float32 != up dtype"),
    (lambda: swiglu(torch.ones(3, 4, dtype=torch.int32), torch.ones(3, 4, dtype=torch.int32)), "dtype torch.int32"),
    (lambda: swiglu(torch.randn(3, 4), torch.randn(3, 4, device="meta")), "gate is on cpu but up is on meta"),
])
def test_bad_input_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_unknown_backend_errors():
    with pytest.raises(ValueError, match="unknown backend"):
        swiglu(torch.randn(2, 2), torch.randn(2, 2), backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_large_hidden(dtype):
    gate = torch.randn(512, 4096, device="cuda", dtype=dtype)
    up = torch.randn(512, 4096, device="cuda", dtype=dtype)
    assert check_op("swiglu cuda", _triton, swiglu_ref, gate, up)


def test_module_state_dict_keys_and_round_trip():
    # The exact key set: a renamed projection breaks every saved checkpoint, so it must fail here first.
    sd = SwiGLU(6, 10).state_dict()
    assert list(sd) == ["gate.weight", "up.weight", "down.weight"]
    assert sd["gate.weight"].shape == sd["up.weight"].shape == (10, 6) and sd["down.weight"].shape == (6, 10)
    assert list(SwiGLU(6, 10, bias=True).state_dict()) == ["gate.weight", "gate.bias", "up.weight", "up.bias",
                                                           "down.weight", "down.bias"]
    torch.manual_seed(0)
    a = SwiGLU(6, 10, backend="torch")
    torch.manual_seed(1)
    b = SwiGLU(6, 10, backend="torch")
    x = torch.randn(3, 6)
    assert not torch.allclose(a(x), b(x))  # different init: the round trip below has something to do
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("fused", [False, True])
def test_module_takes_device_and_dtype_like_rmsnorm(fused):
    # was (issue 26): nn.SwiGLU had no device/dtype arguments while nn.RMSNorm does
    m = SwiGLU(6, 10, fused=fused, device="meta", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in m.parameters()} == {("meta", torch.bfloat16)}
    assert len(list(m.parameters())) == (2 if fused else 3)
