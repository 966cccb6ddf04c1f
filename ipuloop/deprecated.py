"""The first layout's names, each warning that it moved and which release removes it.

``ipuloop.config``, ``ipuloop.plot`` (and ``python -m ipuloop.plot``), ``ipuloop.distributed``,
``ipuloop.errors`` and the loggers ``ipuloop.callbacks`` handed out still work until ipuloop
``REMOVED_IN``, each with a ``DeprecationWarning`` naming the import that replaces it (``MOVED``).

This module sits beside the integrations, above the callbacks: it puts the loggers' old names
into ``ipuloop.callbacks.MOVED``, so the callbacks import nothing above them. ``config.py`` and
``plot.py`` are modules of their own (``import ipuloop.config`` finds a file); ``distributed`` and
``errors`` are module objects in ``sys.modules`` (the emulator has modules of those basenames).
``tests/test_deprecated.py`` fails once the package's version reaches ``REMOVED_IN``: this module,
``config.py``, ``plot.py`` and the lines that name them go then.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import warnings
from types import ModuleType
from typing import Any

from . import callbacks, exceptions, processes

__all__ = ["MOVED", "REMOVED_IN", "message", "warn"]

REMOVED_IN = "0.2.0"

# Each old name, and the name of the same module, class or command now.
MOVED = {
    "ipuloop.config": "ipuloop.integrations.ipu_config",
    "ipuloop.plot": "ipuloop.integrations.plotting",
    "python -m ipuloop.plot": "python -m ipuloop.integrations.plotting",
    "ipuloop.distributed": "ipuloop.processes",
    "ipuloop.errors": "ipuloop.exceptions",
    "ipuloop.callbacks.TensorBoardLogger": "ipuloop.integrations.tensorboard.TensorBoardLogger",
    "ipuloop.callbacks.WandbLogger": "ipuloop.integrations.wandb_logger.WandbLogger",
    "ipuloop.callbacks.MLFlowLogger": "ipuloop.integrations.mlflow_logger.MLFlowLogger",
    "ipuloop.callbacks.ScalarLogger": "ipuloop.integrations.scalars.ScalarLogger",
}


def message(old: str) -> str:
    """What using ``old`` warns: its new name, as an import (or a command), and when it goes."""
    new = MOVED[old]
    if new.startswith("python -m "):
        instead = f"run `{new}`"
    elif old.rpartition(".")[2][:1].isupper():  # a class: where it is imported from now
        module, _, name = new.rpartition(".")
        instead = f"use `from {module} import {name}`"
    else:
        instead = f"import `{new}`"
    return f"`{old}` is deprecated and will be removed in ipuloop {REMOVED_IN}: {instead} instead"


_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_IMPORTLIB = os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside ipuloop and Python's import machinery
    (``import ipuloop.config`` runs the module from importlib's frames): the user's line.
    ``warnings`` skips the frames of importlib's bootstrap itself, so they are not counted."""
    level, frame = 1, sys._getframe(1)  # ``warn``'s frame
    while frame.f_back is not None:
        frame = frame.f_back
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            continue
        level += 1
        if not os.path.abspath(name).startswith((_HERE, _IMPORTLIB)):
            break
    return level


def warn(old: str) -> None:
    """Warns that ``old`` moved, at the line of the program that used it."""
    warnings.warn(message(old), DeprecationWarning, stacklevel=_callers_level())


def _logger(name: str) -> Any:
    from .integrations import mlflow_logger, scalars, tensorboard, wandb_logger

    warn(f"ipuloop.callbacks.{name}")
    return {
        "TensorBoardLogger": tensorboard.TensorBoardLogger,
        "WandbLogger": wandb_logger.WandbLogger,
        "MLFlowLogger": mlflow_logger.MLFlowLogger,
        "ScalarLogger": scalars.ScalarLogger,
    }[name]


def _forwarding(old: str, target: ModuleType) -> ModuleType:
    """A module named ``old`` whose every public name is ``target``'s, warning when read."""
    module = ModuleType(old, f"Deprecated: {message(old)}.")

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # what the import machinery asks a module
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(target, name)
        warn(old)
        return value

    def __dir__() -> list[str]:
        return dir(target)

    vars(module).update(__getattr__=__getattr__, __dir__=__dir__)
    return module


def _install() -> None:
    """Puts the old names in place: the loggers' in ``ipuloop.callbacks``, the two modules in
    ``sys.modules`` (``from ipuloop.distributed import ...`` finds it there)."""
    for old in MOVED:
        if old.startswith("ipuloop.callbacks."):
            name = old.rpartition(".")[2]
            callbacks.MOVED[name] = functools.partial(_logger, name)
    sys.modules.setdefault("ipuloop.distributed", _forwarding("ipuloop.distributed", processes))
    sys.modules.setdefault("ipuloop.errors", _forwarding("ipuloop.errors", exceptions))


_install()
