"""Reading ahead: a loader read in ``DataLoaderMode.Async`` (or ``AsyncRebatched``), each epoch
through a prefetching loader of its own (``Prefetch``, ``Prefetched``).

A ``poptorch.DataLoader``'s mode and its ``async_options`` are kept (``prefetch_of``), and a
torch ``DataLoader`` is read in ``Async`` mode when the loop is asked to
(``Loop(async_data=...)``: ``async_settings``). The prefetching loader is pickled to PopTorch's
worker process with the generator its workers' seeds are drawn from (``PicklableGenerator``),
and a dataset read there without loader workers must draw no random numbers
(``_check_no_draws``).
"""

from __future__ import annotations

import random
import sys
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

from .poptorch_types import DataLoader as PopTorchLoader

__all__ = [
    "Prefetch",
    "Prefetched",
    "PicklableGenerator",
    "picklable",
    "prefetch_of",
    "async_settings",
]


class ShapeCheck(Protocol):
    """What checks each host call a prefetching loader joined (``loaders.OneShape``)."""

    def check(self, batch: object, index: int, unit: str = "batch") -> None: ...


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

    def loader(
        self, synchronous: PopTorchLoader, args: dict[str, Any], generator: torch.Generator
    ) -> Any:
        """The ``synchronous`` loader (built with the keyword arguments ``args``: its order,
        batch size, workers...) in this mode, reading with ``generator`` (in the state the
        synchronous loader's would be in: its workers get the seeds they would get there)."""
        kwargs = {
            **args,
            "generator": picklable(generator),  # (the loader is pickled to its worker)
            "auto_distributed_partitioning": False,
        }
        return self.factory(
            synchronous.options,
            synchronous.dataset,
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
            factory=poptorch.DataLoader,
            mode=modes.AsyncRebatched if rebatched else modes.Async,
            options=_async_options(accessor, name),
            worker_size=worker,
        )
    elif async_options is not None and isinstance(loader, DataLoader):
        prefetch = Prefetch(
            factory=poptorch.DataLoader,
            mode=modes.Async,
            options=dict(async_options),
            worker_size=None,
        )
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
    """One epoch read through its own prefetching loader (``prefetch``'s mode over the
    ``synchronous`` loader, built with the keyword ``args``, its generator in ``state``),
    stopped when the epoch ends; with a custom batch sampler, each host call its loader joined
    is checked (``shape``: ``loaders.OneShape``; ``start``: the host calls skipped into)."""

    def __init__(
        self,
        prefetch: Prefetch,
        synchronous: PopTorchLoader,
        args: dict[str, Any],
        state: torch.Tensor,
        shape: ShapeCheck | None = None,
        start: int = 0,
    ) -> None:
        generator = torch.Generator()  # a copy: the synchronous loader's draws what it did
        generator.set_state(state)
        self.loader = prefetch.loader(synchronous, args, generator)
        self.shape = shape
        self.index = start
        self.batches = iter(self.loader)

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
