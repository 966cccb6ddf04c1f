"""``poptorch.DataLoader`` and ``AsynchronousDataAccessor`` (docs/poptorch-semantics.md §3).

One iteration of a ``DataLoader`` is one model call: it yields batches of
``batch_size * deviceIterations * (replicationFactor // input_group_size) * gradientAccumulation``
samples. As PopTorch's, the emulator's accessor reads the dataset in a worker process started
with its ``sharing_strategy``'s start method (``ForkServer``, the default, and ``SharedMemory``
and ``FileSystem`` start a new interpreter, so the dataset must pickle; ``Fork`` forks); its
batches must pickle and reach the host through shared memory, and a thread of the host
process prefetches them into a bounded buffer. It returns fresh tensors (PopTorch's are
overwritten by the next batch, so code that clones them behaves the same on both).
"""

from __future__ import annotations

import abc
import atexit
import collections
import copyreg
import functools
import io
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import random
import sys
import tempfile
import threading
import traceback
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing
from torch.utils.data import IterableDataset

from .. import rules
from . import _logging
from . import _pytree as pytree
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


_ITEM, _EOF = 0, 1
_ERROR, _EPOCH, _STOP = 2, 3, 4

# PopTorch's worker process start method for each SharingStrategy (python/_dataloader.py):
# only Fork forks the host process; the others start a new interpreter (ForkServer forks a
# single-threaded server process started once), so the dataset must pickle.
_START_METHODS = {
    SharingStrategy.Fork: "fork",
    SharingStrategy.ForkServer: "forkserver",
    SharingStrategy.SharedMemory: "spawn",
    SharingStrategy.FileSystem: "spawn",
}


def _generator(device: str, state: bytes) -> torch.Generator:
    generator = torch.Generator(device)
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def _reduce_generator(generator: torch.Generator) -> tuple:
    """A generator as its state's bytes: torch < 2.1 cannot pickle one, and the state tensor
    a newer torch pickles it as is freed (with the file that shares it) before a spawned
    process reads it."""
    return _generator, (str(generator.device), generator.get_state().numpy().tobytes())


def _dumps(obj: Any, pickler: type = ForkingPickler) -> bytes:
    """``obj`` pickled (its tensors in shared memory, with ``ForkingPickler``), generators
    included (a sampler's, a loader's)."""
    buffer = io.BytesIO()
    p = pickler(buffer, 4)
    p.dispatch_table = {**getattr(p, "dispatch_table", copyreg.dispatch_table)}
    p.dispatch_table[torch.Generator] = _reduce_generator
    p.dump(obj)
    return buffer.getvalue()


class _Source:
    """What the worker process reads: ``dataset`` (a ``poptorch.DataLoader`` read as in Sync
    mode, or any iterable), or, under ``SharingStrategy.FileSystem``, the file it was pickled
    to (PopTorch's worker loads it from there). Picklable when the dataset is."""

    def __init__(self, dataset: Any, ours: bool, path: str | None = None) -> None:
        self.dataset, self.ours, self.path = dataset, ours, path

    def __reduce__(self) -> tuple:
        return _Source._loads, (_dumps(self.dataset), self.ours, self.path)

    @staticmethod
    def _loads(payload: bytes, ours: bool, path: str | None) -> _Source:
        return _Source(pickle.loads(payload), ours, path)

    def load(self) -> None:
        if self.path is not None:
            with open(self.path, "rb") as f:
                self.dataset = pickle.load(f)  # written by the host process
            self.path = None

    def __call__(self) -> Iterator[Any]:
        return self.dataset._sync_iter() if self.ours else iter(self.dataset)


def _worker_main(
    source: _Source,
    commands: Any,
    out: Any,
    credits: Any,
    forked: bool,
    level: int,
    random_state: tuple[torch.Tensor, Any],
    start_method: str,
) -> None:
    """The accessor's worker process: on each ``(_EPOCH, n)`` command, iterate a new epoch and
    send ``(n, _ITEM, batch)`` messages then ``(n, _EOF, None)``, each once the host has a free
    slot (``credits``); a new command abandons the epoch. Ctrl-C ends it quietly, as
    PopTorch's worker does (the host sees the end of its pipe).

    It starts with the host's log level, its torch and Python random states at the
    accessor's construction and its default start method (a forked process has them already),
    so that a sampler without a generator draws what it would in Sync mode, and the processes
    it starts (a torch loader's workers) start as the program's would: a forkserver's would be
    the server's children, which outlive the worker. A forked one computes on one thread, as
    torch's loader workers do: the host's thread pool does not exist in it."""
    try:
        if forked:
            torch.set_num_threads(1)
        else:
            logger.setLevel(level)
            torch.set_rng_state(random_state[0])
            random.setstate(random_state[1])
            multiprocessing.set_start_method(start_method, force=True)
        source.load()
        while True:
            kind, epoch = commands.recv()
            while kind == _EPOCH:
                kind, epoch = _worker_epoch(source, epoch, commands, out, credits)
                if kind is None:  # the epoch ended: wait for the next command
                    break
            if kind == _STOP:
                return
    except KeyboardInterrupt:
        # Leave at once: the exit handlers of what the interrupt cut short (a torch loader's
        # worker queues, on Python 3.8) would print tracebacks, and PopTorch's worker ends
        # without a word.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except (EOFError, BrokenPipeError):
        return


def _preload_forkserver() -> None:
    """Have the forkserver, before it starts, import torch and this module beside what it
    already preloads (the main module): each accessor's worker it forks then holds them, and
    starts in well under a second instead of importing torch afresh (seconds), as PopTorch's
    would in a program that imports them first. A forkserver already running keeps its
    preload list; a program's own list is kept and added to."""
    server = multiprocessing.forkserver._forkserver  # (its preload list has no getter)
    if getattr(server, "_forkserver_pid", None) is not None:
        return
    modules = list(getattr(server, "_preload_modules", ["__main__"]))
    wanted = [m for m in ("torch", __name__) if m not in modules]
    if wanted:
        multiprocessing.set_forkserver_preload(modules + wanted)


def _error_message(e: BaseException) -> tuple[BaseException, str]:
    """``e`` (or, where it does not pickle, a RuntimeError with its words) and its traceback,
    which the host prints: PopTorch's worker prints it ("Check above for details"), and a
    forkserver's worker may not write where the host does."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.dumps(e)
    except Exception:  # noqa: BLE001 - an exception that does not pickle
        e = RuntimeError(f"{type(e).__name__}: {e}")
    return e, text


def _worker_epoch(
    make_iter: Callable[[], Iterator[Any]], epoch: int, commands: Any, out: Any, credits: Any
) -> tuple[int | None, int]:
    """One epoch of ``_worker_main``; returns the command that cut it short, or (None, 0)."""

    def send(kind: int, payload: Any) -> tuple[int | None, int]:
        while not credits.acquire(timeout=0.05):
            if commands.poll():
                return commands.recv()
        if commands.poll():  # a command that came while the host's slots were full
            credits.release()
            return commands.recv()
        try:
            out.put((epoch, kind, payload))
        except Exception as e:  # noqa: BLE001 - e.g. a batch that cannot be pickled
            out.put(
                (
                    epoch,
                    _ERROR,
                    (
                        RuntimeError(
                            f"the worker process could not send a batch to the host process: "
                            f"{type(e).__name__}: {e}"
                        ),
                        "",
                    ),
                )
            )
        return None, 0

    try:
        for batch in make_iter():
            command = send(_ITEM, batch)
            if command[0] is not None:
                return command
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        raise
    except BaseException as e:  # noqa: BLE001 - re-raised by the host
        out.put((epoch, _ERROR, _error_message(e)))
        return None, 0
    command = send(_EOF, None)
    return command if command[0] is not None else (None, 0)


class _WorkerProcess:
    """The process an ``AsynchronousDataAccessor`` reads its dataset in, started with the
    ``sharing_strategy``'s start method (``_START_METHODS``). ``epoch()`` starts a new epoch
    there (abandoning the one before) and yields its batches; ``pid`` is the process's, which
    PopTorch logs at DEBUG."""

    def __init__(
        self, source: _Source, buffer_size: int, sharing_strategy: SharingStrategy
    ) -> None:
        method = _START_METHODS[SharingStrategy(sharing_strategy)]
        if method == "forkserver":
            _preload_forkserver()
        ctx = torch.multiprocessing.get_context(method)  # tensors cross in shared memory
        self._commands, commands = ctx.Pipe()
        self._out = ctx.SimpleQueue()
        self._credits = ctx.Semaphore(max(1, buffer_size))
        self._epoch = 0
        self._stopped = False
        logger.debug("AsynchronousDataAccessor parent process: %d", os.getpid())
        self.process = ctx.Process(
            target=_worker_main,
            name="AsynchronousDataAccessor",
            args=(
                source,
                commands,
                self._out,
                self._credits,
                method == "fork",
                logger.getEffectiveLevel(),
                (torch.get_rng_state(), random.getstate()),
                multiprocessing.get_start_method(),
            ),
        )
        try:
            self.process.start()
        except Exception as e:
            if method == "fork":
                raise
            raise _not_picklable(e, sharing_strategy, method) from e
        self.pid = self.process.pid
        # (PopTorch logs it in the worker; here the host does, as a forkserver's worker may
        # not write where the host does)
        logger.debug("AsynchronousDataAccessor worker process: %d", self.pid)
        self._data_buffers: Any = None  # set by the accessor: what PopTorch's ring buffer holds

    def isAlive(self) -> bool:
        return self.process.exitcode is None

    def exitCode(self) -> int | None:
        return self.process.exitcode

    def epoch(self) -> Iterator[Any]:
        """The batches of a new epoch, read in the worker."""
        self._epoch += 1
        epoch = self._epoch
        self._commands.send((_EPOCH, epoch))
        return self._read(epoch)

    def _read(self, epoch: int) -> Iterator[Any]:
        while True:
            got, kind, payload = self._next()
            self._credits.release()
            if got != epoch:
                continue  # a batch of an abandoned epoch
            if kind == _EOF:
                return
            if kind == _ERROR:
                error, text = payload
                if text:
                    sys.stderr.write(text)
                    sys.stderr.flush()
                raise error
            yield payload

    def _next(self) -> tuple[int, int, Any]:
        while not self._out._poll(0.05):  # (SimpleQueue's own poll)
            if self.process.exitcode is not None or self._stopped:
                raise EOFError("the AsynchronousDataAccessor worker process ended")
        return self._out.get()

    def stop(self) -> None:
        """End the worker process (a Ctrl-C'd one has already ended)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._commands.send((_STOP, 0))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=2)
        if self.process.exitcode is None:
            self.process.terminate()
            self.process.join(timeout=2)


def _not_picklable(e: Exception, sharing_strategy: Any, method: str) -> Exception:
    """``e``, raised pickling the dataset for a worker process that is not forked, as an
    exception of its type (where it takes a message) that says why and what to do."""
    message = (
        f"{e} (poptorch.AsynchronousDataAccessor: with sharing_strategy=SharingStrategy."
        f"{SharingStrategy(sharing_strategy).name} the worker process is started with "
        f"{method!r}, so the dataset, its sampler and collate_fn must pickle: define their "
        "classes and functions at module level, not in a function or lambda; or pass "
        "async_options={'sharing_strategy': poptorch.SharingStrategy.Fork})"
    )
    try:
        return type(e)(message)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        return e


class _RingBufferView:
    """``accessor._worker._data_buffers``: PopTorch's worker flags each of its ``buffer_size``
    ring buffer slots that holds a batch ready for the host (``indices_mem``); here, the
    batches the host has prefetched, the first batch (read at construction) included."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel

    @property
    def indices_mem(self) -> list[int]:
        c = self._channel
        with c.cond:
            ready = len(c.buf) + (0 if c.started else c.held)
        return [1 if i < ready else 0 for i in range(c.size)]


class _Channel:
    """Bounded buffer between the prefetch thread and the consumer.

    Messages are tagged with the consumer's generation ``gen``; restarting an epoch midway bumps
    ``gen`` so the producer abandons its iterator and stale messages are dropped.
    """

    def __init__(self, size: int) -> None:
        self.cond = threading.Condition()
        self.buf: collections.deque[tuple[int, int, Any]] = collections.deque()
        self.size = max(1, size)
        self.gen = 0
        self.started = self.stopped = self.finished = self.is_ready = False
        self.held = 0  # batches the producer read before the consumer started
        self.error: BaseException | None = None
        self.setup_error: BaseException | None = None

    def ready(self, error: BaseException | None, held: int = 0) -> None:
        """The producer read the first batch (``error``: it could not; ``held``: how many)."""
        with self.cond:
            self.is_ready, self.setup_error, self.held = True, error, held
            self.cond.notify_all()

    def wait_ready(self) -> BaseException | None:
        with self.cond:
            self.cond.wait_for(lambda: self.is_ready)
            return self.setup_error

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.buf.clear()
            self.cond.notify_all()

    def wait_start(self) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: self.started or self.stopped)
            return None if self.stopped else self.gen

    def put(self, gen: int, kind: int, payload: Any) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self.gen != gen or len(self.buf) < self.size)
            if self.stopped or self.gen != gen:
                return False
            self.buf.append((gen, kind, payload))
            self.cond.notify_all()
            return True

    def next_epoch(self, gen: int, load_indefinitely: bool) -> int | None:
        """Generation of the next epoch to load (waits for the consumer if not indefinitely)."""
        with self.cond:
            if not load_indefinitely:
                self.cond.wait_for(lambda: self.stopped or self.gen != gen)
            return None if self.stopped else self.gen

    def _drop_stale(self) -> None:
        while self.buf and self.buf[0][0] != self.gen:
            self.buf.popleft()

    def get(self) -> tuple[int, Any]:
        with self.cond:
            while True:
                self._drop_stale()
                if self.buf:
                    _, kind, payload = self.buf.popleft()
                    self.cond.notify_all()
                    return kind, payload
                if self.error is not None:  # PopTorch's words, then what the dataset raised
                    raise AssertionError(
                        "An error occurred in the data fetcher: "
                        f"{type(self.error).__name__}: {self.error}"
                    ) from self.error
                if self.finished or self.stopped:
                    return _EOF, None
                self.cond.wait()

    def eof_is_next(self) -> bool:
        """Consume a buffered end-of-epoch marker, if it is the next message."""
        with self.cond:
            self._drop_stale()
            if self.buf and self.buf[0][1] == _EOF:
                self.buf.popleft()
                self.cond.notify_all()
                return True
            return False


def _stop_all(channel: _Channel, worker: _WorkerProcess) -> None:
    channel.stop()
    worker.stop()


def _epoch(
    make_iter: Callable[[], Iterator[Any]], rebatched_size: int | None, drop_last: bool
) -> Iterator[Any]:
    batches = make_iter()
    return _rebatch(batches, rebatched_size, drop_last) if rebatched_size else batches


def _produce(
    channel: _Channel,
    make_iter: Callable[[], Iterator[Any]],
    rebatched_size: int | None,
    drop_last: bool,
    load_indefinitely: bool,
) -> None:
    """Prefetch thread body: fill ``channel`` epoch after epoch until stopped."""
    try:
        try:  # as in PopTorch's worker, the first batch is read at once: a broken dataset fails
            batches: Iterator[Any] | None = iter(_epoch(make_iter, rebatched_size, drop_last))
            first = [next(batches)]
        except StopIteration:
            first = []
        except BaseException as e:  # noqa: BLE001 - raised by the accessor's constructor
            channel.ready(e)
            return
        channel.ready(None, len(first))
        gen = channel.wait_start()
        while gen is not None:
            if batches is None:
                batches, first = _epoch(make_iter, rebatched_size, drop_last), []
            completed = True
            for batch in itertools.chain(first, batches):
                if not channel.put(gen, _ITEM, batch):
                    completed = False
                    break
            if hasattr(batches, "close"):
                batches.close()
            batches = first = None
            if completed and not channel.put(gen, _EOF, None):
                completed = False
            gen = (
                channel.next_epoch(gen, load_indefinitely)
                if completed
                else (None if channel.stopped else channel.gen)
            )
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer thread
        with channel.cond:
            channel.error = e
    finally:
        with channel.cond:
            channel.finished = True
            channel.cond.notify_all()


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
                raise _not_picklable(e, strategy, "spawn") from e
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
                worker.epoch,
                rebatched_size,
                getattr(dataset, "rebatched_drop_last", True),
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
