"""The worker half of ``poptorch.AsynchronousDataAccessor``: the process that reads the
dataset, the messages it sends, and the host's prefetch thread and bounded buffer.

As PopTorch splits its ``__init__.py`` (``DataLoader`` and the accessor) from its
``_dataloader.py`` (the worker process and its ring buffer), ``data.py`` holds the API and
this module what runs behind it. The worker process is started with the sharing strategy's
start method (``_START_METHODS``) and reads a ``_Source``; it sends ``(epoch, kind, payload)``
messages, each once the host has a free slot, which the prefetch thread (``_produce``) puts in
a ``_Channel`` that the accessor's ``__next__`` reads.
"""

from __future__ import annotations

import collections
import copyreg
import io
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import random
import signal
import sys
import threading
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing

from . import _logging
from .enums import SharingStrategy

logger = _logging.logger


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
        # without a word. Its own children (a torch loader's workers) end first: one handing
        # a batch over as this process ends would print the broken hand-over's traceback.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (torch's loader's would raise on it)
        children = multiprocessing.active_children()
        for child in children:
            child.kill()
        for child in children:
            child.join(5)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except (EOFError, BrokenPipeError):
        return


def _preload_forkserver() -> None:
    """Have the forkserver, before it starts, import torch and the accessor's module (``data``,
    which imports this one) beside what it already preloads (the main module): each accessor's
    worker it forks then holds them, and starts in well under a second instead of importing
    torch afresh (seconds), as PopTorch's would in a program that imports them first. A
    forkserver already running keeps its preload list; a program's own list is kept and added
    to."""
    server = multiprocessing.forkserver._forkserver  # (its preload list has no getter)
    if getattr(server, "_forkserver_pid", None) is not None:
        return
    modules = list(getattr(server, "_preload_modules", ["__main__"]))
    wanted = [m for m in ("torch", f"{__package__}.data") if m not in modules]
    if wanted:
        multiprocessing.set_forkserver_preload(modules + wanted)


def _worker_error(e: BaseException) -> tuple[BaseException, str]:
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
        out.put((epoch, _ERROR, _worker_error(e)))
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
            raise _not_picklable_error(e, sharing_strategy, method) from e
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


def _not_picklable_error(e: Exception, sharing_strategy: Any, method: str) -> Exception:
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


def _produce(
    channel: _Channel, make_epoch: Callable[[], Iterator[Any]], load_indefinitely: bool
) -> None:
    """Prefetch thread body: fill ``channel`` with the batches of ``make_epoch()``, epoch after
    epoch until stopped."""
    try:
        try:  # as in PopTorch's worker, the first batch is read at once: a broken dataset fails
            batches: Iterator[Any] | None = iter(make_epoch())
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
                batches, first = make_epoch(), []
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
