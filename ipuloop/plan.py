"""A loader as this process runs it (``Plan``): built once per call, it hands out the batches.

``build`` checks a loader against the options and rebuilds it as a ``poptorch.DataLoader``
whose order it can draw and skip into (``loaders``): alone, or under several processes this
instance's share of one global order (each instance reads the micro-batches of its replicas in
the order one process with every instance's replicas would read them; validation inside a fit
gives each a contiguous slice of the samples, padded to the same number of host calls).

``Plan.epoch`` draws an epoch's order from the random state as it is, and hands out the
epoch's host batches after the steps already run. A training epoch's draw (``Draw``) records
that random state (``Plan.drawn_from``: a checkpoint reads it there), or draws from a resumed
epoch's saved one (``random_state.Draw``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

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
from .processes import configured
from .random_state import Draw, rng_state, set_rng_state
from .rules import describe_factors, host_call_factor

__all__ = ["Plan", "build", "build_inference", "no_host_call", "num_updates"]


@dataclass
class Plan:
    """A loader as the loop runs it, with what it needs to know about it."""

    loader: Any  # poptorch.DataLoader
    sampler: ResumableSampler | None  # None: iterable dataset or custom batch sampler
    micro: int  # micro-batch size B
    combined: int  # samples per host call
    layout: Layout
    samples: int | None  # dataset length, when known
    name: str
    batches: ResumableBatchSampler | None = None  # a custom batch sampler, wrapped
    prefetch: Prefetch | None = None  # read ahead: the user's Async mode, or async_data
    stream: Any = None  # validation and predict over a stream: a torch loader yielding it in
    # its own loader's order (drop_last=False), cut into host calls as it is read
    shape: OneShape | None = None  # a custom batch sampler's: the shape its batches keep
    reader: Any = None  # the iterator of the epoch last started (stopped when a call ends)
    drawn_from: dict[str, Any] | None = None  # the random state its last training epoch drew
    # its order from (the host's, with the loader generator's under "sampler")

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

    def _iter(self, loader: Any = None, start: int = 0) -> Iterator[Any]:
        # A new torch iterator draws its workers' base seed from the RNG; a persistent-workers
        # loader reuses its iterator from the second epoch on and draws nothing. Draw exactly
        # once either way, so a run resumed in a new process consumes the RNG as the original.
        loader = self.loader if loader is None else loader
        g = loader.generator
        host = torch.get_rng_state()
        own = g.get_state() if g is not None else host
        if loader is self.stream:
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
            it = HostCalls(
                DataLoader.__iter__(loader), self.combined // self.micro, self.shape, start
            )
        else:
            it = iter(loader)
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
        ``drawn_from``, or draws it from a resumed epoch's."""
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
        self.reader = it
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
            self.drawn_from = draw.order
            return
        if order is not None and draw.sampler is not None:  # resumed at an epoch start
            order.set_generator_state(draw.sampler)
        self.drawn_from = rng_state()
        if order is not None:
            self.drawn_from["sampler"] = order.generator_state()

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
        reader = self.reader
        self.reader = None
        close(reader)

    def kill_workers(self) -> None:
        """A second Ctrl-C: the process exits at once, and its loader workers go first."""
        kill_workers(self.reader)


def build(
    poptorch: Any,
    loader: Any,
    opts: Any,
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
    layout = Layout.of(opts, training)
    if opts.Distributed.numProcesses > 1:
        return _share(
            poptorch,
            loader,
            opts,
            layout,
            training=training,
            name=name,
            pad=pad,
            sequential=pad,
            partition=partition,
            async_options=async_options,
        )
    return _alone(
        poptorch,
        loader,
        opts,
        layout,
        training=training,
        name=name,
        pad=pad,
        sequential=pad,
        async_options=async_options,
    )


def build_inference(
    poptorch: Any,
    loader: Any,
    train: Any,
    inference: Any,
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


def _alone(
    poptorch: Any,
    loader: Any,
    opts: Any,
    layout: Layout,
    *,
    training: bool,
    name: str,
    pad: bool = False,
    sequential: bool = False,
    instances: int = 1,
    async_options: dict[str, Any] | None = None,
) -> Plan:
    """Validate ``loader`` against ``opts`` and rebuild it as a ``poptorch.DataLoader`` for
    one process (``_share`` shares a loader out between several: the ``instances`` of the
    run); ``async_options``: read a torch loader ahead in ``Async`` mode (``prefetch_of``)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise TypeError(
            f"{name} must be a torch.utils.data.DataLoader or poptorch.DataLoader. "
            f"Received: {name}={type(loader).__name__}."
        )
    factor = host_call_factor(opts, training)
    dataset: Any = loader.dataset  # (a dataset, a sampler, a batch size: as the loader holds)
    batch_sampler: Any = loader.batch_sampler
    micro: Any
    # A batch sampler the user chose (a subclass, or a plain BatchSampler passed as
    # batch_sampler=, which leaves batch_size None), rather than the one torch built.
    custom_batches = batch_sampler is not None and (
        type(batch_sampler) is not BatchSampler
        or (not isinstance(loader, poptorch.DataLoader) and loader.batch_size is None)
    )
    if isinstance(loader, poptorch.DataLoader):
        micro = built_micro_batch(loader, opts, training, name)
        if custom_batches:
            batch_sampler = getattr(batch_sampler, "batch_sampler", batch_sampler)
    else:
        micro = loader.batch_size
        if micro is None and not custom_batches:
            raise ValueError(
                f"{name} has batch_size=None: the loop needs micro-batches. "
                "Pass the micro-batch size as batch_size."
            )
    if custom_batches:  # each micro-batch of a host call, each replica's too, one batch
        declared = getattr(batch_sampler, "batch_size", None)
        micro = declared or micro or 1
        check_last_batch(batch_sampler, factor, name)
    kwargs = loader_kwargs(loader)
    iterable = isinstance(dataset, IterableDataset)
    samples = None if iterable else len(dataset)
    sampler = None
    if pad and samples is not None:
        combined = micro * factor
        dataset = Padded(dataset, -(-samples // combined) * combined)
    batches = None
    if custom_batches:
        kwargs["batch_sampler"] = batches = ResumableBatchSampler(batch_sampler)
        micro_arg = 1
    else:
        micro_arg = micro
        if not iterable:
            inner = (
                torch.utils.data.SequentialSampler(dataset)
                if sequential or pad
                else whole_order(loader.sampler, instances, name)
            )
            sampler = ResumableSampler(inner)
            kwargs["sampler"] = sampler
    if samples is not None and not pad and not custom_batches:
        combined = micro * factor
        if samples < combined:
            raise ValueError(
                f"{name} has {samples} samples, fewer than one host call needs: "
                f"{describe_factors(opts, micro, training)}. Lower the micro-batch size, "
                "deviceIterations, gradientAccumulation or replicas, or use more data."
            )
        if samples % combined:
            warnings.warn(
                f"{name}: {samples % combined} of {samples} samples are dropped each "
                f"epoch ({describe_factors(opts, micro, training)}).",
                stacklevel=3,
            )
    if custom_batches:
        kwargs.pop("generator", None)
    built = poptorch.DataLoader(opts, dataset, batch_size=micro_arg, drop_last=True, **kwargs)
    plan = Plan(
        built,
        sampler,
        micro,
        micro * factor,
        layout,
        samples,
        name,
        batches,
        prefetch_of(poptorch, loader, name, async_options),
    )
    if custom_batches:
        plan.shape = OneShape(name, batch_sampler, declared, factor)
    if iterable and pad:  # the stream as its loader yields it: its batches, every sample
        stream = loader_kwargs(loader)
        plan.stream = DataLoader(dataset, batch_size=loader.batch_size, drop_last=False, **stream)
    if samples is not None and plan.steps == 0:
        raise ValueError(
            f"{name} is empty: {samples} samples make no host call of "
            f"{describe_factors(opts, micro, training)}."
        )
    return plan


def _dataset_of(poptorch: Any, loader: Any, opts: Any, training: bool, name: str) -> tuple:
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


def _rebuilt(poptorch: Any, opts: Any, plan: Plan, dataset: Any, sampler: Any) -> Any:
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


def _share(
    poptorch: Any,
    loader: Any,
    opts: Any,
    layout: Layout,
    *,
    training: bool,
    name: str,
    pad: bool = False,
    sequential: bool = False,
    partition: bool = True,
    async_options: dict[str, Any] | None = None,
) -> Plan:
    """``_alone`` for one of N instances (``opts.Distributed.numProcesses`` N); its warnings
    (dropped samples...) are given on instance 0 only."""
    with warnings.catch_warnings():
        if opts.Distributed.processId != 0:
            warnings.simplefilter("ignore")
        plan = _process_plan(
            poptorch,
            loader,
            opts,
            layout,
            training=training,
            name=name,
            pad=pad,
            sequential=sequential,
            partition=partition,
        )
        plan.prefetch = prefetch_of(poptorch, loader, name, async_options)  # as read alone
        return plan


def _process_plan(
    poptorch: Any,
    loader: Any,
    opts: Any,
    layout: Any,
    *,
    training: bool,
    name: str,
    pad: bool,
    sequential: bool,
    partition: bool,
) -> Plan:
    size = opts.Distributed.numProcesses
    rank = opts.Distributed.processId
    alone = opts.clone()
    alone.Distributed.disable()
    if not isinstance(loader, torch.utils.data.DataLoader):  # the usual error
        return _alone(
            poptorch,
            loader,
            alone,
            layout,
            training=training,
            name=name,
            pad=pad,
            sequential=sequential,
        )
    view, micro = _dataset_of(poptorch, loader, opts, training, name)
    dataset = view.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or not partition:
        # a stream has no order to share out: each instance reads its own (shard it in
        # __iter__, e.g. by ipuloop.processes.process_index()); predict reads everything
        plan = _alone(
            poptorch,
            view,
            alone,
            layout,
            training=training,
            name=name,
            pad=pad,
            sequential=sequential,
        )
        plan.loader = _rebuilt(
            poptorch,
            opts,
            plan,
            plan.loader.dataset,
            plan.sampler if plan.batches is None else plan.batches,
        )
        return plan
    if training:
        if opts.replication_factor % opts.input_group_size:
            raise ValueError(
                f"{name}: input replica groups of {opts.input_group_size} with "
                f"{opts.replication_factor} replicas per instance cannot be shared out "
                "between instances: use groups that divide the replicas of an instance."
            )
        every = alone.clone()
        every.replicationFactor(opts.replication_factor * size)
        try:
            whole = _alone(
                poptorch,
                view,
                every,
                layout,
                training=True,
                name=name,
                sequential=sequential,
                instances=size,
            )
        except ValueError as e:
            raise ValueError(
                f"{e} (replicationFactor {opts.replication_factor * size}: "
                f"{opts.replication_factor} replica(s) on each of {size} "
                "instances)"
            ) from None
        groups = max(opts.replication_factor // opts.input_group_size, 1)
        iterations = opts.device_iterations * opts.Training.gradient_accumulation
        combined = whole.micro * host_call_factor(opts, True)
        if whole.batches is not None:  # a custom batch sampler: its batches shared out alike
            assert whole.shape is not None  # (a custom batch sampler's plan has one)
            batches = ProcessBatchSampler(whole.batches.inner, rank, size, iterations, groups)
            built = _rebuilt(poptorch, opts, whole, view.dataset, batches)
            return Plan(
                built,
                None,
                whole.micro,
                combined,
                layout,
                whole.samples,
                name,
                batches,
                shape=OneShape(
                    name, whole.batches.inner, whole.shape.batch_size, iterations * groups
                ),
            )
        assert whole.sampler is not None  # (a map-style dataset's plan, read in an order)
        sampler = ProcessSampler(whole.sampler.inner, rank, size, iterations, groups * whole.micro)
        built = _rebuilt(poptorch, opts, whole, view.dataset, sampler)
        return Plan(built, sampler, whole.micro, combined, layout, whole.samples, name)
    # validation: a contiguous slice each, padded to the same number of host calls
    n = len(dataset)
    if n < size:
        raise ValueError(
            f"{name} has {n} samples, fewer than the {size} instances: every "
            "instance needs at least one."
        )
    cuts = [n * p // size for p in range(size + 1)]
    combined = micro * host_call_factor(opts, training)
    longest = max(b - a for a, b in zip(cuts, cuts[1:]))
    total = -(-longest // combined) * combined
    mine = torch.utils.data.Subset(dataset, range(cuts[rank], cuts[rank + 1]))
    view = torch.utils.data.DataLoader(
        Padded(mine, total),
        batch_size=micro,
        collate_fn=view.collate_fn,
        num_workers=view.num_workers,
    )
    plan = _alone(poptorch, view, alone, layout, training=False, name=name, sequential=True)
    plan.loader = _rebuilt(poptorch, opts, plan, plan.loader.dataset, plan.sampler)
    plan.samples = cuts[rank + 1] - cuts[rank]
    return plan


def _check_not_empty(loader: Any, name: str) -> None:
    try:
        empty = len(loader.dataset) == 0
    except TypeError:  # an IterableDataset: its length is unknown
        empty = False
    if empty:
        raise ValueError(
            f"{name} has 0 samples (the loader is empty): there is nothing "
            "to run. Pass a loader over a dataset with at least one sample."
        )


def no_host_call(plan: Plan, epoch: int) -> ValueError:
    """An IterableDataset that yielded less than one host call in an epoch."""
    return ValueError(
        f"{plan.name} yielded no complete host call in epoch {epoch}: one host call takes "
        f"{describe_factors(plan.loader.options, plan.micro, True)}. An IterableDataset must "
        "yield at least that many samples each time it is iterated (a generator can be "
        "iterated only once)."
    )


def num_updates(loader: Any, opts: Any, epochs: int = 1) -> int:
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
    plan = build(pt, loader, opts, True, "loader")
    if plan.steps is None:
        raise ValueError(
            f"loader reads an {type(plan.loader.dataset).__name__}, whose "
            "length is unknown, so neither is its number of updates. Count "
            "them as epochs x (samples per epoch // (B * DI * GA * RF)) x DI."
        )
    return epochs * plan.steps * opts.device_iterations
