"""Per-tensor scaled FP8 quantization (chapter 02): ``Float8Tensor``, ``quantize``, ``dequantize``.

A tensor x is stored as fp8 bits of ``x * scale`` plus one fp32 ``scale_inv = 1 / scale``::

    q    = fp8(clamp(x * scale, -fp8_max, fp8_max))        # 1 byte per element
    x   ~= float(q) * scale_inv

The Triton kernel does this in ONE pass over x: it loads a block, writes the block's fp8 bit patterns
(uint8, viewed as the torch fp8 dtype) and the block's partial amax; the launcher reduces the partial amaxes.
That is what delayed scaling needs: the scale is known before the pass (from earlier steps) and the amax for
the next scale comes out of the same pass. Under the CPU interpreter ``x.to(tl.float8e4nv)`` is wrong on a few
percent of values (TRITON_ON_CPU.md), so the encoding is integer bit operations (``encode_bits_tl``, chapter
01); on a GPU with fp8 hardware (sm_89+) the kernel uses the hardware cast after the same clamp.
"""

from __future__ import annotations

import torch

from minite import _validate as _v
from minite._triton import gpu_tiles, tl, triton
from minite.backend import resolve_backend
from minite.compile import launchable
from minite.formats.recipe import compute_scale, fp8_max
from minite.formats.specs import encode_bits_tl

__all__ = ["Float8Tensor", "quantize", "dequantize", "quantize_ref", "fp8_quantize_fwd", "FP8_DTYPES"]

# torch fp8 dtype -> (exponent bits, mantissa bits, "fn": no inf, only one NaN pattern per sign)
FP8_DTYPES = {torch.float8_e4m3fn: (4, 3, True), torch.float8_e5m2: (5, 2, False)}


class Float8Tensor:
    """fp8 data + fp32 ``scale_inv``: the value is ``data.float() * scale_inv``.

    data: torch.float8_e4m3fn / float8_e5m2 tensor (the bits). scale_inv: fp32 scalar tensor.
    orig_dtype: dtype of the tensor that was quantized (what ``dequantize()`` returns by default).
    amax: max |x| of the quantized tensor (computed in the quantize pass), or None.
    """

    __slots__ = ("data", "scale_inv", "orig_dtype", "amax")

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, orig_dtype: torch.dtype = torch.float32,
                 amax: torch.Tensor | None = None):
        if data.dtype not in FP8_DTYPES:
            raise ValueError(f"Float8Tensor data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
        self.data, self.orig_dtype, self.amax = data, orig_dtype, amax
        self.scale_inv = torch.as_tensor(scale_inv, dtype=torch.float32, device=data.device).reshape(())

    fp8_dtype = property(lambda self: self.data.dtype)
    shape = property(lambda self: self.data.shape)
    device = property(lambda self: self.data.device)

    def dim(self) -> int:
        return self.data.dim()

    def t(self) -> "Float8Tensor":
        """Transposed view of a 2-D Float8Tensor (same bits, same scale; strides swapped)."""
        return Float8Tensor(self.data.t(), self.scale_inv, self.orig_dtype, self.amax)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """float(data) * scale_inv, computed in fp32, returned as `dtype` (default: orig_dtype)."""
        return (self.data.float() * self.scale_inv).to(dtype or self.orig_dtype)

    def __repr__(self) -> str:
        return (f"Float8Tensor(shape={tuple(self.shape)}, fp8={str(self.fp8_dtype).replace('torch.', '')}, "
                f"scale_inv={self.scale_inv.item():.4g}, orig_dtype={str(self.orig_dtype).replace('torch.', '')})")


# ----------------------------------------------------------------------------------------------- 1. reference
def quantize_ref(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec: (fp8 data, amax). Clamp to +-max BEFORE the cast: torch's e5m2 cast overflows to inf."""
    m = fp8_max(fp8_dtype)
    xs = x.detach().float() * scale.float()
    data = xs.clamp(-m, m).to(fp8_dtype)                                # round to nearest even, saturate
    amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return data, amax


# ----------------------------------------------------------------------------------------------- 2. kernel
@triton.jit
def _fp8_quantize_kernel(X_ptr, Scale_ptr, Y_ptr, Amax_ptr, N,
                         EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, FN: tl.constexpr,
                         FP8_MAX: tl.constexpr, HW_CAST: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # One program per BLOCK_SIZE elements of the flattened (N,) input.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)                  # (BLOCK_SIZE,)
    mask = offs < N
    # Load in the input dtype, compute in fp32 at once (the interpreter cannot compute in bf16).
    x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Partial amax of this block: masked lanes are 0 and cannot win. A NaN must survive the max (the
    # recipe keeps the old scale when amax is not finite), but on the GPU tl.max / tl.maximum lower to
    # maxnum, which DROPS NaN (the interpreter's numpy keeps it): count the NaNs (x != x) in the same
    # pass and overwrite the partial amax with NaN when there is one.
    part = tl.max(tl.abs(x), axis=0)
    n_nan = tl.sum((x != x).to(tl.int32), axis=0)
    part = tl.where(n_nan > 0, float("nan"), part)
    tl.store(Amax_ptr + pid, part)
    # Per-tensor scale, read from memory (no host sync to get it here).
    scale = tl.load(Scale_ptr).to(tl.float32)
    y = x * scale
    if HW_CAST:
        # GPU with fp8 hardware: clamp to +-max, then the hardware's round-to-nearest-even cast.
        # propagate_nan=ALL: the default maxnum/minnum would clamp a NaN to -FP8_MAX on the GPU.
        y = tl.minimum(tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        if EXP_BITS == 4:
            bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            bits = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        # Integer bit operations: round to nearest even, saturate to +-max, subnormals (chapter 01).
        bits = encode_bits_tl(y, EXP_BITS, MAN_BITS, True, FN).to(tl.uint8)
    tl.store(Y_ptr + offs, bits, mask=mask)


# ----------------------------------------------------------------------------------------------- 3. launcher
def _block_size(n: int, on_gpu: bool) -> int:
    # GPU: 1024 elements = 8 per thread at 4 warps. Interpreter: ~0.5 ms per program, so few big blocks.
    cap = 1024 if on_gpu else 8192
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def fp8_quantize_fwd(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                     hw_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the quantize kernel: returns (fp8 data shaped like x, amax as an fp32 scalar tensor)."""
    exp_bits, man_bits, fn = FP8_DTYPES[fp8_dtype]
    xc = x.detach().contiguous()
    n = xc.numel()
    on_gpu = gpu_tiles(xc)  # the compile gate captures an sm_90 launch on a CPU tensor
    if hw_cast is None:  # fp8 conversion instructions exist from sm_89 (Ada, Hopper) on
        hw_cast = on_gpu and (not xc.is_cuda or torch.cuda.get_device_capability(xc.device) >= (8, 9))
    block = _block_size(n, on_gpu)
    grid = triton.cdiv(n, block)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)      # the bits; viewed as fp8 below
    partial = torch.empty(max(grid, 1), dtype=torch.float32, device=x.device)
    if n == 0:
        return out.view(fp8_dtype), torch.zeros((), dtype=torch.float32, device=x.device)
    scale_t = scale.detach().reshape(1).to(device=x.device, dtype=torch.float32)
    launchable(_fp8_quantize_kernel)[(grid,)](xc, scale_t, out, partial, n, EXP_BITS=exp_bits, MAN_BITS=man_bits, FN=fn,
                                  FP8_MAX=fp8_max(fp8_dtype), HW_CAST=hw_cast, BLOCK_SIZE=block)
    return out.view(fp8_dtype), partial.max()                          # reduce the per-program amaxes


# ------------------------------------------------------------------------------------- 5. functional API
def _check(x, scale, fp8_dtype):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize: x must be a float32/float16/bfloat16 tensor, got {got}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"quantize: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"quantize: scale must be a scalar (per-tensor), got shape {tuple(scale.shape)}")
        _v.same_device("quantize", "scale", scale, "x", x)
        if scale.device.type == "cpu":  # on CUDA reading the value is a host sync per call: the recipes guard it
            _v.real("quantize", "scale", scale.item(), gt=0)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"quantize: scale must be a number or a scalar tensor, got {_v.describe(scale)}")
    else:  # 0 makes every value 0 (and scale_inv inf); NaN / inf make every value NaN
        _v.real("quantize", "scale", scale, gt=0)


def quantize(x: torch.Tensor, scale: torch.Tensor | float | None = None, *,
             fp8_dtype: torch.dtype = torch.float8_e4m3fn, backend: str | None = None) -> Float8Tensor:
    """Quantize `x` to a ``Float8Tensor`` with a per-tensor `scale` (fp8 value = x * scale).

    scale=None: current scaling, scale = fp8_max / amax(x) (an extra pass; 1.0 for an all-zero x).
    The result carries ``amax`` = max |x|, computed in the quantize pass (what delayed scaling records).
    """
    _check(x, scale, fp8_dtype)
    if scale is None:
        amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        scale = compute_scale(amax, fp8_max(fp8_dtype), 0, torch.ones((), device=x.device))
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    if resolve_backend(x, backend) == "triton":
        data, amax = fp8_quantize_fwd(x, scale, fp8_dtype)
    else:
        data, amax = quantize_ref(x, scale, fp8_dtype)
    return Float8Tensor(data, 1.0 / scale, x.dtype, amax)


def dequantize(q: Float8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """float(q.data) * q.scale_inv in fp32, returned as `dtype` (default: the dtype that was quantized)."""
    if not isinstance(q, Float8Tensor):
        raise ValueError(f"dequantize expects a Float8Tensor, got {type(q).__name__}")
    return q.dequantize(dtype)
