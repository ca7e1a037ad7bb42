"""``fp8_autocast``: the region in which ``minite.nn.Linear`` computes its GEMMs in FP8 (chapter 02).

Shaped like TransformerEngine's ``te.fp8_autocast(enabled=True, fp8_recipe=...)``::

    with fp8_autocast(recipe=DelayedScaling(fp8_format=Format.HYBRID)):
        y = model(x)                 # every minite.nn.Linear quantizes input and weight to E4M3
    y.sum().backward()               # the backward pass may run outside: each Linear remembered its recipe

A class, not a ``@contextmanager`` generator, so the restore is one ``finally``-like ``__exit__`` that always
runs (also when the body raises), and instances nest: an inner region's state is pushed on the instance's own
stack and popped on exit. The state is per thread.
"""

from __future__ import annotations

import functools
import threading

from minite import _validate as _v
from minite.formats.recipe import BlockwiseScaling, CurrentScaling, DelayedScaling, MXFP8Scaling

Recipe = DelayedScaling | CurrentScaling | BlockwiseScaling | MXFP8Scaling  # what fp8_autocast takes

_RECIPE_TYPES = (DelayedScaling, CurrentScaling, BlockwiseScaling, MXFP8Scaling)

__all__ = ["fp8_autocast", "is_fp8_enabled", "get_fp8_recipe"]

_local = threading.local()


def _state() -> tuple[bool, object]:
    return getattr(_local, "enabled", False), getattr(_local, "recipe", None)


def is_fp8_enabled() -> bool:
    """True inside an enabled ``fp8_autocast`` region."""
    return _state()[0]


def get_fp8_recipe() -> Recipe | None:
    """The recipe of the innermost ``fp8_autocast`` region (None outside any region)."""
    return _state()[1]


class fp8_autocast:  # noqa: N801 (lower case like torch.autocast and TransformerEngine's fp8_autocast)
    """Context manager (and decorator): FP8 GEMMs in ``minite.nn.Linear`` inside, with `recipe`.

    enabled: False makes a region that turns FP8 *off* (useful nested inside an enabled one).
    recipe: ``DelayedScaling()`` (default), ``CurrentScaling()``, ``BlockwiseScaling()`` or ``MXFP8Scaling()``.
    """

    def __init__(self, enabled: bool = True, recipe: Recipe | None = None) -> None:
        if recipe is not None and not isinstance(recipe, _RECIPE_TYPES):
            raise ValueError(f"recipe must be DelayedScaling, CurrentScaling, BlockwiseScaling or MXFP8Scaling, "
                             f"got {type(recipe).__name__}")
        self.enabled = _v.boolean("fp8_autocast", "enabled", enabled)  # bool("false") would turn FP8 on
        self.recipe = recipe if recipe is not None else DelayedScaling()
        self._saved: list[tuple[bool, object]] = []  # one entry per active `with` of this instance

    def __enter__(self) -> "fp8_autocast":
        self._saved.append(_state())
        _local.enabled, _local.recipe = self.enabled, (self.recipe if self.enabled else None)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # Runs whether the body returned or raised: restore what was in force before __enter__.
        _local.enabled, _local.recipe = self._saved.pop()
        return False  # never swallow the exception

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapper

    def __repr__(self) -> str:
        return f"fp8_autocast(enabled={self.enabled}, recipe={self.recipe})"
