"""Functional ops, one import each (a facade: imports and __all__ only).

Every op takes tensors positionally, options keyword-only, and ``backend=None`` ("auto" | "torch" | "triton").
Importing a concept module registers its torch.compile custom ops (``torch.ops.minite.*``, CUDA only).
"""
from minite.kernels.attention import attention, attention_varlen  # noqa: F401
from minite.kernels.cross_entropy import cross_entropy, linear_cross_entropy  # noqa: F401
from minite.kernels.decode import decode_attention  # noqa: F401
from minite.kernels.fp8_block import block_scaled_gemm, quantize_blockwise, quantize_mx  # noqa: F401
from minite.kernels.fp8_gemm import fp8_gemm  # noqa: F401
from minite.kernels.fp8_linear import fp8_linear  # noqa: F401
from minite.kernels.grouped_gemm import grouped_gemm  # noqa: F401
from minite.kernels.lora import lora_linear  # noqa: F401
from minite.kernels.rmsnorm import layernorm, rmsnorm  # noqa: F401
from minite.kernels.rope import rope, rope_cos_sin  # noqa: F401
from minite.kernels.softmax import softmax  # noqa: F401
from minite.kernels.swiglu import swiglu  # noqa: F401

__all__ = ["softmax", "rmsnorm", "layernorm", "rope", "rope_cos_sin", "swiglu", "cross_entropy", "attention",
           "linear_cross_entropy", "fp8_gemm", "fp8_linear", "lora_linear", "attention_varlen",
           "decode_attention", "quantize_blockwise", "quantize_mx", "block_scaled_gemm", "grouped_gemm"]
