"""PopTorch's error type."""
from __future__ import annotations

__all__ = ["Error"]


class Error(RuntimeError):
    """Raised where PopTorch raises ``poptorch.Error`` (shape mismatch, attach misuse, ...)."""
