"""Errors the loop raises that callbacks and users catch by type, and notes on exceptions."""
from __future__ import annotations

__all__ = ["NonFiniteLossError", "add_note"]


class NonFiniteLossError(FloatingPointError):
    """A returned loss was NaN or infinite."""


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
