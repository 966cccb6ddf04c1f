"""``CSVLogger``: the logs as a CSV file, one row per epoch (and optionally every N steps)."""

from __future__ import annotations

import csv
import os
import warnings
from typing import Any

from ..rules import check_int
from ..state import CSV_COUNTERS, ESTIMATED
from .base import Callback, LoopView

__all__ = ["CSVLogger"]


class CSVLogger(Callback):
    """Writes ``loop.state.logs`` to ``path``, one row per epoch, flushed at each row.

    Columns: ``epoch`` (``state.epoch``: epochs completed), ``step`` (``state.step``: host
    steps completed), ``update`` (``state.update``: optimizer updates completed), then every
    log key in the order first seen. When a row brings a new key,
    the file is rewritten with the wider header (earlier rows get empty cells), so the header
    always names every column. Rows every ``every_n_steps`` steps hold the step logs (the keys
    not prefixed ``train_``/``val_``, e.g. ``loss``). A validation the fit runs at a step
    (``fit(val_every_n_steps=)``) gets a row at that step too: the step logs and the ``val_``
    logs. A new fit starts a new file; a resumed
    one keeps the rows its checkpoint had written and appends (rows written after that
    checkpoint are dropped, as the resumed run writes them again).

    Under an output mode that returns only some micro-batches (Final, EveryN), the column
    ``estimated`` names the row's values that are estimates, space-separated (``loss
    train_loss train_acc``); it is absent when every value is exact.

    Args:
        path: the CSV file (its folder is created).
        every_n_steps: also write a row every this many host steps (None: epochs only).

    Example::

        loop = Loop(model, opts, callbacks=[CSVLogger("runs/metrics.csv")])
    """

    order = 50  # after callbacks that add logs, before the progress display
    main_instance_only = True

    def __init__(self, path: str | os.PathLike, every_n_steps: int | None = None) -> None:
        check_int("every_n_steps", every_n_steps, optional=True)
        self.path = os.fspath(path)
        self.every_n_steps = every_n_steps
        self.columns: list[str] = list(CSV_COUNTERS)
        self.rows = 0  # data rows in the file
        self._val_at: int | None = None  # the step of the last validation

    def _read(self) -> list[dict[str, str]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.columns, restval="", extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, self.path)  # a crash leaves the old file or the new one, never half

    def _write(self, loop: LoopView, logs: dict[str, Any]) -> None:
        if ESTIMATED in logs:  # the row's estimates only (a step row holds no train_ value)
            logs = {**logs, ESTIMATED: " ".join(k for k in logs[ESTIMATED].split() if k in logs)}
        row = {
            **logs,
            "epoch": loop.state.epoch,
            "step": loop.state.step,
            "update": loop.state.update,
        }
        new = [k for k in row if k not in self.columns]
        if new or self.rows == 0:
            self.columns += new
            self._rewrite([*self._read(), row])
        else:
            with open(self.path, "a", newline="") as f:  # closing flushes the row
                csv.DictWriter(f, self.columns, restval="").writerow(row)
        self.rows += 1

    def on_fit_start(self, loop: LoopView) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        kept = self._read()[: self.rows]
        if self.rows and len(kept) < self.rows:
            warnings.warn(
                f"CSVLogger: {self.path} has {len(kept)} rows but the checkpoint "
                f"recorded {self.rows}: appending after the rows there are.",
                stacklevel=2,
            )
        self.rows = len(kept)
        self._rewrite(kept)

    def on_validation_end(self, loop: LoopView) -> None:
        self._val_at = loop.state.step

    def on_train_step_end(self, loop: LoopView) -> None:
        st = loop.state
        validated = self._val_at == st.step  # a validation at this step: before this event
        if validated or (self.every_n_steps and st.step % self.every_n_steps == 0):
            self._write(
                loop,
                {
                    k: v
                    for k, v in st.logs.items()
                    if not k.startswith("train_") and (validated or not k.startswith("val_"))
                },
            )

    def on_epoch_end(self, loop: LoopView) -> None:
        self._write(loop, loop.state.logs)

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "columns": list(self.columns)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = int(state["rows"])
        self.columns = list(state["columns"])
