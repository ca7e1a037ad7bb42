"""Modules (a facade: imports and __all__ only). Each forwards to the functional op in minite.ops."""
from minite.kernels.cross_entropy import LinearCrossEntropy  # noqa: F401
from minite.kernels.rmsnorm import LayerNorm, RMSNorm  # noqa: F401
from minite.kernels.rope import RotaryEmbedding  # noqa: F401
from minite.kernels.softmax import Softmax  # noqa: F401
from minite.layers.attention import CausalSelfAttention  # noqa: F401
from minite.layers.kv_cache import KVCache  # noqa: F401
from minite.layers.linear import Linear  # noqa: F401
from minite.layers.lora import LoRALinear  # noqa: F401
from minite.layers.mlp import SwiGLU  # noqa: F401
from minite.layers.moe import MoE  # noqa: F401

__all__ = ["Softmax", "RMSNorm", "LayerNorm", "RotaryEmbedding", "SwiGLU", "Linear", "CausalSelfAttention",
           "LinearCrossEntropy", "LoRALinear", "KVCache", "MoE"]
