"""Host calls made of a loader's units (its batches, as torch's iterator yields them).

A training host call joins ``per_call`` units, in the order they come (``joined``): micro-batch
``m`` of the call, laid out ``[DI, GA, RF]``, is the m-th unit. Validation and predict count
every sample: their units' rows are cut into host calls of the combined batch, in order, and
the last one is padded with copies of the last sample (``cut``); so are the batches of a
``poptorch.DataLoader`` that PopTorch re-cuts (``AsyncRebatched``).

A compiled model takes one input shape (PopTorch refuses any other at the next call): every
unit must have the first one's shapes (``OneShape``). A stream's short unit (an
``IterableDataset``'s worker ends its share with one) is dropped from training, with a
warning; any other difference (a collate function padding each batch to its longest
sequence) is refused, naming both shapes and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import torch

from .outputs import map_tensors

__all__ = ["OneShape", "joined", "cut", "join", "rows"]


def rows(batch: object) -> int:
    """Samples in a collated batch: the length of its first tensor (-1: none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    parts = (
        batch.values()
        if isinstance(batch, dict)
        else batch
        if isinstance(batch, (tuple, list))
        else ()
    )
    for part in parts:
        n = rows(part)
        if n >= 0:
            return n
    return -1


def join(batches: list[Any], what: str) -> Any:
    """Batches (tensors, or tuples, namedtuples, lists and dicts of them) joined along dim 0."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, dict):
        return type(first)((k, join([b[k] for b in batches], what)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple
        return type(first)(*(join(list(parts), what) for parts in zip(*batches)))
    if isinstance(first, (tuple, list)):
        return type(first)(join(list(parts), what) for parts in zip(*batches))
    raise TypeError(
        f"Cannot join {what} of {type(first).__name__}: each batch must be tensors, or "
        "tuples, lists or dicts of tensors."
    )


def _shapes(batch: object) -> Any:
    """The shapes of a collated batch's tensors, in its structure (what a compile fixes)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.shape)
    if isinstance(batch, dict):
        return {k: _shapes(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return [_shapes(v) for v in batch]
    return None


def _shorter(shapes: Any, first: Any) -> bool:
    """Whether ``shapes`` are ``first`` but for fewer rows (dim 0) in every tensor."""
    if isinstance(first, list) and first and all(isinstance(d, int) for d in first):
        return (
            isinstance(shapes, list)
            and len(shapes) == len(first)
            and shapes[1:] == first[1:]
            and shapes[0] < first[0]
        )
    if isinstance(first, dict):
        return (
            isinstance(shapes, dict)
            and shapes.keys() == first.keys()
            and all(_shorter(shapes[k], first[k]) for k in first)
        )
    if isinstance(first, list):
        return (
            isinstance(shapes, list)
            and len(shapes) == len(first)
            and all(_shorter(s, f) for s, f in zip(shapes, first))
        )
    return shapes == first


def _without_rows(shapes: Any) -> Any:
    if isinstance(shapes, list) and shapes and all(isinstance(d, int) for d in shapes):
        return shapes[1:]
    if isinstance(shapes, dict):
        return {k: _without_rows(v) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_without_rows(v) for v in shapes]
    return shapes


class OneShape:
    """Every unit of a loader (``name``) checked against the first one read: a model compiles
    for one input shape. ``unit``: the rows a unit must have (None: the first's); ``short``:
    what a unit of fewer rows is: "drop" (a stream's, in training), "refuse" (a custom batch
    sampler's batch), or "keep" (validation and predict, which cut rows into host calls)."""

    def __init__(
        self,
        name: str,
        unit: int | None,
        short: str,
        sampler: str = "",
        where: str = "batch {} of this epoch",
    ) -> None:
        self.name = name
        self.where = where  # a unit's place, for messages
        self.unit = unit
        self.short = short
        self.sampler = sampler  # a custom batch sampler's type, for messages
        self.first: Any = None
        self.dropped = 0  # samples of the short units dropped
        self._refused: tuple = ()  # the short unit found last: where, its shapes, the expected
        self.index = 0  # units checked

    def epoch(self) -> None:
        """A new epoch: its units are counted from 0 in messages."""
        self.index = 0

    def check(self, batch: object) -> bool | str:
        """Whether ``batch`` goes into a host call (False: a short unit, dropped; ``SHORT``: a
        short unit, refused unless it ends the epoch); a ``ValueError`` when it cannot have the
        compiled shape."""
        index = self.index
        self.index += 1
        shapes = _shapes(batch)
        if self.first is None:
            n = rows(batch)
            if self.short == "keep" or self.unit is None or n in (self.unit, -1):
                self.first = shapes
                return True
            if self.short == "drop" and n < self.unit:
                return self._short(batch, index)
            if n < self.unit:
                self._refused = (index, shapes, f"{self.unit} samples (the batch size)")
                return SHORT
            raise self._shape_error(index, shapes, f"{self.unit} samples (the batch size)")
        if shapes == self.first:
            return True
        if self.short == "keep":
            if _without_rows(shapes) == _without_rows(self.first):
                return True
            expected = f"the shapes of the first, {_without_rows(self.first)} beyond dim 0"
            raise self._shape_error(index, _without_rows(shapes), expected)
        if self.short == "drop" and _shorter(shapes, self.first):
            return self._short(batch, index)
        expected = f"the shapes of the first, {self.first}"
        if _shorter(shapes, self.first):
            self._refused = (index, shapes, expected)
            return SHORT
        raise self._shape_error(index, shapes, expected)

    def short_error(self) -> ValueError:
        """The error for the short batch ``check`` found last (a host call would read it)."""
        return self._shape_error(*self._refused)

    def _short(self, batch: object, index: int) -> bool:
        n = rows(batch)
        if not self.dropped:
            warnings.warn(
                f"{self.name}: {self.where.format(index)} holds {n} samples, not "
                f"{self.unit}, and is dropped from training: the model is compiled for one "
                "micro-batch size. (An IterableDataset read by loader workers ends each "
                "worker's share with such a batch; the DataLoader's drop_last=True drops them "
                "itself.)",
                stacklevel=2,
            )
        self.dropped += n
        return False

    def _shape_error(self, index: int, shapes: Any, expected: str) -> ValueError:
        source = f"its batch sampler ({self.sampler}) yields" if self.sampler else "it yields"
        fix = (
            "pad every batch to one fixed shape in the collate_fn (sequences to one length, "
            "max_length=..., rather than to each batch's longest)"
        )
        if self.sampler:
            fix += ", with the same number of samples, or drop a short last batch "
            fix += "(BatchSampler(..., drop_last=True))"
        return ValueError(
            f"{self.name}: {source} batches of different shapes: {self.where.format(index)} "
            f"has shapes {shapes}, but the model is compiled for {expected}. A compiled model "
            "takes one input shape, so every batch must have it. A collate_fn that pads each "
            f"batch to its own longest sequence (dynamic padding) does this: {fix}."
        )


def joined(units: Iterator[Any], per_call: int, shape: OneShape) -> Iterator[Any]:
    """Host calls of ``per_call`` units each, in order, every unit checked (``shape``); a short
    one dropped where ``shape`` drops it (a stream's), else refused unless it ends the epoch in
    its incomplete last call, which is dropped."""
    while True:
        parts: list[Any] = []
        while len(parts) < per_call:
            unit = next(units, _END)
            if unit is _END:
                return
            fits = shape.check(unit)
            if fits is SHORT:  # (the last batch of a BatchSampler(drop_last=False)...)
                whole = shape.short == "refuse" and len(parts) + 1 == per_call
                if whole or next(units, _END) is not _END:
                    raise shape.short_error()  # a host call would read it
                return  # (the epoch's remainder, its short last batch with it)
            if fits:
                parts.append(unit)
        yield join(parts, "a loader's batches")


_END = object()
SHORT = "short"  # ``OneShape.check``: a batch of fewer samples, refused unless it ends the epoch


def cut(
    units: Iterator[Any], combined: int, shape: OneShape, *, pad: bool, calls: int | None = None
) -> Iterator[Any]:
    """Host calls of ``combined`` rows cut from ``units`` in order, each with how many of its
    rows are samples; the last one padded with copies of the last sample (``pad``), or dropped
    when incomplete; then, up to ``calls`` host calls, the last one again holding no sample
    (several processes' validation: another instance has samples left)."""
    made = 0
    last = None
    for whole, real in _cut(units, combined, shape, pad=pad):
        made += 1
        last = whole
        yield whole, real
    while calls is not None and last is not None and made < calls:
        made += 1
        yield last, 0


def _padded(batch: Any, extra: int) -> Any:
    """``batch`` followed by ``extra`` copies of its last sample."""
    return map_tensors(
        batch, lambda t: torch.cat([t, t[-1:].expand(extra, *t.shape[1:])]) if t.dim() else t
    )


def _cut(units: Iterator[Any], combined: int, shape: OneShape, *, pad: bool) -> Iterator[Any]:
    pending: list[Any] = []
    count = 0
    ended = False
    while not ended or count:
        while count < combined and not ended:
            unit = next(units, _END)
            if unit is _END:
                ended = True
                break
            shape.check(unit)
            n = rows(unit)
            if n < 0:
                raise TypeError(
                    f"{shape.name}: its batches must hold tensors to be cut into host calls. "
                    f"Received a {type(unit).__name__}."
                )
            if n:
                pending.append(unit)
                count += n
        if not count or (count < combined and not pad):
            return
        whole = join(pending, "a loader's batches")
        real = min(count, combined)
        if count > combined:
            pending = [map_tensors(whole, lambda t: t[combined:] if t.dim() else t)]
            whole = map_tensors(whole, lambda t: t[:combined] if t.dim() else t)
        else:
            pending = []
        if real < combined:  # the loader ended: copies of its last sample fill the call
            whole = _padded(whole, combined - real)
        count -= real
        yield whole, real
