"""Layers that are more than one op: ``Linear`` (fp8-aware, linear.py), the gated MLP ``SwiGLU`` (mlp.py),
``CausalSelfAttention`` (attention.py), ``LoRALinear`` (lora.py) and ``KVCache`` (kv_cache.py)."""
