"""What a plan is built from: resumable samplers, padding, host-call iterators, reading ahead.

Every loader given to the loop is rebuilt (``plan.build``) as a ``poptorch.DataLoader`` over
the same dataset, micro-batch size, sampler (or shuffle and generator), workers and collate
function, with the loop's options. Its sampler (or custom batch sampler) is wrapped so that
each epoch's order is drawn at one defined moment (``set_epoch``), from random state the
checkpoint records, and so that a resumed epoch starts after the samples already seen without
reading them (an ``IterableDataset``, which has no order to skip into, is read up to there). A
sampler with ``set_epoch`` is told each training epoch's number before the epoch draws its
order, as a DDP loop does; a ``DistributedSampler`` stands for its whole dataset
(``whole_order``). Under several processes, each instance reads its share of one global order
(``ProcessSampler``).

Validation and predict count every sample: a map-style dataset is padded to whole host calls
with copies of its last sample, and a stream (``IterableDataset``) is read in the order its
loader yields it, its workers' batches cut into host calls and the last one padded as it ends.
A ``poptorch.DataLoader``'s mode (``Async``, ``AsyncRebatched``) and its ``async_options`` are
kept, and a torch ``DataLoader`` is read in ``Async`` mode when the loop is asked to
(``Loop(async_data=...)``): each epoch reads through a prefetching loader of its own, built
once the epoch's order is drawn (``Prefetch``).

A custom batch sampler gives each micro-batch of a host call (``[DI, GA, RF/g]``, each replica
its own) one of its batches, in order; every batch must have the shapes of the first, as a
compiled model takes one shape (``OneShape``).
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import warnings
from dataclasses import dataclass
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
from .rules import describe_factors, host_call_factor

__all__ = [
    "ResumableSampler",
    "ResumableBatchSampler",
    "ProcessSampler",
    "ProcessBatchSampler",
    "Padded",
    "StreamCalls",
    "HostCalls",
    "OneShape",
    "Prefetch",
    "PicklableGenerator",
    "Prefetched",
    "built_micro_batch",
    "loader_kwargs",
    "whole_order",
    "tell_epoch",
    "check_last_batch",
    "prefetch_of",
    "async_settings",
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
    loader: PopTorchLoader, opts: Options, training: bool, name: str, where: str = ""
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


_ASYNC_DEFAULTS = {"buffer_size": 3, "miss_sleep_time_in_ms": 0.1, "early_preload": False}


def _async_options(accessor: object, name: str) -> dict[str, Any]:
    """The settings an ``AsynchronousDataAccessor`` was built with (``async_options``)."""
    worker = getattr(getattr(accessor, "_worker", None), "_process", None)
    if worker is not None:  # PopTorch: its worker process object holds them
        out = {
            "buffer_size": worker._buffer_size,
            "miss_sleep_time_in_ms": worker._miss_sleep_time_in_ms,
            "early_preload": worker._early_preload,
            "sharing_strategy": worker._sharing_strategy,
        }
    else:  # the emulator's accessor keeps them; PopTorch's drops them when terminated
        out = dict(getattr(accessor, "_settings", None) or {})
        if not out:
            warnings.warn(
                f"{name}: the settings of its AsynchronousDataAccessor cannot be read "
                "(terminated?), so the loop's loader prefetches with PopTorch's "
                f"defaults {_ASYNC_DEFAULTS}. Pass a loader that was not terminated "
                "to keep them.",
                stacklevel=4,
            )
    out.pop("load_indefinitely", None)  # each epoch has its own accessor: see Prefetch
    return out


_ASYNC_KEYS = ("buffer_size", "miss_sleep_time_in_ms", "early_preload", "sharing_strategy")


def async_settings(value: object) -> dict[str, Any] | None:
    """``Loop(async_data=...)`` as the ``async_options`` a torch loader is read with in
    ``DataLoaderMode.Async``: None (False: read synchronously), ``{}`` (True: PopTorch's
    defaults) or the dict given, whose keys are ``AsynchronousDataAccessor``'s."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise TypeError(
            f"async_data must be a bool or a dict of async_options. Received: async_data={value!r}."
        )
    bad = [k for k in value if k not in _ASYNC_KEYS]
    if bad:
        raise ValueError(
            f"async_data has key(s) {bad}: the async_options the loop passes on "
            f"are {list(_ASYNC_KEYS)} (each epoch has an accessor of its own, so "
            "load_indefinitely is not one of them). Received: "
            f"async_data={value!r}."
        )
    return dict(value)


def _generator(device: str, state: bytes) -> PicklableGenerator:
    generator = PicklableGenerator(device)
    generator.set_state(torch.tensor(list(state), dtype=torch.uint8))
    return generator


class PicklableGenerator(torch.Generator):
    """A ``torch.Generator`` that pickles as its device and state. A prefetching loader is
    pickled to PopTorch's worker process (started by spawn or a fork server), with the
    generator its workers' seeds are drawn from; torch before 2.1 cannot pickle a
    ``torch.Generator`` (a ``TypeError``). The copy draws what the original would."""

    def __reduce__(self) -> tuple:
        return _generator, (str(self.device), bytes(self.get_state().tolist()))


def picklable(generator: torch.Generator) -> PicklableGenerator:
    """A ``PicklableGenerator`` in ``generator``'s state."""
    out = PicklableGenerator(generator.device)
    out.set_state(generator.get_state())
    return out


@dataclass(frozen=True)
class Prefetch:
    """A ``DataLoaderMode.Async`` or ``AsyncRebatched`` mode, its ``async_options`` and
    ``rebatched_worker_size``: a ``poptorch.DataLoader``'s own, kept by the loader the loop
    builds, or ``Async`` for a torch ``DataLoader`` under ``Loop(async_data=...)``.

    Each epoch reads through a loader of its own in that mode, built once the epoch's order is
    drawn and stopped when the epoch ends: an accessor started earlier would read its first
    batches (and, loading indefinitely, the next epoch's) in an order drawn before the one the
    checkpoint records. So ``load_indefinitely`` is False; the other options are the user's.
    """

    factory: Any  # poptorch.DataLoader
    mode: Any  # poptorch.DataLoaderMode
    options: dict  # async_options
    worker_size: int | None  # rebatched_worker_size; None: the combined batch size

    def loader(self, plan: Any, generator: torch.Generator) -> Any:
        """``plan``'s loader in this mode, reading with ``generator`` (in the state the
        synchronous loader's would be in: its workers get the seeds they would get there)."""
        src = plan.loader
        kwargs = loader_kwargs(src)
        kwargs["generator"] = picklable(generator)  # (the loader is pickled to its worker)
        if plan.batches is not None:
            kwargs["batch_sampler"] = plan.batches
        elif plan.sampler is not None:
            kwargs["sampler"] = plan.sampler
        return self.factory(
            src.options,
            src.dataset,
            batch_size=1 if plan.batches is not None else plan.micro,
            drop_last=True,
            auto_distributed_partitioning=False,
            mode=self.mode,
            async_options={**self.options, "load_indefinitely": False},
            rebatched_worker_size=self.worker_size,
            **kwargs,
        )


def prefetch_of(
    poptorch: ModuleType, loader: DataLoader, name: str, async_options: dict[str, Any] | None = None
) -> Prefetch | None:
    """How ``loader`` is read ahead: a ``poptorch.DataLoader`` in its own Async mode (None for
    Sync); a torch one in ``Async`` mode with ``async_options`` (None: synchronously).

    PopTorch keeps no record of the mode but the accessor it builds for it (its
    ``rebatched_size`` set for ``AsyncRebatched``, which ``Async`` with ``drop_last=False``
    becomes); the loader's torch batch size is then the workers' (``rebatched_worker_size``).
    """
    modes = poptorch.DataLoaderMode
    if isinstance(loader, poptorch.DataLoader):
        accessor = loader.__dict__.get("_accessor")
        if accessor is None:
            return None
        rebatched = getattr(accessor, "rebatched_size", None)
        worker = loader.batch_size if rebatched and loader.batch_size != rebatched else None
        prefetch = Prefetch(
            poptorch.DataLoader,
            modes.AsyncRebatched if rebatched else modes.Async,
            _async_options(accessor, name),
            worker,
        )
    elif async_options is not None and isinstance(loader, DataLoader):
        prefetch = Prefetch(poptorch.DataLoader, modes.Async, dict(async_options), None)
    else:
        return None
    if loader.num_workers == 0:
        _check_no_draws(loader.dataset, name)
    return prefetch


def _generators() -> tuple:
    """This process's global random states: torch's, python's, numpy's (when imported)."""
    np = sys.modules.get("numpy")
    numpy_state = None
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        numpy_state = (keys.tobytes(), pos, has_gauss, cached)
    return torch.get_rng_state(), random.getstate(), numpy_state


def _check_no_draws(dataset: Any, name: str) -> None:
    """A prefetching loader without workers reads the dataset outside the loop's process: in
    the accessor's worker process, in PopTorch and the emulator alike, started by the
    ``SharingStrategy``'s start method (forkserver by default) with a copy of the program's
    random states. A dataset drawing random numbers there would draw them from other
    generators, in another order than a synchronous read, and no run or resume could be exact.
    Its first sample is read here, and one that draws is refused."""
    if isinstance(dataset, IterableDataset):
        return  # a stream cannot be read without consuming it: documented instead
    try:
        if len(dataset) == 0:
            return
    except TypeError:
        return
    before = _generators()
    dataset[0]
    after = _generators()
    if torch.equal(before[0], after[0]) and before[1:] == after[1:]:
        return
    raise ValueError(
        f"{name} is read ahead (Loop(async_data=...), or its DataLoaderMode.Async) with "
        f"num_workers=0, and reading a sample of its {type(dataset).__name__} draws random "
        "numbers from this process's generators (torch, random or numpy). Read ahead, they "
        "would be drawn outside the loop's order, so neither the run nor a resume could be "
        "exact. Give the loader num_workers >= 1 (each worker's generator is seeded from the "
        "loop's random state, as when reading synchronously), or read it synchronously "
        "(async_data=False, or DataLoaderMode.Sync)."
    )


class Prefetched:
    """One epoch read through its own prefetching loader, stopped when the epoch ends; with a
    custom batch sampler, each host call its loader joined is checked (``OneShape``)."""

    def __init__(
        self, loader: PopTorchLoader, shape: OneShape | None = None, start: int = 0
    ) -> None:
        self.loader = loader
        self.shape = shape
        self.index = start
        self.batches = iter(loader)

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.batches)
        except StopIteration:
            self.terminate()
            raise
        if self.shape is not None:
            self.shape.check(batch, self.index, "host call")
            self.index += 1
        return batch

    def terminate(self) -> None:
        self.loader.terminate()


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
