"""Models built only from minite parts."""
from minite.models.gpt import GPT, GPTConfig  # noqa: F401

__all__ = ["GPT", "GPTConfig"]
