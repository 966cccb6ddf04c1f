"""``poptorch.poptorch_core``: the error classes PopTorch's compiled core defines.

PopTorch re-exports ``Error``, ``RecoverableError`` and ``UnrecoverableError`` from its C++
module; programs catch them by either name. ``isCompilingWithDispatcher()`` says whether a
model is being compiled (traced). The rest of that module drives the Poplar compiler (option
validation, IR and test hooks) and is refused with ``poptorch.Error``.
"""
from __future__ import annotations

import enum
from typing import Any

from .blocks import Block
from .errors import Error

__all__ = ["Error", "RecoverableError", "UnrecoverableError", "TestErrorType", "CoreOnlyError",
           "isCompilingWithDispatcher"]


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
    raise CoreOnlyError(f"poptorch.poptorch_core.{name} belongs to PopTorch's compiled core "
                        "(the Poplar compiler, its IR and its test hooks), which the ipuloop "
                        "emulator does not have. Only poptorch_core.Error, RecoverableError, "
                        "UnrecoverableError and isCompilingWithDispatcher exist here; use the "
                        "public poptorch API instead.")
