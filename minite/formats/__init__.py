"""Number formats (chapters 01, 02, 15): bit-level specs, fp16 loss scaling, fp8 quantization, recipes, MX."""
from minite.formats.autocast import fp8_autocast, get_fp8_recipe, is_fp8_enabled  # noqa: F401
from minite.formats.fp8 import Float8Tensor, dequantize, quantize  # noqa: F401
from minite.formats.fp16 import DynamicLossScaler  # noqa: F401
from minite.formats.mx import (  # noqa: F401
    BlockScaledTensor,
    e8m0_decode,
    e8m0_encode,
    mx_scale_bits_ref,
    quantize_blockwise_ref,
    quantize_mx_ref,
)
from minite.formats.recipe import (  # noqa: F401
    RECIPES,
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Format,
    MXFP8Scaling,
    ScalingState,
)
from minite.formats.specs import (  # noqa: F401  (E8M0 is a format like E4M3: encode/decode/bit_string take it)
    BF16,
    E4M3,
    E5M2,
    E8M0,
    FP16,
    FP32,
    FormatSpec,
    ScaleSpec,
    bit_string,
    decode,
    encode,
    round_to_format,
)

__all__ = ["FormatSpec", "FP32", "FP16", "BF16", "E4M3", "E5M2", "encode", "decode", "round_to_format", "bit_string",
           "DynamicLossScaler", "Format", "DelayedScaling", "fp8_autocast",
           "CurrentScaling", "ScalingState", "is_fp8_enabled", "get_fp8_recipe", "Float8Tensor", "quantize",
           "dequantize", "E8M0", "ScaleSpec", "e8m0_encode", "e8m0_decode", "BlockScaledTensor", "mx_scale_bits_ref",
           "quantize_blockwise_ref", "quantize_mx_ref", "BlockwiseScaling", "MXFP8Scaling", "RECIPES"]
