"""Callbacks: the base class, cancel exceptions and the built-in callbacks.

``TensorBoardLogger``, ``WandbLogger``, ``MLFlowLogger`` and their base ``ScalarLogger`` live in
``ipuloop.integrations`` (``from ipuloop.integrations.tensorboard import TensorBoardLogger``).
Their first names here are deprecated: ``ipuloop.deprecated``, which sits above the callbacks,
answers them (``MOVED``) with a ``DeprecationWarning``, so the callbacks import no integration.
"""

from __future__ import annotations

from typing import Any, Callable

from .base import Callback, CancelEpoch, CancelFit, CancelStep
from .checkpoint import CheckpointError, ModelCheckpoint, load_checkpoint
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .lr import LRScheduler
from .profile import ProfileCapture
from .progress import ProgressBar

__all__ = [
    "CSVLogger",
    "Callback",
    "CancelEpoch",
    "CancelFit",
    "CancelStep",
    "CheckpointError",
    "EarlyStopping",
    "LRScheduler",
    "ModelCheckpoint",
    "ProfileCapture",
    "ProgressBar",
    "load_checkpoint",
]


# The names this package had for what now lives elsewhere, each with a function that warns and
# gives it: filled by ``ipuloop.deprecated``, which imports what they name.
MOVED: dict[str, Callable[[], Any]] = {}


def __getattr__(name: str) -> Any:
    if name in MOVED:
        return MOVED[name]()
    raise AttributeError(f"module 'ipuloop.callbacks' has no attribute {name!r}")
