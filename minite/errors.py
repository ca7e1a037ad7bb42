"""The errors a user's configuration can raise, on the ground floor: every part of minite imports them from here,
so importing one part (``minite.parallel.dims``) never loads the config or the model."""
from __future__ import annotations

__all__ = ["ConfigError", "ParallelError", "DivergenceError"]


class ConfigError(ValueError):
    """A bad configuration key or value (the message says what is valid)."""


class ParallelError(ConfigError):
    """A parallel layout that cannot work (the message names the numbers); minite.train prints it as an error."""


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss (the message names the step); the last checkpoint written is kept."""
