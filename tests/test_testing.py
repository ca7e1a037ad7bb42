"""minite.testing: the tolerance table and check_op must catch wrong outputs and wrong gradients."""
import pytest
import torch

from minite.testing import assert_close, check_op, dtype_tols


def test_tolerances_grow_as_precision_shrinks():
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    atols = [dtype_tols(d)["atol"] for d in order]
    assert atols == sorted(atols)
    with pytest.raises(ValueError, match="int32"):
        dtype_tols(torch.int32)


def test_assert_close_names_shape_dtype_and_worst_element(device):
    a = torch.zeros(2, 3, device=device)
    b = a.clone()
    b[1, 2] = 1.0
    with pytest.raises(AssertionError, match=r"out \(2, 3\) torch.float32: 1/6 elements differ.*at \(1, 2\)"):
        assert_close(a, b, name="out")
    with pytest.raises(AssertionError, match="shape"):
        assert_close(a, torch.zeros(3, 2, device=device))
    assert_close(a, a + 1e-7)


def _randn(*shape, device, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)


def test_check_op_passes_and_prints(capsys, device):
    # On the suite's device: check_op's upstream gradients must be made where the outputs live.
    x = _randn(3, 7, dtype=torch.float64, device=device)
    assert check_op("tanh", torch.tanh, lambda t: torch.sinh(t) / torch.cosh(t), x)
    assert capsys.readouterr().out.strip() == "PASS: tanh [float64 (3, 7)]: output, grad[0]"


def test_check_op_catches_a_wrong_forward(capsys, device):
    x = _randn(4, 5, device=device)
    assert not check_op("bad", lambda t: t * 1.01, lambda t: t, x)
    assert "FAIL: bad" in capsys.readouterr().out


def test_check_op_catches_a_wrong_gradient_only(capsys, device):
    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3  # should be 2

    x = _randn(4, 5, device=device)
    assert not check_op("wrong grad", WrongGrad.apply, lambda t: t * 2, x)
    out = capsys.readouterr().out
    assert "FAIL: wrong grad" in out and "grad[0]" in out
