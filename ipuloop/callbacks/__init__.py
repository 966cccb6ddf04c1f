"""Callbacks: the base class, cancel exceptions and the built-in callbacks.

``TensorBoardLogger``, ``WandbLogger``, ``MLFlowLogger`` and their base ``ScalarLogger`` live in
``ipuloop.integrations`` (``from ipuloop.integrations.tensorboard import TensorBoardLogger``),
which the callbacks never import.
"""

from __future__ import annotations

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
