"""Block-scaled FP8 formats (chapter 15): E8M0, MX-32 (OCP MX v1.0) and the 1x128 / 128x128 blockwise scales.

Independent references: torch's own float8_e8m0fnu dtype for E8M0's values, and worked examples computed by hand
from the OCP Microscaling v1.0 rule (X = 2^(floor(log2 amax) - emax_elem), elements saturated to ±max). The Triton
quantize kernel is compared bit for bit with the PyTorch reference (formats/mx.py) on ragged shapes.
"""
import pytest
import torch

from minite.formats import E8M0, e8m0_decode, e8m0_encode, mx_scale_bits_ref, quantize_blockwise_ref, quantize_mx_ref
from minite.kernels.fp8_block import quantize_blockwise, quantize_mx

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


# ------------------------------------------------------------------------------------------------------ E8M0
def test_e8m0_decodes_like_torchs_float8_e8m0fnu():
    bits = torch.arange(256, dtype=torch.int32)
    want = bits.to(torch.uint8).view(torch.float8_e8m0fnu).float()    # torch's own E8M0 dtype
    got = e8m0_decode(bits)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[255])
    assert torch.equal(got[:255], want[:255])
    assert got[127] == 1.0 and got[0] == 2.0 ** -127 and got[254] == 2.0 ** 127
    assert (E8M0.bits, E8M0.bias, E8M0.min, E8M0.max) == (8, 127, 2.0 ** -127, 2.0 ** 127)


def test_e8m0_encode_powers_of_two_round_trip_and_rounding():
    bits = torch.arange(255, dtype=torch.int32)
    for rounding in ("floor", "ceil"):
        assert torch.equal(e8m0_encode(e8m0_decode(bits), rounding).long(), bits.long())
    x = torch.tensor([3.0, 1.0, 0.75, 6.0, 3e38, 2.0 ** -140])
    assert e8m0_encode(x).tolist() == [128, 127, 126, 129, 254, 0]                 # floor, clamped
    assert e8m0_encode(x, "ceil").tolist() == [129, 127, 127, 130, 254, 0]
    bad = torch.tensor([0.0, -2.0, float("inf"), float("nan")])                     # no E8M0 value: NaN
    assert e8m0_encode(bad).tolist() == [255] * 4
    with pytest.raises(ValueError, match="rounding must be 'floor' or 'ceil', got 'up'"):
        e8m0_encode(x, "up")
    with pytest.raises(ValueError, match="e8m0_decode expects an integer tensor"):
        e8m0_decode(x)


# ----------------------------------------------------------------------------------- OCP MX worked examples
def test_mx_scale_rule_worked_examples():
    # floor(log2 amax) - emax_elem, emax_elem = 8 (E4M3: 448 = 1.75 * 2^8) or 15 (E5M2), worked out by hand:
    amax = torch.tensor([6.0, 1.0, 500.0, 448.0, 0.0, 2.0 ** -130, 3e38, float("inf"), float("nan")])
    #                    2-8   0-8  8-8    8-8    0 -> -127, clamps; 127-8;  NaN     NaN
    assert mx_scale_bits_ref(amax, 8).tolist() == [121, 119, 127, 127, 0, 0, 246, 255, 255]
    assert mx_scale_bits_ref(amax[:2], 15).tolist() == [114, 112]


def test_mx_quantize_worked_example():
    x = torch.zeros(2, 64)
    x[0, :4] = torch.tensor([6.0, 0.1, -1.0, 0.001])   # block 0: amax 6 -> X = 2^-6, elements times 64
    x[0, 32:35] = torch.tensor([500.0, 1.0, 300.0])    # block 1: amax 500 -> X = 2^0; 500 saturates to 448
    x[1, 0] = float("nan")                             # block (1, 0): NaN scale, every element NaN
    q = quantize_mx_ref(x)
    assert q.scale.tolist() == [[121, 127], [255, 0]]   # row 1, block 1 is all zeros: 2^-127
    # 6 * 64 = 384 (exact); 0.1 * 64 = 6.4 -> 6.5 (E4M3 step 0.5 in [4, 8)); -64; 0.064 -> 0.0625 (subnormal 2^-4)
    assert q.data[0, :4].float().tolist() == [384.0, 6.5, -64.0, 0.0625]
    assert q.data[0, 32:35].float().tolist() == [448.0, 1.0, 288.0]              # 300 -> 288 (step 32)
    deq = q.dequantize()
    assert deq[0, :4].tolist() == [6.0, 6.5 / 64, -1.0, 0.0625 / 64]
    assert torch.isnan(deq[1, :32]).all() and (deq[1, 32:] == 0).all()


def test_blockwise_worked_example():
    x = torch.ones(2, 256)
    x[0, 5] = 2.0                            # block (0, 0): amax 2 -> scale 224, 1.0 -> 224 (= 1.75 * 2^7)
    x[1, 128:] = 0.0
    x[1, 130] = 1000.0                       # block (1, 1): 1000 and zeros -> amax 1000, scale 0.448
    q = quantize_blockwise_ref(x, (1, 128))
    assert q.scale[0, 0] == 1.0 / torch.tensor(224.0) and q.scale[0, 1] == 1.0 / torch.tensor(448.0)
    assert q.data[0, :6].float().tolist() == [224.0] * 5 + [448.0]
    assert q.data[1, 130].float() == 448.0 and q.data[1, 131].float() == 0.0
    assert q.data[1, 0].float() == 448.0 and q.scale[1, 1] == 1.0 / (448.0 / torch.tensor(1000.0))
    p = quantize_blockwise_ref(x, (1, 128), pow2=True)                              # 224 -> 128, 0.448 -> 0.25
    assert p.scale[0, 0] == 1.0 / 128 and p.scale[1, 1] == 4.0
    t = quantize_blockwise_ref(x, (128, 128))                                       # one tile per 128 columns
    assert t.scale.shape == (1, 2) and t.scale[0, 0] == 1.0 / torch.tensor(224.0)


def test_one_outlier_costs_per_tensor_scaling_but_not_block_scaling():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * 10 ** (-3 * torch.rand(64, 256, generator=g))   # 3 decades of sizes
    x[3, 7] = 100 * x.abs().max()                                   # one 100x outlier
    from minite.formats import quantize

    def err(deq):  # mean relative error per element, the outlier's own block excluded
        keep = torch.ones_like(x, dtype=torch.bool)
        keep[3, :128] = False
        return ((deq - x).abs() / x.abs())[keep].mean().item()
    per_tensor = err(quantize(x, backend="torch").dequantize())
    blockwise = err(quantize_blockwise_ref(x, (1, 128)).dequantize())
    mx = err(quantize_mx_ref(x).dequantize())
    assert blockwise < 0.04 and mx < 0.05 and per_tensor > 3 * blockwise, (per_tensor, blockwise, mx)


# ----------------------------------------------------------------------------------------- ragged edges
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (32, 32)])
def test_ragged_blocks_are_zero_padded(block):
    # K = 200 is not a multiple of 128: the last block holds 72 elements and behaves as if zero-padded.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 200, generator=g) * torch.logspace(-2, 2, 200)
    padded = torch.nn.functional.pad(x, (0, 256 - 200, 0, -37 % block[0]))
    q, p = quantize_blockwise_ref(x, block), quantize_blockwise_ref(padded, block)
    assert q.scale.shape == (-(-37 // block[0]), -(-200 // block[1]))
    assert torch.equal(q.scale, p.scale[:q.scale.shape[0], :q.scale.shape[1]])
    assert torch.equal(q.data.view(torch.uint8), p.data[:37, :200].view(torch.uint8))
    m, mp = quantize_mx_ref(x), quantize_mx_ref(padded)
    assert m.scale.shape == (37, 7) and torch.equal(m.scale, mp.scale[:37, :7])


def test_dequantize_is_within_half_an_e4m3_step():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 160, generator=g) * torch.logspace(-3, 3, 160)
    for q in (quantize_blockwise_ref(x, (1, 128)), quantize_blockwise_ref(x, (128, 128)), quantize_mx_ref(x)):
        deq = q.dequantize()
        s = q.scale_inv().repeat_interleave(q.block[0], 0).repeat_interleave(q.block[1], 1)[:16, :160]
        # relative 2^-4 for normals, plus half the smallest subnormal step 2^-9 * (the block's scale_inv) below;
        # MX's scale can leave the block's top above 448 X: those elements saturate to 448 X (OCP v1.0)
        ok = (deq - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * s
        sat = (x.abs() > 448 * s) & (deq.abs() == 448 * s)
        assert (ok | sat).all() if q.kind == "mx" else ok.all(), q
    assert sat.any()  # this tensor does have MX-saturated elements


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_non_finite_block_decodes_to_nan_never_a_finite_value(device, backend):
    # Issue 36: +inf in a 1 x 128 block became 448 (with scale 1 the block's other values lost their precision),
    # silently. Now a block holding inf or NaN has a NaN scale (MX: 0xFF) and decodes to NaN; other blocks are
    # untouched.
    x = _specials(device, torch.float32, 5)
    x[0, :4] = 1.0
    x[2, 3], x[4, 140] = float("inf"), -float("inf")                   # blocks (2, 0) and (4, 1); NaN at (7, 40)
    for q, (br, bc) in ((quantize_blockwise(x, (1, 128), backend=backend), (1, 128)),
                        (quantize_blockwise(x, (128, 128), backend=backend), (128, 128)),
                        (quantize_mx(x, backend=backend), (1, 32))):
        bad = torch.zeros(21, 160, dtype=torch.bool, device=device)
        for r, c in ((2, 3), (4, 140), (7, 40)):
            bad[r // br * br:(r // br + 1) * br, c // bc * bc:(c // bc + 1) * bc] = True
        deq = q.dequantize()
        assert torch.isnan(deq[bad]).all() and torch.isfinite(deq[~bad]).all(), q


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"x must be a 2-D float32/float16/bfloat16 tensor, got \(2, 3, 4\)"):
        quantize_blockwise_ref(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"block must be a pair of ints >= 1, got \(0, 128\)"):
        quantize_blockwise_ref(torch.zeros(2, 3), (0, 128))
    with pytest.raises(ValueError, match="fp8_dtype must be"):
        quantize_mx_ref(torch.zeros(2, 3), fp8_dtype=torch.float16)


@pytest.mark.triton
def test_the_kernel_refuses_blocks_it_cannot_tile(device):
    x = torch.zeros(2, 3).to(device)
    with pytest.raises(ValueError, match="power-of-two block >= 16 along a row, got 100"):
        quantize_blockwise(x, (1, 100), backend="triton")
    with pytest.raises(ValueError, match=r"blocks \(1, B\) or \(B, B\), got \(64, 128\)"):
        quantize_blockwise(x, (64, 128), backend="triton")


# ------------------------------------------------------------------------------------ Triton == reference
def _specials(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(21, 160, generator=g) * torch.logspace(-6, 4, 160)     # ragged: 160 = 128 + 32
    x[0, :4] = torch.tensor([float("inf"), -1e9, 0.0, -0.0])
    x[5] = 0.0                                                   # all-zero row: blocks with amax 0
    x[7, 40] = float("nan")                                      # NaN inside a block
    x[9, 150] = 1e-42                                           # an fp32 subnormal
    return x.to(device=device, dtype=dtype)


def _same_bits(a, b):
    # both computed on one device from the same x (CUDA's reference runs torch's CUDA casts: the same rule)
    assert a.data.device == b.data.device and a.scale.device == b.scale.device
    nan = torch.isnan(b.data.float())
    assert torch.equal(torch.isnan(a.data.float()), nan)
    diff = (a.data.view(torch.uint8) != b.data.view(torch.uint8)) & ~nan
    assert diff.sum() == 0, f"{diff.sum().item()} fp8 patterns differ"
    assert a.scale.dtype == b.scale.dtype and torch.equal(a.scale.isnan(), b.scale.isnan()), (a.scale, b.scale)
    assert torch.equal(a.scale.nan_to_num(0.0), b.scale.nan_to_num(0.0)), (a.scale, b.scale)   # NaN: a bad block


CASES = [(torch.float32, E4), (torch.float32, E5), (torch.bfloat16, E4), (torch.float16, E5)]


@pytest.mark.triton
@pytest.mark.parametrize("dtype, fp8", CASES)
def test_triton_blockwise_quantize_is_bit_exact(device, dtype, fp8):
    x = _specials(device, dtype, 3)
    for block, pow2 in (((1, 128), False), ((128, 128), False), ((1, 128), True), ((32, 32), False)):
        _same_bits(quantize_blockwise(x, block, fp8_dtype=fp8, pow2=pow2, backend="triton"),
                   quantize_blockwise_ref(x, block, fp8, pow2))


@pytest.mark.triton
@pytest.mark.parametrize("dtype, fp8", CASES[:3])
def test_triton_mx_quantize_is_bit_exact(device, dtype, fp8):
    x = _specials(device, dtype, 4)
    q = quantize_mx(x, fp8_dtype=fp8, backend="triton")
    _same_bits(q, quantize_mx_ref(x, fp8_dtype=fp8))
    assert q.scale[7, 1] == 255 and q.scale[5].eq(0).all()                          # NaN block, zero row


def test_mx_matches_torchao_where_it_is_installed():
    # torchao's MX reference (torchao.prototype.mx_formats, FLOOR scale mode = the OCP rule). Not a dependency of
    # minite: skipped without it. Checked by hand with torchao 0.18.0 (pip install --no-deps): equal bit for bit.
    to_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor").to_mx
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g) * 10 ** (4 * torch.rand(64, 1024, generator=g) - 2)
    x[3, :32] = 0.0
    for fp8 in (E4, E5):
        scale, data = to_mx(x, fp8, 32)
        q = quantize_mx_ref(x, fp8_dtype=fp8)
        assert torch.equal(scale.view(torch.uint8).reshape(q.scale.shape), q.scale)
        assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8))
