"""Block-scaled FP8 (chapter 15): E8M0 scales, MX-32 (OCP Microscaling v1.0) and DeepSeek-V3's 1x128 / 128x128.

Chapter 02 gave a whole tensor one fp32 scale. One outlier then sets the amax for every element, and the rest of
the tensor slides down into E4M3's subnormals. Block scaling gives each small block its own scale::

    blockwise (DeepSeek-V3 §3.3, TransformerEngine's Float8BlockScaling): one fp32 scale per 1 x 128 slice of a row
        (activations, gradients) or per 128 x 128 tile (weights):
            scale = fp8_max / amax(block),  q = fp8(clamp(x * scale)),  scale_inv = 1 / scale   (x ~= q * scale_inv)
    MX (OCP Microscaling v1.0, MXFP8): one power-of-two scale per 32 consecutive elements, stored as E8M0:
            X = 2^(floor(log2(amax(block))) - emax_elem),   q = fp8(clamp(x / X)),   (x ~= q * X)
        with emax_elem the exponent of the element format's largest normal (8 for E4M3: 448 = 1.75 * 2^8).

E8M0 is an exponent without sign or mantissa: 8 bits b, value 2^(b - 127); b = 0xFF is NaN; there is no zero
and no infinity. Its range, 2^-127 .. 2^127, is fp32's. It is a format like E4M3 (formats/specs.py):
``encode(x, E8M0)``, ``decode(bits, E8M0)``, ``bit_string(b, E8M0)``.

Edge rules (the kernels in kernels/fp8_block.py follow them bit for bit):
* an all-zero block: blockwise scale 1; MX exponent -127 (bits 0). Its elements are 0 either way.
* a block holding inf or NaN: scale NaN (blockwise scale_inv NaN, MX 0xFF), and then every element of the block
  decodes to NaN (OCP: "if X is NaN, every V_i is NaN"), and so does every GEMM output that reads it, as the
  unquantized product would be inf or NaN. Never a finite stand-in: E4M3 has no inf, and scaling the block by
  1 / inf would flush its other elements to zero. (The elements are encoded with scale 1: inf saturates to ±max.)
* a ragged edge (K not a multiple of the block): the last block holds fewer elements, as if zero-padded (zeros
  never change an amax). Scales have shape cdiv(rows, br) x cdiv(cols, bc).
* ``pow2=True`` (blockwise): the scale rounded down to a power of two (TransformerEngine's power-of-2 scales):
  x * scale is then exact, and a recipe can store the scale in E8M0.

Everything here is PyTorch: it is the spec the Triton kernels are tested against.
"""
from __future__ import annotations

import torch

from minite.formats.specs import E4M3, E5M2, E8M0, ScaleSpec, _encode_scale_ref, decode_ref

__all__ = ["ScaleSpec", "E8M0", "e8m0_encode", "e8m0_decode", "BlockScaledTensor", "mx_scale_bits_ref",
           "quantize_blockwise_ref", "quantize_mx_ref", "elem_emax", "check_block_args", "BLOCK_1x128",
           "BLOCK_128x128", "MX_BLOCK"]

BLOCK_1x128 = (1, 128)      # activations and gradients (DeepSeek-V3): one scale per 128 elements of a row
BLOCK_128x128 = (128, 128)  # weights: one scale per tile
MX_BLOCK = 32               # OCP MX: 32 elements share one E8M0 scale


# ------------------------------------------------------------------------------------------------- E8M0
# E8M0 is a format like the element formats: ``encode(x, E8M0)`` / ``decode(bits, E8M0)`` (formats/specs.py).
# These two are the uint8 spellings the MX code stores, and e8m0_encode can also round up.
def e8m0_encode(x: torch.Tensor, rounding: str = "floor") -> torch.Tensor:
    """Positive values -> E8M0 bits (uint8): the exponent of a power of two near x.

    rounding "floor": 2^floor(log2 x) (the MX rule rounds amax's exponent down; ``encode(x, E8M0)``); "ceil":
    2^ceil(log2 x). Powers of two encode exactly either way. Out of range clamps to 2^-127 / 2^127; x <= 0, inf
    and NaN have no E8M0 value and encode to NaN (0xFF).
    """
    if rounding not in ("floor", "ceil"):
        raise ValueError(f"e8m0_encode: rounding must be 'floor' or 'ceil', got {rounding!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"e8m0_encode expects a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    return _encode_scale_ref(x, E8M0, True, rounding).to(torch.uint8)


def e8m0_decode(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 bits (any integer tensor, low 8 bits read) -> float32 2^(bits - 127); 0xFF -> NaN: ``decode(bits,
    E8M0, backend="torch")``."""
    if not isinstance(bits, torch.Tensor) or bits.is_floating_point() or bits.dtype == torch.bool:
        raise ValueError(f"e8m0_decode expects an integer tensor, got {getattr(bits, 'dtype', type(bits).__name__)}")
    return decode_ref(bits, E8M0)


def elem_emax(fp8_dtype: torch.dtype) -> int:
    """Exponent of the element format's largest normal: 8 for E4M3 (448), 15 for E5M2 (57344)."""
    spec = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}.get(fp8_dtype)
    if spec is None:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return spec.emax


# ------------------------------------------------------------------------------------- the block-scaled tensor
class BlockScaledTensor:
    """fp8 ``data`` (R, C) + one scale per ``block`` = (br, bc) of it: ``scale`` (cdiv(R, br), cdiv(C, bc)).

    kind "blockwise": ``scale`` is fp32 scale_inv (x ~= data * scale_inv). kind "mx": ``scale`` is E8M0 bits
    (uint8), x ~= data * 2^(bits - 127). ``t()`` swaps both (a transposed view: the same blocks).
    """

    __slots__ = ("data", "scale", "block", "kind", "orig_dtype", "amax")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], kind: str,
                 orig_dtype: torch.dtype = torch.float32, amax: torch.Tensor | None = None) -> None:
        if kind not in ("blockwise", "mx"):
            raise ValueError(f"BlockScaledTensor: kind must be 'blockwise' or 'mx', got {kind!r}")
        want = tuple(-(-n // b) for n, b in zip(data.shape, block))
        if data.dim() != 2 or tuple(scale.shape) != want:
            raise ValueError(f"BlockScaledTensor: data {tuple(data.shape)} with blocks {block} needs scales {want}, "
                             f"got {tuple(scale.shape)}")
        self.data, self.scale, self.block, self.kind = data, scale, tuple(block), kind
        self.orig_dtype, self.amax = orig_dtype, amax

    shape = property(lambda self: self.data.shape)
    device = property(lambda self: self.data.device)

    def scale_inv(self) -> torch.Tensor:
        """The per-block multiplier as fp32 (decoded E8M0 for MX)."""
        return e8m0_decode(self.scale) if self.kind == "mx" else self.scale.float()

    def t(self) -> "BlockScaledTensor":
        return BlockScaledTensor(self.data.t(), self.scale.t(), self.block[::-1], self.kind, self.orig_dtype,
                                 self.amax)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """data * (each element's block scale), in fp32 (fp64 when asked: exact), returned as `dtype`."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        (R, C), (br, bc) = self.data.shape, self.block
        s = self.scale_inv().to(acc).repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]
        return (self.data.to(acc) * s).to(dtype or self.orig_dtype)

    def __repr__(self) -> str:
        return (f"BlockScaledTensor({self.kind}, shape={tuple(self.shape)}, block={self.block}, "
                f"fp8={str(self.data.dtype).replace('torch.', '')})")


# ------------------------------------------------------------------------------------------ 1. references
def _blocks(x: torch.Tensor, block) -> tuple[torch.Tensor, tuple[int, int]]:
    """x (R, C) zero-padded to whole blocks and viewed as (R/br, br, C/bc, bc), fp32."""
    (R, C), (br, bc) = x.shape, block
    pad = torch.nn.functional.pad(x.detach().float(), (0, -C % bc, 0, -R % br))
    return pad.view(pad.shape[0] // br, br, pad.shape[1] // bc, bc), (R, C)


def check_block_args(where, x, block, fp8_dtype):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.float32, torch.float16,
                                                                         torch.bfloat16):
        raise ValueError(f"{where}: x must be a 2-D float32/float16/bfloat16 tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__} "
                         f"{getattr(x, 'dtype', '')}")
    if not (isinstance(block, tuple) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ValueError(f"{where}: block must be a pair of ints >= 1, got {block!r}")
    elem_emax(fp8_dtype)


def quantize_blockwise_ref(x: torch.Tensor, block: tuple[int, int] = BLOCK_1x128,
                           fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                           pow2: bool = False) -> BlockScaledTensor:
    """The spec of blockwise quantization: scale = fp8_max / amax per block (1 for a zero or non-finite amax),
    optionally rounded down to a power of two; clamp to ±fp8_max, cast (round to nearest even). scale_inv =
    1 / scale, NaN for a block holding inf or NaN (its values decode to NaN)."""
    check_block_args("quantize_blockwise", x, block, fp8_dtype)
    m = float(torch.finfo(fp8_dtype).max)
    t, (R, C) = _blocks(x, block)
    amax = t.abs().amax(dim=(1, 3))                                     # (R/br, C/bc); NaN propagates
    # tensor / tensor: IEEE division (torch computes `448.0 / t` as 448 * (1 / t), which can be 1 ulp off)
    scale = torch.where((amax > 0) & torch.isfinite(amax), torch.full_like(amax, m) / amax, torch.ones_like(amax))
    if pow2:  # clear the mantissa bits: 2^floor(log2 scale)
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)   # -8388608 = 0xFF800000
    q = (t * scale[:, None, :, None]).clamp(-m, m).to(fp8_dtype)
    data = q.view(t.shape[0] * t.shape[1], -1)[:R, :C].contiguous()
    scale_inv = torch.where(torch.isfinite(amax), torch.ones_like(scale) / scale, float("nan"))
    return BlockScaledTensor(data, scale_inv, block, "blockwise", x.dtype, amax)


def mx_scale_bits_ref(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """OCP MX v1.0 shared scale as E8M0 bits: floor(log2(amax)) - emax_elem, clamped to [-127, 127];
    amax == 0 -> -127 (bits 0); inf / NaN amax -> NaN (0xFF)."""
    a = amax.detach().float()
    _, exp = torch.frexp(a.double())
    shared = (exp.long() - 1 - emax_elem).clamp(E8M0.emin, E8M0.emax)
    shared = torch.where(a == 0, E8M0.emin, shared)
    return torch.where(torch.isfinite(a), shared + E8M0.bias, E8M0.nan_bits).to(torch.uint8)


def quantize_mx_ref(x: torch.Tensor, block: int = MX_BLOCK,
                    fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> BlockScaledTensor:
    """The spec of MX quantization along rows (blocks of 1 x `block`): E8M0 scale X per block, q = fp8(clamp(x / X))."""
    check_block_args("quantize_mx", x, (1, block), fp8_dtype)
    m = float(torch.finfo(fp8_dtype).max)
    t, (R, C) = _blocks(x, (1, block))
    amax = t.abs().amax(dim=(1, 3))
    bits = mx_scale_bits_ref(amax, elem_emax(fp8_dtype))
    inv_x = torch.ldexp(torch.ones_like(amax), (E8M0.bias - bits.long()).float())   # 2^-shared: exact
    inv_x = torch.where(bits == E8M0.nan_bits, float("nan"), inv_x)
    q = (t * inv_x[:, None, :, None]).clamp(-m, m).to(fp8_dtype)
    data = q.view(t.shape[0], -1)[:R, :C].contiguous()
    return BlockScaledTensor(data, bits, (1, block), "mx", x.dtype, amax)
