"""``poptorch.DataLoader`` and ``AsynchronousDataAccessor`` (docs/poptorch-semantics.md §3).

One iteration of a ``DataLoader`` is one model call: it yields batches of
``batch_size * deviceIterations * (replicationFactor // input_group_size) * gradientAccumulation``
samples. As PopTorch's, the emulator's accessor reads the dataset in a worker process started
with its ``sharing_strategy``'s start method (``ForkServer``, the default, and ``SharedMemory``
and ``FileSystem`` start a new interpreter, so the dataset must pickle; ``Fork`` forks); its
batches must pickle and reach the host through shared memory, and a thread of the host
process prefetches them into a bounded buffer. It returns fresh tensors (PopTorch's are
overwritten by the next batch, so code that clones them behaves the same on both).
The worker process and the host's prefetch thread behind the accessor are ``_dataloader.py``'s,
as in PopTorch.
"""

from __future__ import annotations

import abc
import atexit
import functools
import os
import pickle
import tempfile
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing
from torch.utils.data import IterableDataset

from .. import rules
from . import _logging
from . import _pytree as pytree
from ._dataloader import (
    _EOF,
    _Channel,
    _dumps,
    _not_picklable_error,
    _produce,
    _RingBufferView,
    _Source,
    _stop_all,
    _WorkerProcess,
)
from .enums import DataLoaderMode, SharingStrategy
from .errors import Error
from .options import Options

__all__ = ["AsynchronousDataAccessor", "DataLoader", "ICustomArgParser", "registerCustomArgParser"]

logger = _logging.logger


# -- custom argument types ---------------------------------------------------------------------
class ICustomArgParser(abc.ABC):
    """How to take a custom argument (or batch) type apart into its tensors and rebuild it.

    Register one with ``poptorch.registerCustomArgParser(MyType, MyParser())``: model inputs
    and outputs, and DataLoader batches, of that type are then handled tensor by tensor.
    """

    @abc.abstractmethod
    def yieldTensors(self, struct: Any) -> Iterator[torch.Tensor]:
        """Yield every tensor in ``struct``, in a deterministic order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: Any, tensor_iterator: Iterator[torch.Tensor]) -> Any:
        """A copy of ``original_structure`` holding the tensors read from ``tensor_iterator``
        (in ``yieldTensors``' order)."""


class _CustomStructure:
    """pytree context of a custom argument: the object itself (``reconstruct`` reads it); two
    are equal when their types are, as two inputs of one compiled model must be."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CustomStructure) and type(other.obj) is type(self.obj)

    def __hash__(self) -> int:
        return hash(type(self.obj))

    def __repr__(self) -> str:
        return f"{type(self.obj).__name__}(...)"


_custom_arg_parsers: dict[type, ICustomArgParser] = {}


def registerCustomArgParser(arg_data_type: type, arg_parser: ICustomArgParser | None) -> None:
    """Use ``arg_parser`` for arguments of type ``arg_data_type`` (replacing any parser it had);
    ``None`` removes the type's parser."""
    if arg_parser is not None and not isinstance(arg_parser, ICustomArgParser):
        raise Error(
            "arg_parser must inherit from ICustomArgParser. Received: "
            f"{type(arg_parser).__name__}. Subclass poptorch.ICustomArgParser."
        )
    if _custom_arg_parsers.pop(arg_data_type, None) is not None:
        pytree.deregister_pytree_node(arg_data_type)
    if arg_parser is None:
        return
    _custom_arg_parsers[arg_data_type] = arg_parser
    # As a pytree node, the type is taken apart and rebuilt wherever inputs/outputs are.
    pytree.register_pytree_node(
        arg_data_type,
        lambda x: (list(arg_parser.yieldTensors(x)), _CustomStructure(x)),
        lambda tensors, context: arg_parser.reconstruct(context.obj, iter(tensors)),
    )


def _custom_parser(x: Any) -> ICustomArgParser | None:
    parser = _custom_arg_parsers.get(type(x))
    if parser is None and _custom_arg_parsers:  # as in PopTorch, a subclass uses its base's
        parser = next((p for t, p in _custom_arg_parsers.items() if isinstance(x, t)), None)
    return parser


# -- batch structures: tensors, (nested) tuples / lists / dicts of tensors, custom types -------
def _is_structure(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, dict, list, tuple)) or _custom_parser(x) is not None


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    parser = _custom_parser(batch)
    if parser is not None:
        return _batch_len(next(iter(parser.yieldTensors(batch))))
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch and _is_structure(batch[0]):
        return _batch_len(batch[0])
    return len(batch)  # a collated list of non-tensors (e.g. strings)


def _cat(batches: list[Any]) -> Any:
    """Concatenate batches along dim 0, keeping their structure."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    parser = _custom_parser(first)
    if parser is not None:
        columns = zip(*(list(parser.yieldTensors(b)) for b in batches))
        return parser.reconstruct(first, iter([torch.cat(list(c)) for c in columns]))
    if isinstance(first, dict):
        return type(first)({k: _cat([b[k] for b in batches]) for k in first})
    if isinstance(first, (list, tuple)) and first and _is_structure(first[0]):
        return type(first)(_cat(list(parts)) for parts in zip(*batches))
    return [x for b in batches for x in b]


def _slice(batch: Any, start: int, stop: int) -> Any:
    parser = _custom_parser(batch)
    if parser is not None:
        return parser.reconstruct(batch, iter([t[start:stop] for t in parser.yieldTensors(batch)]))
    if isinstance(batch, dict):
        return type(batch)({k: _slice(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and batch and _is_structure(batch[0]):
        return type(batch)(_slice(b, start, stop) for b in batch)
    return batch[start:stop]


def _combine(batches: Iterator[Any], count: int, drop_last: bool) -> Iterator[Any]:
    """Concatenate ``count`` consecutive batches (batch_sampler case)."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == count:
            yield _cat(group)
            group = []
    if group and not drop_last:
        yield _cat(group)


def _rebatch(batches: Iterator[Any], size: int, drop_last: bool) -> Iterator[Any]:
    """Re-cut a stream of batches into batches of ``size``, carrying left-overs forward."""
    pending: list[Any] = []
    count = 0
    for batch in batches:
        pending.append(batch)
        count += _batch_len(batch)
        while count >= size:
            merged = _cat(pending)
            yield _slice(merged, 0, size)
            count -= size
            pending = [_slice(merged, size, size + count)] if count else []
    if count and not drop_last:
        yield _cat(pending)


class _SubDataset:
    """This process's contiguous slice of a map-style dataset (``Distributed.numProcesses > 1``).

    With shuffling, all processes draw the same global permutation (seeded by ``randomSeed``)
    and the left-over elements rotate into use on alternate epochs. The epoch's indices live in
    shared memory, written in place, so persistent worker processes see each new epoch's.
    """

    def __init__(self, dataset: Any, opts: Options, step: int, drop_last: bool) -> None:
        n, procs, rank = len(dataset), opts.Distributed.numProcesses, opts.Distributed.processId
        if drop_last:
            per_proc = step * (n // (step * procs))
            self._offset, self._length = rank * per_proc, per_proc
            self._leftovers = n - per_proc * procs
        else:  # spread everything as evenly as possible; the user handles the odd batch
            sizes = [n // procs + (n % procs > p) for p in range(procs)]
            self._offset, self._length, self._leftovers = sum(sizes[:rank]), sizes[rank], 0
        self._base_offset = self._offset
        self._dataset = dataset
        self._seed = opts.random_seed if opts.exists("random_seed") else None
        self._generator: torch.Generator | None = None
        self._permutation: torch.Tensor | None = None  # the epoch's global order
        self._indices: torch.Tensor | None = None  # this slice of it, in shared memory

    def shuffle_global_indices(self) -> None:
        if self._generator is None:
            assert self._seed is not None, (
                "Seed must be set when shuffling so that all instances "
                "end up with the same shuffled global indices."
            )
            self._generator = torch.Generator().manual_seed(self._seed)
        self._permutation = torch.randperm(len(self._dataset), generator=self._generator)
        self._publish()

    def swap_range(self) -> None:
        self._offset = (
            self._base_offset + self._leftovers
            if self._offset == self._base_offset
            else self._base_offset
        )
        self._publish()

    def _publish(self) -> None:
        if self._permutation is None:
            return
        indices = self._permutation[self._offset : self._offset + self._length]
        if self._indices is None:
            self._indices = indices.clone().share_memory_()
        else:
            self._indices.copy_(indices)  # in place: the workers' copies share this memory

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range for a slice of {self._length} elements")
        if self._indices is not None:
            return self._dataset[int(self._indices[index])]
        return self._dataset[index + self._offset]


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` yielding one model call's worth of samples per batch.

    Args:
        options: the ``Options`` the model will use (frozen here, as PopTorch does).
        dataset, batch_size (the micro-batch), shuffle, num_workers, **kwargs: as in torch.
        drop_last: drop the incomplete final combined batch (default True, unlike torch).
        mode: ``DataLoaderMode.Sync``, ``Async`` (background prefetch) or ``AsyncRebatched``.
        async_options: keyword arguments for ``AsynchronousDataAccessor``.
        rebatched_worker_size: AsyncRebatched: batch size read by the torch loader (default:
            the combined batch size, as in PopTorch).

    Example::

        loader = poptorch.DataLoader(opts, dataset, batch_size=16, shuffle=True)
        for x, y in loader:
            loss = training_model(x, y)
    """

    def __init__(
        self,
        options: Options,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        num_workers: int = 0,
        drop_last: bool = True,
        persistent_workers: bool | None = None,
        auto_distributed_partitioning: bool = True,
        mode: DataLoaderMode = DataLoaderMode.Sync,
        async_options: dict[str, Any] | None = None,
        rebatched_worker_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        assert isinstance(options, Options), (
            "DataLoader expects a poptorch.Options as first argument. "
            f"Received: {type(options).__name__}."
        )
        options._freeze()
        shuffle = bool(shuffle)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        mode = DataLoaderMode(mode)
        if mode != DataLoaderMode.Sync and kwargs.get("generator") is None:
            # The prefetch thread must not draw from the global RNG the model uses (dropout...):
            # give torch's sampler a private generator, seeded here from the global one.
            seed = int(torch.empty((), dtype=torch.int64).random_())
            kwargs["generator"] = torch.Generator().manual_seed(seed)
        procs = options.Distributed.numProcesses
        factor = rules.host_call_factor(options, training=True)  # GA counts: it may train
        self._options = options
        self._accessor: AsynchronousDataAccessor | None = None
        self._shuffle_distributed = False
        self._combine, self._combine_drop_last = 1, drop_last
        self._is_user_batch_sampler_set = kwargs.get("batch_sampler") is not None
        self.rebatched_drop_last = drop_last  # the user's drop_last, read by the accessor
        rebatched_size = None
        torch_kwargs = dict(
            num_workers=num_workers, persistent_workers=persistent_workers, **kwargs
        )

        batch_sampler = kwargs.get("batch_sampler")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle:
                raise ValueError(
                    "`batch_sampler` option is mutually exclusive with batch_size, "
                    f"shuffle. Received: batch_size={batch_size!r}, "
                    f"shuffle={shuffle!r}."
                )
            if procs > 1 and auto_distributed_partitioning:
                raise ValueError(
                    "`batch_sampler` option is mutually exclusive with "
                    "auto_distributed_partitioning when Distributed.numProcesses > 1: "
                    "pass auto_distributed_partitioning=False and partition yourself."
                )
            micro = getattr(batch_sampler, "batch_size", None)
            self._combined_batch_size = None if micro is None else micro * factor
            self._combine = factor
            length = _sampler_len(batch_sampler)  # None: the sampler does not know in advance
            if factor > 1 and length is not None and length % factor:
                logger.warning(
                    "The number of batches generated by the batch sampler (%d) is not divisible by "
                    "the number of batches combined per step (%d): the last %d batch(es) are %s.",
                    length,
                    factor,
                    length % factor,
                    "dropped (drop_last=True)" if drop_last else "combined into a smaller batch",
                )
            super().__init__(dataset, **torch_kwargs)
        else:
            combined = None if batch_size is None else batch_size * factor
            self._combined_batch_size = combined
            if isinstance(dataset, IterableDataset):
                if auto_distributed_partitioning:
                    assert procs == 1, (
                        "auto_distributed_partitioning not supported for IterableDataset"
                    )
                if num_workers > 1 and "worker_init_fn" not in kwargs:
                    logger.warning(
                        "IterableDataset used with num_workers=%d but no worker_init_fn specified: "
                        "as a result the DataLoader will return %d times each element in the "
                        "dataset (See torch.utils.data.IterableDataset's documentation for more "
                        "information)",
                        num_workers,
                        num_workers,
                    )
            else:
                n = len(dataset)
                if not drop_last and combined is not None and n % (combined * procs):
                    logger.warning(
                        "The number of elements in the dataset (%d) is not divisible by the number "
                        "of elements processed per step (%d) and drop_last=False. The last tensor "
                        "will have a batch size of %d. To avoid having to handle this special case "
                        "switch to drop_last=True",
                        n,
                        combined * procs,
                        n % (combined * procs),
                    )
                if procs > 1 and auto_distributed_partitioning:
                    assert not shuffle or options.exists("random_seed"), (
                        "When using auto_distributed_partitioning you must set "
                        "poptorch.Options.randomSeed() to ensure that tensors are in the same "
                        "order in all processes."
                    )
                    assert combined is not None, (
                        "batch_size=None not allowed when using auto_distributed_partitioning."
                    )
                    dataset = _SubDataset(dataset, options, combined, drop_last)
                    self._shuffle_distributed, shuffle = shuffle, False

            worker_batch = combined
            rebatchable = combined is not None and combined > 1
            if mode == DataLoaderMode.Async and not drop_last and rebatchable:
                mode = DataLoaderMode.AsyncRebatched  # PopTorch converts this case automatically
            if mode == DataLoaderMode.AsyncRebatched and rebatchable:
                rebatched_size, drop_last = combined, False  # the accessor drops, if anything
                if rebatched_worker_size is not None:
                    assert rebatched_worker_size <= combined, (
                        f"The rebatched_worker_size ({rebatched_worker_size}) must be <= to the "
                        f"combined batch size ({combined})"
                    )
                    worker_batch = rebatched_worker_size
            # torch rejects drop_last=True without batching; there is nothing to drop then.
            super().__init__(
                dataset,
                batch_size=worker_batch,
                shuffle=shuffle,
                drop_last=drop_last and worker_batch is not None,
                **torch_kwargs,
            )

        if mode != DataLoaderMode.Sync:
            async_options = dict(async_options or {})
            assert "rebatched_size" not in async_options, (
                "You cannot use DataLoaderMode.AsyncRebatched and manually specify the "
                "rebatched_size in async_options"
            )
            # A weak proxy: the prefetch thread must not keep this loader alive.
            self._accessor = AsynchronousDataAccessor(
                weakref.proxy(self), **async_options, rebatched_size=rebatched_size
            )

    @property
    def combinedBatchSize(self) -> int | None:
        """Samples consumed from the dataset per model call."""
        return self._combined_batch_size

    @property
    def options(self) -> Options:
        """The (frozen) options this loader was built with."""
        return self._options

    def __len__(self) -> int:
        """Model calls per epoch; with a ``batch_sampler``, its batches (micro-batches, as in
        PopTorch, which combines them only while iterating)."""
        if self._accessor is not None and self._accessor.rebatched_size:
            n, size = len(self.dataset), self._accessor.rebatched_size
            return n // size + (1 if n % size and not self.rebatched_drop_last else 0)
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        if self._accessor is not None:
            return self._async_iter(iter(self._accessor))
        return self._sync_iter()

    def _async_iter(self, accessor: AsynchronousDataAccessor) -> Iterator[Any]:
        # The accessor holds this loader weakly, so that dropping the loader stops its thread;
        # this generator holds it strongly, so `for b in DataLoader(...)` reads every batch.
        yield from accessor

    def _sync_iter(self) -> Iterator[Any]:
        """The Sync-mode iterator (also what the Async prefetch thread reads)."""
        if self._shuffle_distributed:
            self.dataset.shuffle_global_indices()
            self.dataset.swap_range()
        batches = super().__iter__()
        return (
            _combine(batches, self._combine, self._combine_drop_last)
            if self._combine > 1
            else batches
        )

    def _itself(self) -> DataLoader:
        """This loader (called through the weak proxy its accessor holds)."""
        return self

    def terminate(self) -> None:
        """Stop the background prefetch thread (Async modes); no effect in Sync mode."""
        accessor = self.__dict__.get("_accessor")
        if accessor is not None:
            accessor.terminate()

    def __del__(self) -> None:
        self.terminate()


def _sampler_len(batch_sampler: Any) -> int | None:
    """A batch sampler's length, or None where it has none (or says NotImplemented)."""
    try:
        length = len(batch_sampler)
    except (TypeError, NotImplementedError):
        return None
    return None if length is NotImplemented else length


def _epoch(
    make_iter: Callable[[], Iterator[Any]], rebatched_size: int | None, drop_last: bool
) -> Iterator[Any]:
    batches = make_iter()
    return _rebatch(batches, rebatched_size, drop_last) if rebatched_size else batches


class AsynchronousDataAccessor:
    """Prefetch batches from ``dataset`` (any iterable, typically a DataLoader) in the background.

    Args:
        dataset: what to read; a ``poptorch.DataLoader`` must not already be in an Async mode.
        buffer_size: batches prefetched ahead.
        load_indefinitely: start the next epoch as soon as one ends.
        early_preload: prefetch now rather than from the first ``iter()`` (the first batch
            is always read at once, as PopTorch's worker does: a dataset that cannot produce
            it raises ``poptorch.Error`` here).
        rebatched_size: re-cut the incoming batches into batches of this size (> 1).
        miss_sleep_time_in_ms: accepted, unused.
        sharing_strategy: how the worker process starts, as in PopTorch: ``ForkServer``
            (forked from a single-threaded server process) and ``SharedMemory`` (spawned) get
            the dataset pickled, ``FileSystem`` (spawned) reads it from a file it was pickled
            to, ``Fork`` forks this process (the dataset need not pickle; the worker computes
            on one thread, as torch's loader workers do).

    The worker process's PID is logged at DEBUG ("AsynchronousDataAccessor worker process:
    PID"), as PopTorch logs it; ``accessor._worker`` is that process.

    Example::

        accessor = poptorch.AsynchronousDataAccessor(loader)
        for x, y in accessor:
            ...
        accessor.terminate()
    """

    def __init__(
        self,
        dataset: Any,
        buffer_size: int = 3,
        miss_sleep_time_in_ms: float = 0.1,
        load_indefinitely: bool = True,
        early_preload: bool = False,
        sharing_strategy: SharingStrategy = SharingStrategy.ForkServer,
        rebatched_size: int | None = None,
    ) -> None:
        self._channel: _Channel | None = None
        ours = isinstance(dataset, DataLoader)
        if ours and dataset._accessor is not None:
            raise Error(
                "The DataLoader already uses an AsynchronousDataAccessor internally. "
                "Either use the existing one or set mode='poptorch.DataLoaderMode.Sync' "
                "in the DataLoader."
            )
        # (PopTorch: a user's batch_sampler batches as it likes: not checked)
        if (
            ours
            and not dataset.drop_last
            and rebatched_size is None
            and dataset._combine == 1
            and not dataset._is_user_batch_sampler_set
        ):
            assert dataset.combinedBatchSize is None or dataset.combinedBatchSize == 1, (
                "The 'drop_last=False' option from the DataLoader only works if 'rebatched_size' "
                "is specified too."
            )
        if rebatched_size is not None:
            assert rebatched_size > 1, (
                f"rebatched_size must be None or greater than 1. Received: {rebatched_size!r}."
            )
        self._dataset = dataset
        self.rebatched_size = rebatched_size
        self._load_indefinitely = load_indefinitely
        # as given (PopTorch's worker process object holds them), for a loader rebuilt alike
        self._settings = {
            "buffer_size": buffer_size,
            "miss_sleep_time_in_ms": miss_sleep_time_in_ms,
            "load_indefinitely": load_indefinitely,
            "early_preload": early_preload,
            "sharing_strategy": sharing_strategy,
        }
        self._consumed = False  # something was returned since the last iter()
        self._at_eof = False

        strategy = SharingStrategy(sharing_strategy)
        # (the loader itself, not the weak proxy its Async mode passes: it is pickled)
        source = _Source(dataset._itself() if ours else dataset, ours)
        folder = None
        if strategy == SharingStrategy.FileSystem:  # as PopTorch: the worker reads a file
            folder = tempfile.TemporaryDirectory(prefix="poptorch-dataset-")
            path = os.path.join(folder.name, "dataset.pkl")
            logger.debug("Serialising dataset to file: %s", path)
            try:
                with open(path, "wb") as f:
                    f.write(_dumps(source.dataset, pickle.Pickler))
            except Exception as e:
                folder.cleanup()
                raise _not_picklable_error(e, strategy, "spawn") from e
            source = _Source(None, ours, path)
        try:
            self._start(source, buffer_size, strategy, rebatched_size, load_indefinitely)
        finally:
            if folder is not None:  # read by now (or never: the worker ended)
                folder.cleanup()
        if early_preload:
            channel = self._channel
            assert channel is not None
            with channel.cond:
                channel.started = True
                channel.cond.notify_all()

    def _start(
        self,
        source: _Source,
        buffer_size: int,
        strategy: SharingStrategy,
        rebatched_size: int | None,
        load_indefinitely: bool,
    ) -> None:
        """Start the worker process and the prefetch thread; wait for the first batch."""
        dataset = self._dataset
        channel = _Channel(buffer_size)
        worker = self._worker = _WorkerProcess(source, buffer_size, strategy)
        del source  # (the worker's copy is the one read)
        worker._data_buffers = _RingBufferView(channel)
        thread = threading.Thread(
            target=_produce,
            name="poptorch.AsynchronousDataAccessor",
            daemon=True,
            args=(
                channel,
                functools.partial(
                    _epoch,
                    worker.epoch,
                    rebatched_size,
                    getattr(dataset, "rebatched_drop_last", True),
                ),
                load_indefinitely,
            ),
        )
        self._channel, self._thread = channel, thread
        self._stop_at_exit = functools.partial(_stop_all, channel, worker)
        atexit.register(self._stop_at_exit)  # never block interpreter exit
        thread.start()
        error = channel.wait_ready()
        if error is not None:
            self.terminate()
            raise Error(
                "AsynchronousDataAccessor worker thread failed to start (Check above for "
                f"details): {type(error).__name__}: {error}"
            ) from error

    def terminate(self) -> None:
        """Stop the worker process and the prefetch thread. Also runs on garbage collection
        and at exit."""
        channel = self.__dict__.get("_channel")
        if channel is None:
            return
        self._channel = None
        self._stop_at_exit()
        atexit.unregister(self._stop_at_exit)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __del__(self) -> None:
        self.terminate()

    def __len__(self) -> int:
        length = len(self._dataset)
        if self.rebatched_size and getattr(self._dataset, "_accessor", None) is not self:
            samples = length * (getattr(self._dataset, "batch_size", None) or 1)
            try:
                samples = min(samples, len(self._dataset.dataset))
            except (AttributeError, TypeError):
                pass
            length = samples // self.rebatched_size
        return length

    def __iter__(self) -> AsynchronousDataAccessor:
        channel = self._channel
        if channel is None:
            raise Error("This AsynchronousDataAccessor has been terminated: create a new one.")
        if self._consumed and not self._at_eof and channel.eof_is_next():
            self._at_eof = True  # the previous epoch was in fact fully read
        with channel.cond:
            if not channel.started:
                channel.started = True
            elif (self._consumed and not (self._at_eof and self._load_indefinitely)) or (
                self._at_eof and not self._load_indefinitely
            ):
                channel.gen += 1  # restart: abandon what was prefetched
                channel.buf.clear()
            channel.cond.notify_all()
        self._consumed = self._at_eof = False
        return self

    def __next__(self) -> Any:
        channel = self._channel
        if channel is None:
            raise StopIteration
        if not channel.started:
            self.__iter__()
        kind, payload = channel.get()
        if kind == _EOF:
            self._at_eof = True
            raise StopIteration
        self._consumed = True
        return payload
