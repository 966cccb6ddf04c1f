"""``Dispatcher``: the loop's callbacks and, per event, the hooks fired with the loop's view.

The loop orders the events; the dispatcher fires one (each hook called with the loop's view,
``callbacks.base.LoopView``), brackets a scope (start event, body, end event: a Cancel*
exception skips to the end), and tells the ``on_exception`` hooks of an error once. As
Keras' ``CallbackList`` and TorchTNT's ``CallbackHandler``, it holds the hooks: the loop has
one, and no base class reads the loop's attributes.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from .callbacks.base import (
    EVENTS,
    Callback,
    CancelEpoch,
    CancelFit,
    CancelStep,
    LoopView,
    overridden,
)
from .exceptions import add_note

__all__ = ["Dispatcher"]

_CANCELS = (CancelStep, CancelEpoch, CancelFit)


class Dispatcher:
    """Fires the events of one loop: ``hooks[event]`` holds the (callback, hook) pairs of the
    callbacks that override it, in ``callbacks``' order (arranged once: ``arrange``)."""

    def __init__(self, view: LoopView, callbacks: list[Callback]) -> None:
        self.view = view
        self.callbacks = callbacks
        self.hooks: dict[str, list[tuple[Callback, Callable]]] = {
            e: [(cb, getattr(cb, e)) for cb in callbacks if overridden(cb, e)] for e in EVENTS
        }

    def main_instance_only(self, instance: int) -> None:
        """On instances other than 0 of a multi-process run, the callbacks marked
        ``main_instance_only`` (progress displays, loggers) are not called."""
        if instance == 0:
            return
        self.hooks = {
            e: [(cb, h) for cb, h in hooks if not getattr(cb, "main_instance_only", False)]
            for e, hooks in self.hooks.items()
        }

    def fire(self, event: str) -> None:
        """Call ``event``'s hooks in order; an error other than a Cancel* one records the
        callback that raised it (``state.exception_source``) and gets a note naming it."""
        view = self.view
        for cb, hook in self.hooks[event]:
            try:
                hook(view)
            except _CANCELS:
                raise
            except BaseException as e:
                st = view.state
                if st.exception_source is None:  # the innermost hook: the one that failed
                    st.exception_source = cb
                add_note(e, f"raised in callback {type(cb).__name__}.{event}")
                if isinstance(e, AttributeError) and "frozen Options" in str(e):
                    add_note(
                        e,
                        "The loop's options freeze when fit starts: change "
                        "loop.train_opts in a callback's on_configure.",
                    )
                raise

    def event(self, event: str, cancel: type[BaseException]) -> bool:
        """Fire ``event``; False when a hook raised ``cancel`` (the later hooks skipped)."""
        try:
            self.fire(event)
            return True
        except cancel:
            return False

    def scope(
        self,
        start: str,
        body: Callable[[], Any],
        cancel: type[BaseException],
        end: str | None = None,
    ) -> None:
        """``start``, ``body``, ``end``: ``cancel`` from the first two skips to ``end`` (from
        ``end`` itself, it has nothing left to skip)."""
        try:
            self.fire(start)
            body()
        except cancel:
            pass
        if end is not None:
            self.event(end, cancel)

    def report(self, error: BaseException) -> None:
        """Tell the ``on_exception`` hooks of ``error`` (``state.exception``), once: a nested
        call that reported it already is not repeated. A hook that fails is warned of, and
        the original error stays the one to report."""
        st = self.view.state
        if error is st.exception:
            return
        st.exception = error
        for cb, hook in self.hooks["on_exception"]:
            try:
                hook(self.view)
            except Exception as e:  # noqa: BLE001 (the error being reported stays the one raised)
                warnings.warn(f"{type(cb).__name__}.on_exception failed: {e!r}", stacklevel=2)

    def describe(self) -> str:
        """The loop's events, with the callbacks attached to each."""
        lines = []
        for e in EVENTS:
            names = [type(cb).__name__ for cb, _ in self.hooks[e]]
            lines.append(f"{e:24s} {', '.join(names) if names else '-'}")
        return "\n".join(lines)
