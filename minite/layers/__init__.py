"""Layers that are more than one op: ``Linear`` (fp8-aware, linear.py), the gated MLP ``SwiGLU`` (mlp.py),
``CausalSelfAttention`` (attention.py), ``LoRALinear`` (lora.py), ``KVCache`` (kv_cache.py) and the mixture of
experts ``MoE`` (moe.py)."""
