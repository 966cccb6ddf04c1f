"""A loader as this process runs it (``Plan``): built once per call, it hands out the batches.

Separation of concerns: the loader owns the data (dataset, sampler, batch size, workers);
``Factors`` (frozen, made once per ``build``) owns everything else a plan is built from (the
options and their host-call factor, the call's kind and name, padding, order, instances,
reading ahead); the ``Plan`` (frozen, built whole) owns the rebuilt loader and what the loop
reads of it, and its ``Reading`` the running epoch's iterator and draw.

``build`` checks a loader against the options and rebuilds it as a ``poptorch.DataLoader``
whose order it can draw and skip into (``loaders``): alone, or under several processes this
instance's share of one global order (each instance reads the micro-batches of its replicas in
the order one process with every instance's replicas would read them; validation inside a fit
gives each a contiguous slice of the samples, padded to the same number of host calls).
``num_updates`` counts a fit's updates from the same factors without building a loader.

``Plan.epoch`` draws an epoch's order from the random state as it is, and hands out the
epoch's host batches after the steps already run. A training epoch's draw (``Draw``) records
that random state (``Plan.drawn_from``: a checkpoint reads it there), or draws from a resumed
epoch's saved one (``random_state.Draw``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler

from .backend import poptorch_module
from .loaders import (
    HostCalls,
    OneShape,
    Padded,
    Prefetch,
    Prefetched,
    ProcessBatchSampler,
    ProcessSampler,
    ResumableBatchSampler,
    ResumableSampler,
    StreamCalls,
    built_micro_batch,
    check_last_batch,
    close,
    kill_workers,
    loader_kwargs,
    prefetch_of,
    tell_epoch,
    whole_order,
)
from .loop_options import inference_options, resolve_options
from .outputs import Layout, map_tensors
from .poptorch_types import DataLoader as PopTorchLoader
from .poptorch_types import Options
from .processes import configured
from .random_state import Draw, rng_state, set_rng_state
from .rules import describe_factors, host_call_factor, input_groups

__all__ = ["Plan", "build", "build_inference", "no_host_call", "num_updates"]


@dataclass
class Reading:
    """What a plan's running epoch leaves behind (the one part of a plan that changes)."""

    reader: Any = None  # the iterator of the epoch last started (stopped when a call ends)
    drawn_from: dict[str, Any] | None = None  # the random state its last training epoch drew
    # its order from (the host's, with the loader generator's under "sampler")


@dataclass(frozen=True)
class Plan:
    """A loader as the loop runs it, with what it needs to know about it: built whole by
    ``build`` (frozen); its running epoch's iterator and draw are in ``reading``."""

    loader: PopTorchLoader
    sampler: ResumableSampler | None  # None: iterable dataset or custom batch sampler
    micro: int  # micro-batch size B
    combined: int  # samples per host call
    layout: Layout
    samples: int | None  # dataset length, when known (one instance's share in validation)
    name: str
    batches: ResumableBatchSampler | None = None  # a custom batch sampler, wrapped
    prefetch: Prefetch | None = None  # read ahead: the user's Async mode, or async_data
    stream: DataLoader | None = (
        None  # validation and predict over a stream: a torch loader yielding it in
    )
    # its own loader's order (drop_last=False), cut into host calls as it is read
    shape: OneShape | None = None  # a custom batch sampler's: the shape its batches keep
    reading: Reading = field(default_factory=Reading, compare=False)

    @property
    def drawn_from(self) -> dict[str, Any] | None:
        """The random state its last training epoch drew its order from (a checkpoint's)."""
        return self.reading.drawn_from

    @property
    def steps(self) -> int | None:
        """Host calls per epoch (PopTorch's ``len`` counts a custom batch sampler's batches)."""
        try:
            if self.batches is not None:
                return self.batches.items() // (self.combined // self.micro)
            if self.sampler is not None:  # (its len is the order drawn, less a resume's skip)
                return self.sampler.items() // self.combined
            return len(self.loader)
        except TypeError:
            return None

    def _iter(self, loader: DataLoader | None = None, start: int = 0) -> Iterator[Any]:
        # A new torch iterator draws its workers' base seed from the RNG; a persistent-workers
        # loader reuses its iterator from the second epoch on and draws nothing. Draw exactly
        # once either way, so a run resumed in a new process consumes the RNG as the original.
        src: Any = self.loader if loader is None else loader  # (a stream's: a torch one)
        g = src.generator
        host = torch.get_rng_state()
        own = g.get_state() if g is not None else host
        it: Iterator[Any]
        if loader is not None:  # (the stream's)
            it = iter(loader)
        elif self.prefetch is not None:  # its own loader draws from a copy of the generator
            own_g = torch.Generator()
            own_g.set_state(own)
            it = Prefetched(
                self.prefetch.loader(self, own_g),
                self.shape,
                start // max(self.combined // self.micro, 1),
            )
        elif self.batches is not None:  # torch's iterator of micro-batches, joined here
            assert self.shape is not None  # (a custom batch sampler's plan has one)
            it = HostCalls(DataLoader.__iter__(src), self.combined // self.micro, self.shape, start)
        else:
            it = iter(src)
        torch.set_rng_state(host)
        if g is not None:
            g.set_state(own)
        torch.empty((), dtype=torch.int64).random_(generator=g)  # the same draw iter() makes
        return it

    def counted(self) -> Iterator[tuple[Any, int]]:
        """This epoch's host batches from its start, each with how many of its rows are
        samples: the rest (of the last call, or of a call past the samples, as several
        processes' validation runs) is padding."""
        it: Any = self.epoch()  # (a stream's says how many rows are samples: ``real``)
        left = self.samples if self.sampler is not None and self.samples else None
        for batch in it:
            if self.stream is not None:
                real = it.real
            elif left is not None:
                real = min(self.combined, left)
                left -= real
            else:
                real = self.combined
            yield batch, real

    def epoch(
        self, skip_steps: int = 0, number: int | None = None, draw: Draw | None = None
    ) -> Iterator[Any]:
        """An iterator over this epoch's host batches, after ``skip_steps`` of them; a
        sampler with ``set_epoch`` is given the epoch's ``number`` first, when there is one.
        A training epoch's ``draw`` records the random state the order is drawn from in
        ``reading.drawn_from``, or draws it from a resumed epoch's."""
        if draw is not None:
            self._draw(draw)
        if number is not None:
            tell_epoch(self.sampler if self.sampler is not None else self.batches, number)
        if self.stream is not None:  # validation or predict: read from its start
            it: Any = StreamCalls(self._iter(self.stream), self.combined)
        elif self.sampler is not None:
            self.sampler.set_epoch(skip_steps * self.combined)
            it = self._iter()
        elif self.batches is not None:  # a host call is combined // micro of its batches
            skip = skip_steps * (self.combined // self.micro)
            self.batches.set_epoch(skip)
            it = self._iter(start=skip)
        else:
            it = self._iter()
            for _ in range(skip_steps):  # an IterableDataset: nothing to skip into, read it
                next(it, None)
        self.reading.reader = it
        if draw is not None and draw.then is not None:
            set_rng_state(draw.then)  # the saved step's random state: go on from there
        return it

    def _draw(self, draw: Draw) -> None:
        """Set the random state the epoch's order is drawn from, and record it."""
        order = self.sampler if self.batches is None else self.batches  # its own generator
        if draw.order is not None:  # a resumed epoch's order, drawn again
            set_rng_state(draw.order)
            if order is not None:
                order.set_generator_state(draw.order.get("sampler"))
            self.reading.drawn_from = draw.order
            return
        if order is not None and draw.sampler is not None:  # resumed at an epoch start
            order.set_generator_state(draw.sampler)
        drawn = rng_state()
        if order is not None:
            drawn["sampler"] = order.generator_state()
        self.reading.drawn_from = drawn

    def generator_state(self) -> torch.Tensor | None:
        """The state of the loader's own generator, if its order is drawn with one."""
        order = self.sampler if self.batches is None else self.batches
        return order.generator_state() if order is not None else None

    def first_micro_batch(self) -> Any:
        """The first micro-batch of the dataset, as the device receives it (float64 as
        float32), for the host probe; None when the dataset cannot be indexed."""
        if self.samples is None or self.sampler is None:
            return None
        ds = self.loader.dataset
        batch = self.loader.collate_fn([ds[i] for i in range(min(self.micro, self.samples))])
        return map_tensors(batch, lambda x: x.float() if x.dtype == torch.float64 else x)

    def close(self) -> None:
        """Stop the loader workers (or prefetching loader) of the epoch last started."""
        reader = self.reading.reader
        self.reading.reader = None
        close(reader)

    def kill_workers(self) -> None:
        """A second Ctrl-C: the process exits at once, and its loader workers go first."""
        kill_workers(self.reading.reader)


@dataclass(frozen=True)
class Factors:
    """What a plan is built from besides the loader, made once per ``build`` and read by each
    of its steps (one that needs another value makes a copy: ``dataclasses.replace``).

    ``opts``: the options the checks and the host call read (``host_call_factor``: DI, RF/g,
    GA); ``loader_opts``: those the built loader carries when they differ (several processes:
    the instance's, ``opts`` being its options alone, and the loader reads every sample it is
    given: ``auto_distributed_partitioning=False``); ``instances``: the processes a training
    order is read for (``loaders.whole_order``)."""

    poptorch: ModuleType
    opts: Options
    training: bool
    name: str
    layout: Layout
    pad: bool = False  # every sample in order, the last host call padded (validation, predict)
    sequential: bool = False  # in order, not padded (validation's slices)
    partition: bool = True  # several processes share the samples out (False: each reads all)
    instances: int = 1
    async_options: dict[str, Any] | None = None  # a torch loader read ahead (async_data)
    loader_opts: Any = None  # None: ``opts``

    @property
    def factor(self) -> int:
        """Micro-batches in one host call."""
        return host_call_factor(self.opts, self.training)


def build(
    poptorch: ModuleType,
    loader: DataLoader,
    opts: Options,
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
        poptorch,
        opts,
        training,
        name,
        Layout.of(opts, training),
        pad=pad,
        sequential=pad,
        partition=partition,
        async_options=async_options,
    )
    if opts.Distributed.numProcesses > 1:
        with warnings.catch_warnings():  # (dropped samples...: said on instance 0 only)
            if opts.Distributed.processId != 0:
                warnings.simplefilter("ignore")
            return _share(loader, f)
    return _alone(loader, f, source=loader)


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
    (``loop_options.inference_options``); an empty loader is refused."""
    opts = inference_options(poptorch, train, inference, loader)
    _check_not_empty(loader, name)
    return build(poptorch, loader, opts, False, name, pad, partition, async_options)


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
        micro = built_micro_batch(loader, f.opts, f.training, f.name)
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
            f"{describe_factors(f.opts, micro, f.training)}. Lower the micro-batch size, "
            "deviceIterations, gradientAccumulation or replicas, or use more data."
        )
    if samples % combined:
        warnings.warn(
            f"{f.name}: {samples % combined} of {samples} samples are dropped each "
            f"epoch ({describe_factors(f.opts, micro, f.training)}).",
            stacklevel=4,
        )


def _alone(
    loader: DataLoader, f: Factors, source: DataLoader | None = None, samples: int | None = None
) -> Plan:
    """Validate ``loader`` against ``f.opts`` and rebuild it as a ``poptorch.DataLoader`` for
    one process (``_share`` shares a loader out between several: ``f.instances``); ``source``:
    the loader whose read-ahead mode the plan keeps (``prefetch_of``; None: none);
    ``samples``: the samples of the order that count (validation's slice; None: all)."""
    _check_loader(loader, f.name)
    custom = _custom_batches(f.poptorch, loader)
    micro = _micro_batch(loader, f, custom)
    factor = f.factor
    dataset: Any = loader.dataset  # (a dataset, a sampler, a batch size: as the loader holds)
    kwargs = loader_kwargs(loader)
    iterable = isinstance(dataset, IterableDataset)
    length = None if iterable else len(dataset)
    sampler = None
    if f.pad and length is not None:
        combined = micro * factor
        dataset = Padded(dataset, -(-length // combined) * combined)
    batches = None
    if custom is not None:
        kwargs["batch_sampler"] = batches = ResumableBatchSampler(custom)
        kwargs.pop("generator", None)
        micro_arg = 1
    else:
        micro_arg = micro
        if not iterable:
            inner = (
                torch.utils.data.SequentialSampler(dataset)
                if f.sequential or f.pad
                else whole_order(order_of(loader), f.instances, f.name)
            )
            kwargs["sampler"] = sampler = ResumableSampler(inner)
    if length is not None and not f.pad and custom is None:
        _check_samples(length, micro, f)
    if f.loader_opts is not None:  # this instance's options: it reads what it is given
        kwargs["auto_distributed_partitioning"] = False
    built = f.poptorch.DataLoader(
        f.opts if f.loader_opts is None else f.loader_opts,
        dataset,
        batch_size=micro_arg,
        drop_last=True,
        **kwargs,
    )
    stream = None
    if iterable and f.pad:  # the stream as its loader yields it: its batches, every sample
        kwargs = loader_kwargs(loader)
        stream = DataLoader(dataset, batch_size=loader.batch_size, drop_last=False, **kwargs)
    plan = Plan(
        built,
        sampler,
        micro,
        micro * factor,
        f.layout,
        length if samples is None else samples,
        f.name,
        batches,
        None if source is None else prefetch_of(f.poptorch, source, f.name, f.async_options),
        stream,
        None
        if custom is None
        else OneShape(f.name, custom, getattr(custom, "batch_size", None), factor),
    )
    if length is not None and plan.steps == 0:
        raise ValueError(
            f"{f.name} is empty: {length} samples make no host call of "
            f"{describe_factors(f.opts, micro, f.training)}."
        )
    return plan


def _dataset_of(
    poptorch: ModuleType, loader: DataLoader, opts: Options, training: bool, name: str
) -> tuple:
    """The whole dataset behind ``loader`` and its micro-batch size."""
    dataset = loader.dataset
    if isinstance(loader, poptorch.DataLoader):
        micro = built_micro_batch(loader, opts, training, name, " per instance")
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


def _rebuilt(
    poptorch: ModuleType, opts: Options, plan: Plan, dataset: Dataset, sampler: Sampler
) -> PopTorchLoader:
    """``plan``'s loader again, with this instance's options and order (``sampler``: of
    samples, or a custom batch sampler's batches), unpartitioned."""
    kwargs = loader_kwargs(plan.loader)
    micro = plan.micro
    if isinstance(sampler, ResumableBatchSampler):
        kwargs["batch_sampler"] = sampler
        micro = 1
        kwargs.pop("generator", None)
    elif sampler is not None:
        kwargs["sampler"] = sampler
    return poptorch.DataLoader(
        opts,
        dataset,
        batch_size=micro,
        drop_last=True,
        auto_distributed_partitioning=False,
        **kwargs,
    )


def _check_groups(opts: Options, name: str) -> None:
    if opts.replication_factor % opts.input_group_size:
        raise ValueError(
            f"{name}: input replica groups of {opts.input_group_size} with "
            f"{opts.replication_factor} replicas per instance cannot be shared out "
            "between instances: use groups that divide the replicas of an instance."
        )


def _share(loader: DataLoader, f: Factors) -> Plan:
    """``_alone`` for one of N instances (``f.opts.Distributed.numProcesses`` N)."""
    opts = f.opts
    size = opts.Distributed.numProcesses
    rank = opts.Distributed.processId
    alone = opts.clone()
    alone.Distributed.disable()
    mine = replace(f, opts=alone, loader_opts=opts)  # checked alone, read as this instance
    if not isinstance(loader, torch.utils.data.DataLoader):  # the usual error
        return _alone(loader, mine)
    view, micro = _dataset_of(f.poptorch, loader, opts, f.training, f.name)
    dataset = view.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or not f.partition:
        # a stream has no order to share out: each instance reads its own (shard it in
        # __iter__, e.g. by ipuloop.processes.process_index()); predict reads everything
        return _alone(view, mine, source=loader)
    if f.training:
        _check_groups(opts, f.name)
        every = alone.clone()
        every.replicationFactor(opts.replication_factor * size)
        try:
            whole = _alone(view, replace(f, opts=every, instances=size))
        except ValueError as e:
            raise ValueError(
                f"{e} (replicationFactor {opts.replication_factor * size}: "
                f"{opts.replication_factor} replica(s) on each of {size} "
                "instances)"
            ) from None
        groups = input_groups(opts)
        iterations = opts.device_iterations * opts.Training.gradient_accumulation
        combined = whole.micro * host_call_factor(opts, True)
        prefetch = prefetch_of(f.poptorch, loader, f.name, f.async_options)  # as read alone
        if whole.batches is not None:  # a custom batch sampler: its batches shared out alike
            assert whole.shape is not None  # (a custom batch sampler's plan has one)
            batches = ProcessBatchSampler(whole.batches.inner, rank, size, iterations, groups)
            return Plan(
                _rebuilt(f.poptorch, opts, whole, view.dataset, batches),
                None,
                whole.micro,
                combined,
                f.layout,
                whole.samples,
                f.name,
                batches,
                prefetch,
                shape=OneShape(
                    f.name, whole.batches.inner, whole.shape.batch_size, iterations * groups
                ),
            )
        assert whole.sampler is not None  # (a map-style dataset's plan, read in an order)
        sampler = ProcessSampler(whole.sampler.inner, rank, size, iterations, groups * whole.micro)
        built = _rebuilt(f.poptorch, opts, whole, view.dataset, sampler)
        return Plan(
            built,
            sampler,
            whole.micro,
            combined,
            f.layout,
            whole.samples,
            f.name,
            prefetch=prefetch,
        )
    # validation: a contiguous slice each, padded to the same number of host calls
    n = len(dataset)
    if n < size:
        raise ValueError(
            f"{f.name} has {n} samples, fewer than the {size} instances: every "
            "instance needs at least one."
        )
    cuts = [n * p // size for p in range(size + 1)]
    combined = micro * host_call_factor(opts, f.training)
    longest = max(b - a for a, b in zip(cuts, cuts[1:]))
    total = -(-longest // combined) * combined
    part = torch.utils.data.Subset(dataset, range(cuts[rank], cuts[rank + 1]))
    view = torch.utils.data.DataLoader(
        Padded(part, total),
        batch_size=micro,
        collate_fn=view.collate_fn,
        num_workers=view.num_workers,
    )
    sliced = replace(mine, pad=False, sequential=True)
    return _alone(view, sliced, source=loader, samples=cuts[rank + 1] - cuts[rank])


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


def order_of(loader: DataLoader) -> Sampler:
    """The sampler of ``loader``'s samples (torch types it an iterable)."""
    sampler: Any = loader.sampler
    return sampler


def no_host_call(plan: Plan, epoch: int) -> ValueError:
    """An IterableDataset that yielded less than one host call in an epoch."""
    return ValueError(
        f"{plan.name} yielded no complete host call in epoch {epoch}: one host call takes "
        f"{describe_factors(plan.loader.options, plan.micro, True)}. An IterableDataset must "
        "yield at least that many samples each time it is iterated (a generator can be "
        "iterated only once)."
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
    counted from the length of its order (its sampler's, or its batch sampler's batches) and
    the factors, without building a loader, with ``build``'s checks; None for a stream of
    unknown length."""
    f = Factors(poptorch, opts, True, name, Layout.of(opts, True))
    size = opts.Distributed.numProcesses
    if size == 1:
        return _count(loader, f)
    with warnings.catch_warnings():  # (as ``build``: said on instance 0 only)
        if opts.Distributed.processId != 0:
            warnings.simplefilter("ignore")
        return _count_share(loader, f)


def _count_share(loader: DataLoader, f: Factors) -> int | None:
    """``_share(loader, f).steps`` for training, counted."""
    opts = f.opts
    size = opts.Distributed.numProcesses
    name = f.name
    alone = opts.clone()
    alone.Distributed.disable()
    _check_loader(loader, name)
    view, _ = _dataset_of(f.poptorch, loader, opts, True, name)
    if isinstance(view.dataset, torch.utils.data.IterableDataset):  # each reads its own
        return _count(view, replace(f, opts=alone))
    _check_groups(opts, name)
    every = alone.clone()
    every.replicationFactor(opts.replication_factor * size)
    try:  # an instance's share of a global host call: as many of them as the whole run's
        return _count(view, replace(f, opts=every, instances=size))
    except ValueError as e:
        raise ValueError(
            f"{e} (replicationFactor {opts.replication_factor * size}: "
            f"{opts.replication_factor} replica(s) on each of {size} instances)"
        ) from None


def _count(loader: DataLoader, f: Factors) -> int | None:
    """``_alone(loader, f).steps`` for training, counted."""
    _check_loader(loader, f.name)
    custom = _custom_batches(f.poptorch, loader)
    micro = _micro_batch(loader, f, custom)
    dataset: Any = loader.dataset  # (sized, or a stream that may be)
    length = None if isinstance(dataset, IterableDataset) else len(dataset)
    try:
        if custom is not None:  # a host call is factor of its batches
            steps = len(custom) // f.factor  # type: ignore[arg-type]
        elif length is None:  # a stream: as long as it says it is
            steps = len(dataset) // (micro * f.factor)
        else:
            _check_samples(length, micro, f)
            order: Any = whole_order(order_of(loader), f.instances, f.name)  # (with a length)
            steps = len(order) // (micro * f.factor)
    except TypeError:  # no length
        return None
    if length is not None and steps == 0:
        raise ValueError(
            f"{f.name} is empty: {length} samples make no host call of "
            f"{describe_factors(f.opts, micro, f.training)}."
        )
    return steps
