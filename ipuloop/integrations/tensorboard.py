"""``TensorBoardLogger``: the loop's logs, learning rate and throughput as TensorBoard scalars."""

from __future__ import annotations

import os
from typing import Any

from ..callbacks.base import LoopView
from .scalars import ScalarLogger

__all__ = ["TensorBoardLogger"]

INSTALL = 'pip install "ipuloop[tensorboard]"'


class TensorBoardLogger(ScalarLogger):
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter`` to ``log_dir``.

    The x axis (``global_step``) is ``loop.state.update``, the optimizer updates completed, so
    runs with different device iterations line up. Scalars:

    - every host step: the step logs (the keys not prefixed ``train_``/``val_``, e.g.
      ``loss``, the step's mean loss), ``samples_per_second`` (the step's samples over the
      time since the previous step ended, or since the epoch started or the model compiled:
      data loading counts, compilation and validation do not), and the learning rate the
      step runs (``lr``; ``lr/group<i>`` per parameter group when there are several),
      recorded at the update that step starts from;
    - every validation of the fit (at epoch ends, and at steps with
      ``fit(val_every_n_steps=)``): the ``val_*`` logs;
    - every epoch: the ``train_*`` logs.

    Under ``OutputMode.Final`` or ``EveryN`` the training values are estimates, from the
    micro-batches the device returns: each is written as ``<name>_estimate`` (``loss_estimate``,
    ``train_acc_estimate``).

    The file is flushed at every epoch end and closed when the fit ends. A resumed fit
    purges what the interrupted run wrote after its checkpoint (``SummaryWriter(purge_step=)``
    at the checkpoint's update, then the scalars written at that update before the save
    again), so TensorBoard shows every update once. View it with
    ``tensorboard --logdir <log_dir>``. Needs the ``tensorboard`` package
    (``pip install "ipuloop[tensorboard]"``).

    Args:
        log_dir: the folder of the event files (created).

    Example::

        loop = Loop(model, opts, callbacks=[TensorBoardLogger("runs/exp1")])
    """

    def __init__(self, log_dir: str | os.PathLike = "runs") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch imports tensorboard there, and raises without it
            raise ImportError(
                f"TensorBoardLogger needs the tensorboard package, which is not "
                f"installed ({e}). Install it with: {INSTALL}"
            ) from e
        super().__init__()
        self._writer_type = SummaryWriter
        self.log_dir = os.fspath(log_dir)
        self.writer: Any = None
        self._update = -1  # the update the last scalars were written at,
        self._written: dict[str, float] = {}  # and those scalars (a checkpoint records them)
        self._saved: dict[str, Any] = {}  # state_dict(): as the last checkpoint was taken
        self._resumed: dict[str, Any] | None = None  # a loaded state, until the writer opens

    def log_scalars(self, values: dict[str, float], update: int) -> None:
        if update != self._update:
            self._update = update
            self._written = {}
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=update)
            self._written[tag] = value

    def on_save_checkpoint(self, loop: LoopView) -> None:
        update = loop.state.update
        self._saved = {
            "update": update,
            "scalars": dict(self._written) if update == self._update else {},
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self._saved)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = dict(state) if "update" in state else None

    def on_fit_start(self, loop: LoopView) -> None:
        super().on_fit_start(loop)
        resumed = self._resumed
        self._resumed = None
        if self.writer is None and resumed is not None:
            # TensorBoard hides what earlier files hold from purge_step on: the updates the
            # interrupted run wrote after its checkpoint. Those at the checkpoint's own
            # update written before it are written again.
            update = int(resumed["update"])
            self.writer = self._writer_type(log_dir=self.log_dir, purge_step=update)
            self.log_scalars(
                {tag: float(value) for tag, value in resumed.get("scalars", {}).items()}, update
            )
        elif self.writer is None:
            self.writer = self._writer_type(log_dir=self.log_dir)

    def on_epoch_end(self, loop: LoopView) -> None:
        super().on_epoch_end(loop)
        self.writer.flush()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def on_fit_end(self, loop: LoopView) -> None:
        super().on_fit_end(loop)
        self._close()

    def on_exception(self, loop: LoopView) -> None:
        super().on_exception(loop)
        self._close()
