"""``EarlyStopping``: ends the fit when a monitored log stops improving."""

from __future__ import annotations

import math
from typing import Any

from ..rules import check_int
from ..state import State
from .base import Callback, LoopView, check_mode, check_monitor, monitored

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Calls ``loop.stop()`` after ``patience`` checks in a row without improvement.

    The value is checked at each epoch end, and a validation log (``val_...``) also after
    each validation a fit runs at a step (``fit(val_every_n_steps=)``: a stop there ends the
    fit after that step), so each validation is one check. A check improves
    when the value beats the best by more than ``min_delta`` (below it in "min" mode, above
    it in "max" mode). With ``check_finite`` a NaN or infinite value stops at once.
    ``stopped_epoch`` and ``reason`` say why it stopped.

    Args:
        monitor: the log to watch (``loop.state.logs``, e.g. "val_loss"); a validation log
            in a fit without ``val_loader`` is an error when the fit starts.
        patience: stop after this many checks in a row without improvement (>= 1).
        min_delta: smallest change that counts as an improvement (>= 0).
        mode: "min" (lower is better) or "max".
        check_finite: stop when the value is NaN or infinite.

    Example::

        loop = Loop(model, opts, callbacks=[EarlyStopping("val_loss", patience=2)])
    """

    order = 10  # after callbacks that add logs at epoch end (LRScheduler)

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "min",
        *,
        check_finite: bool = True,
    ) -> None:
        self._sign = check_mode(mode)
        check_int("patience", patience)
        if not (min_delta >= 0):  # also rejects NaN
            raise ValueError(f"min_delta must be >= 0. Received: min_delta={min_delta!r}.")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = mode
        self.check_finite = check_finite
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0  # checks since the last improvement
        self.stopped_epoch: int | None = None  # 1-based epoch in (or after) which it stopped
        self.reason = ""
        self._fitting = False  # (a validate() outside a fit is no check)

    def on_fit_start(self, loop: LoopView) -> None:
        check_monitor(loop.state, self.monitor, "EarlyStopping")
        self._fitting = True

    def on_fit_end(self, loop: LoopView) -> None:
        self._fitting = False

    on_exception = on_fit_end

    def _step_validated(self, st: State) -> bool:
        """Whether the fit validated at this step itself (then no epoch-end validation)."""
        every = st.val_every_n_steps
        return bool(every and st.step and st.step % every == 0 and self.monitor.startswith("val_"))

    def on_validation_end(self, loop: LoopView) -> None:
        st = loop.state
        if self._fitting and self._step_validated(st):
            self._check(loop, st.epoch + 1, f"at step {st.step} (epoch {st.epoch + 1})")

    def on_epoch_end(self, loop: LoopView) -> None:
        if not self._step_validated(loop.state):  # (else checked at that validation)
            self._check(loop, loop.state.epoch, f"after epoch {loop.state.epoch}")

    def _check(self, loop: LoopView, epoch: int, where: str) -> None:
        value = monitored(loop.state, self.monitor, "EarlyStopping")
        sign = self._sign
        if self.check_finite and not math.isfinite(value):
            self.reason = f"{self.monitor} = {value} is not finite"
        elif sign * (self.best - value) > self.min_delta:
            self.best = value
            self.wait = 0
            return
        else:
            self.wait += 1
            if self.wait < self.patience:
                return
            checks = "validations" if self.monitor.startswith("val_") else "epochs"
            self.reason = (
                f"{self.monitor} did not improve on {self.best:.6g} by more than "
                f"{self.min_delta:g} for {self.wait} {checks}"
            )
        self.stopped_epoch = epoch
        print(f"EarlyStopping: stopping {where}: {self.reason}.", flush=True)
        loop.stop()

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.wait = int(state["wait"])
        self.stopped_epoch = state["stopped_epoch"]
