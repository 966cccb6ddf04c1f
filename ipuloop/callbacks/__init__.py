"""Callbacks: the base class, cancel exceptions and the built-in callbacks."""
from __future__ import annotations

from .base import Callback, CancelEpoch, CancelFit, CancelStep
from .checkpoint import CheckpointError, ModelCheckpoint, load_checkpoint
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .lr import LRScheduler
from .profile import ProfileCapture
from .progress import ProgressBar
from .tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Callback", "CancelEpoch", "CancelFit", "CancelStep", "CheckpointError",
           "EarlyStopping", "LRScheduler", "ModelCheckpoint", "ProfileCapture", "ProgressBar",
           "TensorBoardLogger", "load_checkpoint"]
