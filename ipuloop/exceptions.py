"""Errors the loop raises that callbacks and users catch by type, and notes on exceptions."""

from __future__ import annotations

__all__ = ["NonFiniteLossError", "InstanceFailedError", "add_note"]


class NonFiniteLossError(FloatingPointError):
    """A returned loss was NaN or infinite."""


class InstanceFailedError(RuntimeError):
    """Several processes: another instance's fit failed first, so this one's ended too.

    ``instance`` is the failing instance's index and ``error`` its exception as text (its
    traceback is in that instance's output); this instance's own error is the ``__cause__``.
    """

    def __init__(self, message: str, instance: int, error: str) -> None:
        super().__init__(message)
        self.instance = instance
        self.error = error

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.instance, self.error)


def add_note(e: BaseException, note: str) -> None:
    """``e.add_note(note)``; before Python 3.11, the ``__notes__`` list it would write."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:
        try:
            notes = e.__dict__.setdefault("__notes__", [])
        except AttributeError:  # an exception type without a __dict__
            return
        notes.append(note)
