"""Chapter 02: per-tensor fp8 quantize (Triton vs torch, bit-exact), Float8Tensor, and the FP8 GEMM kernel.

No fp64 gradcheck here: fp8 quantization and fp8 GEMM operands have no gradient (the autograd of the FP8
linear layer is tested against explicit formulas in tests/layers/test_linear.py).
"""
import pytest
import torch

from minite.formats import E4M3, E5M2, Float8Tensor, dequantize, quantize
from minite.formats.fp8 import fp8_quantize_fwd, quantize_ref
from minite.formats.specs import decode_ref
from minite.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from minite.testing import assert_close, dtype_tols, fp8_dot_tolerance

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SPEC = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def _wide(shape, dtype, seed=0):
    """Values spanning ~10 decades, plus +-inf and 0 at the front: every fp8 regime gets exercised."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 4, shape[-1])
    x = x.to(dtype)
    x.view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), 0.0], dtype=dtype)
    return x


def _bits(q):
    return q.data.view(torch.uint8)


@pytest.mark.triton
@pytest.mark.parametrize("shape", [(37, 129), (64, 64), (5,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_triton_bit_exact(shape, dtype, fp8_dtype, device):
    x = _wide(shape, dtype).to(device)
    for scale in (1.0, 3.7, 1e3):
        a = quantize(x, scale, fp8_dtype=fp8_dtype, backend="triton")
        b = quantize(x, scale, fp8_dtype=fp8_dtype, backend="torch")
        diff = (_bits(a) != _bits(b)).sum().item()
        assert diff == 0, f"{diff} fp8 patterns differ ({dtype}, {fp8_dtype}, scale {scale})"
        assert a.data.dtype == fp8_dtype and a.data.shape == x.shape
        assert a.amax.item() == b.amax.item() == float("inf")


@pytest.mark.triton
def test_quantize_triton_amax_in_same_pass_and_nan(device):
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0)).to(device)  # several programs' partial amaxes
    x[2500] = -9.0
    q = quantize(x, 1.0, backend="triton")
    assert q.amax.item() == 9.0
    x[1234] = float("nan")
    q = quantize(x, 1.0, backend="triton")
    assert torch.isnan(q.amax) and torch.isnan(q.dequantize()[1234])


def test_quantize_ref_rounds_to_nearest_and_saturates():
    # independent of torch's casts: decode the bits with chapter 01's integer decoder and check the error bound
    for fp8_dtype in FP8:
        spec = SPEC[fp8_dtype]
        x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 100
        scale = torch.tensor(2.0)
        data, amax = quantize_ref(x, scale, fp8_dtype)
        vals = decode_ref(data.view(torch.uint8).int(), spec)
        xs = (x * scale).clamp(-spec.max, spec.max)
        half_ulp = torch.maximum(xs.abs() * spec.eps / 2, torch.tensor(spec.min_subnormal / 2))
        assert ((vals - xs).abs() <= half_ulp * (1 + 1e-6)).all()
        assert amax.item() == x.abs().max().item()
        # e5m2: torch's own cast would give inf for 1e6; quantize saturates to +-max
        big, _ = quantize_ref(torch.tensor([1e6, -1e6]), torch.tensor(1.0), fp8_dtype)
        assert big.float().tolist() == [spec.max, -spec.max]


def test_current_scaling_maps_amax_to_max():
    x = torch.randn(100) * 0.01
    q = quantize(x, fp8_dtype=torch.float8_e5m2, backend="torch")           # scale=None: current scaling
    assert q.data.float().abs().max().item() == 57344.0
    assert_close(q.dequantize(), x, atol=0, rtol=2 ** -3)    # E5M2: 2 mantissa bits -> half ulp 2^-3


def test_float8tensor_basics():
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    q = quantize(x, 8.0, backend="torch")
    assert q.dequantize().dtype == torch.bfloat16 and dequantize(q, torch.float32).dtype == torch.float32
    assert q.scale_inv.item() == 0.125 and q.scale_inv.dtype == torch.float32
    assert q.t().shape == (4, 6) and torch.equal(q.t().dequantize(), q.dequantize().t())
    assert "float8_e4m3fn" in repr(q)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        Float8Tensor(torch.zeros(3), torch.tensor(1.0))


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        quantize(torch.arange(4))
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize(torch.randn(4), 1.0, fp8_dtype=torch.float16)
    with pytest.raises(ValueError, match="scalar"):
        quantize(torch.randn(4), torch.ones(4))
    with pytest.raises(ValueError, match="Float8Tensor"):
        dequantize(torch.randn(4))


# ----------------------------------------------------------------------------------------------- FP8 GEMM
def _q(shape, fp8_dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(shape, generator=g).to(device), fp8_dtype=fp8_dtype, backend="torch")


@pytest.mark.triton
@pytest.mark.parametrize("mkn", [(33, 65, 17), (64, 64, 64), (1, 20, 3)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_gemm_triton_vs_ref(mkn, out_dtype, device):
    M, K, N = mkn
    a = _q((M, K), torch.float8_e4m3fn, 0, device)
    w = _q((N, K), torch.float8_e5m2, 1, device)                  # mixed formats, and B is a transposed view
    out = fp8_gemm(a, w.t(), out_dtype=out_dtype, backend="triton")
    ref = fp8_gemm_ref(a, w.t(), out_dtype)
    # fp32: summation order only. fp16/bf16: one rounding of the output (the interpreter truncates bf16).
    # On CUDA, + the tensor cores' ~14-bit accumulator error (minite.testing.fp8_dot_tolerance).
    tol = fp8_dot_tolerance(a, w.t(), device=device, atol=dtype_tols(out_dtype)["atol"] * 10,
                            rtol=dtype_tols(out_dtype)["rtol"])
    assert_close(out, ref, name=f"fp8_gemm {mkn}", **tol)


@pytest.mark.triton
def test_fp8_gemm_triton_strided_operands(device):
    a = _q((40, 24), torch.float8_e4m3fn, 2, device)
    b = _q((40, 18), torch.float8_e4m3fn, 3, device)
    out = fp8_gemm(a.t(), b, out_dtype=torch.float32, backend="triton")     # (24, 40) @ (40, 18), like wgrad
    tol = fp8_dot_tolerance(a.t(), b, device=device, atol=1e-4, rtol=1e-5)  # + the accumulator term on CUDA
    assert_close(out, fp8_gemm_ref(a.t(), b, torch.float32), name="wgrad-shaped gemm", **tol)


def test_fp8_gemm_ref_vs_float64():
    a = _q((9, 31), torch.float8_e4m3fn, 4)
    b = _q((31, 7), torch.float8_e5m2, 5)
    a64 = decode_ref(a.data.view(torch.uint8).int(), E4M3).double() * a.scale_inv.double()
    b64 = decode_ref(b.data.view(torch.uint8).int(), E5M2).double() * b.scale_inv.double()
    assert_close(fp8_gemm_ref(a, b, torch.float32), (a64 @ b64).float(), name="ref vs fp64", atol=1e-5)


def test_fp8_gemm_bad_input():
    a = _q((4, 8), torch.float8_e4m3fn, 0)
    with pytest.raises(ValueError, match="Float8Tensor"):
        fp8_gemm(a, torch.randn(8, 4))
    with pytest.raises(ValueError, match="inner dimensions"):
        fp8_gemm(a, a)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm(a, a.t(), out_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_hardware_cast_matches_bit_ops(fp8_dtype):
    x = _wide((1000, 257), torch.float32).cuda()
    a, _ = fp8_quantize_fwd(x, torch.tensor(3.0, device="cuda"), fp8_dtype, hw_cast=True)
    b, _ = fp8_quantize_fwd(x, torch.tensor(3.0, device="cuda"), fp8_dtype, hw_cast=False)
    assert (a.view(torch.uint8) != b.view(torch.uint8)).sum().item() == 0
