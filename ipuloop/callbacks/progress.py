"""Progress display: a tqdm bar per epoch on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from ..state import ESTIMATED
from .base import Callback, LoopView, register_default

__all__ = ["ProgressBar"]


def _fmt(logs: dict[str, float], keys: list[str]) -> str:
    return "  ".join(f"{k} {logs[k]:.4g}" for k in keys if k in logs)


def _estimates(logs: dict[str, Any], prefix: str = "") -> list[str]:
    """The names ``logs["estimated"]`` gives (those starting with ``prefix``)."""
    return [k for k in str(logs.get(ESTIMATED, "")).split() if k.startswith(prefix)]


class ProgressBar(Callback):
    """Shows what a fit runs, then loss and metrics while fitting.

    At the fit's start it prints ``state.summary`` (``Loop.summary``: the backend, factors,
    steps, each IPU's layers, precision, threads, and for a resumed fit the checkpoint and
    where it continues). Under ``OutputMode.Final`` or ``EveryN`` it marks the step's loss and
    lists the epoch's estimated values (``state.logs["estimated"]``).

    Args:
        every: on a non-terminal, print a line every ``every`` steps (default: about 10
            lines an epoch); on a terminal, the bar's refresh period in steps (default 1).
        stream: where to write (default ``sys.stderr`` for the bar, ``sys.stdout`` for lines).
    """

    order = 100  # after the callbacks that add logs
    main_instance_only = True

    def __init__(self, every: int | None = None, stream: TextIO | None = None) -> None:
        self.every = every
        self.stream = stream
        self._bar: Any = None

    def _tty(self) -> bool:
        s = self.stream or sys.stderr
        return hasattr(s, "isatty") and s.isatty()

    def on_fit_start(self, loop: LoopView) -> None:
        if loop.state.summary:  # what the fit runs, before its first step (Loop.summary)
            print(loop.state.summary, file=self.stream or sys.stdout, flush=True)

    def on_epoch_start(self, loop: LoopView) -> None:
        self._steps = loop.state.steps_per_epoch
        self._start = time.perf_counter()
        self._t0_step = loop.state.step
        if self._tty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self._steps,
                initial=loop.state.epoch_step,
                desc=f"Epoch {loop.state.epoch + 1}",
                file=self.stream or sys.stderr,
                leave=True,
                dynamic_ncols=True,
            )

    def on_train_step_end(self, loop: LoopView) -> None:
        st = loop.state
        # under Final or EveryN the step's loss is the returned micro-batches' mean: an estimate
        mark = " (estimate)" if "loss" in _estimates(st.logs) else ""
        if self._bar is not None:
            every = self.every or 1
            if st.epoch_step % every == 0:
                self._bar.update(st.epoch_step - self._bar.n)
                self._bar.set_postfix_str(_fmt(st.logs, ["loss"]) + mark, refresh=False)
            return
        every = self.every or max((self._steps or 100) // 10, 1)
        if st.epoch_step % every == 0:
            total = f"/{self._steps}" if self._steps else ""
            rate = (st.step - self._t0_step) / max(time.perf_counter() - self._start, 1e-9)
            print(
                f"epoch {st.epoch + 1} step {st.epoch_step}{total}  loss {st.logs['loss']:.4f}"
                f"{mark}  {rate:.2f} steps/s",
                file=self.stream or sys.stdout,
                flush=True,
            )

    def on_epoch_end(self, loop: LoopView) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        logs = loop.state.logs
        keys = [k for k in logs if k.startswith(("train_", "val_"))]
        estimated = _estimates(logs, "train_")
        approx = (
            f" (estimates from the micro-batches the output mode returns: {', '.join(estimated)})"
            if estimated
            else ""
        )
        took = time.perf_counter() - self._start
        print(
            f"epoch {loop.state.epoch}: {_fmt(logs, keys)}  [{took:.1f}s]{approx}",
            file=self.stream or sys.stdout,
            flush=True,
        )

    def on_fit_end(self, loop: LoopView) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    on_exception = on_fit_end


def _default(callbacks: list[Callback], *, progress: bool | int) -> ProgressBar | None:
    """``Loop(progress=...)``: a ProgressBar unless one is given or progress is False (an int
    is its ``every``)."""
    if not progress or any(isinstance(cb, ProgressBar) for cb in callbacks):
        return None
    return ProgressBar(every=progress if progress is not True else None)


register_default(_default)
