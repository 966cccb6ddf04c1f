"""``ScalarLogger``: what the experiment loggers record, against optimizer updates.

TensorBoard, Weights & Biases and MLflow get the same numbers at the same x (``state.update``)
from this one base; each subclass only says how a batch of values reaches its backend.
"""

from __future__ import annotations

import time
from typing import Any

from ..callbacks.base import Callback, LoopView
from ..state import ESTIMATED

__all__ = ["ScalarLogger", "hyperparameters"]


class ScalarLogger(Callback):
    """Base of the loggers: calls ``log_scalars(values, update)`` with, at each x =
    ``loop.state.update`` (optimizer updates completed):

    - every host step, when it starts: the learning rate it runs (``lr``; ``lr/group<i>`` per
      parameter group when there are several), at the update that step starts from;
    - every host step, when it ends: the step logs (the keys not prefixed ``train_``/``val_``,
      e.g. ``loss``, the step's mean loss) and ``samples_per_second`` (the step's samples over
      the time since the previous step ended, or since the epoch started or the model
      compiled: data loading counts, compilation and validation do not);
    - every epoch: the epoch logs (``train_*``);
    - every validation of the fit (at an epoch end, or at a step with
      ``fit(val_every_n_steps=)``): the ``val_*`` logs; its time is left out of
      ``samples_per_second``. A ``validate()`` outside a fit logs nothing.

    Under an output mode that returns only some micro-batches (Final, EveryN), the training
    values the logs name as estimates (``state.logs["estimated"]``: the step's ``loss``, the
    values the model logs, every ``train_`` value) are recorded as ``<name>_estimate``.

    Instance 0 alone logs when several processes train (``main_instance_only``).
    """

    order = 50  # after callbacks that add logs or step the LR at the same event
    main_instance_only = True

    def __init__(self) -> None:
        self._since: float | None = None  # when the running step's time started
        self._samples = 0  # state.samples at that time
        self._paused: float | None = None  # when the running validation started
        self._fitting = False  # between on_fit_start and the fit's end (validate(): no logs)

    def log_scalars(self, values: dict[str, float], update: int) -> None:
        """Record ``values`` at x = ``update`` (each subclass writes to its backend)."""
        raise NotImplementedError

    def _restart_clock(self, loop: LoopView) -> None:
        self._since = time.perf_counter()
        self._samples = loop.state.samples
        self._paused = None

    # Subclasses that override these call them too (super()).
    def on_fit_start(self, loop: LoopView) -> None:
        self._fitting = True

    def on_fit_end(self, loop: LoopView) -> None:
        self._fitting = False

    def on_exception(self, loop: LoopView) -> None:
        self._fitting = False

    def on_epoch_start(self, loop: LoopView) -> None:
        self._restart_clock(loop)

    def on_compile_end(self, loop: LoopView) -> None:
        if self._paused is None:  # (a validation's compilation: its time is left out anyway)
            self._restart_clock(loop)

    def on_validation_start(self, loop: LoopView) -> None:
        self._paused = time.perf_counter()

    def on_validation_end(self, loop: LoopView) -> None:
        if self._paused is not None and self._since is not None:  # the step's time goes on
            self._since += time.perf_counter() - self._paused
        self._paused = None
        if self._fitting:  # at an epoch end or a step (val_every_n_steps)
            st = loop.state
            values = {k: float(v) for k, v in st.logs.items() if k.startswith("val_")}
            if values:
                self.log_scalars(values, st.update)

    def on_train_step_start(self, loop: LoopView) -> None:
        groups = loop.optimizer.param_groups if loop.optimizer is not None else []
        if groups:
            self.log_scalars(
                {
                    "lr" if len(groups) == 1 else f"lr/group{i}": float(g["lr"])
                    for i, g in enumerate(groups)
                },
                loop.state.update,
            )

    def on_train_step_end(self, loop: LoopView) -> None:
        st = loop.state
        values = _marked(
            {k: v for k, v in st.logs.items() if not k.startswith(("train_", "val_"))}, st.logs
        )
        now = time.perf_counter()
        if self._since is not None and now > self._since and st.samples > self._samples:
            values["samples_per_second"] = (st.samples - self._samples) / (now - self._since)
        self._restart_clock(loop)
        if values:
            self.log_scalars(values, st.update)

    def on_epoch_end(self, loop: LoopView) -> None:
        st = loop.state
        values = _marked({k: v for k, v in st.logs.items() if k.startswith("train_")}, st.logs)
        if values:
            self.log_scalars(values, st.update)


def _marked(values: dict[str, Any], logs: dict[str, Any]) -> dict[str, float]:
    """``values`` as numbers, each one ``logs`` names as an estimate under ``<name>_estimate``
    (the names themselves are not a number: left out)."""
    estimated = set(str(logs.get(ESTIMATED, "")).split())
    return {
        f"{k}_estimate" if k in estimated else k: float(v)
        for k, v in values.items()
        if k != ESTIMATED
    }


def hyperparameters(loop: LoopView) -> dict[str, Any]:
    """The run's settings a logger records once per fit: the options' factors, the number of
    processes, and the optimizer's class with its scalar defaults (``optimizer.lr``, ...)."""
    opts = loop.train_opts
    out: dict[str, Any] = {
        "device_iterations": opts.device_iterations,
        "gradient_accumulation": opts.Training.gradient_accumulation,
        "replicas": opts.replication_factor,
        "instances": loop.state.instances,
    }
    opt = loop.optimizer
    if opt is not None:
        out["optimizer"] = type(opt).__name__
        for key, value in opt.defaults.items():
            if isinstance(value, (bool, int, float, str)):
                out[f"optimizer.{key}"] = value
            elif isinstance(value, (tuple, list)) and all(
                isinstance(v, (int, float)) for v in value
            ):  # Adam's betas
                out[f"optimizer.{key}"] = list(value)
    return out
