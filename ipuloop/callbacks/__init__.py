"""Callbacks: the base class, cancel exceptions and the built-in callbacks.

``TensorBoardLogger``, ``WandbLogger``, ``MLFlowLogger`` and their base ``ScalarLogger`` live in
``ipuloop.integrations``; importing them from here imports them on first use, so importing the
callbacks imports no integration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Callback, CancelEpoch, CancelFit, CancelStep
from .checkpoint import CheckpointError, ModelCheckpoint, load_checkpoint
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .lr import LRScheduler
from .profile import ProfileCapture
from .progress import ProgressBar

if TYPE_CHECKING:
    from ..integrations.mlflow_logger import MLFlowLogger
    from ..integrations.scalars import ScalarLogger
    from ..integrations.tensorboard import TensorBoardLogger
    from ..integrations.wandb_logger import WandbLogger

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


def __getattr__(name: str) -> Any:
    # The loggers of ipuloop.integrations, imported on first use.
    if name == "TensorBoardLogger":
        from ..integrations.tensorboard import TensorBoardLogger

        return TensorBoardLogger
    if name == "WandbLogger":
        from ..integrations.wandb_logger import WandbLogger

        return WandbLogger
    if name == "MLFlowLogger":
        from ..integrations.mlflow_logger import MLFlowLogger

        return MLFlowLogger
    if name == "ScalarLogger":
        from ..integrations.scalars import ScalarLogger

        return ScalarLogger
    raise AttributeError(f"module 'ipuloop.callbacks' has no attribute {name!r}")
