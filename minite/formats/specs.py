"""Floating-point formats from their bits (chapter 01): FP32, FP16, BF16, E4M3, E5M2; and (chapter 15) the scale
format E8M0, in the same language: ``encode``/``decode``/``round_to_format``/``bit_string`` take either kind.

A format is (exponent bits E, mantissa bits M, bias, special-value rule); everything else is derived:

    value = (-1)^s * 2^(e - bias) * (1 + m / 2^M)      exponent field e in 1 .. (top), "normal"
          = (-1)^s * 2^(1 - bias) * (m / 2^M)           e == 0, "subnormal" (and ±0)

Special-value rules:
* IEEE (FP32, FP16, BF16, E5M2): e all ones is inf (m == 0) or NaN (m != 0).
* "fn" (E4M3 as float8_e4m3fn): no inf; only S.1111.111 is NaN, so S.1111.000-110 are normal and max = 448.

Overflow rule of ``encode`` (a value whose round-to-nearest-even result is above ``max``, or ±inf):
* FP16, BF16, E5M2 (``saturate=False``, the IEEE rule): ±inf.
* E4M3 (``saturate=True``): ±max (448), like torch's float8_e4m3fn cast and PTX ``cvt.rn.satfinite``;
  with ``saturate=False`` E4M3 overflows to NaN (it has no inf).
``saturate=True`` maps finite overflow *and* ±inf to ±max; NaN stays NaN.

A scale format (``ScaleSpec``: OCP MX's E8M0) is an exponent alone: no sign, no mantissa, value 2^(bits - bias),
the all-ones pattern NaN, no zero or inf. ``encode`` takes the exponent of a positive value rounded down (the MX
rule; ``mx.e8m0_encode`` also rounds up); out of range it clamps to min / max (``saturate=False``: above max is
NaN); x <= 0, inf and NaN have no value and encode to NaN.

Bit patterns are int32 tensors: the low ``spec.bits`` bits hold the pattern (0 <= b < 2**bits); for FP32
the int32 with the float's bits. Sections: 1. ``FormatSpec``, references ``encode_ref``/``decode_ref`` (torch
integer ops: the spec); 2. Triton helpers ``encode_bits_tl``/``decode_bits_tl`` (chapter 02's fp8 kernels use
them: stable signatures) and kernels; 3. launchers; 5. ``encode``/``decode``. No autograd: bits have no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minite import _validate as _v
from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend

__all__ = ["FormatSpec", "ScaleSpec", "FP32", "FP16", "BF16", "E4M3", "E5M2", "E8M0", "FORMATS", "encode", "decode",
           "encode_ref", "decode_ref", "round_to_format", "bit_string", "encode_bits_tl", "decode_bits_tl",
           "decode_scale_tl"]


# --------------------------------------------------------------------------------------------- 1. spec
@dataclass(frozen=True)
class FormatSpec:
    """A binary floating-point format. ``fn=True``: no inf, only the all-ones pattern is NaN."""
    name: str
    exp_bits: int
    man_bits: int
    bias: int
    fn: bool = False
    saturate: bool = False          # default overflow rule of encode(): ±max (True) or ±inf/NaN (False)
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:          # 1 sign bit + E + M
        return 1 + self.exp_bits + self.man_bits

    @property
    def emin(self) -> int:          # exponent of the smallest normal
        return 1 - self.bias

    @property
    def emax(self) -> int:          # exponent of the largest finite value
        top = (1 << self.exp_bits) - 1          # the all-ones exponent field
        return top - self.bias if self.fn else top - 1 - self.bias

    @property
    def max(self) -> float:         # IEEE: 1.11..1 * 2^emax; fn: 1.11..0 * 2^emax (1.11..1 is NaN)
        top_mantissa = (1 << self.man_bits) - (2 if self.fn else 1)
        return (1 + top_mantissa / 2 ** self.man_bits) * 2.0 ** self.emax

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.man_bits)

    @property
    def eps(self) -> float:         # gap between 1 and the next value
        return 2.0 ** -self.man_bits

    @property
    def max_bits(self) -> int:      # pattern of +max
        top = (1 << self.exp_bits) - 1
        return (top << self.man_bits) | ((1 << self.man_bits) - 2) if self.fn else \
            ((top - 1) << self.man_bits) | ((1 << self.man_bits) - 1)


FP32 = FormatSpec("fp32", 8, 23, 127, torch_dtype=torch.float32)
FP16 = FormatSpec("fp16", 5, 10, 15, torch_dtype=torch.float16)
BF16 = FormatSpec("bf16", 8, 7, 127, torch_dtype=torch.bfloat16)       # FP32's exponent: FP32's range
E4M3 = FormatSpec("e4m3", 4, 3, 7, fn=True, saturate=True, torch_dtype=getattr(torch, "float8_e4m3fn", None))
E5M2 = FormatSpec("e5m2", 5, 2, 15, torch_dtype=getattr(torch, "float8_e5m2", None))
FORMATS = (FP32, FP16, BF16, E4M3, E5M2)


@dataclass(frozen=True)
class ScaleSpec:
    """An unsigned exponent-only format (OCP MX's E8M0): value = 2^(bits - bias), ``nan_bits`` is NaN."""
    name: str
    exp_bits: int
    bias: int
    nan_bits: int
    saturate: bool = True           # default overflow rule of encode(): clamp to max (True) or NaN (False)
    man_bits: int = 0               # no mantissa (and no sign): the fields an element format also has

    @property
    def bits(self) -> int:
        return self.exp_bits

    @property
    def emin(self) -> int:          # bits 0 -> 2^-bias
        return -self.bias

    @property
    def emax(self) -> int:          # the pattern below nan_bits
        return (1 << self.exp_bits) - 2 - self.bias

    @property
    def min(self) -> float:
        return 2.0 ** self.emin

    @property
    def max(self) -> float:
        return 2.0 ** self.emax


E8M0 = ScaleSpec("e8m0", 8, 127, 0xFF)          # fp32's exponent range, 2^-127 .. 2^127


def bit_string(bits: int, spec: FormatSpec) -> str:
    """'s eeeee mmmmmmmmmm' for one pattern, e.g. bit_string(0x3C00, FP16) == '0 01111 0000000000'."""
    b = format(int(bits) & ((1 << spec.bits) - 1), f"0{spec.bits}b")
    return b if isinstance(spec, ScaleSpec) else f"{b[0]} {b[1:1 + spec.exp_bits]} {b[1 + spec.exp_bits:]}"


def _encode_scale_ref(x: torch.Tensor, spec: ScaleSpec, saturate: bool, rounding: str = "floor") -> torch.Tensor:
    """Positive values -> the exponent of a power of two near x (rounded down, or up with "ceil"), int64."""
    xd = x.detach().double()
    mant, exp = torch.frexp(xd)                           # x = mant * 2^exp, mant in [0.5, 1)
    e = exp.long() - 1                                    # floor(log2 x)
    if rounding == "ceil":
        e = e + (mant != 0.5).long()                      # not a power of two: one up
    bits = e.clamp(spec.emin, spec.emax) + spec.bias
    bad = ~((xd > 0) & torch.isfinite(xd)) | ((e > spec.emax) & (not saturate))
    return torch.where(bad, torch.full_like(bits, spec.nan_bits), bits)


def encode_ref(x: torch.Tensor, spec: FormatSpec, saturate: bool | None = None) -> torch.Tensor:
    """Reference: fp32 values -> int32 bit patterns of `spec`, round-to-nearest-even, with integer ops only."""
    sat = spec.saturate if saturate is None else saturate
    if isinstance(spec, ScaleSpec):
        return _encode_scale_ref(x.float(), spec, sat).to(torch.int32)
    E, M = spec.exp_bits, spec.man_bits
    u = x.float().view(torch.int32).long() & 0xFFFFFFFF          # work in int64: no sign-bit surprises
    sign, a = u >> 31, u & 0x7FFFFFFF                              # sign, |x| as bits
    e32 = a >> 23                                                  # biased fp32 exponent, 0 for subnormals
    e32eff = e32.clamp(min=1)                                      # fp32 subnormals use exponent 1
    sig = torch.where(e32 > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)   # x = sig * 2^(e32eff-150)
    e = (e32eff - 127).clamp(min=spec.emin)                        # target exponent (emin in subnormal range)
    shift = (e - M - e32eff + 150).clamp(max=26)                   # bits of sig below the target's last bit
    r = sig >> shift                                               # truncated count of target quanta
    rem, half = sig - (r << shift), (1 << shift) >> 1              # dropped bits, and half a quantum
    r = r + ((rem > half) | ((rem == half) & (half > 0) & (r & 1 == 1))).long()   # round half to even
    mag = ((e - spec.emin) << M) + r                               # a carry into the exponent is automatic
    top = (1 << E) - 1
    nan_bits = (top << M) | ((1 << M) - 1 if spec.fn else 1 << (M - 1))
    ovf_bits = spec.max_bits if sat else (nan_bits if spec.fn else top << M)
    mag = torch.where((mag > spec.max_bits) | (a == 0x7F800000), ovf_bits, mag)   # overflow and ±inf
    mag = torch.where(a > 0x7F800000, nan_bits, mag)                                # NaN
    out = (sign << (E + M)) | mag
    return (out - ((out >> 31) << 32)).to(torch.int32) if spec.bits == 32 else out.to(torch.int32)


def decode_ref(bits: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Reference: int bit patterns of `spec` -> float32 values (exact: every format here fits in fp32)."""
    if isinstance(spec, ScaleSpec):  # 2^(b - bias); 2^-127 is an fp32 subnormal, still exact
        b = bits.long() & ((1 << spec.bits) - 1)
        v = torch.ldexp(torch.ones_like(b, dtype=torch.float64), (b - spec.bias).double())
        return torch.where(b == spec.nan_bits, float("nan"), v).float()
    E, M = spec.exp_bits, spec.man_bits
    b = bits.long() & ((1 << spec.bits) - 1)
    sign, e, m = b >> (E + M), (b >> M) & ((1 << E) - 1), b & ((1 << M) - 1)
    normal = torch.ldexp((m + (1 << M)).double(), (e - spec.bias - M).double())     # 1.m * 2^(e-bias)
    sub = torch.ldexp(m.double(), torch.full_like(m, spec.emin - M).double())       # 0.m * 2^emin
    v = torch.where(e == 0, sub, normal)
    top = (1 << E) - 1
    if spec.fn:
        v = torch.where((e == top) & (m == (1 << M) - 1), float("nan"), v)
    else:
        v = torch.where(e == top, torch.where(m == 0, float("inf"), float("nan")), v)
    return torch.where(sign == 1, -v, v).float()


# --------------------------------------------------------------------------------------------- 2. kernels
@triton.jit
def encode_bits_tl(x, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, SATURATE: tl.constexpr, FN: tl.constexpr):
    """fp32 block `x` -> int32 bit patterns of the (1, EXP_BITS, MAN_BITS) format, bias 2^(EXP_BITS-1)-1.

    Round-to-nearest-even with integer operations only (the interpreter's fp8 casts are wrong, and this is
    exact everywhere): subnormals, ±0, NaN (-> canonical NaN), and the overflow rule: SATURATE=True maps
    values rounding above max, and ±inf, to ±max; otherwise to ±inf, or NaN when FN. FN is the float8_e4m3fn
    convention: no inf, only S.1..1.1..1 is NaN, max = 1.1..10 * 2^(2^E-1-bias) (448 for E4M3).
    The pattern sits in the low 1+EXP_BITS+MAN_BITS bits (sign on top). Stable API: chapter 02 uses it.
    """
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    EMIN: tl.constexpr = 1 - BIAS                       # exponent of the smallest normal
    TOP: tl.constexpr = (1 << EXP_BITS) - 1             # the all-ones exponent field
    if FN:                                              # S.1111.110 is max, S.1111.111 is NaN
        MAX_BITS: tl.constexpr = (TOP << MAN_BITS) | ((1 << MAN_BITS) - 2)
        NAN_BITS: tl.constexpr = (TOP << MAN_BITS) | ((1 << MAN_BITS) - 1)
        OVF_BITS: tl.constexpr = NAN_BITS
    else:                                               # IEEE: S.11111.00 is inf, quiet NaN has the top m bit
        MAX_BITS: tl.constexpr = ((TOP - 1) << MAN_BITS) | ((1 << MAN_BITS) - 1)
        NAN_BITS: tl.constexpr = (TOP << MAN_BITS) | (1 << (MAN_BITS - 1))
        OVF_BITS: tl.constexpr = TOP << MAN_BITS
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1                                # >> is arithmetic on int32: mask it
    a = u & 0x7FFFFFFF                                  # |x| as bits; > 0x7F800000 means NaN
    e32 = a >> 23                                       # biased fp32 exponent (0: fp32 subnormal)
    e32eff = tl.maximum(e32, 1)
    # x = sig * 2^(e32eff - 150), sig < 2^24 (hidden bit added for normals)
    sig = tl.where(e32 > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    # target exponent; below EMIN the quantum stays 2^(EMIN-MAN_BITS) (subnormals)
    e = tl.maximum(e32eff - 127, EMIN)
    # how many low bits of sig fall below the target quantum (>= 23-MAN_BITS; capped: sig >> 26 is 0 anyway)
    shift = tl.minimum(e - MAN_BITS - e32eff + 150, 26)
    r = sig >> shift                                    # truncated number of quanta
    rem = sig - (r << shift)                            # the dropped bits
    half = (1 << shift) >> 1                            # half a quantum (0 when nothing is dropped)
    up = (rem > half) | ((rem == half) & (half > 0) & ((r & 1) == 1))   # round half to even
    r = r + up.to(tl.int32)
    # normal: r = 2^M + m, pattern = (e-EMIN+1) << M | m = ((e-EMIN) << M) + r; subnormal: pattern = r.
    # A rounding carry (r = 2^(M+1)) moves into the exponent field by itself.
    mag = ((e - EMIN) << MAN_BITS) + r
    over = (mag > MAX_BITS) | (a == 0x7F800000)         # rounds past max, or is ±inf
    if SATURATE:
        mag = tl.where(over, MAX_BITS, mag)
    else:
        mag = tl.where(over, OVF_BITS, mag)
    mag = tl.where(a > 0x7F800000, NAN_BITS, mag)
    return (sign << (EXP_BITS + MAN_BITS)) | mag


@triton.jit
def decode_bits_tl(bits, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, FN: tl.constexpr):
    """int32 bit patterns (low 1+EXP_BITS+MAN_BITS bits) -> fp32 values, exactly. Stable API (chapter 02)."""
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    TOP: tl.constexpr = (1 << EXP_BITS) - 1
    MMASK: tl.constexpr = (1 << MAN_BITS) - 1
    sign = (bits >> (EXP_BITS + MAN_BITS)) & 1
    e = (bits >> MAN_BITS) & TOP                        # exponent field
    m = bits & MMASK                                    # mantissa field
    if EXP_BITS == 8:
        # FP32's exponent (BF16, FP32): the fields are fp32's own, subnormals included -> just shift
        out = (sign << 31) | (e << 23) | (m << (23 - MAN_BITS))
    else:
        # normal: re-bias the exponent, left-align the mantissa in fp32's 23 bits
        normal = (sign << 31) | ((e - BIAS + 127) << 23) | (m << (23 - MAN_BITS))
        # subnormal m * 2^(1-BIAS-MAN_BITS) is an fp32 *normal*: exact int->float, times a power of two
        scale = tl.full(bits.shape, (1 - BIAS - MAN_BITS + 127) << 23, tl.int32).to(tl.float32, bitcast=True)
        sub = (m.to(tl.float32) * scale).to(tl.int32, bitcast=True) | (sign << 31)
        out = tl.where(e == 0, sub, normal)
        if FN:                                          # only S.1..1.1..1 is NaN
            out = tl.where((e == TOP) & (m == MMASK), 0x7FC00000, out)
        else:                                           # e all ones: inf (m == 0) or NaN
            out = tl.where(e == TOP, tl.where(m == 0, (sign << 31) | 0x7F800000, 0x7FC00000), out)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _encode_scale_tl(x, EXP_BITS: tl.constexpr, BIAS: tl.constexpr, SATURATE: tl.constexpr):
    # fp32 -> a scale format's bits: floor(log2 x) is fp32's exponent field minus 127 (an fp32 subnormal, field 0,
    # is below 2^-126 and clamps to emin >= -127); x <= 0, inf, NaN -> NaN (all ones)
    NAN_BITS: tl.constexpr = (1 << EXP_BITS) - 1
    u = x.to(tl.int32, bitcast=True)
    e = ((u >> 23) & 0xFF) - 127
    bits = tl.minimum(tl.maximum(e, -BIAS), NAN_BITS - 1 - BIAS) + BIAS
    bad = (u <= 0) | (e == 128)                        # sign bit or zero; inf / NaN
    if not SATURATE:
        bad = bad | (e > NAN_BITS - 1 - BIAS)
    return tl.where(bad, NAN_BITS, bits)


@triton.jit
def decode_scale_tl(bits, EXP_BITS: tl.constexpr, BIAS: tl.constexpr):
    """int32 bits of a scale format (E8M0: 8, 127) -> fp32 2^(bits - BIAS); all ones -> NaN. Exponents below
    -126 are fp32 subnormals (2^-127: 0x00400000). The block GEMMs decode their E8M0 scales with it."""
    e = (bits & ((1 << EXP_BITS) - 1)) - BIAS
    v = tl.where(e >= -126, (e + 127) << 23, 1 << tl.maximum(e + 149, 0))
    return tl.where(e == (1 << EXP_BITS) - 1 - BIAS, 0x7FC00000, v).to(tl.float32, bitcast=True)


@triton.jit
def _encode_kernel(X_ptr, Y_ptr, N, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, SATURATE: tl.constexpr,
                   FN: tl.constexpr, SCALE_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # one program encodes BLOCK_SIZE consecutive values of the flat (N,) fp32 input; SCALE_BIAS: a scale format's
    # bias (0: an element format)
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    if SCALE_BIAS:
        y = _encode_scale_tl(x, EXP_BITS, SCALE_BIAS, SATURATE)
    else:
        y = encode_bits_tl(x, EXP_BITS, MAN_BITS, SATURATE, FN)
    tl.store(Y_ptr + offs, y, mask=mask)


@triton.jit
def _decode_kernel(B_ptr, Y_ptr, N, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, FN: tl.constexpr,
                   SCALE_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # one program decodes BLOCK_SIZE consecutive int32 patterns of the flat (N,) input
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    b = tl.load(B_ptr + offs, mask=mask, other=0)
    if SCALE_BIAS:
        y = decode_scale_tl(b, EXP_BITS, SCALE_BIAS)
    else:
        y = decode_bits_tl(b, EXP_BITS, MAN_BITS, FN)
    tl.store(Y_ptr + offs, y, mask=mask)


# --------------------------------------------------------------------------------------------- 3. launchers
def _block_size(n: int) -> int:
    # GPU: 1024 elements per program is plenty for a bandwidth-bound map. The interpreter pays ~0.5 ms per
    # program, so there one program takes up to 16384 elements (10^6 values = 62 programs).
    return max(16, min(16384 if interpreting() else 1024, triton.next_power_of_2(max(n, 1))))


def _fn(spec) -> bool:
    return getattr(spec, "fn", False)


def _scale_bias(spec) -> int:
    return spec.bias if isinstance(spec, ScaleSpec) else 0


def encode_triton(x: torch.Tensor, spec: FormatSpec, saturate: bool | None = None) -> torch.Tensor:
    sat = spec.saturate if saturate is None else saturate
    xf = x.float().contiguous().view(-1)                                 # (N,)
    y = torch.empty(xf.shape, dtype=torch.int32, device=x.device)       # (N,)
    bs = _block_size(xf.numel())
    _encode_kernel[(triton.cdiv(xf.numel(), bs),)](xf, y, xf.numel(), spec.exp_bits, spec.man_bits, bool(sat),
                                                   _fn(spec), _scale_bias(spec), BLOCK_SIZE=bs)
    return y.view(x.shape)


def decode_triton(bits: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    mask = -1 if spec.bits == 32 else (1 << spec.bits) - 1                # drop sign-extension of int8/int16
    b = (bits.to(torch.int32) & mask).contiguous().view(-1)              # (N,)
    y = torch.empty(b.shape, dtype=torch.float32, device=bits.device)   # (N,)
    bs = _block_size(b.numel())
    _decode_kernel[(triton.cdiv(b.numel(), bs),)](b, y, b.numel(), spec.exp_bits, spec.man_bits, _fn(spec),
                                                  _scale_bias(spec), BLOCK_SIZE=bs)
    return y.view(bits.shape)


# --------------------------------------------------------------------------------------------- 5. functional
def _check_spec(spec) -> None:
    if not isinstance(spec, (FormatSpec, ScaleSpec)):
        raise TypeError("spec must be a FormatSpec (FP32, FP16, BF16, E4M3, E5M2) or a ScaleSpec (E8M0), got "
                        f"{type(spec).__name__}")


def encode(x: torch.Tensor, spec: FormatSpec | ScaleSpec, *, saturate: bool | None = None,
           backend: str | None = None) -> torch.Tensor:
    """Round `x` to `spec` (nearest, ties to even) and return the bit patterns as int32 (see module doc).

    `x`: a floating tensor of at most 32 bits (fp32/fp16/bf16/fp8: converted to fp32 exactly).
    `saturate`: overflow to ±max (True) or to ±inf / NaN (False); None: the format's rule (E4M3, E8M0 saturate).
    E8M0 (a ``ScaleSpec``): the exponent of x rounded down, see the module doc.
    """
    _check_spec(spec)
    saturate = _v.boolean("encode", "saturate", saturate, allow_none=True)  # "no" is a truthy string
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.element_size() > 4:
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"encode expects a floating tensor of <= 32 bits (fp32/fp16/bf16/fp8), got {what}; "
                         "float64 would be rounded twice (to fp32, then to the format): convert it yourself")
    if resolve_backend(x, backend) == "triton":
        return encode_triton(x, spec, saturate)
    return encode_ref(x, spec, saturate)


def decode(bits: torch.Tensor, spec: FormatSpec | ScaleSpec, *, backend: str | None = None) -> torch.Tensor:
    """Bit patterns of `spec` (any integer tensor; only the low spec.bits bits are read) -> float32 values."""
    _check_spec(spec)
    if not isinstance(bits, torch.Tensor) or bits.is_floating_point() or bits.is_complex() or bits.dtype == torch.bool:
        what = bits.dtype if isinstance(bits, torch.Tensor) else type(bits).__name__
        raise ValueError(f"decode expects an integer tensor of bit patterns, got {what}")
    if resolve_backend(bits, backend) == "triton":
        return decode_triton(bits, spec)
    return decode_ref(bits, spec)


def round_to_format(x: torch.Tensor, spec: FormatSpec | ScaleSpec, *, saturate: bool | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """The nearest value of `spec` to each element of `x`, as float32 (``decode(encode(x))``)."""
    return decode(encode(x, spec, saturate=saturate, backend=backend), spec, backend=backend)
