"""FP8 GEMM accumulation modes ("split" promotes partial sums to fp32 every BLOCK_K, "fast" does not) and the
K-major operand copies of the launcher."""
import pytest
import torch

from minite.formats import quantize
from minite.kernels import fp8_gemm as G
from minite.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from minite.testing import assert_close, fp8_dot_tolerance


def _q(shape, seed, device):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)
    return quantize(x)


@pytest.mark.triton
@pytest.mark.parametrize("accumulate", ["split", "fast"])
@pytest.mark.parametrize("b_layout", ["k_major", "n_major"])
def test_modes_match_the_reference(device, accumulate, b_layout):
    # Odd M/N/K; B either K-contiguous (w.t()) or N-contiguous (the launcher then makes a K-major copy).
    a = _q((37, 70), 0, device)
    b = _q((45, 70), 1, device).t() if b_layout == "k_major" else _q((70, 45), 1, device)
    got = fp8_gemm(a, b, out_dtype=torch.float32, accumulate=accumulate, backend="triton")
    # CPU: summation order only. CUDA: + the tensor cores' ~14-bit accumulator (promoted every 128 in "split").
    tol = fp8_dot_tolerance(a, b, device=device, atol=1e-3, rtol=1e-4,
                            promote_every=128 if accumulate == "split" else None)
    assert_close(got, fp8_gemm_ref(a, b, torch.float32), name=f"{accumulate} {b_layout}", **tol)


@pytest.mark.triton
@pytest.mark.parametrize("accumulate", ["split", "fast"])
def test_a_nan_operand_gives_nan_where_the_reference_does(device, accumulate):
    # Issue 36: the interpreter's fp8 cast reads E4M3's NaN (0x7F) as 480, so a NaN in `a` came out finite; the
    # kernel now decodes the bits there (the GPU's own cast and MMA propagate NaN).
    x, w = torch.randn(9, 70), torch.randn(11, 70)
    x[2, 5], w[4, 60] = float("nan"), float("nan")
    a, b = quantize(x.to(device)), quantize(w.to(device)).t()
    got = fp8_gemm(a, b, out_dtype=torch.float32, accumulate=accumulate, backend="triton")
    want = fp8_gemm_ref(a, b, torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 9 + 11 - 1, got.isnan().sum()


@pytest.mark.triton
def test_k_major_copy_is_a_transpose(device):
    t = torch.randint(0, 256, (33, 70), dtype=torch.uint8).to(device)
    assert G._k_major(t, 1) is t  # already K-contiguous: no copy
    kt = G._k_major(t, 0)  # t (K=33, N=70) with unit stride along K
    assert kt.stride(0) == 1 and torch.equal(kt, t)


def test_accumulate_is_validated():
    a = quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="accumulate must be one of"):
        fp8_gemm(a, a.t(), accumulate="exact")


def test_gpu_tiles_are_legal_for_fp8_dot():
    # Every tl.dot dimension >= 16 and K >= 32 for fp8 (DESIGN §4), and BLOCK_K = 128 = the promotion interval.
    for bm, bn, bk, _, _ in G.GPU_TILES.values():
        assert bm >= 16 and bn >= 16 and bk == 128


@pytest.mark.gpu
def test_split_accumulation_matches_cublas_error():
    # At K = 8192 the split mode's error against the fp64 product is within 2x of cuBLAS's (use_fast_accum off);
    # the fast mode's is much larger (Hopper's ~14-bit accumulator), which is why dgrad/wgrad use split.
    a, w = _q((512, 8192), 0, "cuda"), _q((512, 8192), 1, "cuda")
    exact = a.dequantize(torch.float64) @ w.dequantize(torch.float64).t()

    def err(y):
        return ((y.double() - exact).abs().max() / exact.std()).item()

    split = err(fp8_gemm(a, w.t(), out_dtype=torch.float32, accumulate="split"))
    fast = err(fp8_gemm(a, w.t(), out_dtype=torch.float32, accumulate="fast"))
    cublas = err(torch._scaled_mm(a.data, w.data.t(), scale_a=a.scale_inv.reshape(()),
                                  scale_b=w.scale_inv.reshape(()), out_dtype=torch.float32))
    assert split <= 2 * cublas, (split, cublas)
    assert fast > 5 * split, (fast, split)


def test_fp8_dot_tolerance_is_tight_where_it_must_be():
    # The CUDA bound (computed here without a GPU: it only reads the device type) still rejects a kernel that
    # drops one K element or one 32-wide K chunk; on the CPU the test's own tolerance comes back unchanged.
    a, b = _q((37, 200), 0, "cpu"), _q((200, 45), 1, "cpu")
    assert fp8_dot_tolerance(a, b, device="cpu", atol=1e-3, rtol=1e-4) == {"atol": 1e-3, "rtol": 1e-4}
    A, B = a.dequantize(torch.float64), b.dequantize(torch.float64)
    split = fp8_dot_tolerance(a, b, device="cuda", atol=1e-3, rtol=1e-4)
    fast = fp8_dot_tolerance(a, b, device="cuda", atol=1e-3, rtol=1e-4, promote_every=None)
    mag = (A.abs() @ B.abs()).float()
    assert torch.allclose(split["atol"], 1e-3 + 4 * 2.0 ** -13 * mag)   # 128 / 32 = 4 MMA steps per promotion
    assert torch.allclose(fast["atol"], 1e-3 + 7 * 2.0 ** -13 * mag)    # never promoted: ceil(200 / 32) = 7
    exact = (A @ B).float()
    assert_close(exact, exact + 0.9 * (split["atol"] - 1e-3), name="within the bound", **split)
    for keep in (torch.arange(200) < 199, torch.arange(200) >= 32):       # a dropped element / K chunk
        with pytest.raises(AssertionError, match="elements differ"):
            assert_close((A[:, keep] @ B[keep]).float(), exact, name="wrong kernel", **fast)
