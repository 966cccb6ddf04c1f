"""Which checkpoints a ``ModelCheckpoint`` keeps: each save's rank by the monitored log, the
best ``save_top_k`` of them (the newest without a monitor) and the last, best so far first.

A save is ranked by the monitored value only when that value was computed from the weights
it holds (``Ranking.fresh``); other saves are kept unranked. Writing the kept ones, naming
their folders and rotating the others out is ``checkpoint.py``'s.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..state import State
from .base import check_mode, monitored

__all__ = ["Ranking", "is_score"]


def is_score(value: Any) -> bool:
    """Whether a kept entry's score ranks it (None: no monitor; NaN: an unranked save)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


class Ranking:
    """The kept regular saves (``{"name", "step", "score"}`` each, oldest first) and how they
    are ranked: ``monitor`` and ``mode`` ("min" or "max"), ``save_top_k`` (-1: all) and
    ``save_last``; and the steps whose weights the epoch logs belong to."""

    def __init__(self, monitor: str | None, mode: str, *, save_top_k: int, save_last: bool) -> None:
        self.sign = check_mode(mode)
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.kept: list[dict[str, Any]] = []
        # Steps whose weights the epoch logs belong to: the last validation's, the last epoch
        # end's (a monitored epoch log ranks only a save at its step)
        self.val_at: int | None = None
        self.epoch_end_at: int | None = None
        self.warned_unranked = False

    def ranked(self) -> list[dict[str, Any]]:
        """The best ``save_top_k`` kept entries that have a score, best first (ties: the
        newer first); not the one kept only as the last."""
        ranked = [e for e in self.kept[::-1] if is_score(e.get("score"))]
        ranked.sort(key=lambda e: self.sign * e["score"])
        return ranked if self.save_top_k < 0 else ranked[: self.save_top_k]

    def fresh(self, log: str, step: int) -> bool:
        """Whether the log ``log`` was computed from the weights of ``step``: an epoch log
        at the step where it was written, any other log (a step log) always."""
        if log.startswith("val_"):
            return step in (self.val_at, self.epoch_end_at)
        if log.startswith("train_"):
            return step == self.epoch_end_at
        return True

    def score(self, st: State, *, at_step: bool, always: bool) -> float | None:
        """The save's rank: None without monitor, NaN for an unranked save."""
        monitor = self.monitor
        if monitor is None:
            return None
        missing = monitor not in st.logs
        if (at_step or always) and (missing or not self.fresh(monitor, st.step)):
            if not self.warned_unranked:  # e.g. val_loss at a mid-epoch step save
                self.warned_unranked = True
                why = (
                    "no such log yet"
                    if missing
                    else "its value was computed from the weights of an earlier step"
                )
                warnings.warn(
                    f"ModelCheckpoint(monitor={monitor!r}): {why} at step {st.step}: "
                    "saves between the steps that write it are kept unranked (as "
                    "the last, never among the best). Save at epoch ends "
                    "(every_n_epochs) to rank by a validation log, or every_n_steps "
                    "a multiple of fit(val_every_n_steps=).",
                    stacklevel=4,
                )
            return math.nan
        return monitored(st, monitor, "ModelCheckpoint")

    def keep(self, entries: list[dict[str, Any]], newest: str) -> set[str]:
        """Names to keep: all (``save_top_k=-1``), or the best ``save_top_k`` ranked ones (the
        newest without ``monitor``), plus the last."""
        if self.save_top_k < 0:
            return {e["name"] for e in entries}
        ranked = entries[::-1]  # newest first; the sort is stable, so ties go to the newest
        if self.monitor is not None:
            ranked = [e for e in ranked if is_score(e["score"])]  # unranked: no best slot
            ranked.sort(key=lambda e: self.sign * e["score"])
        keep = {e["name"] for e in ranked[: self.save_top_k]}
        return keep | {newest} if self.save_last else keep

    def retain(
        self, st: State, name: str, *, at_step: bool, always: bool, apart: bool
    ) -> dict[str, Any] | None:
        """The save's entry (its name, step and score) with ``kept`` set to the checkpoints
        that stay beside it, or None (``kept`` as it was) when the save itself would not stay.
        Regular saves rotate; exception saves (``apart``) sit apart, unranked."""
        step = st.step
        entry: dict[str, Any] = {"name": name, "step": step, "score": None}
        if apart:
            return entry
        entry["score"] = self.score(st, at_step=at_step, always=always)
        # one checkpoint per step: this save replaces one at the same step (same weights)
        entries = [e for e in self.kept if e["name"] != name and e["step"] != step] + [entry]
        keep = self.keep(entries, name)
        if name not in keep:
            return None  # neither among the best k nor kept as the last
        self.kept = [e for e in entries if e["name"] in keep]
        return entry
