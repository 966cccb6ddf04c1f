"""``Events``: how the loop fires callback events, brackets event scopes and stops.

A base of ``Loop``, which provides ``state``, ``_hooks`` (event -> [(callback, hook)]),
``executors``, ``_batches``, ``_reading`` (the plan a validation or predict reads) and
``_dist`` (the other instances of a multi-process run, or None). ``stop()``, ``max_steps``
and SIGTERM are flags read at step boundaries (``_step_boundary``); each scope runs start
event, body, end event (``_with_events``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

from .callbacks.base import EVENTS, Callback, CancelEpoch, CancelFit, CancelStep
from .data import close, kill_workers
from .errors import add_note
from .signals import Preempted

__all__ = ["Events"]


class Events:
    """Event dispatch, event scopes, error reporting and the stop flags of a ``Loop``."""

    @property
    def exception(self) -> BaseException | None:
        """The error ``on_exception`` hooks are told of (``state.exception``)."""
        return self.state.exception

    @property
    def exception_source(self) -> Callback | None:
        """The callback whose hook raised ``exception``, if one did."""
        return self.state.exception_source

    # -- events ---------------------------------------------------------------------------------
    def _fire(self, event: str) -> None:
        for cb, hook in self._hooks[event]:
            try:
                hook(self)
            except (CancelStep, CancelEpoch, CancelFit):
                raise
            except BaseException as e:
                if self.state.exception_source is None:  # the innermost hook: the one that failed
                    self.state.exception_source = cb
                add_note(e, f"raised in callback {type(cb).__name__}.{event}")
                if isinstance(e, AttributeError) and "frozen Options" in str(e):
                    add_note(e, "The loop's options freeze when fit starts: change "
                                "loop.train_opts in a callback's on_configure.")
                raise

    def _event(self, event: str, cancel: type) -> bool:
        """Fire ``event``; False when a hook raised ``cancel`` (the later hooks skipped)."""
        try:
            self._fire(event)
            return True
        except cancel:
            return False

    def _with_events(self, start: str, body: Callable[[], Any], cancel: type,
                     end: str | None = None) -> None:
        """``start``, ``body``, ``end``: ``cancel`` from the first two skips to ``end`` (from
        ``end`` itself, it has nothing left to skip)."""
        try:
            self._fire(start)
            body()
        except cancel:
            pass
        if end is not None:
            self._event(end, cancel)

    @contextlib.contextmanager
    def _reporting(self, fit: bool = False) -> Iterator[None]:
        """Any error fires ``on_exception`` once and propagates; a fit's also releases the
        device, and with several processes ends the other instances' fits first (what
        propagates may then name the instance that failed first). The loader workers (and
        prefetching loaders) of a fit, a validation or a predict stop when it ends, however it
        ends."""
        try:
            yield
        except BaseException as caught:
            st, error = self.state, caught
            if fit and self._dist is not None:
                error = self._dist.failed(caught, st)
            if error is not st.exception:  # a nested call reported it already
                st.exception = error
                for cb, hook in self._hooks["on_exception"]:
                    try:
                        hook(self)
                    except Exception as e:  # the original exception is the one to report
                        warnings.warn(f"{type(cb).__name__}.on_exception failed: {e!r}")
            if fit:
                self.executors.release()
            if error is caught:
                raise
            raise error from caught
        finally:
            if fit:
                batches, self._batches = self._batches, None
                close(batches)
            reading, self._reading = self._reading, None
            if reading is not None:
                close(reading.reader)

    def describe(self) -> str:
        """The loop's events, with the callbacks attached to each."""
        lines = []
        for e in EVENTS:
            names = [type(cb).__name__ for cb, _ in self._hooks[e]]
            lines.append(f"{e:24s} {', '.join(names) if names else '-'}")
        return "\n".join(lines)

    def stop(self) -> None:
        """End the fit after the current step."""
        self.state.stop_requested = True

    def _kill_workers(self) -> None:  # a second Ctrl-C: the process exits at once
        kill_workers(self._batches)
        if self._reading is not None:
            kill_workers(self._reading.reader)

    def _on_sigterm(self) -> None:
        if self._dist is not None:  # several processes: all stop at the next agreed boundary
            self._dist.term_pending = True
        else:
            self.state.preempted = True

    def _check_preempted(self) -> None:
        if self._dist is not None:  # several processes: SIGTERM or stop() on any stops all
            self._dist.agree_on_stop(self.state)
        if self.state.preempted:
            raise Preempted

    def _should_stop(self) -> bool:
        st = self.state
        return st.stop_requested or (st.max_steps is not None and st.step >= st.max_steps)

    def _step_boundary(self) -> bool:
        """Between two steps: a SIGTERM preempts the fit here; True when it should stop."""
        self._check_preempted()
        return self._should_stop()
