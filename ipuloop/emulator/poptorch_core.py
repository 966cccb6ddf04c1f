"""``poptorch.poptorch_core``: the error classes PopTorch's compiled core defines.

PopTorch re-exports ``Error``, ``RecoverableError`` and ``UnrecoverableError`` from its C++
module; programs catch them by either name. ``isCompilingWithDispatcher()`` says whether a
model is being compiled (traced); ``_throwTestError(TestErrorType)`` raises the error of each
category as PopTorch's core reports it (what programs test their error handling with, as
PopTorch's user guide does). The rest of that module drives the Poplar compiler (option
validation, IR and the other test hooks) and is refused with ``poptorch.Error``.
"""

from __future__ import annotations

import enum
from typing import Any

from .blocks import Block
from .errors import Error

__all__ = [
    "Error",
    "RecoverableError",
    "UnrecoverableError",
    "TestErrorType",
    "CoreOnlyError",
    "isCompilingWithDispatcher",
    "_throwTestError",
]


class RecoverableError(Error):
    """A runtime error the device can recover from; ``recovery_action`` says how (on an IPU:
    e.g. "FULL_RESET")."""

    recovery_action = ""


class UnrecoverableError(Error):
    """A runtime error after which the device cannot be used again."""


class TestErrorType(enum.IntEnum):
    """The errors PopTorch's ``_throwTestError`` hook raises (its own tests' parameters)."""

    Poptorch = 0
    Popart = 1
    PopartInternal = 2
    Poplibs = 3
    PoplarUnrecoverable = 4
    PoplarUnknown = 5
    PoplarRecoverableFullReset = 6
    PoplarLinkError = 7


# TestErrorType -> (class, type, message, recovery action) of the error PopTorch's
# ``throwTestError`` (popart_compiler/source/Compiler.cpp) raises, as its exception handling
# (poptorch_err/source/ExceptionHandling.cpp) reports it.
_TEST_ERRORS = {
    TestErrorType.Poptorch: (Error, "poptorch_cpp_error", "This is a PopTorch error", ""),
    TestErrorType.Popart: (Error, "popart_exception", "This is a Popart error", ""),
    TestErrorType.PopartInternal: (
        Error,
        "popart_internal_exception",
        "This is a Popart error",
        "",
    ),
    TestErrorType.Poplibs: (Error, "poplibs_exception", "This is a Poplibs error", ""),
    TestErrorType.PoplarUnrecoverable: (
        UnrecoverableError,
        "poplar_unrecoverable_runtime_error",
        "This is not recoverable",
        "",
    ),
    TestErrorType.PoplarUnknown: (
        Error,
        "poplar_unknown_runtime_error",
        "Don't know what happened",
        "",
    ),
    TestErrorType.PoplarRecoverableFullReset: (
        RecoverableError,
        "poplar_recoverable_runtime_error",
        "Reboot needed",
        "FULL_RESET",
    ),
    TestErrorType.PoplarLinkError: (
        Error,
        "poplar_link_error",
        "Link error. Output: Library -lfoo not found\ncheck path",
        "",
    ),
}


def _throwTestError(error_type: TestErrorType) -> None:
    """Raise the test error of ``error_type``'s category, with PopTorch's ``message``,
    ``type``, ``location`` (the two contexts PopTorch's hook raises it in) and, for a
    recoverable one, ``recovery_action``."""
    cls, kind, message, action = _TEST_ERRORS.get(
        error_type, (Error, "poptorch_cpp_error", "Unknown TestErrorType", "")
    )
    location = " [0] throwTestError::topLevel\n [1] throwTestError::bottomLevel"
    text = f"In Compiler.cpp: '{kind}': {message}"
    if action:
        text += f"\nRecovery action required: {action}"
    error = cls(
        f"{text}\nError raised in:\n{location}", type=kind, location=location, message=message
    )
    if action:
        error.recovery_action = action
    raise error


def isCompilingWithDispatcher() -> bool:
    """True while a model is being compiled: the emulator traces its first micro-batch (a
    failed compilation leaves it False)."""
    return Block._trace is not None


class CoreOnlyError(Error, AttributeError):
    """A name of PopTorch's compiled core the emulator lacks: a ``poptorch.Error``, and an
    ``AttributeError`` so that ``hasattr`` and ``getattr(..., default)`` see it missing."""


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise CoreOnlyError(
        f"poptorch.poptorch_core.{name} belongs to PopTorch's compiled core "
        "(the Poplar compiler, its IR and its test hooks), which the ipuloop "
        "emulator does not have. Only poptorch_core.Error, RecoverableError, "
        "UnrecoverableError and isCompilingWithDispatcher exist here; use the "
        "public poptorch API instead."
    )
