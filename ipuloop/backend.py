"""Which PopTorch ``ipuloop.poptorch`` is: the real one, or ``ipuloop.emulator``.

``IPULOOP_BACKEND`` picks: ``auto`` (default: real poptorch when it imports, else the
emulator, with a warning naming the cause when an installed poptorch fails to import),
``poptorch`` (the real one or an error, never a silent fallback) or ``emulator``.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from types import ModuleType

from .rules import uses_ipu_model

__all__ = ["poptorch_module", "backend_name", "BackendError", "uses_ipu_model"]

logger = logging.getLogger("ipuloop")

_CHOICES = ("auto", "poptorch", "emulator")
_resolved: tuple[str, ModuleType] | None = None


class BackendError(ImportError):
    """The requested PopTorch backend cannot be used."""


def _resolve() -> tuple[str, ModuleType]:
    choice = os.environ.get("IPULOOP_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise BackendError(
            f"IPULOOP_BACKEND must be one of {', '.join(_CHOICES)}. "
            f"Received: IPULOOP_BACKEND={choice!r}."
        )
    if choice in ("auto", "poptorch"):
        try:
            return "poptorch", importlib.import_module("poptorch")
        except Exception as e:  # ImportError, or e.g. the AssertionError of a poptorch built
            # for another torch version: either way there is no PopTorch to run on
            if choice == "poptorch":
                raise BackendError(
                    "IPULOOP_BACKEND=poptorch, but poptorch cannot be imported "
                    f"({type(e).__name__}: {e}). poptorch ships with Graphcore's Poplar SDK: "
                    "enable the SDK (source <sdk>/enable) and install its wheel with "
                    "`pip install <sdk>/poptorch-*.whl` into an environment with the torch "
                    "version it was built for, or set IPULOOP_BACKEND=emulator to run on the "
                    "CPU."
                ) from e
            if not isinstance(e, ImportError):  # installed but broken: say why, once
                warnings.warn(
                    f"poptorch is installed but failed to import ({type(e).__name__}: "
                    f"{e}): using the ipuloop emulator. Set IPULOOP_BACKEND=emulator "
                    "to silence this, or fix the installation to run on IPUs.",
                    RuntimeWarning,
                    stacklevel=4,
                )
    return "emulator", importlib.import_module("ipuloop.emulator")


def poptorch_module() -> ModuleType:
    """The PopTorch module in use (resolved once per process, logged once)."""
    global _resolved
    if _resolved is None:
        _resolved = _resolve()
        name, module = _resolved
        logger.info(
            "ipuloop backend: %s (%s)", name, getattr(module, "__version__", "unknown version")
        )
    return _resolved[1]


def backend_name() -> str:
    """ "poptorch" (real IPUs) or "emulator" (CPU/CUDA emulation of PopTorch)."""
    poptorch_module()
    assert _resolved is not None  # (resolved by poptorch_module)
    return _resolved[0]
