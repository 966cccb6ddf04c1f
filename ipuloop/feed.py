"""A batch as the model's call: ``Feed`` (the loop's), ``split_batch`` (its inputs and labels),
``predict_inputs`` (predict's inputs) and ``as_sent`` (float inputs as the device gets them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .outputs import WithLoss

__all__ = ["Feed", "split_batch", "predict_inputs", "as_sent"]


class Feed:
    """A batch as the model's call and its labels (``split_batch``), its float inputs cast to
    ``dtype`` (16-bit precision: the device gets float inputs as half; None: as they are).

    It remembers how many inputs a tuple batch holds besides its labels (what predict feeds,
    ``num_inputs``) and tells a ``WithLoss`` model, which tells labels from inputs by it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        label_key: str,
        *,
        needs_labels: bool,
        dtype: torch.dtype | None,
    ) -> None:
        self.model: Any = model  # (a WithLoss's num_inputs is read and set)
        self.label_key = label_key
        self.needs_labels = needs_labels  # (the labels of a dict batch: for loss_fn, metrics)
        self.dtype = dtype
        self.num_inputs: int | None = None  # inputs per batch in the last fit or validate
        # (issubclass: isinstance would read the wrapped __class__)
        self.with_loss = issubclass(type(model), WithLoss)

    def split(self, batch: object, name: str, *, cast: bool = True) -> tuple[tuple, dict, Any]:
        """The model's call ``(*args, **kwargs)`` for a training or validation ``batch`` of
        the loader ``name``, and its labels; ``cast=False``: float inputs as they are."""
        args, kwargs, labels = split_batch(
            batch, name, self.label_key, need_labels=self.needs_labels
        )
        if not kwargs:
            n = self.num_inputs = len(args) - 1
            if self.with_loss and self.model.num_inputs != n:
                self.model.num_inputs = n  # (Module.__setattr__: only when it changes)
        if self.dtype is not None and cast:
            args, kwargs = as_sent(args, kwargs, self.dtype)
            labels = kwargs.get(self.label_key) if kwargs else args[-1]
        return args, kwargs, labels

    def predict(self, batch: object, name: str, *, first: bool) -> tuple[tuple, dict]:
        """The model's inputs in a predict ``batch`` (``predict_inputs``); the ``first`` batch,
        before the model compiles, tells a ``WithLoss`` how many there are."""
        args, kwargs = predict_inputs(batch, self.num_inputs, name, self.label_key)
        if first and self.with_loss and not kwargs:
            self.model.num_inputs = len(args)
        return as_sent(args, kwargs, self.dtype)


def split_batch(
    batch: object, name: str, label_key: str = "labels", *, need_labels: bool = True
) -> tuple[tuple, dict, Any]:
    """A batch as the model's call and its labels: ``(args, kwargs, labels)``.

    A tuple ``(inputs..., labels)`` is called ``model(inputs..., labels)``, the labels last;
    a dict (any mapping: a Hugging Face batch) ``model(**batch)``, the labels included, found
    under ``label_key`` (a Transformers model takes them as ``labels=`` and returns its loss).
    A dict without ``label_key`` has no labels: a ``ValueError`` naming its keys when
    ``need_labels`` (the loop computes the loss or metrics from them).
    """
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(batch), _NO_KWARGS, batch[-1]
    if isinstance(batch, Mapping):
        kwargs = batch if type(batch) is dict else dict(batch)
        if label_key in kwargs:
            return (), kwargs, kwargs[label_key]
        if need_labels:
            raise ValueError(
                f"{name} yields dict batches without the labels' key label_key={label_key!r} "
                f"(keys {list(kwargs)}), but the loop needs the labels (for loss_fn or the "
                "metrics). Pass Loop(label_key=...) naming the key that holds them."
            )
        return (), kwargs, None
    raise ValueError(
        f"{name} must yield (inputs..., labels) tuples (the last element "
        f"is the labels) or dicts of keyword inputs. Received a "
        f"{type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        + ". Return (x, y) from the dataset's __getitem__."
    )


_NO_KWARGS: dict = {}  # a tuple batch's keyword inputs (never written to)


def as_sent(args: tuple, kwargs: dict, dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """A call's inputs with their float tensors as ``dtype`` (16-bit precision: the device
    gets float inputs as half); unchanged for None."""
    if dtype is None:
        return args, kwargs

    def cast(x: object) -> object:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}


def predict_inputs(
    batch: object, num_inputs: int | None, name: str, label_key: str = "labels"
) -> tuple[tuple, dict]:
    """The model's inputs in a predict batch, as ``(args, kwargs)``: all of its elements, or
    all but the labels.

    After a fit or validate with N inputs, a batch of N elements is N inputs and one of
    N + 1 is N inputs and the labels; before, a batch of two or more elements is taken
    as (inputs..., labels). A dict is keyword inputs, less its ``label_key`` entry.
    """
    if isinstance(batch, Mapping):
        return (), {k: v for k, v in batch.items() if k != label_key}
    if not isinstance(batch, (tuple, list)):
        return (batch,), _NO_KWARGS
    n = num_inputs
    if n is None:
        return (tuple(batch[:-1]) if len(batch) >= 2 else tuple(batch)), _NO_KWARGS
    if len(batch) in (n, n + 1):
        return tuple(batch[:n]), _NO_KWARGS
    raise ValueError(
        f"{name} yields batches of {len(batch)} elements, but the model "
        f"was fit with {n} input(s): predict takes (inputs...) or "
        "(inputs..., labels) batches of those inputs."
    )
