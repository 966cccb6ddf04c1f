"""A running call's plans (``Reading``): workers stopped when it ends, a fit's signals handled.

A fit, a validation and a predict each read their plans' loaders while they run; a
``validate()`` from a fit's hook reads beside the fit. When a call ends, however it ends, the
loader workers (and read-ahead threads) of its plans stop (a persistent-workers loader's go on
from epoch to epoch within it). During a fit SIGTERM and Ctrl-C are handled (``signals``): a
second Ctrl-C kills the workers of every plan being read before the process exits.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from .plan import Plan
from .signals import handle_signals

__all__ = ["Reading"]


class Reading:
    """The plans the running calls of one loop read."""

    def __init__(self) -> None:
        self.plans: tuple[Plan, ...] = ()

    @contextlib.contextmanager
    def during(
        self, plans: tuple[Plan | None, ...], on_term: Callable[[], None] | None = None
    ) -> Iterator[None]:
        """A call reading ``plans``, whose workers stop when it ends; with ``on_term`` (a
        fit's), SIGTERM calls it and Ctrl-C is handled while it runs."""
        outer = self.plans  # (a validate() from a fit's hook reads beside the fit)
        reading = tuple(p for p in plans if p is not None)
        self.plans = outer + reading
        signals = handle_signals(on_term, self.kill_workers) if on_term is not None else None
        with signals or contextlib.nullcontext():
            try:
                yield
            finally:
                self.plans = outer
                for plan in reading:
                    plan.close()

    def kill_workers(self) -> None:  # a second Ctrl-C: the process exits at once
        for plan in self.plans:
            plan.kill_workers()
