"""Chapter 02: minite.nn.Linear — plain outside fp8_autocast, three FP8 GEMMs inside.

The FP8 layer is compared (forward, grad of x, grad of W, grad of b) with an independent formula that
quantizes with the *same scales* using torch's casts and multiplies in fp32; with the Triton and torch
backends against each other; and loosely with the full-precision layer. No fp64 gradcheck: quantization
is not differentiable (the backward is defined by the three FP8 GEMMs, which is what the formula checks).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minite.formats import CurrentScaling, DelayedScaling, Format, fp8_autocast
from minite.layers.linear import FP8_ACCUMULATE, fp8_linear
from minite.nn import Linear
from minite.testing import assert_close, dtype_tols, fp8_dot_tolerance


def _fake_q(t, scale, fp8_dtype):
    """Quantize-dequantize with torch's cast (clamp first): the independent spec of one fp8 operand."""
    m = torch.finfo(fp8_dtype).max
    return (t.float() * scale).clamp(-m, m).to(fp8_dtype).float() / scale


def _step(layer, x, gy, recipe):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with fp8_autocast(recipe=recipe):
        y = layer(x)
    y.backward(gy)
    return y, x.grad, layer.weight.grad, layer.bias.grad


def test_plain_outside_autocast_and_state_dict_compatible():
    torch.manual_seed(0)
    ref = nn.Linear(13, 7)
    lin = Linear(13, 7)
    assert list(lin.state_dict()) == list(ref.state_dict())
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(4, 13)
    assert torch.equal(lin(x), ref(x))
    assert Linear(3, 2, bias=False).bias is None and "backend='torch'" in repr(Linear(3, 2, backend="torch"))


@pytest.mark.triton
@pytest.mark.parametrize("shape", [((3, 11, 65), 17), ((64, 64), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_linear_matches_same_quantization_formula(shape, dtype, device):
    (xshape, O), K = shape, shape[0][-1]
    torch.manual_seed(0)
    lin = Linear(K, O).to(device, dtype)
    recipe = DelayedScaling(amax_history_len=4, fp8_format=Format.HYBRID)
    g = torch.Generator().manual_seed(0)  # inputs drawn on the CPU (the same on every device), then moved
    x0 = torch.randn(xshape, generator=g).to(device, dtype)
    x1 = (3 * torch.randn(xshape, generator=g)).to(device, dtype)
    gy = (0.01 * torch.randn(*xshape[:-1], O, generator=g)).to(device, dtype)
    outs = {}
    for backend in ("triton", "torch"):
        m = copy.deepcopy(lin)
        m.backend = backend
        _step(m, x0, gy, recipe)                                   # step 0 fills the amax histories
        s = {k: v.scale.clone() for k, v in m.fp8_states.items()}  # the scales step 1 will use (delayed)
        outs[backend] = _step(m, x1, gy, recipe)
        assert s["input"].item() == pytest.approx(448.0 / x0.abs().max().item())   # from step 0's amax only
    # independent formula with the same scales: quantize with torch casts, multiply in fp32
    qx = _fake_q(x1.reshape(-1, K), s["input"], torch.float8_e4m3fn)
    qw = _fake_q(lin.weight, s["weight"], torch.float8_e4m3fn)
    qg = _fake_q(gy.reshape(-1, O), s["grad_output"], torch.float8_e5m2)
    want = ((qx @ qw.t()).to(dtype) + lin.bias).reshape(*xshape[:-1], O), (qg @ qw).to(dtype).reshape(xshape), \
        (qg.t() @ qx).to(dtype), gy.reshape(-1, O).float().sum(0).to(dtype)
    # one extra output rounding in the kernel path (y in `dtype`, then + bias): allow 2x the dtype tolerance
    tol = {k: 2 * v for k, v in dtype_tols(dtype).items()}
    # y, dx, dW are FP8 GEMMs: on CUDA add the tensor cores' accumulator error (minite.testing.fp8_dot_tolerance)
    operands = ((qx, qw.t(), "fprop"), (qg, qw, "dgrad"), (qg.t(), qx, "wgrad"), None)
    for name, a, b, w, ops in zip(("y", "dx", "dW", "db"), outs["triton"], outs["torch"], want, operands):
        t = tol if ops is None else fp8_dot_tolerance(
            ops[0], ops[1], device=device, promote_every=None if FP8_ACCUMULATE[ops[2]] == "fast" else 128, **tol)
        if isinstance(t["atol"], torch.Tensor):
            t = {**t, "atol": t["atol"].reshape(w.shape)}
        assert_close(a, w, name=f"triton {name}", **t)
        assert_close(b, w, name=f"torch {name}", **t)


@pytest.mark.triton
def test_fp8_linear_close_to_full_precision(device):
    torch.manual_seed(1)
    lin = Linear(48, 24, backend="triton").to(device)
    g = torch.Generator().manual_seed(1)
    x, gy = torch.randn(20, 48, generator=g).to(device), torch.randn(20, 24, generator=g).to(device)
    y8, dx8, dw8, _ = _step(lin, x, gy, CurrentScaling())
    xr = x.clone().requires_grad_(True)
    yr = F.linear(xr, lin.weight, lin.bias)
    dxr, dwr = torch.autograd.grad(yr, (xr, lin.weight), gy)
    for name, a, b in (("y", y8, yr), ("dx", dx8, dxr), ("dW", dw8, dwr)):
        rel = ((a - b).norm() / b.norm()).item()
        # E4M3 rounding error is up to 2^-4 relative per element (E5M2 2^-3), averaging down in the sums
        assert rel < 0.08, f"{name}: relative error {rel:.3f} is not FP8-sized"


def test_module_histories_roll_per_tensor():
    torch.manual_seed(2)
    lin = Linear(8, 4, backend="torch")
    recipe = DelayedScaling(amax_history_len=3)
    amaxes = []
    for i in range(4):
        x = torch.randn(5, 8) * (i + 1)
        amaxes.append(x.abs().max().item())
        _step(lin, x, torch.ones(5, 4), recipe)
    st = lin.fp8_states
    assert st["input"].amax_history.tolist() == pytest.approx(amaxes[::-1][:3])
    assert st["input"].scale.item() == pytest.approx(448.0 / max(amaxes[1:]))
    assert st["grad_output"].fp8_dtype == torch.float8_e5m2
    assert st["grad_output"].amax_history.tolist() == [1.0, 1.0, 1.0]
    assert st["weight"].amax_history[0].item() == lin.weight.abs().max().item()


def test_fp8_states_travel_as_module_extra_state():
    # TransformerEngine's way: the module owns its FP8 states and state_dict carries them once FP8 has run.
    torch.manual_seed(3)
    lin = Linear(8, 4, backend="torch")
    assert list(lin.state_dict()) == ["weight", "bias"]                   # never ran under FP8: nn.Linear's keys
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=3)):
        lin(torch.randn(5, 8) * 3).sum().backward()
    sd = lin.state_dict()
    assert list(sd) == ["weight", "bias", "_extra_state"] and sd["_extra_state"]["format"] == "HYBRID"
    fresh = Linear(8, 4, backend="torch")
    fresh.load_state_dict(sd)
    for role, st in lin.fp8_states.items():
        assert torch.equal(fresh.fp8_states[role].amax_history, st.amax_history)
        assert torch.equal(fresh.fp8_states[role].scale, st.scale) and fresh.fp8_states[role].fp8_dtype == st.fp8_dtype
    assert fresh._fp8_key == lin._fp8_key                                  # the same recipe reuses them, no reset
    fresh.load_state_dict(nn.Linear(8, 4).state_dict())                   # no extra state: fresh states next time
    assert fresh.fp8_states is None
    with pytest.raises(ValueError, match="FP8 extra state must hold the states"):
        fresh.load_state_dict({**sd, "_extra_state": {"states": {}}})


def test_autocast_restored_after_exception_in_forward():
    lin = Linear(8, 4, backend="torch")
    with pytest.raises(ValueError, match="does not match weight"):
        with fp8_autocast():
            lin(torch.randn(2, 9))
    x = torch.randn(2, 8)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))     # plain again: state was restored


def test_fp8_linear_functional_errors():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        fp8_linear(torch.ones(2, 8, dtype=torch.int64), w)
    with pytest.raises(ValueError, match="bias shape"):
        fp8_linear(torch.randn(2, 8), w, torch.randn(5))


def test_fp8_mlp_trains():
    torch.manual_seed(0)
    X = torch.randn(128, 16)
    Y = torch.sin(X[:, :4] * 2) + X[:, 4:8] ** 2

    def run(fp8: bool):
        torch.manual_seed(1)
        model = nn.Sequential(Linear(16, 64, backend="torch"), nn.GELU(), Linear(64, 4, backend="torch"))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        recipe = DelayedScaling(amax_history_len=16)
        losses = []
        for _ in range(60):
            with fp8_autocast(enabled=fp8, recipe=recipe):
                loss = F.mse_loss(model(X), Y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    threads = torch.get_num_threads()
    torch.set_num_threads(1)                  # tiny matmuls: extra threads only add overhead on a busy machine
    try:
        l8, l32 = run(True), run(False)
    finally:
        torch.set_num_threads(threads)
    assert l8[-1] < 0.3 * l8[0], f"FP8 MLP did not train: {l8[0]:.3f} -> {l8[-1]:.3f}"
    assert abs(l8[-1] - l32[-1]) < 0.25 * l32[-1] + 0.02, f"FP8 {l8[-1]:.4f} vs FP32 {l32[-1]:.4f}"


@pytest.mark.triton
def test_fp8_gpt_trains_same_with_triton_kernels(monkeypatch, device):
    """3 FP8 training steps of a tiny GPT: Triton quantize + FP8 GEMM kernels vs the torch reference path."""
    import minite
    from minite.formats import fp8 as fp8_mod
    from minite.kernels import fp8_gemm as gemm_mod
    from minite.models.gpt import GPT, GPTConfig

    def run(linear_backend):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=32,
                              vocab_multiple=16)).to(device)
        for m in model.modules():
            if isinstance(m, Linear):
                m.backend = linear_backend                  # module attribute beats the use_backend() context
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        recipe, g, losses = DelayedScaling(amax_history_len=4), torch.Generator().manual_seed(1), []
        with minite.use_backend("torch"):                   # all other ops: reference, in both runs
            for _ in range(3):
                x = torch.randint(16, (4, 16), generator=g).to(device)            # (B, T)
                with fp8_autocast(recipe=recipe):
                    _, loss = model(x, torch.roll(x, -1, dims=1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses

    launches = {"fp8_gemm": 0, "quantize": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(gemm_mod, "fp8_gemm_fwd", counting("fp8_gemm", gemm_mod.fp8_gemm_fwd))
    monkeypatch.setattr(fp8_mod, "fp8_quantize_fwd", counting("quantize", fp8_mod.fp8_quantize_fwd))
    loss_triton = run("triton")
    # 4 FP8 linears (qkv, attention out, gate_up, down) x 3 GEMMs and 3 quantizations each x 3 steps
    assert launches == {"fp8_gemm": 36, "quantize": 36}, launches
    loss_torch = run("torch")
    assert launches == {"fp8_gemm": 36, "quantize": 36}, "torch backend launched Triton kernels"
    # Same quantization math; the GEMMs differ only in fp32 accumulation order, whose last-bit differences can
    # tip an occasional value across an fp8 rounding boundary later on: ~5e-4 measured, a real bug is >> 2e-3.
    gap = max(abs(a - b) for a, b in zip(loss_triton, loss_torch))
    assert gap < 2e-3, f"Triton {loss_triton} vs torch {loss_torch}: gap {gap:.2e}"
    assert loss_triton[0] > 2.0, f"untrained loss {loss_triton[0]:.3f} should be near ln(16) = 2.77"
