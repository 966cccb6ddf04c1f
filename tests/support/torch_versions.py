"""Tests that need a torch newer than the Poplar SDK's 2.0.1 (PopTorch 3.4's pin).

``newer_torch(reason)`` gives such a test its marks: skipped on torch < 2.1, and marked
``newer_torch``, which CI runs in its first environment (the current torch) whatever the test's
folder (tests/support/ci_share.py). Use it as a decorator or as ``pytest.param(..., marks=...)``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

OLD_TORCH = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 1)


class _Marks(list):
    """Marks that also decorate a test."""

    def __call__(self, test: Callable[..., Any]) -> Callable[..., Any]:
        for mark in self:
            test = mark(test)
        return test


def newer_torch(reason: str) -> _Marks:
    """The marks of a test that needs torch >= 2.1, ``reason`` saying why."""
    return _Marks([pytest.mark.skipif(OLD_TORCH, reason=reason), pytest.mark.newer_torch])
