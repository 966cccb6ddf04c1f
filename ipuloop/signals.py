"""Signals during ``fit``: SIGTERM preempts at the next step boundary; Ctrl-C interrupts.

SIGTERM sets a flag; the loop finishes the running step, fires ``on_preempt`` (a
``ModelCheckpoint`` saves there), runs the end hooks and exits with status 143. A SIGTERM
handler installed before ``fit`` still runs. The first Ctrl-C raises ``KeyboardInterrupt``
(``on_exception`` runs once, no checkpoint starts); a second one ends the process at once
(status 130), after ``on_abort`` (the loop kills its loader workers: nothing outlives it).
Both handlers are restored when ``fit`` returns.

The Ctrl-C handling replaces only Python's default handler: a SIGINT handler of the user's is
left alone, and so is an ignored SIGINT, as in a process started by ``nohup`` or as ``cmd &``
from a script (Python then installs no handler): such a fit is not interrupted by Ctrl-C, as
its starter asked. SIGTERM preempts it all the same.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Callable, Iterator

__all__ = ["Preempted", "handle_signals"]


class Preempted(Exception):
    """SIGTERM was received: the fit ends at this step boundary."""


@contextlib.contextmanager
def handle_signals(
    on_term: Callable[[], None], on_abort: Callable[[], None] | None = None
) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    prev_term = signal.getsignal(signal.SIGTERM)
    prev_int = signal.getsignal(signal.SIGINT)

    def term(signum: int, frame: FrameType | None) -> None:
        on_term()
        if callable(prev_term):
            prev_term(signum, frame)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        def again(signum: int, frame: FrameType | None) -> None:
            try:
                sys.stderr.write("\nSecond interrupt: exiting now.\n")
                sys.stderr.flush()
                if on_abort is not None:
                    on_abort()
            finally:
                os._exit(130)

        signal.signal(signal.SIGINT, again)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, term)
    if prev_int is signal.default_int_handler:  # leave a user's own SIGINT handler alone
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev_term)
        signal.signal(signal.SIGINT, prev_int)
