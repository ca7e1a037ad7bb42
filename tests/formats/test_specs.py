"""Bit-level formats: derived constants vs torch.finfo, encode/decode bit-exact against torch's casts.

Encode is checked on every fp16 bit pattern converted to bf16/e4m3/e5m2, and on > 10^6 fp32 values (random bit
patterns, log-uniform magnitudes over each format's range, exact ties and their neighbours, values around each
max, subnormals, ±0, ±inf, NaN) for every target format. Where the rounded value is out of range the expected
pattern comes from the format's stated overflow rule (torch's own choice has changed between versions).
"""
import pytest
import torch

from minite._triton import tl, triton
from minite.formats.mx import e8m0_decode, e8m0_encode
from minite.formats.specs import (
    BF16,
    E4M3,
    E5M2,
    E8M0,
    FP16,
    FP32,
    FormatSpec,
    bit_string,
    decode,
    decode_ref,
    encode,
    encode_ref,
    round_to_format,
)

SMALL = [FP16, BF16, E4M3, E5M2]            # the targets of an fp32 -> narrower encode
ALL = [FP32] + SMALL
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
_INT = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def run_on(fn, x, spec, backend, device, **kw):
    """fn(x, spec, backend=backend, **kw) with x on `device` for the Triton backend (CUDA, or the CPU with the
    interpreter: tests/conftest.py), on the CPU for the reference; the result comes back to the CPU."""
    return fn(x.to(device if backend == "triton" else "cpu"), spec, backend=backend, **kw).cpu()


def torch_bits(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """torch's own cast, as the int32 pattern convention of minite (low spec.bits bits)."""
    b = x.to(spec.torch_dtype).view(_INT[spec.bits]).to(torch.int32)
    return b if spec.bits == 32 else b & ((1 << spec.bits) - 1)


def all_patterns(spec: FormatSpec) -> torch.Tensor:
    return torch.arange(1 << spec.bits, dtype=torch.int32)


def expected_bits(x: torch.Tensor, spec: FormatSpec, saturate: bool) -> torch.Tensor:
    """torch's cast where the rounded value is in range; the stated overflow rule where it is not."""
    exp = torch_bits(x.clamp(-spec.max, spec.max), spec)   # clamp: no version-dependent overflow in torch
    exp = torch.where(x.isnan(), torch_bits(x, spec), exp)
    # the overflow threshold is max + half an ulp of max; a tie there rounds to the even neighbour, which is
    # 2^(emax+1) (overflow) for IEEE formats and max itself (mantissa 110) for E4M3fn
    half_ulp = 2.0 ** (spec.emax - spec.man_bits - 1)
    thr = spec.max + half_ulp
    over = (x.abs() > thr) if spec.fn else (x.abs() >= thr)
    sign = (x < 0).to(torch.int32) << (spec.bits - 1)
    top = (1 << spec.exp_bits) - 1
    ovf = spec.max_bits if saturate else ((top << spec.man_bits) | ((1 << spec.man_bits) - 1) if spec.fn
                                          else top << spec.man_bits)
    return torch.where(over & ~x.isnan(), sign | ovf, exp)


def is_nan_bits(b: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    top, mmask = (1 << spec.exp_bits) - 1, (1 << spec.man_bits) - 1
    e, m = (b >> spec.man_bits) & top, b & mmask
    return (e == top) & ((m == mmask) if spec.fn else (m != 0))


_EXPECTED: dict = {}


def expected_cached(x: torch.Tensor, spec: FormatSpec, saturate: bool) -> torch.Tensor:
    key = (id(x), x.numel(), spec.name, saturate)        # x is the module-scoped fixture: computed once per spec
    if key not in _EXPECTED:
        _EXPECTED[key] = expected_bits(x, spec, saturate)
    return _EXPECTED[key]


def assert_bits_equal(got: torch.Tensor, exp: torch.Tensor, x: torch.Tensor, spec: FormatSpec, what: str):
    assert got.dtype == torch.int32 and got.shape == exp.shape, (got.dtype, got.shape)
    nan_got, nan_exp = is_nan_bits(got, spec), is_nan_bits(exp, spec)
    bad = (nan_got != nan_exp) | (~nan_exp & (got != exp))              # NaN compared as NaN
    if bad.any():
        i = bad.nonzero()[:5, 0]
        rows = [f"x={x[j].item()!r} got {bit_string(got[j].item(), spec)} want {bit_string(exp[j].item(), spec)}"
                for j in i]
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.numel()} patterns differ, e.g.\n" + "\n".join(rows))


@pytest.fixture(scope="module")
def fp32_values() -> torch.Tensor:
    """>= 10^6 fp32 values that stress every target format."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(-2 ** 31, 2 ** 31, (250_000,), generator=g, dtype=torch.int64).to(torch.int32)
             .view(torch.float32)]                                            # any pattern: NaNs, huge, tiny
    for spec in SMALL:
        lo, hi = torch.tensor(spec.min_subnormal).log2() - 2, torch.tensor(spec.max).log2() + 1
        mag = torch.exp2(lo + (hi - lo) * torch.rand(120_000, generator=g, dtype=torch.float64))
        parts.append((mag * torch.randn(120_000, generator=g, dtype=torch.float64).sign()).float())
        # exact ties between neighbours of the format, and the fp32 values just beside them
        v = decode_ref(all_patterns(spec) if spec.bits == 8 else
                       torch.randint(0, 1 << spec.bits, (40_000,), generator=g, dtype=torch.int32), spec)
        nxt = decode_ref(encode_ref(v, spec) + 1, spec)                  # next pattern up in magnitude
        mid = ((v.double() + nxt.double()) / 2).float()                  # exact: needs M + 2 bits < 24
        mid = mid[mid.isfinite()]
        parts += [mid, torch.nextafter(mid, mid * 2), torch.nextafter(mid, mid * 0), v]
        # around max and the overflow threshold, around min_normal / min_subnormal
        for c in (spec.max, spec.max + 2.0 ** (spec.emax - spec.man_bits - 1), spec.min_normal,
                  spec.min_subnormal, spec.min_subnormal / 2):
            t = torch.tensor([c] * 64, dtype=torch.float32)
            for _ in range(3):
                t = torch.cat([t, torch.nextafter(t, t * 2), torch.nextafter(t, t * 0)])
            parts += [t, -t]
    parts.append(torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-45, -1e-45,
                               1.1754942e-38, 3.4028235e38, -3.4028235e38]))
    x = torch.cat(parts)
    assert x.numel() >= 1_000_000, x.numel()
    return x


# ---------------------------------------------------------------------------------------------- constants
@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.name)
def test_derived_constants_match_finfo(spec):
    fi = torch.finfo(spec.torch_dtype)
    assert spec.bits == fi.bits
    assert spec.max == fi.max and spec.min_normal == fi.smallest_normal and spec.eps == fi.eps
    # the smallest subnormal is the pattern 0...01
    assert spec.min_subnormal == decode_ref(torch.tensor([1]), spec).item() > 0
    assert spec.max == decode_ref(torch.tensor([spec.max_bits]), spec).item()


def test_bit_string_and_hand_examples():
    assert bit_string(0x3C00, FP16) == "0 01111 0000000000"
    assert bit_string(encode(torch.tensor([-2.0]), E4M3, backend="torch").item(), E4M3) == "1 1000 000"
    assert encode(torch.tensor([1.0, 65504.0, 2.0 ** -24]), FP16, backend="torch").tolist() == [0x3C00, 0x7BFF, 1]
    assert encode(torch.tensor([448.0, 2.0 ** -9]), E4M3, backend="torch").tolist() == [0x7E, 0x01]
    assert BF16.max == FP32.max * (1 - 2 ** -8) / (1 - 2 ** -24)         # 1.1111111 vs 1.111...1 times 2^127


# ---------------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.name)
def test_decode_every_pattern(spec, backend, device):
    if spec.bits == 32:   # 2^32 patterns is too many: 65536 random ones plus the special ones
        b = torch.cat([torch.randint(-2 ** 31, 2 ** 31, (65536,), generator=torch.Generator().manual_seed(1),
                                     dtype=torch.int64).to(torch.int32),
                       torch.tensor([0, 1, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x007FFFFF], dtype=torch.int32)])
        want = b.view(torch.float32)
    else:
        b = all_patterns(spec)
        want = b.to(_INT[spec.bits]).view(spec.torch_dtype).float()
    got = run_on(decode, b, spec, backend, device)
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))   # bit-exact, -0.0 included


# ---------------------------------------------------------------------------------------------- encode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [BF16, E4M3, E5M2, FP16], ids=lambda s: s.name)
def test_encode_every_fp16_pattern(spec, backend, device):
    x = all_patterns(FP16).to(torch.int16).view(torch.float16)         # all 65,536 fp16 values
    got = run_on(encode, x, spec, backend, device)                      # fp16 in, converted to fp32 exactly
    assert_bits_equal(got, expected_bits(x.float(), spec, spec.saturate), x.float(), spec, f"fp16 -> {spec.name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SMALL, ids=lambda s: s.name)
def test_encode_fp32_values(spec, backend, fp32_values, device):
    x = fp32_values
    got = run_on(encode, x, spec, backend, device)
    assert_bits_equal(got, expected_cached(x, spec, spec.saturate), x, spec, f"fp32 -> {spec.name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SMALL, ids=lambda s: s.name)
def test_encode_other_overflow_rule(spec, backend, fp32_values, device):
    x = fp32_values[-300_000:]     # the ties/threshold/max parts of the set, plus the specials
    sat = not spec.saturate
    assert_bits_equal(run_on(encode, x, spec, backend, device, saturate=sat), expected_bits(x, spec, sat), x, spec,
                      f"fp32 -> {spec.name} saturate={sat}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_rules_by_hand(backend, device):
    x = torch.tensor([500.0, -1e30, float("inf"), -float("inf"), float("nan"), 464.0, 465.0])
    e4 = decode(run_on(encode, x, E4M3, backend, device), E4M3).tolist()
    assert e4[:4] == [448.0, -448.0, 448.0, -448.0] and e4[5:] == [448.0, 448.0]    # 464 is a tie -> even 448
    assert all(v != v for v in decode(run_on(encode, x[:5], E4M3, backend, device, saturate=False), E4M3).tolist())
    e5 = decode(run_on(encode, torch.tensor([61439.0, 61440.0, -1e6]), E5M2, backend, device), E5M2).tolist()
    assert e5 == [57344.0, float("inf"), -float("inf")]
    e5s = decode(run_on(encode, torch.tensor([1e6, -float("inf"), float("nan")]), E5M2, backend, device, saturate=True),
                 E5M2)
    assert e5s[:2].tolist() == [57344.0, -57344.0] and e5s[2].isnan()


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_fp32_is_identity_and_shapes_kept(backend, fp32_values, device):
    x = fp32_values[:20_000].view(100, 200).t()                         # non-contiguous (200, 100)
    got = run_on(encode, x, FP32, backend, device)
    assert got.shape == (200, 100)
    ok = ~x.isnan()
    assert torch.equal(got[ok], x.contiguous().view(torch.int32)[ok])
    assert torch.equal(run_on(round_to_format, x, BF16, backend, device)[ok], x.to(torch.bfloat16).float()[ok])


@pytest.mark.triton
def test_reference_and_triton_agree_on_odd_size(device):
    x = torch.randn(1237, generator=torch.Generator().manual_seed(0)) * 300
    for spec in SMALL:
        assert torch.equal(run_on(encode, x, spec, "triton", device), encode(x, spec, backend="torch"))


# --------------------------------------------------------------------- the scale format E8M0, in the same language
@pytest.mark.parametrize("backend", BACKENDS)
def test_e8m0_is_a_format_like_the_others(backend, device):
    # Issue 35: decode(bits, E8M0) refused ("spec must be a FormatSpec"). Now every pattern decodes as torch's own
    # float8_e8m0fnu does, encode takes a value's exponent rounded down (OCP MX), and bit_string prints it.
    bits = torch.arange(256, dtype=torch.int32)
    want = bits.to(torch.uint8).view(torch.float8_e8m0fnu).float()
    got = run_on(decode, bits, E8M0, backend, device)
    assert torch.equal(got[:255], want[:255]) and got[255].isnan() and got[0] == 2.0 ** -127
    assert torch.equal(run_on(encode, got[:255], E8M0, backend, device), bits[:255])      # round trip
    x = torch.tensor([3.0, 1.0, 0.75, 6.0, 3e38, 2.0 ** -140, 1e-45, 2.0 ** -126, 0.0, -0.0, -2.0, float("inf"),
                      float("nan")])
    assert run_on(encode, x, E8M0, backend, device).tolist() == [128, 127, 126, 129, 254, 0, 0, 1] + [255] * 5
    assert torch.equal(run_on(round_to_format, x[:4], E8M0, backend, device), torch.tensor([2.0, 1.0, 0.5, 4.0]))
    assert torch.equal(run_on(encode, x, E8M0, backend, device, saturate=False),
                       run_on(encode, x, E8M0, backend, device))                 # fp32 never rounds down past 2^127
    assert bit_string(127, E8M0) == "01111111" and (E8M0.bits, E8M0.min, E8M0.max) == (8, 2.0 ** -127, 2.0 ** 127)
    # the MX code's uint8 spellings agree
    torch.testing.assert_close(e8m0_decode(bits), decode(bits, E8M0, backend="torch"), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(e8m0_encode(x).long(), encode(x, E8M0, backend="torch").long())


def test_bad_inputs():
    with pytest.raises(ValueError, match="float64"):
        encode(torch.zeros(3, dtype=torch.float64), FP16)
    with pytest.raises(ValueError, match="int32"):
        encode(torch.zeros(3, dtype=torch.int32), FP16)
    with pytest.raises(ValueError, match="integer tensor"):
        decode(torch.zeros(3), FP16)
    with pytest.raises(TypeError, match=r"FormatSpec \(FP32, FP16, BF16, E4M3, E5M2\) or a ScaleSpec \(E8M0\)"):
        encode(torch.zeros(3), "fp16")
    with pytest.raises(AttributeError):
        FP16.man_bits = 3                                               # frozen


# ---------------------------------------------------------------------------------------------- GPU
if triton.__class__.__name__ != "_TritonStub":
    @triton.jit
    def _hw_cast_kernel(X_ptr, Y_ptr, N, E5: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(X_ptr + offs, mask=offs < N, other=0.0)
        y = x.to(tl.float8e5) if E5 else x.to(tl.float8e4nv)           # the hardware cvt.rn(.satfinite)
        tl.store(Y_ptr + offs, y.to(tl.uint8, bitcast=True), mask=offs < N)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [E4M3, E5M2], ids=lambda s: s.name)
def test_hardware_cast_matches_encode(spec, fp32_values):
    x = fp32_values.cuda()
    x = x[x.abs() <= spec.max]                       # in range: the hardware's overflow rule is not ours to test
    y = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    _hw_cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), spec is E5M2, BLOCK_SIZE=1024)
    got = encode(x, spec, backend="triton")
    assert_bits_equal(y.to(torch.int32).cpu(), got.cpu(), x.cpu(), spec, f"hardware {spec.name} vs encode")
    assert_bits_equal(got.cpu(), torch_bits(x.cpu(), spec), x.cpu(), spec, f"encode on CUDA vs torch {spec.name}")
