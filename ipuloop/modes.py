"""Each submodule's train/eval mode, read and put back whole: a module the user put in eval mode
(a frozen BatchNorm) stays in it through training, validation, predict and the host probe; and
a model's weights put back after a run on the host (``kept_weights``)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator, List, Tuple

import torch

__all__ = ["Modes", "modes", "restore", "eval_mode", "kept_weights", "warn_if_evaluating"]

Modes = List[Tuple[torch.nn.Module, bool]]


def modes(model: torch.nn.Module) -> Modes:
    """Every module of ``model`` (itself first) with its ``training`` flag."""
    return [(m, m.training) for m in model.modules()]


def restore(saved: Modes) -> None:
    """Put back the flags ``modes`` read, each module's own (``train()`` would set them all)."""
    for m, training in saved:
        m.training = training


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode, then each module back in the mode it had."""
    saved = modes(model)
    model.eval()
    try:
        yield
    finally:
        restore(saved)


@contextlib.contextmanager
def kept_weights(model: torch.nn.Module) -> Iterator[Callable[[], None]]:
    """``model``'s parameters and buffers bitwise as they were before the block: what a run on
    the host writes in place (BatchNorm statistics, a parameter a ``forward`` updates under
    ``no_grad``, as an EMA does) is undone. The block gets the function that undoes it."""
    tensors = [*model.parameters(), *model.buffers()]
    saved = [t.detach().clone() for t in tensors]

    def put_back() -> None:
        with torch.no_grad():
            for t, s in zip(tensors, saved):
                t.copy_(s)

    try:
        yield put_back
    finally:
        put_back()


def warn_if_evaluating(model: torch.nn.Module, stacklevel: int = 2) -> None:
    """Warn when ``model`` itself is in eval mode as training starts: the loop trains each module
    in the mode it has (as PopTorch traces it), so a ``model.eval()`` left from an evaluation
    would train with dropout off and frozen normalisation statistics."""
    if model.training:
        return
    evaluating = sum(not m.training for m in model.modules())
    warnings.warn(
        f"The model is in eval mode as the fit starts ({evaluating} of "
        f"{sum(1 for _ in model.modules())} modules): the loop trains each module in the mode "
        "it has, as PopTorch traces it, so dropout is off and normalisation statistics stay "
        "frozen where a module is in eval mode. Call model.train() before fit() to train in "
        "training mode (then put the modules to keep frozen back in eval mode).",
        stacklevel=stacklevel,
    )
