"""RMSNorm / LayerNorm: Triton kernels vs the reference, reference vs torch built-ins, gradcheck, errors."""
import pytest
import torch
import torch.nn.functional as F

from minite.kernels import rmsnorm as K
from minite.kernels.rmsnorm import LayerNorm, RMSNorm, layernorm, layernorm_ref, rmsnorm, rmsnorm_ref
from minite.testing import assert_close, check_op

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# odd C (masked lanes), power-of-two C, a 3-D input; 13 rows > the 4 backward programs used on CPU, so each
# program loops over several rows and the last one gets a short chunk.
SHAPES = [(13, 37), (4, 64), (2, 3, 40)]


def _inputs(shape, dtype, seed=0, device="cpu"):
    """x, weight, bias drawn from a seeded CPU generator (the same numbers on every device), then moved."""
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(C, generator=g)).to(dtype)  # not ones: a wrong use of w must show
    b = (0.5 * torch.randn(C, generator=g)).to(dtype)
    return x.to(device), w.to(device), b.to(device)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rmsnorm_triton_matches_reference(shape, dtype, device):
    x, w, _ = _inputs(shape, dtype, device=device)
    # output, grad x, grad weight
    assert check_op("rmsnorm", lambda x, w: rmsnorm(x, w, eps=1e-6, backend="triton"),
                    lambda x, w: rmsnorm_ref(x, w, 1e-6), x, w)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layernorm_triton_matches_reference(shape, dtype, device):
    x, w, b = _inputs(shape, dtype, device=device)
    # output, grad x, grad weight, grad bias
    assert check_op("layernorm", lambda x, w, b: layernorm(x, w, b, eps=1e-5, backend="triton"),
                    lambda x, w, b: layernorm_ref(x, w, b, 1e-5), x, w, b)


@pytest.mark.triton
def test_gradcheck_fp64(device):
    x, w, b = (t.double().requires_grad_() for t in _inputs((5, 7), torch.float64, device=device))
    assert torch.autograd.gradcheck(lambda x, w: K.RMSNormFunction.apply(x, w, 1e-6), (x, w), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, w, b: K.LayerNormFunction.apply(x, w, b, 1e-5), (x, w, b),
                                    fast_mode=True)


@pytest.mark.triton
@pytest.mark.parametrize("n_programs", [1, 3, 13])
def test_two_stage_dw_any_program_count(n_programs, device):
    """dx, dw, db do not depend on how rows are split among programs (1 = serial, 13 = one row each)."""
    x, w, b = _inputs((13, 24), torch.float32, seed=1, device=device)
    dy = _inputs((13, 24), torch.float32, seed=2, device=device)[0]
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    layernorm_ref(xr, wr, br, 1e-5).backward(dy)
    _, mean, rstd = K.layernorm_fwd(x, w, b, 1e-5)
    dx, dw, db = K.layernorm_bwd(dy, x, w, mean, rstd, n_programs=n_programs)
    assert_close(dx, xr.grad, name="dx")
    assert_close(dw, wr.grad, name="dw")
    assert_close(db, br.grad, name="db")
    xr.grad = wr.grad = None
    rmsnorm_ref(xr, wr, 1e-6).backward(dy)
    y, rstd = K.rmsnorm_fwd(x, w, 1e-6)
    dx, dw = K.rmsnorm_bwd(dy, x, w, rstd, n_programs=n_programs)
    assert_close(dx, xr.grad, name="dx")
    assert_close(dw, wr.grad, name="dw")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(13, 37), (2, 3, 40)], ids=str)
def test_layernorm_wide_row_db_on_host(shape, dtype, device, monkeypatch):
    """Rows wider than DB_IN_KERNEL_MAX (8192 columns on a GPU) leave db to the host (dy summed over rows), so the
    kernel holds one fp32 partial instead of two: forced here at small C. Output and every gradient."""
    monkeypatch.setattr(K, "DB_IN_KERNEL_MAX", 16)  # C = 37, 40 > 16: the wide path
    x, w, b = _inputs(shape, dtype, seed=6, device=device)
    assert check_op("layernorm wide", lambda x, w, b: layernorm(x, w, b, eps=1e-5, backend="triton"),
                    lambda x, w, b: layernorm_ref(x, w, b, 1e-5), x, w, b)
    dy = _inputs(shape, dtype, seed=7, device=device)[0]
    _, mean, rstd = K.layernorm_fwd(x, w, b, 1e-5)
    db = K.layernorm_bwd(dy, x, w, mean, rstd, n_programs=3)[2]
    assert_close(db, dy.float().reshape(-1, shape[-1]).sum(0).to(dtype), name="db")


@pytest.mark.triton
def test_saved_statistics(device):
    x, w, b = _inputs((6, 33), torch.float16, device=device)
    _, mean, rstd = K.layernorm_fwd(x, w, b, 1e-5)
    xf = x.float()
    assert mean.dtype == rstd.dtype == torch.float32  # fp32 statistics for a fp16 input
    assert_close(mean, xf.mean(-1), name="mean")
    assert_close(rstd, torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5), name="rstd")
    _, rstd = K.rmsnorm_fwd(x, w, 1e-6)
    assert_close(rstd, torch.rsqrt(xf.pow(2).mean(-1) + 1e-6), name="rstd")


@pytest.mark.triton
def test_non_contiguous_input_and_modules(device):
    x0, w, _ = _inputs((40, 6), torch.float32, seed=4, device=device)
    x = x0.t()  # (6, 40), stride along C is 6
    m = RMSNorm(40, backend="triton").to(device)
    with torch.no_grad():
        m.weight.copy_(_inputs((40,), torch.float32, seed=5, device=device)[0])
    assert_close(m(x), rmsnorm_ref(x, m.weight.detach()), name="rmsnorm non-contiguous")
    ln = LayerNorm(40, backend="triton").to(device)
    assert_close(ln(x), F.layer_norm(x, (40,)), name="layernorm module")


@pytest.mark.triton
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_strided_weight_and_bias(op, device):
    # weight/bias as every-other-element views (stride 2): the kernels index W_ptr + cols, so the launchers
    # must hand them a contiguous copy. Forward and the grads that flow back into the strided parents.
    g = torch.Generator().manual_seed(3)
    C = 37
    x0 = torch.randn(5, C, generator=g).to(device)
    wb0 = (1 + 0.5 * torch.randn(2 * C, generator=g)).to(device)
    bb0 = (0.5 * torch.randn(2 * C, generator=g)).to(device)
    dy = torch.randn(5, C, generator=g).to(device)
    outs = {}
    for backend in ("triton", "torch"):
        x, wb, bb = (t.clone().requires_grad_() for t in (x0, wb0, bb0))
        w, b = wb[::2], bb[1::2]  # (C,) each, stride 2
        assert w.stride() == (2,) and b.stride() == (2,)
        y = (rmsnorm(x, w, backend=backend) if op == "rmsnorm" else layernorm(x, w, b, backend=backend))
        y.backward(dy)
        outs[backend] = (y, x.grad, wb.grad, bb.grad if op == "layernorm" else torch.zeros(1, device=device))
    for name, a, r in zip(("y", "dx", "dweight", "dbias"), outs["triton"], outs["torch"]):
        assert_close(a, r, name=f"{op} strided {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_reference_matches_torch_builtins(dtype):
    x, w, b = _inputs((5, 48), dtype, seed=2)
    x = 3 * x + 1  # a non-zero mean, so RMSNorm and LayerNorm differ
    assert_close(rmsnorm_ref(x, w, 1e-6), F.rms_norm(x, (48,), w, 1e-6), name="rmsnorm_ref vs F.rms_norm")
    assert_close(layernorm_ref(x, w, b, 1e-5), F.layer_norm(x, (48,), w, b, 1e-5),
                 name="layernorm_ref vs F.layer_norm")
    assert not torch.allclose(rmsnorm_ref(x, w, 1e-6), layernorm_ref(x, w, torch.zeros_like(b), 1e-5))


def test_torch_backend_is_reference():
    x, w, b = _inputs((3, 10), torch.float32)
    assert torch.equal(rmsnorm(x, w, backend="torch"), rmsnorm_ref(x, w))
    assert torch.equal(layernorm(x, w, b, backend="torch"), layernorm_ref(x, w, b))


def test_module_state_dict_and_repr():
    assert list(RMSNorm(8).state_dict()) == ["weight"]
    assert list(LayerNorm(8).state_dict()) == ["weight", "bias"]
    assert "eps=1e-06" in repr(RMSNorm(8))
    m = RMSNorm(8, dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16 and m.weight.shape == (8,)


def test_bad_inputs():
    x, w, b = _inputs((3, 10), torch.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \(10,\).*\(9,\)"):
        rmsnorm(x, w[:9])
    with pytest.raises(ValueError, match=r"bias must have shape \(10,\)"):
        layernorm(x, w, b[:4])
    with pytest.raises(ValueError, match="bias is required"):
        layernorm(x, w, None)
    with pytest.raises(ValueError, match="floating-point.*int64"):
        rmsnorm(torch.ones(3, 10, dtype=torch.long), w)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        rmsnorm(torch.tensor(1.0), w)
    with pytest.raises(ValueError, match=r"eps must be finite and > 0, got 0.0"):
        rmsnorm(x, w, eps=0.0)
    with pytest.raises(ValueError, match="is on meta but x is on cpu"):
        rmsnorm(x, w.to("meta"))


@pytest.mark.triton
def test_too_wide_row_is_refused(device):
    with pytest.raises(ValueError, match="C=65537 exceeds 65536"):
        rmsnorm(torch.ones(1, 65537, device=device), torch.ones(65537, device=device), backend="triton")


# ------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 1000), (1024, 16384)], ids=str)
def test_gpu_rmsnorm_large_shapes(shape):
    # Realistic sizes (too slow for the interpreter): output and grads vs the reference. Speed is measured by
    # benchmarks/, never asserted in a test.
    C = shape[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to("cuda", torch.bfloat16)
    w = (1 + 0.5 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    assert check_op("rmsnorm large", lambda x, w: rmsnorm(x, w, eps=1e-6, backend="triton"),
                    lambda x, w: rmsnorm_ref(x, w, 1e-6), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 1000), (1024, 16384)], ids=str)  # 16384: db on the host
def test_gpu_layernorm_large_shapes(shape):
    C = shape[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to("cuda", torch.bfloat16)
    w = (1 + 0.5 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    b = (0.5 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    # output, grad x, grad weight, grad bias
    assert check_op("layernorm large", lambda x, w, b: layernorm(x, w, b, eps=1e-5, backend="triton"),
                    lambda x, w, b: layernorm_ref(x, w, b, 1e-5), x, w, b)
