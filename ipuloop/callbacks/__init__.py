"""Callbacks: the base class, cancel exceptions and the built-in callbacks."""

from __future__ import annotations

from .base import Callback, CancelEpoch, CancelFit, CancelStep
from .checkpoint import CheckpointError, ModelCheckpoint, load_checkpoint
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .lr import LRScheduler
from .mlflow_logger import MLFlowLogger
from .profile import ProfileCapture
from .progress import ProgressBar
from .scalars import ScalarLogger
from .tensorboard import TensorBoardLogger
from .wandb_logger import WandbLogger

__all__ = [
    "CSVLogger",
    "Callback",
    "CancelEpoch",
    "CancelFit",
    "CancelStep",
    "CheckpointError",
    "EarlyStopping",
    "LRScheduler",
    "MLFlowLogger",
    "ModelCheckpoint",
    "ProfileCapture",
    "ProgressBar",
    "ScalarLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "load_checkpoint",
]
