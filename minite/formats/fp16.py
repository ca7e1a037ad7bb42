"""Dynamic loss scaling for FP16 training (chapter 01), as Megatron-LM's DynamicGradScaler and torch's GradScaler.

Why: FP16's smallest subnormal is 2^-24 ~ 6e-8, and many gradients are smaller; they flush to zero. Multiplying
the loss by S (say 2^16) multiplies every gradient by S (the chain rule is linear), lifting them into FP16's
range; the optimizer must see the true gradient, so the grads are divided by S before the step. Too large an S
overflows to inf: then the step is skipped and S shrinks. The rule (``update``):

    overflow   -> growth_tracker = 0; hysteresis_tracker -= 1; if it reached 0: S = max(S * backoff, min_scale)
    clean step -> growth_tracker += 1; after growth_interval clean steps in a row:
                  S *= growth_factor, growth_tracker = 0, hysteresis_tracker = hysteresis

``hysteresis`` (Megatron) = how many overflows are tolerated before backing off; 1 = back off at every overflow
(torch's GradScaler). One iteration::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # optional (e.g. before clipping); step() calls it otherwise
    stepped = scaler.step(optimizer)    # False: inf/NaN found, optimizer.step() was skipped
    scaler.update()

The scaler works on the gradients of the optimizer's parameters: with FP16 model weights and FP32 master
weights, copy the FP16 grads into the master params' ``.grad`` before ``unscale_``. An optimizer that keeps its
gradients elsewhere says where with a ``grads()`` method (ZeRO's ShardedAdamW: its flat shard's gradient). BF16
has FP32's range and needs no scaler (``enabled=False`` makes every method a pass-through).

Distributed: when the ranks hold different pieces of the gradient (ZeRO shards, tensor-parallel slices, pipeline
stages), one rank may find the inf alone; if only it skipped, the replicas would drift apart. So the verdict is
OR-ed over the ranks by ``found_inf_everywhere`` (a callable, bool -> bool: minite.train sets it to
``Parallel.found_inf_anywhere``, one all-reduce of one flag per step) before anyone steps.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from minite import _validate as _v

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Scale the loss, unscale and check the grads, skip steps on overflow, adapt the scale."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 1, min_scale: float = 1.0, enabled: bool = True,
                 found_inf_everywhere: Callable[[bool], bool] | None = None):
        w = "DynamicLossScaler"
        init_scale = _v.real(w, "init_scale", init_scale, gt=0)
        growth_factor = _v.real(w, "growth_factor", growth_factor, gt=1)
        backoff_factor = _v.real(w, "backoff_factor", backoff_factor, gt=0, lt=1)
        growth_interval = _v.integer(w, "growth_interval", growth_interval, lo=1)
        hysteresis = _v.integer(w, "hysteresis", hysteresis, lo=1)
        min_scale = _v.real(w, "min_scale", min_scale, gt=0, le=init_scale)
        enabled = _v.boolean(w, "enabled", enabled)  # bool("no") is True
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale, self.enabled = float(min_scale), bool(enabled)
        self._scale = float(init_scale)
        self._growth_tracker = 0                 # clean steps since the last change of scale
        self._hysteresis_tracker = self.hysteresis   # overflows still tolerated before backing off
        self._found_inf: bool | None = None     # this iteration's verdict; None: grads not unscaled yet
        if found_inf_everywhere is not None and not callable(found_inf_everywhere):
            raise TypeError(f"{w}: found_inf_everywhere must be a callable (bool -> bool) or None, "
                            f"got {type(found_inf_everywhere).__name__}")
        self.found_inf_everywhere = found_inf_everywhere  # my verdict -> every rank's (distributed), else None

    @property
    def scale_value(self) -> float:
        """The current loss scale S (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S. Compute the loss in fp32: an fp16 loss times 2^16 can itself overflow."""
        return loss * self._scale if self.enabled else loss

    @staticmethod
    def _grads(optimizer) -> list[torch.Tensor]:
        if hasattr(optimizer, "grads"):          # ZeRO: the gradients live in the shard, not in the params' .grad
            return list(optimizer.grads())
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the grads of `optimizer`'s params by S in place; return (and remember) whether any is inf/NaN."""
        if not self.enabled:
            return False
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update(); call update() once per "
                               "iteration")
        inv = 1.0 / self._scale
        bad = None                              # a flag on the grads' device: one host sync at the end
        for g in self._grads(optimizer):
            g.mul_(inv)                         # inf stays inf and NaN stays NaN, so check after unscaling
            flag = ~torch.isfinite(g).all()
            bad = flag if bad is None else bad | flag.to(bad.device)
        found = bool(bad) if bad is not None else False
        if self.found_inf_everywhere is not None:  # the same verdict on every rank: all step, or all skip
            found = bool(self.found_inf_everywhere(found))
        self._found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> bool:
        """Unscale (if not done) and call optimizer.step() unless inf/NaN was found. Returns True if it stepped."""
        if not self.enabled:
            optimizer.step(*args, **kwargs)
            return True
        if self._found_inf is None:
            self.unscale_(optimizer)
        if self._found_inf:
            return False                        # skip: the weights stay as they were
        optimizer.step(*args, **kwargs)
        return True

    def update(self) -> None:
        """Adapt S from this iteration's verdict (see the module docstring), then start a new iteration."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() needs this iteration's inf check: call step(optimizer) or "
                               "unscale_(optimizer) first")
        if self._found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "hysteresis": self.hysteresis, "min_scale": self.min_scale, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state)
        if missing:
            raise KeyError(f"loss-scaler state is missing {sorted(missing)}")
        # The same checks as the constructor: a NaN or negative scale would poison every later step silently.
        w = "DynamicLossScaler.load_state_dict"
        checks = {"growth_factor": lambda v: _v.real(w, "growth_factor", v, gt=1),
                  "backoff_factor": lambda v: _v.real(w, "backoff_factor", v, gt=0, lt=1),
                  "growth_interval": lambda v: _v.integer(w, "growth_interval", v, lo=1),
                  "hysteresis": lambda v: _v.integer(w, "hysteresis", v, lo=1),
                  "min_scale": lambda v: _v.real(w, "min_scale", v, gt=0),
                  "enabled": lambda v: _v.boolean(w, "enabled", v)}
        new = {k: check(state[k]) for k, check in checks.items() if k in state}
        scale = _v.real(w, "scale", state["scale"], gt=0)
        growth = _v.integer(w, "growth_tracker", state["growth_tracker"], lo=0)
        hyst = _v.integer(w, "hysteresis_tracker", state["hysteresis_tracker"])
        for k, v in new.items():
            setattr(self, k, v)
        self._scale, self._growth_tracker, self._hysteresis_tracker = scale, growth, hyst
        self._found_inf = None

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self._scale:g}, growth_tracker={self._growth_tracker}, "
                f"hysteresis_tracker={self._hysteresis_tracker}, growth_interval={self.growth_interval}, "
                f"enabled={self.enabled})")
