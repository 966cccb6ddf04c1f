"""Reading ahead: a loader's host calls read by a thread of the loop's process while the steps
run (``Ahead``), as ``DataLoaderMode.Async`` reads them while the device runs.

A torch ``DataLoader`` is read ahead when the loop is asked to (``Loop(async_data=...)``:
``async_settings``), a ``poptorch.DataLoader`` in its own ``Async`` or ``AsyncRebatched`` mode
with its ``async_options`` (``async_of``). The host calls are those of reading synchronously,
in the same order, from the same random state: the first is read before the thread starts (the
epoch's order is drawn there), and the loader's workers do the rest of the reading. Without
workers the thread reads the dataset itself, so a dataset that draws random numbers as it
reads a sample is refused (``check_no_draws``): its draws would interleave with the loop's.
"""

from __future__ import annotations

import contextlib
import queue
import random
import sys
import threading
import warnings
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset

__all__ = ["Ahead", "async_of", "async_settings", "check_no_draws", "buffer_size"]

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
    out.pop("load_indefinitely", None)  # (each epoch is read ahead on its own)
    return out


_ASYNC_KEYS = ("buffer_size", "miss_sleep_time_in_ms", "early_preload", "sharing_strategy")


def async_settings(value: object) -> dict[str, Any] | None:
    """``Loop(async_data=...)`` as the ``async_options`` a torch loader is read ahead with: None
    (False: read synchronously), ``{}`` (True: PopTorch's defaults) or the dict given, whose
    keys are ``AsynchronousDataAccessor``'s (``buffer_size``: host calls waiting at most; the
    others, which tune PopTorch's worker process, are taken and have no effect here)."""
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
            f"are {list(_ASYNC_KEYS)} (each epoch is read ahead on its own, so "
            "load_indefinitely is not one of them). Received: "
            f"async_data={value!r}."
        )
    return dict(value)


def async_of(loader: Any, name: str) -> dict[str, Any] | None:
    """A ``poptorch.DataLoader``'s ``DataLoaderMode.Async`` (or ``AsyncRebatched``) settings, as
    the loop reads it ahead; None in ``Sync`` mode (or for any other loader)."""
    accessor = loader.__dict__.get("_accessor")
    return None if accessor is None else _async_options(accessor, name)


def _generators() -> tuple:
    """This process's global random states: torch's, python's, numpy's (when imported)."""
    np = sys.modules.get("numpy")
    numpy_state = None
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        numpy_state = (keys.tobytes(), pos, has_gauss, cached)
    return torch.get_rng_state(), random.getstate(), numpy_state


def _set_generators(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np = sys.modules.get("numpy")
    if np is not None and states[2] is not None:
        keys, pos, has_gauss, cached = states[2]
        np.random.set_state(
            ("MT19937", np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, cached)
        )


def check_no_draws(dataset: Any, name: str) -> None:
    """A loader read ahead without workers is read by the read-ahead thread, while the loop's
    thread runs steps (the device's random stream swapped in) and callbacks. A dataset drawing
    random numbers from this process's generators there would draw them in another order than a
    synchronous read, and no run or resume could be exact. Its first sample is read here (the
    random state kept), and one that draws is refused."""
    if isinstance(dataset, IterableDataset):
        return  # a stream cannot be read without consuming it: documented instead
    try:
        if len(dataset) == 0:
            return
    except TypeError:
        return
    before = _generators()
    try:
        dataset[0]
    finally:
        after = _generators()
        _set_generators(before)
    if torch.equal(before[0], after[0]) and before[1:] == after[1:]:
        return
    raise ValueError(
        f"{name} is read ahead (Loop(async_data=...), or its DataLoaderMode.Async) with "
        f"num_workers=0, and reading a sample of its {type(dataset).__name__} draws random "
        "numbers from this process's generators (torch, random or numpy). Read ahead, they "
        "would be drawn by the read-ahead thread, outside the loop's order, so neither the run "
        "nor a resume could be exact. Give the loader num_workers >= 1 (each worker's generator "
        "is seeded from the loop's random state, as when reading synchronously), or read it "
        "synchronously "
        "(async_data=False, or DataLoaderMode.Sync)."
    )


def buffer_size(options: dict[str, Any]) -> int:
    """The host calls a read-ahead thread keeps waiting (``buffer_size``, PopTorch's default 3)."""
    return max(int(options.get("buffer_size", _ASYNC_DEFAULTS["buffer_size"])), 1)


_END = object()


class Ahead:
    """An epoch's host calls (``calls``) read ahead of the steps by a thread of this process,
    at most ``buffer_size`` waiting. The first is read here, before the thread starts, so the
    epoch's order is drawn (and a resume's skip made) in this thread, as when reading
    synchronously; an error reading one is raised where it would have been read. ``terminate``
    stops the thread (the epoch ended, the call failed, Ctrl-C, SIGTERM)."""

    def __init__(self, calls: Iterator[Any], buffer_size: int) -> None:
        self.calls = calls
        self.waiting: queue.Queue = queue.Queue(buffer_size)
        self.stopped = threading.Event()
        self.first: Any = next(calls, _END)
        self.thread: threading.Thread | None = None
        if self.first is not _END:
            self.thread = threading.Thread(target=self._read, name="ipuloop-read-ahead")
            self.thread.daemon = True
            self.thread.start()

    def _read(self) -> None:
        try:
            for call in self.calls:
                if not self._put((call, None)):
                    return
            self._put((_END, None))
        except BaseException as e:  # noqa: BLE001 (raised in the loop's thread, where read)
            self._put((_END, e))

    def _put(self, item: tuple) -> bool:
        while not self.stopped.is_set():
            try:
                self.waiting.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Ahead:
        return self

    def __next__(self) -> Any:
        if self.first is not _END:
            call, self.first = self.first, _END
            return call
        if self.thread is None:
            raise StopIteration
        call, error = self.waiting.get()
        if error is not None:
            self.terminate()
            raise error
        if call is _END:
            self.terminate()
            raise StopIteration
        return call

    def terminate(self) -> None:
        """Stop reading ahead: the thread ends once the call it is reading returns."""
        self.stopped.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.waiting.get_nowait()  # (a thread waiting to put one goes on, and sees it)
        self.first = _END

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the stopped thread to end (its loader's workers stopped first)."""
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
