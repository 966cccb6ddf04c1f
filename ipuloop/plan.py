"""A loader as this process runs it (``Plan``): built once per call, it hands out the batches.

Separation of concerns: the loader owns the data (dataset, sampler, batch size, workers);
``loaders.Factors`` (frozen, made once per ``build``) owns everything else a plan is built from
(the options and their host-call factor, the call's kind and name, padding, order, instances,
reading ahead); the loader's kind (``loaders.Kind``, picked once: a stream, an order of
samples, a custom batch sampler's batches) measures and checks it, says the
``poptorch.DataLoader`` it is rebuilt as, and starts and reads each epoch; the ``Plan``
(frozen, built whole) holds the kind and the rebuilt loader, and its ``Reading`` the running
epoch's iterator and draw.

``build`` rebuilds a loader as a ``poptorch.DataLoader`` whose order it can draw and skip into:
alone, or under several processes this instance's share of one global order (each instance
reads the micro-batches of its replicas in the order one process with every instance's
replicas would read them; validation inside a fit gives each a contiguous slice of the
samples, padded to the same number of host calls). ``num_updates`` counts a fit's updates from
the same kind without building a loader.

``Plan.epoch`` draws an epoch's order from the random state as it is, and hands out the
epoch's host batches after the steps already run. A training epoch's draw (``Draw``) records
that random state (``Plan.drawn_from``: a checkpoint reads it there), or draws from a resumed
epoch's saved one (``random_state.Draw``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from .backend import poptorch_module
from .loaders import Factors, Kind, Reading, close, kill_workers, pick
from .loop_options import inference_options, resolve_options
from .outputs import Layout, map_tensors
from .poptorch_types import DataLoader as PopTorchLoader
from .poptorch_types import Options
from .processes import configured
from .random_state import Draw, set_rng_state
from .read_ahead import Prefetch, prefetch_of
from .rules import describe_factors

__all__ = ["Plan", "build", "build_inference", "no_host_call", "num_updates"]


@dataclass(frozen=True)
class Plan:
    """A loader as the loop runs it, with what it needs to know about it: built whole by
    ``build`` (frozen); its running epoch's iterator and draw are in ``reading``."""

    loader: PopTorchLoader  # the rebuilt loader
    kind: Kind  # what it reads, and how
    layout: Layout
    prefetch: Prefetch | None = None  # read ahead: the user's Async mode, or async_data
    reading: Reading = field(default_factory=Reading, compare=False)

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def micro(self) -> int:
        """Micro-batch size B."""
        return self.kind.micro

    @property
    def combined(self) -> int:
        """Samples per host call."""
        return self.kind.combined

    @property
    def samples(self) -> int | None:
        """Dataset length, when known (one instance's share in validation)."""
        return self.kind.samples

    @property
    def drawn_from(self) -> dict[str, Any] | None:
        """The random state its last training epoch drew its order from (a checkpoint's)."""
        return self.reading.drawn_from

    @property
    def steps(self) -> int | None:
        """Host calls per epoch (None: a stream of unknown length)."""
        return self.kind.steps()

    def counted(self) -> Iterator[tuple[Any, int]]:
        """This epoch's host batches from its start, each with how many of its rows are
        samples: the rest (of the last call, or of a call past the samples, as several
        processes' validation runs) is padding."""
        return self.kind.counted(self.epoch())

    def epoch(
        self, skip_steps: int = 0, number: int | None = None, draw: Draw | None = None
    ) -> Iterator[Any]:
        """An iterator over this epoch's host batches, after ``skip_steps`` of them; a
        sampler with ``set_epoch`` is given the epoch's ``number`` first, when there is one.
        A training epoch's ``draw`` records the random state the order is drawn from in
        ``reading.drawn_from``, or draws it from a resumed epoch's."""
        if draw is not None:
            self._draw(draw)
        self.kind.start(skip_steps, number)
        self.kind.read(self.reading, self.loader, self.prefetch, skip_steps)
        if draw is not None and draw.then is not None:
            set_rng_state(draw.then)  # the saved step's random state: go on from there
        return self.reading.reader

    def _draw(self, draw: Draw) -> None:
        """Set the random state the epoch's order is drawn from, and record it."""
        if draw.order is not None:  # a resumed epoch's order, drawn again
            set_rng_state(draw.order)
            self.kind.set_generator_state(draw.order.get("sampler"))
            self.reading.drawn_from = draw.order
            return
        self.kind.set_generator_state(draw.sampler)  # (resumed at an epoch start; None: as is)
        self.reading.drawn_from = self.kind.drawn_from()

    def generator_state(self) -> torch.Tensor | None:
        """The state of the loader's own generator, if its order is drawn with one."""
        return self.kind.generator_state()

    def first_micro_batch(self) -> Any:
        """The first micro-batch of the dataset, as the device receives it (float64 as
        float32), for the host probe; None when the dataset cannot be indexed."""
        rows = self.kind.first_rows()
        if rows is None:
            return None
        ds = self.loader.dataset
        batch = self.loader.collate_fn([ds[i] for i in range(rows)])
        return map_tensors(batch, lambda x: x.float() if x.dtype == torch.float64 else x)

    def close(self) -> None:
        """Stop the loader workers (or prefetching loader) of the epoch last started."""
        reader = self.reading.reader
        self.reading.reader = None
        close(reader)

    def kill_workers(self) -> None:
        """A second Ctrl-C: the process exits at once, and its loader workers go first."""
        kill_workers(self.reading.reader)


def build(
    poptorch: ModuleType,
    loader: DataLoader,
    opts: Options,
    *,
    training: bool,
    name: str,
    pad: bool = False,
    partition: bool = True,
    async_options: dict[str, Any] | None = None,
) -> Plan:
    """``loader`` as this process runs it with ``opts``: alone, or its share of several
    processes' (``opts.Distributed.numProcesses`` > 1; ``partition=False``: every sample, as
    predict reads them); ``pad``: every sample in order, the last host call padded
    (validation, predict); ``async_options``: a torch loader is read ahead
    (``Loop(async_data=...)``)."""
    f = Factors(
        poptorch=poptorch,
        opts=opts,
        training=training,
        name=name,
        pad=pad,
        sequential=pad,
        partition=partition,
        async_options=async_options,
    )
    return _built(loader, f)


def build_inference(
    poptorch: ModuleType,
    loader: DataLoader,
    train: Options,
    inference: Options | None,
    name: str,
    *,
    pad: bool = True,
    partition: bool = True,
    async_options: dict[str, Any] | None = None,
) -> Plan:
    """``loader`` as a validation or predict runs it: with the ``inference`` options given
    to the loop, else the training options ``train`` less their training-only settings
    (``loop_options.inference_options``), with device iterations fitted to the loader
    (``loaders.fit_iterations``); an empty loader is refused."""
    f = Factors(
        poptorch=poptorch,
        opts=inference_options(poptorch, train, inference),
        training=False,
        name=name,
        pad=pad,
        sequential=pad,
        partition=partition,
        async_options=async_options,
        inference=True,
        fitted_to=train if inference is None else None,
    )
    return _built(loader, f)


def _built(loader: DataLoader, f: Factors) -> Plan:
    """The plan of ``loader``'s kind (``loaders.pick``), rebuilt as a ``poptorch.DataLoader``
    and read ahead as ``loader`` is (``read_ahead.prefetch_of``)."""
    kind = pick(loader, f)
    rebuilt = kind.rebuilt(f.poptorch)
    return Plan(
        loader=rebuilt,
        kind=kind,
        layout=Layout.of(kind.opts, training=f.training),
        prefetch=prefetch_of(f.poptorch, loader, f.name, f.async_options),  # as read alone
    )


def no_host_call(plan: Plan, epoch: int) -> ValueError:
    """An IterableDataset that yielded less than one host call in an epoch."""
    return ValueError(
        f"{plan.name} yielded no complete host call in epoch {epoch}: one host call takes "
        f"{describe_factors(plan.loader.options, plan.micro, training=True)}. An "
        "IterableDataset must yield at least that many samples each time it is iterated (a "
        "generator can be iterated only once)."
    )


def num_updates(loader: DataLoader, opts: Options, epochs: int = 1) -> int:
    """Optimizer updates that ``fit(loader, epochs)`` runs from the first epoch, with the
    training options ``opts`` (``poptorch.Options``, an ``IPUConfig`` or None, as given to
    ``Loop``; a ``replicas=`` given to ``Loop`` instead must be set in them too).

    ``epochs`` x the steps of an epoch (``len(dataset) // (B * DI * GA * RF)``) x DI: the
    ``total_steps`` of a scheduler stepped per update (``LRScheduler``'s default), such
    as ``OneCycleLR``. ``Loop.num_updates`` is this, a static method, so it can size the
    scheduler the ``Loop`` takes. (``len(loader) * epochs`` counts micro-batches: GA * RF
    times too many.)
    """
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1. Received: epochs={epochs!r}.")
    pt = poptorch_module()
    opts = configured(resolve_options(pt, opts, None)[0])
    steps = training_steps(pt, loader, opts, "loader")
    if steps is None:
        dataset = getattr(loader.dataset, "_dataset", loader.dataset)
        raise ValueError(
            f"loader reads an {type(dataset).__name__}, whose "
            "length is unknown, so neither is its number of updates. Count "
            "them as epochs x (samples per epoch // (B * DI * GA * RF)) x DI."
        )
    return epochs * steps * opts.device_iterations


def training_steps(
    poptorch: ModuleType, loader: DataLoader, opts: Options, name: str
) -> int | None:
    """The host calls of a training epoch of ``loader`` with ``opts`` (``build(...).steps``),
    counted by the same kind, with the same checks, without building a loader; None for a
    stream of unknown length."""
    f = Factors(poptorch=poptorch, opts=opts, training=True, name=name)
    return pick(loader, f).steps()
