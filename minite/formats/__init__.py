"""Number formats (chapters 01-02): bit-level specs, fp16 loss scaling, fp8 quantization and recipes."""
from minite.formats.autocast import fp8_autocast, get_fp8_recipe, is_fp8_enabled  # noqa: F401
from minite.formats.fp8 import Float8Tensor, dequantize, quantize  # noqa: F401
from minite.formats.fp16 import DynamicLossScaler  # noqa: F401
from minite.formats.recipe import CurrentScaling, DelayedScaling, Format, ScalingState  # noqa: F401
from minite.formats.specs import BF16, E4M3, E5M2, FP16, FP32, FormatSpec, decode, encode  # noqa: F401

__all__ = ["FormatSpec", "FP32", "FP16", "BF16", "E4M3", "E5M2", "encode", "decode",
           "DynamicLossScaler", "Format", "DelayedScaling", "fp8_autocast",
           "CurrentScaling", "ScalingState", "is_fp8_enabled", "get_fp8_recipe", "Float8Tensor", "quantize",
           "dequantize"]
