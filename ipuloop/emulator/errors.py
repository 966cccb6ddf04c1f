"""PopTorch's error type."""

from __future__ import annotations

from typing import Any

__all__ = ["Error"]


class Error(RuntimeError):
    """Raised where PopTorch raises ``poptorch.Error`` (shape mismatch, attach misuse, ...).

    As PopTorch's, it has the string attributes ``message`` (the text without context),
    ``type`` (the part of the stack that raised it: "poptorch_py_error" for the emulator's
    own checks, as for PopTorch's Python layer) and ``location`` (where it was raised; empty
    unless a context was given)."""

    def __init__(
        self,
        *args: Any,
        type: str = "poptorch_py_error",
        location: str = "",
        message: str | None = None,
    ) -> None:
        super().__init__(*args)
        self.message = message if message is not None else (str(args[0]) if args else "")
        self.type = type
        self.location = location
