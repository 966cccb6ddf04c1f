"""Callbacks and the loop's events.

The loop, with every event (``Loop.fit``; ``Loop.describe()`` prints this with the callbacks
attached at each event)::

    on_fit_start
    for epoch in range(state.epoch, epochs):
        on_epoch_start
        for each host batch (one step = DI*GA*RF micro-batches):
            [first step only: on_compile_start, compile the training model, on_compile_end]
            on_train_step_start
            run the training model               # DI optimizer updates on the device
            reduce the returned loss, update train metrics, check the loss is finite
            on_train_step_end                    # state.logs["loss"] is this step's mean loss
            if loop.stop() was called: leave the epoch
        epoch logs: train_loss, train_<metric>
        if val_loader:
            on_validation_start
            [first time: on_compile_start, compile the inference model, on_compile_end]
            for each host batch: run the inference model; on_validation_step_end
            on_validation_end                    # state.logs has val_loss, val_<metric>
        on_epoch_end                             # the place to checkpoint or stop on val logs
        if loop.stop() was called: leave
    on_fit_end

SIGTERM: the running step finishes, then ``on_preempt`` (checkpoint here), ``on_fit_end``,
and the process exits with status 143.
``Loop.validate`` runs the validation block alone (with on_fit_start/on_fit_end not fired).
Any exception other than the Cancel* ones fires ``on_exception`` once, then propagates; an
exception raised in a hook carries a note naming the callback and the hook. ``CancelStep``,
``CancelEpoch`` and ``CancelFit`` raised in a hook skip to the end of their scope.

Hooks fire per step, never per micro-batch: the host never sees a micro-batch on an IPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the loop imports this module; annotations only
    from ..loop import Loop

__all__ = ["Callback", "CancelStep", "CancelEpoch", "CancelFit", "EVENTS"]

EVENTS = (
    "on_fit_start", "on_epoch_start", "on_compile_start", "on_compile_end",
    "on_train_step_start", "on_train_step_end", "on_validation_start",
    "on_validation_step_end", "on_validation_end", "on_epoch_end", "on_fit_end",
    "on_save_checkpoint", "on_load_checkpoint", "on_preempt", "on_exception",
)


class CancelStep(Exception):
    """Raised in ``on_train_step_start``: skip this step (its data is consumed)."""


class CancelEpoch(Exception):
    """Raised in a step or epoch hook: end the running epoch now (epoch-end hooks still run)."""


class CancelFit(Exception):
    """Raised in any fit hook: end the fit now (``on_fit_end`` still runs)."""


class Callback:
    """Base class: override the hooks you need; each takes the loop (``loop.state`` etc.).

    The loop calls only the hooks a callback overrides, in ascending ``order`` (stable).
    A callback with state to checkpoint returns it from ``state_dict()`` (tensors, numbers,
    strings, lists and dicts only) and takes it back in ``load_state_dict()``.
    """

    order: int = 0

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint (unique per loop)."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def on_fit_start(self, loop: Loop) -> None: ...
    def on_epoch_start(self, loop: Loop) -> None: ...
    def on_compile_start(self, loop: Loop) -> None: ...
    def on_compile_end(self, loop: Loop) -> None: ...
    def on_train_step_start(self, loop: Loop) -> None: ...
    def on_train_step_end(self, loop: Loop) -> None: ...
    def on_validation_start(self, loop: Loop) -> None: ...
    def on_validation_step_end(self, loop: Loop) -> None: ...
    def on_validation_end(self, loop: Loop) -> None: ...
    def on_epoch_end(self, loop: Loop) -> None: ...
    def on_fit_end(self, loop: Loop) -> None: ...
    def on_save_checkpoint(self, loop: Loop) -> None: ...
    def on_load_checkpoint(self, loop: Loop) -> None: ...
    def on_preempt(self, loop: Loop) -> None: ...
    def on_exception(self, loop: Loop) -> None: ...


def overridden(callback: Callback, event: str) -> bool:
    return getattr(type(callback), event) is not getattr(Callback, event)
