"""What a plan is built from: the kinds of loader, resumable samplers, padding, host calls.

One object per kind of loader (``Kind``), picked once (``pick``): a stream read for training
(``Streamed``) or cut into padded host calls (``CutStream``), a map-style dataset read in an
order (``Ordered``), a custom batch sampler's batches (``Batched``). It checks the loader against
the options and measures it, and answers the host calls of an epoch (``steps``: what
``num_updates`` counts, building nothing), the ``poptorch.DataLoader`` it is rebuilt as
(``rebuilt``), an epoch's start (``start``) and reading (``read``, ``counted``), and its order's
generator state.

Every loader given to the loop is rebuilt as a ``poptorch.DataLoader`` over the same dataset,
micro-batch size, sampler (or shuffle and generator), workers and collate function, with the
loop's options. Its sampler (or custom batch sampler) is wrapped so that each epoch's order is
drawn at one defined moment (``set_epoch``), from random state the checkpoint records, and so
that a resumed epoch starts after the samples already seen without reading them (an
``IterableDataset``, which has no order to skip into, is read up to there). A sampler with
``set_epoch`` is told each training epoch's number before the epoch draws its order, as a DDP
loop does; a ``DistributedSampler`` stands for its whole dataset (``whole_order``). Under several
processes, each instance reads its share of one global order (``ProcessSampler``).

Validation and predict count every sample: a map-style dataset is padded to whole host calls
with copies of its last sample, and a stream (``IterableDataset``) is read in the order its
loader yields it, its workers' batches cut into host calls and the last one padded as it ends.
Reading ahead (``DataLoaderMode.Async``, ``Loop(async_data=...)``) is ``read_ahead.py``'s.

A custom batch sampler gives each micro-batch of a host call (``[DI, GA, RF/g]``, each replica
its own) one of its batches, in order; every batch must have the shapes of the first, as a
compiled model takes one shape (``OneShape``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, replace
from functools import cached_property
from types import ModuleType
from typing import Any, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
)

from .outputs import map_tensors
from .poptorch_types import DataLoader as PopTorchLoader
from .poptorch_types import Options
from .random_state import rng_state
from .read_ahead import Prefetch, Prefetched, picklable
from .rules import describe_factors, host_call_factor, input_groups

__all__ = [
    "ResumableSampler",
    "ResumableBatchSampler",
    "ProcessSampler",
    "ProcessBatchSampler",
    "Padded",
    "StreamCalls",
    "HostCalls",
    "OneShape",
    "Factors",
    "Reading",
    "Kind",
    "Streamed",
    "CutStream",
    "Ordered",
    "Batched",
    "pick",
    "fit_iterations",
    "built_micro_batch",
    "loader_kwargs",
    "whole_order",
    "tell_epoch",
    "check_last_batch",
    "kill_workers",
    "close",
]

_KEEP = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
)


def built_micro_batch(
    loader: PopTorchLoader, opts: Options, *, training: bool, name: str, where: str = ""
) -> int | None:
    """The micro-batch size a ``poptorch.DataLoader`` was built for (None if it has no batch
    size); a ``ValueError`` when its host call is not the one the loop runs with ``opts``
    (``where``: " per instance" under several processes)."""
    combined = loader.combinedBatchSize
    if not combined:
        return None
    micro = combined // host_call_factor(loader.options, training)
    if combined != micro * host_call_factor(opts, training):
        raise ValueError(
            f"{name} was built for {describe_factors(loader.options, micro, training)}, "
            f"but the loop runs {describe_factors(opts, micro, training)}{where}. Build the "
            "loader with the same options as the loop, or pass a torch DataLoader with the "
            "micro-batch size and let the loop build it."
        )
    return micro


def loader_kwargs(loader: object) -> dict[str, Any]:
    """The settings of ``loader`` that a rebuilt loader over the same data keeps (workers,
    collation, memory pinning, generator), less those its worker count makes invalid."""
    kwargs = {k: getattr(loader, k) for k in _KEEP if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("persistent_workers", None)
        kwargs.pop("timeout", None)
    else:
        kwargs["prefetch_factor"] = getattr(loader, "prefetch_factor")  # noqa: B009
    return kwargs


def whole_order(sampler: Sampler, instances: int, name: str) -> Sampler:
    """The order of the whole dataset that a training loader's ``sampler`` stands for.

    A ``DistributedSampler`` (the DDP idiom) yields one rank's share of a permutation of its
    dataset drawn from its ``seed`` and the epoch its ``set_epoch`` was given. The loop reads
    that whole permutation instead (its ``shuffle`` and ``seed``; the loop sets the epoch each
    epoch), so every sample is read once an epoch, in a new order each epoch, and the loop
    shares it out between the ``instances`` itself. Its ``rank`` and ``drop_last`` are not
    used: the loop drops the samples that make no whole host call. Refused with a
    ``ValueError``: one made for another number of processes than the run has, and a subclass
    (whose order the loop cannot see whole).
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
    return DistributedSampler(
        sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed
    )


def tell_epoch(wrapped: object, epoch: int) -> None:
    """``set_epoch(epoch)`` on the sampler (and a batch sampler's sampler) ``wrapped`` holds,
    where it has one: samplers that draw each epoch's order from its number."""
    inner = getattr(wrapped, "inner", None)
    for s in (inner, getattr(inner, "sampler", None)):
        set_epoch = getattr(s, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class ResumableSampler(Sampler):
    """Wraps a sampler: the epoch's order is drawn in ``set_epoch``, then skipped into.

    Every ``iter()`` until the next ``set_epoch`` yields that one order: torch's loader with
    workers calls ``iter()`` on its (batch) sampler twice as its iterator starts (once as it
    is built, once as it resets), and a second draw would read another order than the one
    the checkpoint records, from random state already moved on, without the resume's skip."""

    def __init__(self, inner: Any) -> None:  # (a sampler, or a batch sampler, with a length)
        self.inner = inner
        self._order: list[int] | None = None

    def set_epoch(self, skip: int = 0) -> None:
        """Draw this epoch's order now (from the RNG as it is) and drop the first ``skip``."""
        self._order = list(iter(self.inner))[skip:]

    def items(self) -> int:
        """Items of a whole epoch (samples, or a batch sampler's batches)."""
        return len(self.inner)

    def generator_state(self) -> torch.Tensor | None:
        g = getattr(self.inner, "generator", None)
        return g.get_state() if isinstance(g, torch.Generator) else None

    def set_generator_state(self, state: torch.Tensor | None) -> None:
        g = getattr(self.inner, "generator", None)
        if state is not None and isinstance(g, torch.Generator):
            g.set_state(state)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a prefetching loader's, for its worker process): the wrapped sampler's
        generator as a ``PicklableGenerator``, which torch before 2.1 can pickle."""
        state = dict(self.__dict__)
        g = getattr(self.inner, "generator", None)
        if type(g) is torch.Generator:
            state["inner"] = inner = copy.copy(self.inner)
            inner.generator = picklable(g)
        return state

    def __iter__(self) -> Iterator[int]:
        if self._order is None:  # iterated before any epoch drew (a loader read directly)
            self.set_epoch()
        return iter(self._order or ())

    def __len__(self) -> int:
        return len(self._order) if self._order is not None else len(self.inner)


class ResumableBatchSampler(ResumableSampler):
    """``ResumableSampler`` for a custom batch sampler: its items are batches, and the wrapped
    sampler's attributes (``batch_size``, ``sampler``...) show through."""

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class ProcessSampler(ResumableSampler):
    """This instance's share of a global order: of each global host call laid out
    ``[DI*GA, N, share]``, the ``share`` items (its replicas' micro-batches: samples, or a
    batch sampler's batches) at index ``rank``; the remainder of the epoch that makes no whole
    global call is dropped."""

    def __init__(self, inner: Any, rank: int, size: int, iterations: int, share: int) -> None:
        super().__init__(inner)
        self.rank = rank
        self.size = size
        self.iterations = iterations
        self.share = share
        self.local_call = iterations * share
        self.global_call = self.local_call * size

    def set_epoch(self, skip: int = 0) -> None:
        order = list(iter(self.inner))
        steps = len(order) // self.global_call
        skip_steps = skip // self.local_call
        if steps <= skip_steps:
            self._order = []
            return
        at = torch.arange(steps * self.global_call).view(
            steps, self.iterations, self.size, self.share
        )[skip_steps:, :, self.rank]
        self._order = [order[i] for i in at.reshape(-1).tolist()]

    def items(self) -> int:
        return len(self.inner) // self.global_call * self.local_call

    def __len__(self) -> int:
        return len(self._order) if self._order is not None else self.items()


class ProcessBatchSampler(ProcessSampler, ResumableBatchSampler):
    """``ProcessSampler`` over a custom batch sampler's batches, whose attributes show
    through: instance p reads the batches its replicas would read in one process with N*R
    replicas."""


class Padded(Dataset):
    """The dataset followed by copies of its last sample, up to ``total`` (for predict)."""

    def __init__(self, dataset: Any, total: int) -> None:  # (a dataset with a length)
        self.dataset = dataset
        self.n = len(dataset)
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> Any:
        return self.dataset[min(i, self.n - 1)]


def _cat(batches: list[Any], what: str = "a custom batch sampler's batches") -> Any:
    """Batches (tensors, or tuples, namedtuples, lists and dicts of them) joined along dim 0."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, dict):
        return type(first)((k, _cat([b[k] for b in batches], what)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple
        return type(first)(*(_cat(list(parts), what) for parts in zip(*batches)))
    if isinstance(first, (tuple, list)):
        return type(first)(_cat(list(parts), what) for parts in zip(*batches))
    raise TypeError(
        f"Cannot join batches of {type(first).__name__}: {what} must be tensors, "
        "or tuples, lists or dicts of tensors."
    )


def _rows(batch: object) -> int:
    """Samples in a collated batch: the length of its first tensor."""
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
        n = _rows(part)
        if n >= 0:
            return n
    return -1


class StreamCalls:
    """Host calls of ``combined`` samples cut from a stream's batches, in the order its loader
    yields them (its workers' batches in turn); the last call is padded with copies of the
    last sample. ``real``: the samples of the call last returned (the rest is padding).

    The torch iterator's attributes (``_workers``, ``_shutdown_workers``) show through."""

    def __init__(self, batches: Iterator[Any], combined: int) -> None:
        self.batches = batches
        self.combined = combined
        self.pending: list[Any] = []
        self.count = 0
        self.real = 0
        self.ended = False

    def __iter__(self) -> StreamCalls:
        return self

    def __next__(self) -> Any:
        combined = self.combined
        while self.count < combined and not self.ended:
            try:
                batch = next(self.batches)
            except StopIteration:
                self.ended = True
                break
            n = _rows(batch)
            if n < 0:
                raise TypeError(
                    f"A stream's batches must hold tensors to be cut into host "
                    f"calls. Received a {type(batch).__name__}."
                )
            if n:
                self.pending.append(batch)
                self.count += n
        if not self.count:
            raise StopIteration
        joined = _cat(self.pending, "a stream's batches")
        self.real = min(self.count, combined)
        if self.count > combined:
            self.pending = [map_tensors(joined, lambda t: t[combined:] if t.dim() else t)]
            joined = map_tensors(joined, lambda t: t[:combined] if t.dim() else t)
        else:
            self.pending = []
        pad = combined - self.real
        if pad:  # the stream ended: copies of its last sample fill the call
            joined = map_tensors(
                joined, lambda t: torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) if t.dim() else t
            )
        self.count -= self.real
        return joined

    def __getattr__(self, name: str) -> Any:
        if name == "batches":
            raise AttributeError(name)
        return getattr(self.batches, name)


def _shapes(batch: object) -> Any:
    """The shapes of a collated batch's tensors, in its structure (what a compile fixes)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.shape)
    if isinstance(batch, dict):
        return {k: _shapes(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return [_shapes(v) for v in batch]
    return None


class OneShape:
    """A custom batch sampler's batches, each checked against the first of the fit: a model
    compiles for one input shape (PopTorch refuses any other at the next call), so a sampler
    of batches that vary (bucketing by length, a short last batch) is refused at the first
    batch that differs, before it is joined into a host call or run. ``batch_size``: the rows
    the sampler declares (its ``batch_size``), None when it declares none; ``per_call``: its
    batches per host call."""

    def __init__(self, name: str, sampler: object, batch_size: int | None, per_call: int) -> None:
        self.name = name
        self.sampler = type(sampler).__name__
        self.batch_size = batch_size
        self.per_call = per_call
        self.first: Any = None

    def check(self, batch: object, index: int, unit: str = "batch") -> None:
        """``batch``: the ``index``-th ``unit`` (0-based) of the epoch: a sampler's batch, or a
        host call that a prefetching loader joined."""
        shapes = _shapes(batch)
        if shapes == self.first:
            return
        if self.first is None:
            want = self.batch_size
            if want is not None and unit != "batch":
                want *= self.per_call
            if want is None or _rows(batch) in (want, -1):
                self.first = shapes
                return
            expected = f"{want} samples (the sampler's batch_size {self.batch_size}" + (
                f" x {self.per_call} batches)" if unit != "batch" else ")"
            )
        else:
            expected = f"the shapes of the first, {self.first}"
        raise ValueError(
            f"{self.name}: its batch sampler ({self.sampler}) yields batches of different "
            f"shapes: {unit} {index} of this epoch has shapes {shapes}, but it needs "
            f"{expected}. The model is compiled for one input shape, so every batch must have "
            "it: pad each batch to the same shape in the collate_fn (the same number of "
            "samples, sequences padded to one length), or drop a short last batch "
            "(BatchSampler(..., drop_last=True))."
        )


class HostCalls:
    """A custom batch sampler's micro-batches, ``count`` at a time, joined into host batches.

    PopTorch's DataLoader does this in a plain generator (``_utils.combined_batch_generator``),
    whose workers the loop could neither shut down nor kill: here the torch iterator's
    attributes (``_workers``, ``_shutdown_workers``) show through. An incomplete group at the
    end is dropped, as the loop drops the last incomplete host call. Each micro-batch is
    checked (``OneShape``) before it is joined; ``start``: the batches skipped into.
    """

    def __init__(self, batches: Iterator[Any], count: int, shape: OneShape, start: int = 0) -> None:
        self.batches = batches
        self.count = count
        self.shape = shape
        self.index = start

    def __iter__(self) -> HostCalls:
        return self

    def __next__(self) -> Any:
        parts = [next(self.batches) for _ in range(self.count)]  # an incomplete one: dropped
        for batch in parts:
            self.shape.check(batch, self.index)
            self.index += 1
        return _cat(parts)

    def __getattr__(self, name: str) -> Any:
        if name == "batches":
            raise AttributeError(name)
        return getattr(self.batches, name)


def check_last_batch(batch_sampler: object, count: int, name: str) -> None:
    """A ``BatchSampler(drop_last=False)`` whose short last batch a host call would read (its
    batches make whole host calls of ``count``) is refused before any step."""
    if not isinstance(batch_sampler, BatchSampler) or batch_sampler.drop_last:
        return
    try:
        sampler: Any = batch_sampler.sampler  # (with a length, or a TypeError)
        short = len(sampler) % batch_sampler.batch_size
        batches = len(batch_sampler)
    except TypeError:  # a sampler without a length
        return
    if short and batches % count == 0:
        raise ValueError(
            f"{name}: its BatchSampler has drop_last=False, so its last batch holds {short} "
            f"samples, not {batch_sampler.batch_size}, and a host call reads it (its {batches} "
            f"batches make whole host calls of {count}), but the model is compiled for one "
            "shape. Pass drop_last=True to the BatchSampler, or pad that batch in the "
            "collate_fn."
        )


def kill_workers(batches: object) -> None:
    """A second Ctrl-C: the process exits at once, so its loader workers must go first."""
    for w in getattr(batches, "_workers", ()):
        with contextlib.suppress(Exception):
            w.kill()
    terminate = getattr(batches, "terminate", None)  # a prefetching loader's worker or thread
    if terminate is not None:
        with contextlib.suppress(Exception):
            terminate()


def close(batches: object) -> None:
    """Stop loader worker processes now rather than when the iterator is collected."""
    shutdown = getattr(batches, "_shutdown_workers", None) or getattr(batches, "terminate", None)
    if shutdown is not None:
        shutdown()


# -- the kinds of loader: how one is measured, rebuilt, started and read ------------------------
@dataclass(frozen=True)
class Factors:
    """What a plan is built from besides the loader, made once per build and read by each
    of its steps (one that needs another value makes a copy: ``dataclasses.replace``).

    ``opts``: the options the checks and the host call read (``host_call_factor``: DI, RF/g,
    GA); ``loader_opts``: those the rebuilt loader carries when they differ (several
    processes: the instance's, ``opts`` being its options alone, and the loader reads every
    sample it is given: ``auto_distributed_partitioning=False``); ``instances``: the processes
    a training order is read for (``whole_order``). A validation or predict (``inference``)
    refuses an empty loader; ``fitted_to``: the training options whose DI*GA its device
    iterations are fitted from (``fit_iterations``), when it has no options of its own."""

    poptorch: ModuleType
    opts: Options
    training: bool
    name: str
    pad: bool = False  # every sample in order, the last host call padded (validation, predict)
    sequential: bool = False  # in order, not padded (validation's slices)
    partition: bool = True  # several processes share the samples out (False: each reads all)
    instances: int = 1
    async_options: dict[str, Any] | None = None  # a torch loader read ahead (async_data)
    loader_opts: Any = None  # None: ``opts``
    inference: bool = False
    fitted_to: Options | None = None

    @cached_property
    def factor(self) -> int:
        """Micro-batches in one host call (asked once)."""
        return host_call_factor(self.opts, training=self.training)


@dataclass
class Reading:
    """What a plan's running epoch leaves behind (the one part of a plan that changes)."""

    reader: Any = None  # the iterator of the epoch last started (stopped when a call ends)
    drawn_from: dict[str, Any] | None = None  # the random state its last training epoch drew
    # its order from (the host's, with the loader generator's under "sampler")


@contextlib.contextmanager
def _one_draw(generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """Around starting an epoch's iterator: the state of the loader's ``generator`` (the
    host's when it has none) to start it from; after it, the random state is as one draw from
    that generator left it.

    A new torch iterator draws its workers' base seed from the RNG; a persistent-workers
    loader reuses its iterator from the second epoch on and draws nothing. Drawn exactly once
    either way, a run resumed in a new process consumes the RNG as the original."""
    host = torch.get_rng_state()
    own = generator.get_state() if generator is not None else host
    yield own
    torch.set_rng_state(host)
    if generator is not None:
        generator.set_state(own)
    torch.empty((), dtype=torch.int64).random_(generator=generator)  # the same draw iter() makes


@dataclass(frozen=True)
class Kind:
    """A loader as one process reads it, measured and checked (``pick``): a stream, read in the
    order its loader yields it (``Streamed``; cut into padded host calls by validation and
    predict: ``CutStream``), a map-style dataset read in an order drawn each epoch
    (``Ordered``), or a custom batch sampler's batches (``Batched``).

    Each answers the host calls of an epoch (``steps``), the ``poptorch.DataLoader`` it is read
    through (``rebuilt``: its ``opts``, ``dataset`` and keyword ``args``), an epoch's start
    (``start``: the epoch's number, the steps skipped), its reading (``read``, ``counted``) and
    its order's generator state."""

    name: str
    micro: int  # micro-batch size B
    combined: int  # samples per host call
    samples: int | None  # dataset length, when known (one instance's share in validation)
    dataset: Any  # what the rebuilt loader reads (padded, an instance's slice)
    opts: Options  # the options the rebuilt loader carries
    args: dict[str, Any]  # its keyword arguments besides the options and the dataset

    def steps(self) -> int | None:
        """Host calls per epoch: those its length makes (None: it has none)."""
        try:
            return len(self.dataset) // self.combined
        except TypeError:
            return None

    def rebuilt(self, poptorch: ModuleType) -> PopTorchLoader:
        """The ``poptorch.DataLoader`` it is read through."""
        return poptorch.DataLoader(self.opts, self.dataset, **self.args)

    def start(self, skip_steps: int, number: int | None) -> None:
        """Before an epoch is read, after ``skip_steps`` host calls; ``number``: a training
        epoch's, for a sampler with ``set_epoch``."""

    def read(
        self, reading: Reading, loader: PopTorchLoader, prefetch: Prefetch | None, skip_steps: int
    ) -> None:
        """The epoch's host batches from ``loader`` (``prefetch``: read ahead, through a loader
        of its own), after ``skip_steps`` of them, as ``reading.reader``."""
        it: Any
        with _one_draw(loader.generator) as own:
            it = iter(loader) if prefetch is None else Prefetched(prefetch, loader, self.args, own)
        for _ in range(skip_steps):  # a stream: nothing to skip into, read it
            next(it, None)
        reading.reader = it

    def counted(self, batches: Iterator[Any]) -> Iterator[tuple[Any, int]]:
        """``batches``, each with how many of its rows are samples (the rest is padding)."""
        for batch in batches:
            yield batch, self.combined

    def first_rows(self) -> int | None:
        """The samples of the first micro-batch (the host probe's), None when the dataset
        cannot be indexed."""
        return None

    def generator_state(self) -> torch.Tensor | None:
        """The state of its order's own generator, if it draws with one."""
        return None

    def set_generator_state(self, state: torch.Tensor | None) -> None:
        """Its order's generator set to ``state`` (None: as it is)."""

    def drawn_from(self) -> dict[str, Any]:
        """The random state an epoch's order is drawn from now."""
        return rng_state()


@dataclass(frozen=True)
class Streamed(Kind):
    """An ``IterableDataset`` read for training: its host calls as its loader yields them, a
    resumed epoch read up to where it stopped."""


@dataclass(frozen=True)
class CutStream(Kind):
    """An ``IterableDataset`` read by validation or predict: every sample, in the order its
    own loader yields it (``stream``: its batches, ``drop_last=False``), cut into host calls
    and the last one padded (``StreamCalls``)."""

    stream: DataLoader

    def read(
        self, reading: Reading, loader: PopTorchLoader, prefetch: Prefetch | None, skip_steps: int
    ) -> None:
        with _one_draw(self.stream.generator):
            batches = iter(self.stream)
        reading.reader = StreamCalls(batches, self.combined)  # read from its start

    def counted(self, batches: Iterator[Any]) -> Iterator[tuple[Any, int]]:
        calls: Any = batches  # (a ``StreamCalls``: ``real``, the samples of the call it gave)
        for batch in calls:
            yield batch, calls.real


@dataclass(frozen=True)
class Ordered(Kind):
    """A map-style dataset read in ``order`` (a ``ResumableSampler``, or an instance's share
    of one: ``ProcessSampler``), drawn as each epoch starts and skipped into."""

    order: ResumableSampler

    @property
    def per_call(self) -> int:
        """The order's items in one host call (samples)."""
        return self.combined

    def steps(self) -> int | None:
        try:  # (the order's whole epoch: its len is the order drawn, less a resume's skip)
            return self.order.items() // self.per_call
        except TypeError:
            return None

    def start(self, skip_steps: int, number: int | None) -> None:
        if number is not None:
            tell_epoch(self.order, number)
        self.order.set_epoch(skip_steps * self.per_call)

    def read(
        self, reading: Reading, loader: PopTorchLoader, prefetch: Prefetch | None, skip_steps: int
    ) -> None:
        with _one_draw(loader.generator) as own:
            reading.reader = (
                iter(loader) if prefetch is None else Prefetched(prefetch, loader, self.args, own)
            )

    def counted(self, batches: Iterator[Any]) -> Iterator[tuple[Any, int]]:
        left = self.samples or None  # (validation's, padded: the rest of the last call)
        for batch in batches:
            real = self.combined if left is None else min(self.combined, left)
            if left is not None:
                left -= real
            yield batch, real

    def first_rows(self) -> int | None:
        return None if self.samples is None else min(self.micro, self.samples)

    def generator_state(self) -> torch.Tensor | None:
        return self.order.generator_state()

    def set_generator_state(self, state: torch.Tensor | None) -> None:
        self.order.set_generator_state(state)

    def drawn_from(self) -> dict[str, Any]:
        drawn = rng_state()
        drawn["sampler"] = self.order.generator_state()
        return drawn

    def shared(self, opts: Options) -> Ordered:
        """This instance's share (``opts``: its options, ``Distributed``'s process id and
        count) of the whole run's order, which this kind reads in one process with every
        instance's replicas."""
        rank, size, iterations = self._layout(opts)
        share = input_groups(opts) * self.micro  # (its replicas' samples of an iteration)
        order = ProcessSampler(self.order.inner, rank, size, iterations, share)
        return replace(
            self,
            combined=self.micro * host_call_factor(opts, training=True),
            opts=opts,
            args={**self.args, "sampler": order, "auto_distributed_partitioning": False},
            order=order,
        )

    @staticmethod
    def _layout(opts: Options) -> tuple[int, int, int]:
        """This instance's rank, the instances, and the iterations (DI*GA) of a host call."""
        iterations = opts.device_iterations * opts.Training.gradient_accumulation
        return opts.Distributed.processId, opts.Distributed.numProcesses, iterations


@dataclass(frozen=True)
class Batched(Ordered):
    """A custom batch sampler's batches (``order``: a ``ResumableBatchSampler``, or an
    instance's share: ``ProcessBatchSampler``): each micro-batch of a host call is one batch,
    read as torch's loader yields them and joined (``HostCalls``); every batch has the shapes
    of the first (``shape``)."""

    shape: OneShape

    @property
    def per_call(self) -> int:
        return self.combined // self.micro

    def read(
        self, reading: Reading, loader: PopTorchLoader, prefetch: Prefetch | None, skip_steps: int
    ) -> None:
        skip = skip_steps * self.per_call
        with _one_draw(loader.generator) as own:
            if prefetch is not None:  # each host call its loader joined is checked
                reading.reader = Prefetched(
                    prefetch, loader, self.args, own, self.shape, skip_steps
                )
            else:  # torch's iterator of micro-batches, joined here
                batches = DataLoader.__iter__(loader)  # type: ignore[arg-type]
                reading.reader = HostCalls(batches, self.per_call, self.shape, skip)

    def counted(self, batches: Iterator[Any]) -> Iterator[tuple[Any, int]]:
        for batch in batches:
            yield batch, self.combined

    def first_rows(self) -> int | None:
        return None

    def shared(self, opts: Options) -> Ordered:
        rank, size, iterations = self._layout(opts)
        groups = input_groups(opts)
        order = ProcessBatchSampler(self.order.inner, rank, size, iterations, groups)
        return replace(
            self,
            combined=self.micro * host_call_factor(opts, training=True),
            opts=opts,
            args={**self.args, "batch_sampler": order, "auto_distributed_partitioning": False},
            order=order,
            shape=OneShape(self.name, self.order.inner, self.shape.batch_size, iterations * groups),
        )


def pick(loader: DataLoader, f: Factors) -> Kind:
    """The kind of ``loader`` as this process reads it with ``f`` (alone, or its share of
    several processes': ``opts.Distributed.numProcesses`` > 1), measured and checked against
    the options; a validation or predict's device iterations fitted first (``f.fitted_to``)."""
    if f.inference:
        if f.fitted_to is not None:
            fit_iterations(f.poptorch, loader, f.fitted_to, f.opts)
        _check_not_empty(loader, f.name)
    if f.opts.Distributed.numProcesses > 1:
        with warnings.catch_warnings():  # (dropped samples...: said on instance 0 only)
            if f.opts.Distributed.processId != 0:
                warnings.simplefilter("ignore")
            return _share(loader, f)
    return _alone(loader, f)


def fit_iterations(poptorch: ModuleType, loader: DataLoader, train: Options, opts: Options) -> None:
    """Set the device iterations a validation or predict over ``loader`` runs with ``opts``
    (derived from the training options ``train``): from DI*GA down to half of it, the count
    that pads the fewest samples (fewer only for a short loader); a ``poptorch.DataLoader``'s
    own (and its replicas)."""
    if isinstance(loader, poptorch.DataLoader):
        lo = loader.options
        opts.deviceIterations(lo.device_iterations)
        opts.replicationFactor(lo.replication_factor)
        return
    di = target = train.device_iterations * train.Training.gradient_accumulation
    per_iteration = (loader.batch_size or 1) * input_groups(train)
    with contextlib.suppress(TypeError):
        n = len(loader.dataset)  # type: ignore[arg-type]
        if n < per_iteration * target:
            di = max(1, n // per_iteration)
        else:  # from DI*GA down to half of it: the count that pads the fewest samples
            di = min(range(target, (target - 1) // 2, -1), key=lambda d: -n % (per_iteration * d))
    opts.deviceIterations(di)


def _check_not_empty(loader: DataLoader, name: str) -> None:
    try:
        empty = len(loader.dataset) == 0  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset: its length is unknown
        empty = False
    if empty:
        raise ValueError(
            f"{name} has 0 samples (the loader is empty): there is nothing "
            "to run. Pass a loader over a dataset with at least one sample."
        )


def _check_loader(loader: object, name: str) -> None:
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise TypeError(
            f"{name} must be a torch.utils.data.DataLoader or poptorch.DataLoader. "
            f"Received: {name}={type(loader).__name__}."
        )


def _custom_batches(poptorch: ModuleType, loader: DataLoader) -> Sampler | None:
    """The batch sampler the user chose (a subclass, or a plain BatchSampler passed as
    batch_sampler=, which leaves batch_size None), rather than the one torch built; None."""
    batch_sampler: Any = loader.batch_sampler  # (a sampler of lists of indices)
    built = isinstance(loader, poptorch.DataLoader)
    if batch_sampler is None or not (
        type(batch_sampler) is not BatchSampler or (not built and loader.batch_size is None)
    ):
        return None
    return getattr(batch_sampler, "batch_sampler", batch_sampler) if built else batch_sampler


def _micro_batch(loader: DataLoader, f: Factors, custom: Sampler | None) -> int:
    """The micro-batch size ``loader`` is read in (a custom batch sampler: its declared batch
    size, which each micro-batch of a host call, each replica's too, is one batch of)."""
    micro: Any
    if isinstance(loader, f.poptorch.DataLoader):
        micro = built_micro_batch(loader, f.opts, training=f.training, name=f.name)
    else:
        micro = loader.batch_size
        if micro is None and custom is None:
            raise ValueError(
                f"{f.name} has batch_size=None: the loop needs micro-batches. "
                "Pass the micro-batch size as batch_size."
            )
    if custom is not None:
        micro = getattr(custom, "batch_size", None) or micro or 1
        check_last_batch(custom, f.factor, f.name)
    return micro


def _check_samples(samples: int, micro: int, f: Factors) -> None:
    """A training order of ``samples`` makes at least one host call; its remainder is dropped,
    with a warning."""
    combined = micro * f.factor
    if samples < combined:
        raise ValueError(
            f"{f.name} has {samples} samples, fewer than one host call needs: "
            f"{describe_factors(f.opts, micro, training=f.training)}. Lower the micro-batch "
            "size, deviceIterations, gradientAccumulation or replicas, or use more data."
        )
    if samples % combined:
        warnings.warn(
            f"{f.name}: {samples % combined} of {samples} samples are dropped each "
            f"epoch ({describe_factors(f.opts, micro, training=f.training)}).",
            stacklevel=7,
        )


def _alone(loader: DataLoader, f: Factors, samples: int | None = None) -> Kind:
    """``loader`` checked against ``f.opts`` and measured as one process reads it (``_share``
    shares a loader out between several: ``f.instances``); ``samples``: the samples of the
    order that count (validation's slice; None: all)."""
    _check_loader(loader, f.name)
    custom = _custom_batches(f.poptorch, loader)
    micro = _micro_batch(loader, f, custom)
    dataset: Any = loader.dataset  # (a dataset, a sampler, a batch size: as the loader holds)
    length = None if isinstance(dataset, IterableDataset) else len(dataset)
    if f.pad and length is not None:
        combined = micro * f.factor
        dataset = Padded(dataset, -(-length // combined) * combined)
    args = {**loader_kwargs(loader), "batch_size": micro, "drop_last": True}
    if f.loader_opts is not None:  # this instance's options: it reads what it is given
        args["auto_distributed_partitioning"] = False
    measured = {
        "name": f.name,
        "micro": micro,
        "combined": micro * f.factor,
        "samples": length if samples is None else samples,
        "dataset": dataset,
        "opts": f.opts if f.loader_opts is None else f.loader_opts,
    }
    kind = _kind(loader, f, custom, args, measured)
    if length is not None and kind.steps() == 0:
        raise ValueError(
            f"{f.name} is empty: {length} samples make no host call of "
            f"{describe_factors(f.opts, micro, training=f.training)}."
        )
    return kind


def _kind(
    loader: DataLoader,
    f: Factors,
    custom: Sampler | None,
    args: dict[str, Any],
    measured: dict[str, Any],
) -> Kind:
    """The kind ``_alone`` measured: its order wrapped to be drawn and skipped into."""
    dataset = measured["dataset"]
    if custom is not None:
        args.pop("generator", None)
        batches = ResumableBatchSampler(custom)
        shape = OneShape(f.name, custom, getattr(custom, "batch_size", None), f.factor)
        args.update(batch_sampler=batches, batch_size=1)
        return Batched(**measured, args=args, order=batches, shape=shape)
    if isinstance(dataset, IterableDataset):
        if not f.pad:
            return Streamed(**measured, args=args)
        # the stream as its loader yields it: its batches, every sample
        stream = DataLoader(
            dataset, batch_size=loader.batch_size, drop_last=False, **loader_kwargs(loader)
        )
        return CutStream(**measured, args=args, stream=stream)
    inner = (
        torch.utils.data.SequentialSampler(dataset)
        if f.sequential or f.pad
        else whole_order(order_of(loader), f.instances, f.name)
    )
    args["sampler"] = order = ResumableSampler(inner)
    if not f.pad:
        _check_samples(len(dataset), measured["micro"], f)
    return Ordered(**measured, args=args, order=order)


def _dataset_of(loader: DataLoader, f: Factors) -> tuple:
    """The whole dataset behind ``loader`` and its micro-batch size."""
    dataset = loader.dataset
    if isinstance(loader, f.poptorch.DataLoader):
        micro = built_micro_batch(
            loader, f.opts, training=f.training, name=f.name, where=" per instance"
        )
        dataset = getattr(dataset, "_dataset", dataset)  # PopTorch's per-process slice
        shuffle = isinstance(loader.sampler, torch.utils.data.RandomSampler) or bool(
            getattr(loader, "_shuffle_distributed", False)
        )
        if type(loader.batch_sampler) is not torch.utils.data.BatchSampler:  # a custom one
            view = torch.utils.data.DataLoader(
                dataset,
                batch_sampler=loader.batch_sampler,
                collate_fn=loader.collate_fn,
                num_workers=loader.num_workers,
            )
            return view, micro
        view = torch.utils.data.DataLoader(
            dataset,
            batch_size=micro,
            shuffle=shuffle,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
        )
        return view, micro
    return loader, loader.batch_size or getattr(loader.batch_sampler, "batch_size", None) or 1


def _check_groups(opts: Options, name: str) -> None:
    if opts.replication_factor % opts.input_group_size:
        raise ValueError(
            f"{name}: input replica groups of {opts.input_group_size} with "
            f"{opts.replication_factor} replicas per instance cannot be shared out "
            "between instances: use groups that divide the replicas of an instance."
        )


def _share(loader: DataLoader, f: Factors) -> Kind:
    """``_alone`` for one of N instances (``f.opts.Distributed.numProcesses`` N)."""
    alone = f.opts.clone()
    alone.Distributed.disable()
    mine = replace(f, opts=alone, loader_opts=f.opts)  # checked alone, read as this instance
    if not isinstance(loader, torch.utils.data.DataLoader):  # the usual error
        return _alone(loader, mine)
    view, micro = _dataset_of(loader, f)
    if isinstance(view.dataset, IterableDataset) or not f.partition:
        # a stream has no order to share out: each instance reads its own (shard it in
        # __iter__, e.g. by ipuloop.processes.process_index()); predict reads everything
        return _alone(view, mine)
    if f.training:
        return _global_share(view, f, alone)
    return _slice(view, micro, mine)


def _global_share(view: DataLoader, f: Factors, alone: Options) -> Kind:
    """A training order shared out: this instance's replicas' micro-batches of each host call
    of the whole run, read as one process with every instance's replicas reads them."""
    opts = f.opts
    size = opts.Distributed.numProcesses
    _check_groups(opts, f.name)
    every = alone.clone()
    every.replicationFactor(opts.replication_factor * size)
    try:  # an instance's share of a global host call: as many of them as the whole run's
        whole = _alone(view, replace(f, opts=every, instances=size))
    except ValueError as e:
        raise ValueError(
            f"{e} (replicationFactor {opts.replication_factor * size}: "
            f"{opts.replication_factor} replica(s) on each of {size} instances)"
        ) from None
    assert isinstance(whole, Ordered)  # (a map-style dataset's, read in an order)
    return whole.shared(opts)


def _slice(view: DataLoader, micro: int, mine: Factors) -> Kind:
    """Validation under several processes: a contiguous slice of the samples each, padded to
    the same number of host calls."""
    opts = mine.loader_opts
    size = opts.Distributed.numProcesses
    rank = opts.Distributed.processId
    dataset: Any = view.dataset  # (sized: a map-style dataset)
    n = len(dataset)
    if n < size:
        raise ValueError(
            f"{mine.name} has {n} samples, fewer than the {size} instances: every "
            "instance needs at least one."
        )
    cuts = [n * p // size for p in range(size + 1)]
    combined = micro * host_call_factor(opts, training=mine.training)
    longest = max(b - a for a, b in zip(cuts, cuts[1:]))
    total = -(-longest // combined) * combined
    part = torch.utils.data.Subset(dataset, range(cuts[rank], cuts[rank + 1]))
    padded = torch.utils.data.DataLoader(
        Padded(part, total),
        batch_size=micro,
        collate_fn=view.collate_fn,
        num_workers=view.num_workers,
    )
    sliced = replace(mine, pad=False, sequential=True)
    return _alone(padded, sliced, samples=cuts[rank + 1] - cuts[rank])


def order_of(loader: DataLoader) -> Sampler:
    """The sampler of ``loader``'s samples (torch types it an iterable)."""
    sampler: Any = loader.sampler
    return sampler
