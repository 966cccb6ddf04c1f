"""Automatic loss scaling (``Training.setAutomaticLossScaling(True)``), as PopART 3.x runs it.

The loss scale a step uses is ``finalLossScale = loss_scaling * lossScaleUpdateFactor``: the
optimizer's ``loss_scaling`` times a factor that starts at 1. Each micro-batch's float16
gradient tensors are counted in a two-bin histogram of their absolute values, split at the bin
edge ``65504 * binEdgeLocation`` (the float16 maximum times the location, 0.125 by default).
After the step's update, with ``u`` the upper count and ``l`` the lower one, summed over the
step's micro-batches (and replicas), and ``t = thresholdUpperCountProportion`` (1e-7):

    factor *= 0.5   if u > l * t / (1 - t)      (too close to overflow)
    factor *= 2     otherwise

then the factor is clipped so that the final loss scale stays at most 2**15. With
``updatePeriod`` P the factor changes on the first step of every P (from that step's
counts) and holds in between. A non-finite gradient counts in the upper bin. Steps are not
skipped: as on an IPU, a step whose gradients overflowed still updates the weights.

The settings are PopART's, set as ``opts._Popart.set("automaticLossScalingSettings.NAME",
value)``. The counted tensors are PopART 3.4's default choice
(``GradientTensorTrackingMethod::AllNonViewChangingGradientTensors``): every float16 gradient
the backward pass computes below the loss, whatever the parameters' dtype (float16 weights, or
float32 master weights whose float16 casts feed float16 ops), except the outputs of view
changes (reshapes, transposes, squeezes) and of the loss's own gradient op (PopART leaves out
ops reading the loss scale); float32 gradients are not counted. PopART also leaves out a
gradient op that reads a weight directly (a float16 weight's data gradient): the emulator
counts those too. A model with no float16 gradient is refused at compile, with PopART's error.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import Error

__all__ = ["AutoLossScale", "check_float16_gradients", "settings"]

_PREFIX = "automaticLossScalingSettings."
_DEFAULTS = {"binEdgeLocation": 0.125, "thresholdUpperCountProportion": 1e-7, "updatePeriod": 1}
_FP16_MAX = 65504.0
_MAX_SCALE = 2.0**15  # the largest power of two float16 holds: PopART's clip
# Backward ops that only change a view (PopART's isInplaceViewChange/isOutplaceViewChange):
# their gradients are not counted. Keyed by the autograd node's name without "Backward<n>".
_VIEW_CHANGES = frozenset(
    {
        "View",
        "UnsafeView",
        "Reshape",
        "ReshapeAlias",
        "T",
        "Transpose",
        "Permute",
        "Squeeze",
        "Unsqueeze",
        "Alias",
    }
)


def settings(options: Any) -> dict[str, float] | None:
    """The automatic loss scaling settings of ``options``, or None where it is off; out of
    range values raise PopART's errors."""
    popart = options._Popart.options
    if not popart.get(_PREFIX + "enabled", False):
        return None
    values = {k: popart.get(_PREFIX + k, v) for k, v in _DEFAULTS.items()}
    for name in ("binEdgeLocation", "thresholdUpperCountProportion"):
        if not 0.0 <= values[name] <= 1.0:
            raise Error(
                f"[AutomaticLossScale transform] Out of range value for '{name}'. The "
                f"current value is {values[name]}, but it should be in the range "
                "[0, 1]."
            )
    if int(values["updatePeriod"]) < 1:
        raise Error(
            f"automaticLossScalingSettings.updatePeriod must be >= 1. Received: "
            f"{values['updatePeriod']}."
        )
    return values


def check_float16_gradients(found: bool) -> None:
    """PopART's compile-time refusal of a model whose backward has no float16 gradient
    (``found``: an op of the trace used or made a float16 tensor that requires grad, a float16
    weight cast to float32 included)."""
    if not found:
        raise Error(
            "[AutomaticLossScale transform] No tracked gradient tensors of type fp16 "
            "were found. Training.setAutomaticLossScaling(True) adjusts the loss scale "
            "from the float16 gradients of the backward pass, and this model computes "
            "none: compute in float16 (model.half(), or float16 inputs into float32 "
            "weights), or turn automatic loss scaling off."
        )


class AutoLossScale:
    """The loss scale update factor of one training model and the histogram its steps fill.

    ``track(loss)`` counts the float16 gradients the backward of one micro-batch's ``loss``
    computes (through hooks on its autograd graph); ``after_step()`` applies the update
    rule."""

    def __init__(self, values: dict[str, float], micro_batch_scale: float) -> None:
        self.factor = 1.0  # lossScaleUpdateFactor
        self.last_final: float | None = None  # finalLossScale of the last step (None before any)
        self._edge = _FP16_MAX * float(values["binEdgeLocation"])
        t = float(values["thresholdUpperCountProportion"])
        self._ratio = t / (1.0 - t) if t < 1.0 else math.inf
        self._period = int(values["updatePeriod"])
        self._steps = 0
        # The executor's backward scales each micro-batch by loss_scale / (GA*RF) under Mean;
        # PopART's gradient tensors carry the loss scale alone: undo the division.
        self._undo = micro_batch_scale
        self._upper: torch.Tensor | int = 0  # a device tensor once counted (``_count``)
        self._total = 0

    def track(self, loss: torch.Tensor) -> None:
        """Count the float16 gradients the coming backward of ``loss`` computes: those of
        every op below the loss's own, but view changes. Only on the steps whose counts
        decide the factor (the first of each update period): ``after_step`` clears the
        others' unread."""
        node = loss.grad_fn
        if node is None or self._steps % self._period:
            return
        seen = {node}
        todo = [n for n, _ in node.next_functions if n is not None]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            name = type(node).__name__
            if (
                name != "AccumulateGrad"
                and name.rstrip("0123456789")[: -len("Backward")] not in _VIEW_CHANGES
            ):
                node.register_hook(self._count_node)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def _count_node(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        for g in grad_inputs:
            if g is not None and g.dtype == torch.float16:
                self._count(g)

    def _count(self, grad: torch.Tensor) -> None:
        g = grad.detach()
        if self._undo != 1.0:
            g = g.float() * self._undo
        # |g| >= edge, or not finite (NaN compares false: counted with the overflows). Summed
        # on the device: ``after_step`` reads it once per update, not once per gradient (each
        # read waits for the device).
        self._upper = (~(g.abs() < self._edge)).sum() + self._upper
        self._total += g.numel()

    def final(self, loss_scaling: float) -> float:
        """The loss scale a step uses: the optimizer's times the factor."""
        return loss_scaling * self.factor

    def after_step(self, loss_scaling: float) -> None:
        """The step with ``loss_scaling`` as the optimizer's is done: update the factor on the
        first step of each update period, and clear the counts."""
        self.last_final = self.final(loss_scaling)
        if self._steps % self._period == 0:
            upper = int(self._upper)  # host sync, one per update period: the rule needs it
            lower = self._total - upper
            self.factor *= 0.5 if upper > lower * self._ratio else 2.0
            self.factor = min(self.factor, _MAX_SCALE / loss_scaling)
        self._steps += 1
        self._upper = self._total = 0
