"""Layers that are more than one op: ``Linear`` (fp8-aware, linear.py) and ``CausalSelfAttention`` (attention.py)."""
