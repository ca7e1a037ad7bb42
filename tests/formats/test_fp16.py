"""DynamicLossScaler: skip on overflow, back off, grow after clean steps, hysteresis, state round-trip."""
import pytest
import torch

from minite.formats import DynamicLossScaler


def fp16_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4).half()


def backward(model, scaler, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).float().pow(2).mean()          # loss in fp32, the activations/grads in fp16
    scaler.scale(loss).backward()
    return loss


def test_overflow_skips_step_and_backs_off():
    model = fp16_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0 ** 16)
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, scaler, torch.full((16, 8), 100.0, dtype=torch.float16))   # grads ~1e2 * 2^16 > 65504
    assert any(not torch.isfinite(p.grad).all() for p in model.parameters())  # it really overflowed in fp16
    assert scaler.step(opt) is False
    scaler.update()
    assert scaler.scale_value == 2.0 ** 15
    for p, b in zip(model.parameters(), before):
        assert torch.isfinite(p).all() and torch.equal(p, b)                  # weights unchanged and finite
    # with a smaller input the next steps are clean and do update the weights
    x = torch.randn(16, 8, dtype=torch.float16)
    backward(model, scaler, x)
    assert scaler.step(opt) is True
    scaler.update()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_unscaled_step_equals_fp32_step():
    torch.manual_seed(0)
    w = torch.randn(4, 8)
    x = torch.randn(16, 8)
    ref = w.clone().requires_grad_()
    (x @ ref.t()).pow(2).mean().backward()
    p = w.clone().requires_grad_()
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10)
    scaler.scale((x @ p.t()).pow(2).mean()).backward()
    assert torch.allclose(p.grad, ref.grad * 2 ** 10, rtol=1e-5)
    assert scaler.unscale_(opt) is False
    assert torch.allclose(p.grad, ref.grad, rtol=1e-6)                        # divided in place
    assert scaler.step(opt)                                                   # does not unscale twice
    scaler.update()
    assert torch.allclose(p.detach(), w - 0.5 * ref.grad, rtol=1e-6)


def test_scaling_rescues_underflowing_fp16_grads():
    g = torch.full((1000,), 1e-8)                    # true gradients below fp16's smallest subnormal (6e-8)
    assert (g.half() == 0).all()
    s = DynamicLossScaler().scale_value
    assert ((g * s).half() != 0).all()               # scaled by 2^16 they survive the fp16 cast
    assert torch.allclose((g * s).half().float() / s, g, rtol=1e-3)


def run(scaler, verdicts):
    """Feed a sequence of overflow verdicts (True = inf found) through scaler.update(); return the scales."""
    scales = []
    for bad in verdicts:
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.tensor([1.0, float("inf") if bad else 2.0, 3.0])
        opt = torch.optim.SGD([p], lr=1.0)
        assert scaler.step(opt) is (not bad)
        scaler.update()
        scales.append(scaler.scale_value)
    return scales


def test_growth_after_interval():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    assert run(s, [False] * 7) == [8, 8, 16, 16, 16, 32, 32]
    assert run(s, [False, True, False, False, False]) == [32, 16, 16, 16, 32]   # overflow resets the tracker


def test_hysteresis_and_min_scale():
    s = DynamicLossScaler(init_scale=8.0, hysteresis=2, growth_interval=100, min_scale=2.0)
    assert run(s, [True, True, True, False, True]) == [8, 4, 2, 2, 2]   # tolerates 1 overflow; floor at 2
    torch_like = DynamicLossScaler(init_scale=8.0, backoff_factor=0.25)
    assert run(torch_like, [True, True]) == [2, 1]


def test_nan_counts_as_overflow():
    s = DynamicLossScaler(init_scale=4.0)
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("nan"), 1.0])
    assert s.unscale_(torch.optim.SGD([p], lr=1.0)) is True


def test_state_dict_round_trip():
    a = DynamicLossScaler(init_scale=64.0, growth_interval=2, hysteresis=2)
    run(a, [False, True, False])
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.scale_value == a.scale_value
    tail = [True, True, False, False, False, True]
    assert run(b, tail) == run(a, tail)
    with pytest.raises(KeyError, match="scale"):
        b.load_state_dict({"growth_tracker": 0})


def test_misuse_and_bad_arguments():
    s = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="step"):
        s.update()
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=1.0)
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already"):
        s.unscale_(opt)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=2.0)
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=float("inf"))


def test_disabled_is_pass_through():
    s = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert s.scale(loss) is loss and s.scale_value == 1.0
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    assert s.step(torch.optim.SGD([p], lr=1.0)) is True
    s.update()
    assert torch.equal(p.detach(), -torch.ones(2))
