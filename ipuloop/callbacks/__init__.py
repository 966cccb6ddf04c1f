"""Callbacks: the base class, cancel exceptions and the built-in callbacks."""
from __future__ import annotations

from .base import Callback, CancelEpoch, CancelFit, CancelStep
from .progress import ProgressBar

__all__ = ["Callback", "CancelEpoch", "CancelFit", "CancelStep", "ProgressBar"]
