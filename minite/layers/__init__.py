"""Layers that are more than one op: Linear (fp8-aware), LoRALinear, KVCache, CausalSelfAttention."""
