"""A loader read as torch reads it: the batches its own iterator yields, in its own order.

The loop reads every loader through a ``Source``: a torch ``DataLoader`` (``reader``) that
yields what the loader yields, each batch a *unit* of ``unit`` rows, of which a host call
takes ``per_call``; for a map-style dataset, the ``Order`` its batches of indices are read in,
which one epoch's ``Selection`` skips into (a resume), shares out between instances (several
processes) or stops (several processes: the run's last, incomplete host call, which none
reads). Units are joined into host calls by ``host_calls.py``.

- A torch ``DataLoader`` over a map-style dataset is read through a loader built once over the
  same dataset, collate function, workers (``worker_init_fn``, ``persistent_workers``,
  ``prefetch_factor``), generator and memory pinning, whose batch sampler is the loader's own
  behind an ``Order``: torch's iterator draws its workers' base seed and then the order, gives
  ``worker_init_fn`` the loader's dataset and collates each micro-batch, as for the loader
  itself. A ``DistributedSampler`` under several processes stands for its whole dataset
  (``whole_order``), which the loop shares out.
- A torch ``DataLoader`` over an ``IterableDataset`` is read itself: a stream has no order to
  skip into or share out (a resume reads up to where it stopped; each instance reads its own).
- A ``poptorch.DataLoader`` keeps PopTorch's semantics: each of its batches is a host call (its
  ``collate_fn`` sees the combined batch), or, with a custom batch sampler, a micro-batch,
  joined into host calls as PopTorch joins them; under several processes each instance reads
  its own loader, as PopTorch partitions it.

A persistent-workers loader keeps its workers from epoch to epoch within a call, and draws its
workers' base seed once, as its first iterator starts; its workers started again (by the next
call, or in a resumed process) start without that draw (``Source.start``), so the random state
moves as it does for the loader. (Their own random streams restart then: a dataset drawing
random numbers in persistent workers draws others after a call ends than plain torch's.)
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
)

from .random_state import rng_state, set_rng_state

__all__ = [
    "Selection",
    "Order",
    "Source",
    "torch_source",
    "poptorch_source",
    "whole_order",
    "generators",
    "kill_workers",
    "close",
]

# torch's DataLoader settings besides what the order is made of: the reader is built with the
# loader's own (those of torch's release: in_order, pin_memory_device... when it has them)
_ORDER = {"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}
_SETTINGS = tuple(p for p in inspect.signature(DataLoader.__init__).parameters if p not in _ORDER)

# Loaders whose workers' base seed was drawn (persistent workers: once, by their first
# iterator); weakly, as torch keeps a persistent iterator on the loader itself
_SEEDED: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class Selection:
    """Which units (batches of indices) of an epoch's order this process reads: after the
    first ``skip`` (a resume), up to ``stop`` (None: all; counted from the epoch's start), of
    each run of ``share`` x ``size`` units the ``rank``-th ``share`` (several processes' host
    calls), or with ``span`` those in ``[lo, hi)`` (a validation's slice). ``started`` runs
    once the skipped units are drawn, before the first unit read (a resume's random state)."""

    skip: int = 0
    stop: int | None = None
    share: int = 1
    size: int = 1
    rank: int = 0
    span: tuple[int, int] | None = None
    started: Callable[[], None] | None = None
    drawn: list[Any] | None = None  # the epoch's batches, drawn already (an older checkpoint's)

    def takes(self, u: int) -> bool:
        if self.span is not None:
            return self.span[0] <= u < self.span[1]
        return self.size == 1 or (u // self.share) % self.size == self.rank


_NONE = Selection(stop=0)


class Order(Sampler):
    """A loader's batch sampler, read an epoch at a time as its ``selection`` says. Each
    ``iter()`` is the wrapped sampler's, when torch's iterator calls it (once as it starts, and
    again as it resets with workers); ``prime`` draws the order of the last one made now (a
    sampler drawing it lazily, as torch's do, draws it when the first batch of indices is
    asked for, after the workers' base seed), so an epoch's order is drawn as the epoch
    starts, whatever runs before its first batch is read."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.selection = Selection()
        self.current: _Units | None = None

    def __iter__(self) -> Iterator[Any]:
        sel = self.selection
        self.current = _Units(sel, iter(self.inner if sel.drawn is None else sel.drawn))
        return self.current

    def prime(self) -> None:
        if self.current is not None:
            self.current.prime()

    def __len__(self) -> int:
        return len(self.inner)


_END = object()


class _Units:
    """The batches of indices of one ``iter()`` of an ``Order``, as its ``Selection`` takes
    them: counted from the epoch's start, ``selection.started`` run once the skipped ones are
    drawn."""

    def __init__(self, selection: Selection, units: Iterator[Any]) -> None:
        self.sel = selection
        self.units = units
        self.u = 0
        self.started = False
        self.next: Any = _END

    def __iter__(self) -> _Units:
        return self

    def prime(self) -> None:
        if not self.started and self.next is _END:
            self.next = self._take()

    def __next__(self) -> Any:
        batch, self.next = (self.next if self.next is not _END else self._take()), _END
        if batch is _END:
            raise StopIteration
        return batch

    def _take(self) -> Any:
        sel = self.sel
        while sel.stop is None or self.u < sel.stop:
            batch = next(self.units, _END)
            if batch is _END:
                break
            u = self.u
            self.u += 1
            if u >= sel.skip:
                self._start()
                if sel.takes(u):
                    if self.u == sel.stop:
                        self._drain()
                    return batch
        self._start()  # (nothing left after the skip)
        if sel.stop != 0:
            self._drain()
        return _END

    def _drain(self) -> None:
        """The rest of the order drawn, not read, as the last batch an epoch reads is taken: the
        sampler draws what a whole epoch draws (torch's ``RandomSampler`` draws as it ends)."""
        for _ in self.units:
            pass

    def _start(self) -> None:
        if not self.started:
            self.started = True
            if self.sel.started is not None:
                self.sel.started()


def whole_order(sampler: Sampler, instances: int, name: str) -> Sampler:
    """The order of the whole dataset that a training loader's ``sampler`` stands for.

    A ``DistributedSampler`` (the DDP idiom) yields one rank's share of a permutation drawn from
    its ``seed`` and the epoch its ``set_epoch`` was given. Under several processes the loop
    reads that whole permutation (its ``shuffle`` and ``seed``; the loop sets the epoch each
    epoch) and shares it out between the ``instances`` itself. Refused with a ``ValueError``:
    one made for another number of processes than the run has, and a subclass (whose order
    the loop cannot see whole).
    """
    if not isinstance(sampler, DistributedSampler):
        return sampler
    given = f"{name} has sampler={type(sampler).__name__}(num_replicas={sampler.num_replicas})"
    if type(sampler) is not DistributedSampler:
        raise ValueError(
            f"{given}, a subclass of DistributedSampler: it yields one process's share of an "
            "order the loop cannot see whole, and the loop shares the data out between its "
            "instances itself. Pass a sampler over the whole dataset (or shuffle=True), the "
            "same on every instance."
        )
    if sampler.num_replicas != instances:
        raise ValueError(
            f"{given}, but this run has {instances} instance(s). The loop reads a "
            "DistributedSampler as the order of its whole dataset and shares it out between "
            "the instances itself: drop the sampler and pass shuffle=True (every sample once "
            "an epoch), or build it for the run's processes: DistributedSampler(dataset) "
            "after the Loop, which joins the process group."
        )
    if instances == 1:
        return sampler  # (the whole permutation already)
    return DistributedSampler(
        sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed
    )


def generators(*owners: object) -> tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects an order draws from: the ``generator`` of each owner (a
    loader, its sampler, its batch sampler and the batch sampler's sampler), each once."""
    found: list[torch.Generator] = []
    for owner in owners:
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and not any(g is f for f in found):
            found.append(g)
    return tuple(found)


@contextlib.contextmanager
def kept_random_state(gens: tuple[torch.Generator, ...]) -> Iterator[None]:
    """The host's random state and the states of ``gens``, as they were before the block."""
    host = rng_state()
    own = [g.get_state() for g in gens]
    try:
        yield
    finally:
        set_rng_state(host)
        for g, s in zip(gens, own):
            g.set_state(s)


def _tell_epoch(samplers: tuple[Any, ...], epoch: int) -> None:
    for s in samplers:
        set_epoch = getattr(s, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


@dataclass
class Source:
    """A loader as the loop reads it: ``reader`` yields its units (``unit`` rows each; None:
    known from the first), of which a host call takes ``per_call``.

    ``order``: the order of a map-style dataset's units (None for a stream, read as its loader
    yields it); ``samplers``: those told each training epoch's number (``set_epoch``);
    ``gens``: the generators its order draws from; ``units``: the units of an epoch when known;
    ``full``: those of ``unit`` rows (a short last batch does not count); ``samples``: the
    samples of an epoch when known; ``own``: each instance reads its own loader (a stream, or a
    ``poptorch.DataLoader`` under several processes); ``rebatched``: the reader's batches are
    re-cut into host calls (PopTorch's ``AsyncRebatched``); ``prefetch``: read ahead with these
    ``async_options`` (None: synchronously)."""

    name: str
    reader: DataLoader
    loader: DataLoader  # the user's (``_SEEDED`` records its workers' base seed)
    dataset: Any
    unit: int | None
    per_call: int
    order: Order | None
    samplers: tuple[Any, ...]
    gens: tuple[torch.Generator, ...]
    units: int | None
    full: int | None
    samples: int | None
    own: bool = False
    rebatched: bool = False
    prefetch: dict[str, Any] | None = None
    epoch_hook: Callable[[int | None], None] | None = None  # before each epoch (PopTorch's)
    live: Any = field(default=None, compare=False)  # the running iterator

    @property
    def stream(self) -> bool:
        return self.order is None

    @property
    def persistent(self) -> bool:
        return bool(getattr(self.reader, "persistent_workers", False))

    def start(self, selection: Selection, number: int | None) -> Iterator[Any]:
        """An iterator over this epoch's units, read as ``selection`` says; ``number``: a
        training epoch's, told to the samplers with ``set_epoch`` first. A persistent-workers
        loader goes on with its running workers, as torch's does; one whose base seed was
        drawn but whose workers were stopped (a call that failed, a resumed process) starts
        them again without drawing it."""
        if number is not None:
            _tell_epoch(self.samplers, number)
        if self.epoch_hook is not None:
            self.epoch_hook(number)
        reader = self.reader
        seeded = self.was_seeded()
        if not self.persistent:
            self.close()  # (the last epoch's iterator)
        elif getattr(reader, "_iterator", None) is not None and not seeded:
            self.close()  # (an epoch drawn again that drew its workers' base seed: as it did)
        if self.persistent and getattr(reader, "_iterator", None) is None and seeded:
            with kept_random_state(self.gens):  # its workers start; no draw is kept
                self._select(_NONE)
                iter(reader)
        self._select(selection)
        it = iter(reader)
        with contextlib.suppress(TypeError):  # (a loader that cannot be weakly referenced)
            _SEEDED.add(self.loader)
        self.live = it
        if self.order is not None:
            self.order.prime()  # the order drawn now, as the epoch starts
        return it

    def _select(self, selection: Selection) -> None:
        if self.order is not None:
            self.order.selection = selection

    def seeded(self, *, drawn: bool = True) -> None:
        """Whether its loader's workers' base seed was drawn (by the run this one resumes)."""
        with contextlib.suppress(TypeError):
            if drawn:
                _SEEDED.add(self.loader)
            else:
                _SEEDED.discard(self.loader)

    def was_seeded(self) -> bool:
        return self.loader in _SEEDED

    def close(self) -> None:
        """Stop the loader workers of the running iterator (a persistent-workers loader's too:
        a call's workers do not outlive it; the next call starts them again)."""
        it, self.live = self.live, None
        persistent = getattr(self.reader, "_iterator", None)
        close(it)
        if persistent is not None:
            close(persistent)
            self.reader._iterator = None  # (torch's persistent iterator, now stopped)


# The reader of a loader over its own batch sampler, kept as long as the loader lives
_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ordered(loader: DataLoader, inner: Any, dataset: Any) -> tuple[DataLoader, Order]:
    """The reader of ``loader`` over the batches of ``inner`` and its ``Order``: the one kept
    for the loader when ``inner`` is its own batch sampler."""
    own = inner is loader.batch_sampler
    if own:
        with contextlib.suppress(TypeError):
            kept = _READERS.get(loader)
            if kept is not None:
                return kept
    order = Order(inner)
    reader = _reader(loader, order, dataset)
    if own:
        with contextlib.suppress(TypeError):
            _READERS[loader] = (reader, order)
    return reader, order


def _reader(loader: DataLoader, order: Order, dataset: Any) -> DataLoader:
    """A torch loader with ``loader``'s settings over ``dataset``, reading the batches of
    indices ``order`` gives."""
    kwargs = {k: getattr(loader, k) for k in _SETTINGS if hasattr(loader, k)}
    if not kwargs.get("num_workers"):  # (torch refuses them without workers)
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return DataLoader(dataset, batch_sampler=order, **kwargs)


def _length(x: object) -> int | None:
    try:
        n = len(x)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None
    return None if n is NotImplemented else n


def _peek_rows(batch_sampler: Any, gens: tuple[torch.Generator, ...]) -> int | None:
    """The indices in a custom batch sampler's first batch, drawn with the random state kept."""
    with kept_random_state(gens):
        first = next(iter(batch_sampler), None)
    return None if first is None else len(first)


def torch_source(
    loader: DataLoader, name: str, per_call: int, *, instances: int, training: bool
) -> Source:
    """A torch ``DataLoader`` as the loop reads it: its micro-batches, ``per_call`` a host call;
    a training order under several processes (``instances``) is the whole dataset's."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):  # read through its own iterator
        return _stream(loader, name, loader.batch_size, per_call)
    batch_sampler: Any = loader.batch_sampler  # (not None: the loop refuses batch_size=None)
    sampler: Any = loader.sampler
    if type(batch_sampler) is not BatchSampler or loader.batch_size is None:  # a custom one
        inner = batch_sampler
        samplers: tuple[Any, ...] = (getattr(batch_sampler, "sampler", None), batch_sampler)
        unit = getattr(batch_sampler, "batch_size", None)
        if not isinstance(unit, int):
            unit = _peek_rows(batch_sampler, generators(*samplers, loader))
        units = full = _length(batch_sampler)
        samples = _length(dataset)
    else:
        unit = batch_sampler.batch_size
        whole = whole_order(sampler, instances, name) if training else sampler
        inner = batch_sampler if whole is sampler else BatchSampler(whole, unit, drop_last=False)
        samplers = (whole,)
        samples = _length(whole)
        units = _length(inner)
        full = None if samples is None else samples // unit
    reader, order = _ordered(loader, inner, dataset)
    return Source(
        name=name,
        reader=reader,
        loader=loader,
        dataset=dataset,
        unit=unit,
        per_call=per_call,
        order=order,
        samplers=samplers,
        gens=generators(*samplers, loader, batch_sampler),
        units=units,
        full=full,
        samples=samples,
    )


def _stream(loader: Any, name: str, unit: int | None, per_call: int) -> Source:
    """An ``IterableDataset``'s loader, read through its own iterator (each instance its own)."""
    length = _length(loader.dataset)
    counted = length is not None and unit
    return Source(
        name=name,
        reader=loader,
        loader=loader,
        dataset=loader.dataset,
        unit=unit,
        per_call=per_call,
        order=None,
        samplers=(),
        gens=generators(loader),
        units=-(-length // unit) if counted else None,  # type: ignore[operator]
        full=length // unit if counted else None,  # type: ignore[operator]
        samples=length,
        own=True,
    )


# How many times PopTorch's partition of a loader's dataset was shuffled (once an epoch, as its
# __iter__ does), so that epoch e reads the partition PopTorch's e-th iteration reads
_SHUFFLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def poptorch_source(
    loader: Any, name: str, factor: int, *, training: bool, prefetch: dict[str, Any] | None
) -> Source:
    """A ``poptorch.DataLoader`` as PopTorch reads it: its batches (``combinedBatchSize``
    samples, a host call each; a custom batch sampler's micro-batches, ``factor`` a host call),
    each instance its own partition; ``prefetch``: its Async mode's settings. Validation and
    predict read every sample: its last, short host call too."""
    combined = loader.combinedBatchSize
    if isinstance(loader.dataset, IterableDataset):  # through its own iterator and mode
        return _stream(loader, name, combined, 1)
    dataset = loader.dataset
    batch_sampler: Any = loader.batch_sampler
    sampler: Any = loader.sampler
    rebatched = False
    if getattr(loader, "_is_user_batch_sampler_set", False):
        inner = getattr(batch_sampler, "batch_sampler", batch_sampler)  # (PopTorch's wrapper)
        unit, per_call, samples = getattr(inner, "batch_size", None), factor, _length(dataset)
        units = full = _length(inner)
    else:
        rebatched = _rebatched(loader)  # (its batches re-cut into host calls)
        unit, per_call, samples = loader.batch_size, 1, _length(sampler)
        keep = batch_sampler.drop_last and training  # (validation and predict read all)
        inner = (
            batch_sampler if keep == batch_sampler.drop_last else BatchSampler(sampler, unit, keep)
        )
        units = _length(inner)
        full = None if samples is None or not unit else samples // unit
    samplers = (sampler, inner, getattr(inner, "sampler", None))
    reader, order = _ordered(loader, inner, dataset)
    return Source(
        name=name,
        reader=reader,
        loader=loader,
        dataset=dataset,
        unit=unit,
        per_call=per_call,
        order=order,
        samplers=samplers,
        gens=generators(*samplers, loader, batch_sampler),
        units=units,
        full=full,
        samples=samples,
        own=True,
        rebatched=rebatched,
        prefetch=prefetch,
        epoch_hook=_partition_hook(loader)
        if getattr(loader, "_shuffle_distributed", False)
        else None,
    )


def _partition_hook(loader: Any) -> Callable[[int | None], None]:
    """Before an epoch (``number``; None: an inference's iteration), PopTorch's partition of the
    dataset shuffled as its ``__iter__`` shuffles it: for epoch e, after its e-th shuffle (a
    resumed or continued fit catches up)."""
    partition = loader.dataset

    def shuffle(number: int | None) -> None:
        done = _SHUFFLED.get(loader, 0)
        for _ in range(done, max(done + 1, (number or 0) + 1)):
            partition.shuffle_global_indices()
            partition.swap_range()
            done += 1
        _SHUFFLED[loader] = done

    return shuffle


def _rebatched(loader: Any) -> bool:
    """Whether a ``poptorch.DataLoader`` reads batches of another size than its host call
    (``AsyncRebatched``, its ``rebatched_worker_size``), which PopTorch re-cuts into them."""
    accessor = loader.__dict__.get("_accessor")
    size = getattr(accessor, "rebatched_size", None)
    return bool(size) and loader.batch_size != size


def kill_workers(it: object) -> None:
    """A second Ctrl-C: the process exits at once, so the loader workers must go first."""
    for w in getattr(it, "_workers", ()):
        with contextlib.suppress(Exception):
            w.kill()
    terminate = getattr(it, "terminate", None)  # a read-ahead thread, an accessor
    if terminate is not None:
        with contextlib.suppress(Exception):
            terminate()


def close(it: object) -> None:
    """Stop loader worker processes (or a read-ahead thread) now rather than when collected."""
    shutdown = getattr(it, "_shutdown_workers", None) or getattr(it, "terminate", None)
    if shutdown is not None:
        shutdown()
