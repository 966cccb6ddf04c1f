"""Automatic loss scaling (``Training.setAutomaticLossScaling(True)``), as PopART 3.x runs it.

The loss scale a step uses is ``finalLossScale = loss_scaling * lossScaleUpdateFactor``: the
optimizer's ``loss_scaling`` times a factor that starts at 1. Each micro-batch's float16
gradients are counted in a two-bin histogram of their absolute values, split at the bin edge
``65504 * binEdgeLocation`` (the float16 maximum times the location, 0.125 by default).
After the step's update, with ``u`` the upper count and ``l`` the lower one, summed over the
step's micro-batches (and replicas), and ``t = thresholdUpperCountProportion`` (1e-7):

    factor *= 0.5   if u > l * t / (1 - t)      (too close to overflow)
    factor *= 2     otherwise

then the factor is clipped so that the final loss scale stays at most 2**15. With
``updatePeriod`` P the factor changes on the first step of every P (from that step's
counts) and holds in between. A non-finite gradient counts in the upper bin. Steps are not
skipped: as on an IPU, a step whose gradients overflowed still updates the weights.

The settings are PopART's, set as ``opts._Popart.set("automaticLossScalingSettings.NAME",
value)``. The counted gradients are the float16 parameters' (PopART also counts the float16
gradients between ops, which move with them); a model without float16 parameters is refused.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .errors import Error

__all__ = ["AutoLossScale", "settings"]

_PREFIX = "automaticLossScalingSettings."
_DEFAULTS = {"binEdgeLocation": 0.125, "thresholdUpperCountProportion": 1e-7, "updatePeriod": 1}
_FP16_MAX = 65504.0
_MAX_SCALE = 2.0 ** 15  # the largest power of two float16 holds: PopART's clip


def settings(options: Any) -> dict[str, float] | None:
    """The automatic loss scaling settings of ``options``, or None where it is off; out of
    range values raise PopART's errors."""
    popart = options._Popart.options
    if not popart.get(_PREFIX + "enabled", False):
        return None
    values = {k: popart.get(_PREFIX + k, v) for k, v in _DEFAULTS.items()}
    for name in ("binEdgeLocation", "thresholdUpperCountProportion"):
        if not 0.0 <= values[name] <= 1.0:
            raise Error(f"[AutomaticLossScale transform] Out of range value for '{name}'. The "
                        f"current value is {values[name]}, but it should be in the range "
                        "[0, 1].")
    if int(values["updatePeriod"]) < 1:
        raise Error(f"automaticLossScalingSettings.updatePeriod must be >= 1. Received: "
                    f"{values['updatePeriod']}.")
    return values


class AutoLossScale:
    """The loss scale update factor of one training model and the histogram its steps fill.

    ``watch(params)`` counts the gradients of the float16 ones among ``params`` (each
    micro-batch's, through a tensor hook); ``after_step()`` applies the update rule."""

    def __init__(self, values: dict[str, float], micro_batch_scale: float) -> None:
        self.factor = 1.0  # lossScaleUpdateFactor
        self.last_final = None  # finalLossScale of the last step (None before any)
        self._edge = _FP16_MAX * float(values["binEdgeLocation"])
        t = float(values["thresholdUpperCountProportion"])
        self._ratio = t / (1.0 - t) if t < 1.0 else math.inf
        self._period = int(values["updatePeriod"])
        self._steps = 0
        # The executor's backward scales each micro-batch by loss_scale / (GA*RF) under Mean;
        # PopART's gradient tensors carry the loss scale alone: undo the division.
        self._undo = micro_batch_scale
        self._upper = 0
        self._total = 0
        self._hooks: list[Any] = []

    def watch(self, params: list[torch.Tensor]) -> None:
        """Count the gradients of ``params``' float16 tensors (the device's tensors the
        executor runs); raise where there are none."""
        self.unwatch()
        half = [p for p in params if p.dtype == torch.float16 and p.requires_grad]
        if not half:
            raise Error("Training.setAutomaticLossScaling(True): the model has no float16 "
                        "parameters. On an IPU, PopART counts float16 gradients to adjust the "
                        "loss scale and refuses a model without any ('[AutomaticLossScale "
                        "transform] No tracked gradient tensors of type fp16 were found.'); "
                        "the ipuloop emulator counts the float16 parameters' gradients. Convert "
                        "the model with model.half(), or turn automatic loss scaling off.")
        self._hooks = [p.register_hook(self._count) for p in half]

    def unwatch(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _count(self, grad: torch.Tensor) -> None:
        g = grad.detach()
        if self._undo != 1.0:
            g = g.float() * self._undo
        # |g| >= edge, or not finite (NaN compares false: counted with the overflows)
        self._upper += int((~(g.abs() < self._edge)).sum())
        self._total += g.numel()

    def final(self, loss_scaling: float) -> float:
        """The loss scale a step uses: the optimizer's times the factor."""
        return loss_scaling * self.factor

    def after_step(self, loss_scaling: float) -> None:
        """The step with ``loss_scaling`` as the optimizer's is done: update the factor on the
        first step of each update period, and clear the counts."""
        self.last_final = self.final(loss_scaling)
        if self._steps % self._period == 0:
            lower = self._total - self._upper
            self.factor *= 0.5 if self._upper > lower * self._ratio else 2.0
            self.factor = min(self.factor, _MAX_SCALE / loss_scaling)
        self._steps += 1
        self._upper = self._total = 0
