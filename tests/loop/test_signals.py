"""``ipuloop.signals.handle_signals``: SIGTERM calls ``on_term`` (and a handler installed
before); the first Ctrl-C raises ``KeyboardInterrupt`` where Python's default handler was;
the handlers are put back when it ends."""

from __future__ import annotations

import signal
import threading

import pytest

from ipuloop.signals import handle_signals


@pytest.fixture
def handlers():
    """The SIGTERM and SIGINT handlers, put back after the test."""
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGTERM, saved[0])
    signal.signal(signal.SIGINT, saved[1])


def test_sigterm_calls_on_term_then_the_previous_handler_and_both_are_restored(handlers):
    seen = []

    def previous(signum, frame) -> None:
        seen.append("previous")

    signal.signal(signal.SIGTERM, previous)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(ValueError), handle_signals(lambda: seen.append("on_term")):
        signal.raise_signal(signal.SIGTERM)
        assert seen == ["on_term", "previous"]
        raise ValueError  # (the fit fails: the handlers are put back all the same)
    assert seen == ["on_term", "previous"]
    assert signal.getsignal(signal.SIGTERM) is previous
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_first_ctrl_c_raises_keyboard_interrupt_and_arms_the_second(handlers):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with handle_signals(lambda: None, lambda: None):
        first = signal.getsignal(signal.SIGINT)
        assert first is not signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        second = signal.getsignal(signal.SIGINT)  # the next one exits at once (not raised here)
        assert callable(second) and second not in (first, signal.default_int_handler)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("theirs", [signal.SIG_IGN, "handler"], ids=["ignored", "user-handler"])
def test_a_sigint_not_pythons_default_is_left_alone(handlers, theirs):
    if theirs == "handler":
        theirs = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGINT, theirs)
    with handle_signals(lambda: None):
        assert signal.getsignal(signal.SIGINT) is theirs
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)


def test_outside_the_main_thread_nothing_is_installed(handlers):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    inside = []

    def fit() -> None:
        with handle_signals(lambda: None):
            inside.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))

    t = threading.Thread(target=fit)
    t.start()
    t.join()
    assert inside == [before]
