"""Row softmax (minite/kernels/softmax.py): Triton vs reference, reference vs independent formulas, edge cases.

Kernel tests carry @pytest.mark.triton (CUDA, or the CPU interpreter that tests/conftest.py switches on).
"""

import pytest
import torch

import minite
import minite.kernels.softmax as S
from minite.kernels.softmax import Softmax, SoftmaxFunction, softmax, softmax_ref
from minite.testing import assert_close, check_op, dtype_tols

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Odd and power-of-two row lengths: a single column, < 1 block, exactly one block, one column past 4096,
# a reduction over a middle dimension (dim=1 of (2, 3, 17): rows of 3 strided by 17 in the input).
SHAPES_DIMS = [((1, 1), -1), ((3, 1000), -1), ((7, 4097), -1), ((4, 1024), -1), ((2, 3, 17), -1), ((2, 3, 17), 1)]


def _triton(x, dim=-1):
    return softmax(x, dim=dim, backend="triton")


def _randn(shape, dtype, device="cpu", scale=3.0, seed=0):
    """Seeded on the CPU (the same numbers on every device), then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(dtype).to(device)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", SHAPES_DIMS, ids=lambda v: str(v))
def test_triton_matches_reference(shape, dim, dtype, device):
    # Output and input gradient (check_op back-propagates one random upstream gradient through both).
    assert check_op("softmax", _triton, softmax_ref, _randn(shape, dtype, device), dim=dim)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_row_takes_the_looped_path(dtype, device):
    C = 20000
    block, single, _ = S._launch_config(C)
    assert not single and block < C, "a 20000-column row must be walked in blocks"
    assert check_op("softmax looped", _triton, softmax_ref, _randn((2, C), dtype, device))


@pytest.mark.triton
@pytest.mark.parametrize("shape,dim", [((2, 11), -1), ((3, 2, 2), 0)], ids=str)
@pytest.mark.parametrize("max_block", [S.MAX_BLOCK_SIZE, 4], ids=["single", "looped"])
def test_gradcheck_fp64(shape, dim, max_block, monkeypatch, device):
    # fp64 input computes in fp64 inside the kernels, so finite differences agree with the analytic backward.
    # Tiny shapes: full gradcheck runs the forward twice per input element (each a kernel launch).
    monkeypatch.setattr(S, "MAX_BLOCK_SIZE", max_block)
    x = _randn(shape, torch.float64, device, scale=1.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: _triton(t, dim), (x,), eps=1e-6, atol=1e-8)


@pytest.mark.triton
def test_triton_path_is_really_taken(device):
    # Guards the tests above: were the Triton path silently replaced by the reference, they would all pass.
    x = _randn((2, 5), torch.float32, device).requires_grad_()
    assert type(_triton(x).grad_fn).__name__ == "SoftmaxFunctionBackward"
    assert SoftmaxFunction.apply(x.detach(), 1).shape == (2, 5)
    assert type(softmax(x, backend="torch").grad_fn).__name__ != "SoftmaxFunctionBackward"


@pytest.mark.triton
@pytest.mark.parametrize("max_block", [S.MAX_BLOCK_SIZE, 16], ids=["single", "looped"])
def test_minus_inf_and_large_magnitudes_stay_finite(max_block, monkeypatch, device):
    monkeypatch.setattr(S, "MAX_BLOCK_SIZE", max_block)
    x = _randn((4, 100), torch.float32, device, scale=1e4)  # exp(1e4) overflows fp32 unless the max is subtracted
    x[:, :40] = -float("inf")  # the first blocks of every row hold only -inf (a causal-mask-like pattern)
    x[1, 50:] = -float("inf")
    x = x.requires_grad_()
    y = _triton(x)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert_close(y.sum(-1), torch.ones(4, device=device), name="row sums")
    assert (y[:, :40] == 0).all(), "exp(-inf) must be exactly 0"
    assert_close(y, softmax_ref(x.detach()), name="softmax with -inf and 1e4 entries")


@pytest.mark.triton
@pytest.mark.parametrize("max_block", [S.MAX_BLOCK_SIZE, 16], ids=["single", "looped"])
def test_fp64_rows_far_below_fp32_range(max_block, monkeypatch, device):
    # fp64 holds -1e300; the looped path's running max must not start above such values (a -3e38 start made
    # every row below it 0 / 0 = NaN). Row 1 also begins with a block of -inf only (the guard against -inf - -inf).
    monkeypatch.setattr(S, "MAX_BLOCK_SIZE", max_block)
    x = -1e300 + 1e299 * _randn((3, 40), torch.float64, device, scale=1.0, seed=5)  # every value around -1e300
    x[1, :20] = -float("inf")
    x = x.requires_grad_()
    y = _triton(x)
    y.backward(torch.randn_like(y))
    ref = softmax_ref(x.detach())
    assert torch.isfinite(ref).all() and torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert_close(y, ref, name="softmax of fp64 rows around -1e300")


@pytest.mark.triton
def test_empty_and_noncontiguous_inputs(device):
    assert _triton(torch.empty(0, 5, device=device)).shape == (0, 5)
    x = _randn((6, 10), torch.float32, device).t()  # (10, 6), non-contiguous
    assert_close(_triton(x, dim=0), softmax_ref(x, 0), name="transposed input")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_reference_matches_torch_softmax(dtype):
    x = _randn((5, 33), dtype)
    y = softmax_ref(x, dim=0)
    assert y.dtype == dtype
    assert_close(y, torch.softmax(x.double(), dim=0).to(dtype), name="softmax_ref vs torch.softmax")


def test_reference_matches_independent_formula():
    # exp(x - logsumexp(x)) in fp64: no max-subtraction, no division, a different route to the same values.
    x = _randn((4, 50), torch.float32)
    expected = (x.double() - torch.logsumexp(x.double(), dim=-1, keepdim=True)).exp().float()
    assert_close(softmax_ref(x), expected, name="softmax_ref vs exp(x - logsumexp x)")
    # And its gradient against the closed form dx = y * (dy - <dy, y>).
    xr = x.clone().requires_grad_()
    y = softmax_ref(xr)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert_close(xr.grad, y.detach() * (dy - (dy * y.detach()).sum(-1, keepdim=True)), name="softmax_ref grad")


def test_backend_torch_gives_the_reference():
    x = _randn((3, 7), torch.float16)
    assert torch.equal(softmax(x, backend="torch"), softmax_ref(x))
    with minite.use_backend("torch"):
        assert torch.equal(Softmax(dim=0)(x), softmax_ref(x, 0))


def test_module_repr_and_defaults():
    assert repr(Softmax()) == "Softmax(dim=-1)"
    assert repr(Softmax(dim=1, backend="torch")) == "Softmax(dim=1, backend='torch')"
    assert dtype_tols(torch.float32)["atol"] > 0  # the tolerance table the checks above rely on exists


@pytest.mark.parametrize("x,dim,err,match", [
    (torch.arange(6).view(2, 3), -1, ValueError, r"floating-point.*torch\.int64.*\(2, 3\)"),
    (torch.tensor(1.0), -1, ValueError, r"0-dim"),
    (torch.randn(2, 3), 2, ValueError, r"dim=2 is out of range.*\(2, 3\).*-2 \.\. 1"),
    (torch.randn(2, 3), -3, ValueError, r"dim=-3 is out of range"),
    (torch.randn(2, 3), 1.0, TypeError, r"dim must be an int"),
    ([1.0, 2.0], -1, TypeError, r"expects a torch.Tensor, got list"),
])
def test_bad_input_errors(x, dim, err, match):
    with pytest.raises(err, match=match):
        softmax(x, dim=dim)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 32768), (65536, 7)], ids=str)
def test_gpu_large_shapes(shape):
    # Realistic sizes (too slow for the interpreter): output and grad vs the reference. Speed is measured by
    # benchmarks/, never asserted in a test.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    assert check_op("softmax large", _triton, softmax_ref, x)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        softmax(torch.randn(2, 3), backend="cuda")
