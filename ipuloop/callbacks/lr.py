"""``LRScheduler``: steps a torch LR scheduler per optimizer update or per epoch."""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from .base import Callback, LoopView, check_monitor, monitored

__all__ = ["LRScheduler"]

# The device runs the optimizer, never the host's optimizer.step(), so torch would warn.
_ORDER_WARNING = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


def _plain(x: Any, path: str) -> Any:
    """``x`` as what ``torch.load(weights_only=True)`` accepts (numpy values converted)."""
    if x is None or isinstance(x, (bool, int, float, str, torch.Tensor)):
        return x
    if isinstance(x, dict):
        return {k: _plain(v, f"{path}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v, f"{path}[{i}]") for i, v in enumerate(x))
    if type(x).__module__ == "numpy":
        return x.item() if getattr(x, "ndim", 0) == 0 else torch.from_numpy(x.copy())
    raise TypeError(
        f"LRScheduler: the scheduler's state {path} is a {type(x).__name__}, which a "
        "checkpoint cannot hold (tensors, numbers, strings, lists and dicts only). "
        "Keep such objects out of the scheduler's __dict__ (e.g. in a closure)."
    )


class LRScheduler(Callback):
    """Steps ``scheduler`` as the device trains, so the device runs the scheduled LR.

    One host step runs DI (device iterations) optimizer updates on the device, and the device
    reads hyper-parameters only between host calls. So with ``interval="update"`` the callback
    steps the scheduler DI times after each host step: the schedule counts updates, not host
    calls, but the LR is constant within a step (as on hardware): updates ``k*DI ... k*DI+DI-1``
    all run the LR the schedule gives update ``k*DI``. The loop pushes a changed LR to the device
    with ``setOptimizer`` before the next step, and only when it changed.

    Args:
        scheduler: any ``torch.optim.lr_scheduler`` scheduler over the loop's optimizer.
        interval: "update" (per optimizer update) or "epoch" (at ``on_epoch_end``); default
            "update", and "epoch" for ``ReduceLROnPlateau``, which only steps per epoch.
        monitor: for ``ReduceLROnPlateau``, the log it watches (e.g. "val_loss").

    A scheduler that cycles momentum (``OneCycleLR``, ``CyclicLR``) needs it variable on the
    device (for ``poptorch.optim``, passed to the optimizer's constructor); otherwise
    ``fit`` fails before the first step, naming the fix (e.g. ``cycle_momentum=False``).

    Example::

        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.1, total_steps=Loop.num_updates(train_loader, opts, epochs))
        loop = Loop(model, opts, optimizer=opt, callbacks=[LRScheduler(sched)])
    """

    order = -10  # steps before callbacks that save its state at the same event (ModelCheckpoint)

    def __init__(
        self, scheduler: Any, interval: str | None = None, monitor: str | None = None
    ) -> None:
        self.plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if not (hasattr(scheduler, "step") and hasattr(scheduler, "optimizer")):
            raise TypeError(
                "scheduler must be a torch LR scheduler (with .step() and "
                f".optimizer). Received: scheduler={type(scheduler).__name__}."
            )
        interval = interval or ("epoch" if self.plateau else "update")
        if interval not in ("update", "epoch"):
            raise ValueError(
                f'interval must be "update" or "epoch". Received: interval={interval!r}.'
            )
        if self.plateau and (interval != "epoch" or monitor is None):
            raise ValueError(
                "ReduceLROnPlateau steps on a monitored log at epoch end: pass "
                f'interval="epoch" and monitor=, e.g. "val_loss". Received: '
                f"interval={interval!r}, monitor={monitor!r}."
            )
        if monitor is not None and not self.plateau:
            raise ValueError(
                f"monitor is only used with ReduceLROnPlateau; "
                f"{type(scheduler).__name__} takes no metric. Received: "
                f"monitor={monitor!r}."
            )
        self.scheduler = scheduler
        self.interval = interval
        self.monitor = monitor

    def _step(self, *args: float) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ORDER_WARNING)
            self.scheduler.step(*args)

    def on_fit_start(self, loop: LoopView) -> None:
        check_monitor(loop.state, self.monitor, "LRScheduler")
        if self.scheduler.optimizer is not loop.optimizer:
            raise ValueError(
                "LRScheduler: the scheduler drives another optimizer than the "
                "loop's, so its LR would never reach the device. Build the "
                "scheduler over the optimizer passed to Loop(optimizer=...)."
            )
        self._check_cycled_momentum(loop.optimizer)
        # A checkpoint or a device read-back can hold the LR the device last ran, one scheduler
        # step behind: the schedule's LR wins, and the loop pushes it before the first step.
        lrs = getattr(self.scheduler, "_last_lr", None) or ()
        for group, lr in zip(self.scheduler.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = float(lr)

    def _check_cycled_momentum(self, opt: Any) -> None:
        """A scheduler that cycles momentum (OneCycleLR, CyclicLR) changes ``betas`` or
        ``momentum`` every update: PopTorch lets only variable attributes change after
        compilation, so a constant one fails here rather than at the first pushed change."""
        if not getattr(self.scheduler, "cycle_momentum", False):
            return
        name = "betas" if getattr(self.scheduler, "use_beta1", False) else "momentum"
        variable_attrs = getattr(opt, "variable_attrs", None)  # poptorch.optim optimizers
        if variable_attrs is not None:
            constant = variable_attrs.isConstant(name)
            why = (
                f"{name} was not passed to its constructor (PopTorch makes an attribute "
                "variable only when it is passed)"
            )
            fix = (
                f"pass {name} explicitly, e.g. {type(opt).__name__}(params, lr=..., "
                + ("betas=(0.9, 0.999))" if name == "betas" else "momentum=0.9)")
                + f" or opt.variable_attrs.markAsVariable({name!r}), or"
            )
        else:  # torch.optim: PopTorch keeps betas constant whatever the constructor was given
            constant = name == "betas"
            why = "PopTorch keeps a torch.optim optimizer's betas constant"
            fix = f"use poptorch.optim.{type(opt).__name__}(params, lr=..., betas=...), or"
        if constant:
            raise ValueError(
                f"LRScheduler: {type(self.scheduler).__name__} with cycle_momentum=True changes "
                f"{name} every update, but {name} cannot change after compilation: {why}. "
                f"To cycle it, {fix} build the scheduler with cycle_momentum=False."
            )

    def on_train_step_end(self, loop: LoopView) -> None:
        if self.interval == "update":
            for _ in range(loop.train_opts.device_iterations):  # DI updates ran in this step
                self._step()

    def on_epoch_end(self, loop: LoopView) -> None:
        if self.interval != "epoch":
            return
        if not self.plateau:
            self._step()
        else:  # (a plateau scheduler has a monitor: checked when built)
            self._step(monitored(loop.state, str(self.monitor), "LRScheduler"))

    def state_dict(self) -> dict[str, Any]:
        # A method of the scheduler itself (torch 2.0's OneCycleLR keeps ``anneal_func``) is
        # made again by its __init__: not state.
        state = {
            k: v
            for k, v in self.scheduler.state_dict().items()
            if getattr(v, "__self__", None) is not self.scheduler
        }
        return _plain(state, "state_dict()")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)  # its LR reaches the optimizer at on_fit_start
