"""A loader checked against the options and measured, before a plan reads it (``measure``).

``Factors`` (frozen, made once per build) holds what a plan is built from besides the loader:
the options and their host-call factor, the call's kind and name, instances, reading ahead.
``measure`` checks the loader (its type, an empty one, a ``poptorch.DataLoader`` built for other
factors, a short last batch a host call would read, too few samples) and gives ``Measured``: the
loader read as torch reads it (``sources.py``), its micro-batch, host call and steps, and the
``Selection`` of its batches this instance reads: under several processes, of each host call of
the run laid out ``[DI, GA, N*R]`` micro-batches, the ``R`` of its replicas (training), or a
contiguous slice of the batches padded to the same number of host calls (validation).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from .host_calls import OneShape
from .poptorch_types import Options
from .read_ahead import async_of, check_no_draws
from .rules import describe_factors, host_call_factor, input_groups
from .sources import Selection, Source, kept_random_state, poptorch_source, torch_source

__all__ = ["Factors", "Measured", "measure", "fit_iterations", "custom_name"]


@dataclass(frozen=True)
class Factors:
    """What a plan is built from besides the loader, made once per build.

    ``opts``: the options the host calls are made for (several processes: this instance's,
    whose host call is its share of the run's); ``training``: a fit's (GA counts, remainders
    are dropped) or an inference's (every sample counts, the last call padded); ``partition``:
    several processes share the samples out (False: each reads all, as predict does);
    ``async_options``: a torch loader is read ahead; ``fitted_to``: the training options whose
    DI*GA an inference's device iterations are fitted from (``fit_iterations``)."""

    poptorch: ModuleType
    opts: Options
    training: bool
    name: str
    partition: bool = True
    async_options: dict[str, Any] | None = None
    fitted_to: Options | None = None

    @cached_property
    def instances(self) -> int:
        return self.opts.Distributed.numProcesses

    @cached_property
    def factor(self) -> int:
        """Micro-batches in one host call of this instance (asked once)."""
        return host_call_factor(self.alone, training=self.training)

    @cached_property
    def alone(self) -> Options:
        """The options as one process runs them (an instance's, its Distributed group off)."""
        if self.instances == 1:
            return self.opts
        alone = self.opts.clone()
        alone.Distributed.disable()
        return alone

    def describe(self, micro: int) -> str:
        return describe_factors(self.alone, micro, training=self.training)


@dataclass(frozen=True)
class Measured:
    """How this process reads a loader: its ``source``, micro-batch size and samples per host
    call (this instance's), the steps of an epoch (None: a stream of unknown length), the
    samples known, the ``selection`` of its batches, the batches of the whole run's order one
    step reads (``per_step``), the ``shape`` each batch is checked against, and an inference's
    host calls padding included (``calls``, several processes)."""

    source: Source
    micro: int
    combined: int
    steps: int | None
    samples: int | None
    selection: Selection
    per_step: int
    shape: OneShape
    calls: int | None = None


def measure(loader: DataLoader, f: Factors) -> Measured:
    """``loader`` checked against ``f`` and measured: how this process reads it."""
    _check_loader(loader, f.name)
    if not f.training:
        if f.fitted_to is not None:
            fit_iterations(f.poptorch, loader, f.fitted_to, f.opts)
        _check_not_empty(loader, f.name)
    if f.instances > 1:
        with warnings.catch_warnings():  # (dropped samples...: said on instance 0 only)
            if f.opts.Distributed.processId != 0:
                warnings.simplefilter("ignore")
            return _measured(loader, f)
    return _measured(loader, f)


def _measured(loader: DataLoader, f: Factors) -> Measured:
    """``loader`` with ``f``, measured and checked."""
    poptorch = f.poptorch
    size = f.instances if f.partition else 1
    if isinstance(loader, poptorch.DataLoader):
        micro = _built_micro_batch(loader, f)
        prefetch = async_of(loader, f.name)
        source = poptorch_source(loader, f.name, f.factor, training=f.training, prefetch=prefetch)
        size = 1  # (each instance reads its own loader, as PopTorch partitions it)
    else:
        if loader.batch_sampler is None:  # (torch batches nothing)
            raise ValueError(
                f"{f.name} has batch_size=None: the loop needs micro-batches. "
                "Pass the micro-batch size as batch_size."
            )
        shared = size > 1 and f.training and not isinstance(loader.dataset, IterableDataset)
        source = torch_source(
            loader, f.name, f.factor, instances=size if shared else 1, training=f.training
        )
        if source.unit is None:
            raise ValueError(
                f"{f.name}'s batch sampler ({type(loader.batch_sampler).__name__}) yields no "
                "batch: the loop needs micro-batches."
            )
        micro = source.unit
        if f.training and loader.batch_size is None:  # a batch_sampler= the user gave
            _check_last_batch(loader.batch_sampler, f.factor, f.name)
        source.prefetch = f.async_options
        if source.stream or _own_share(loader, size, f):
            source.own = True
            size = 1
    if source.prefetch is not None and loader.num_workers == 0:
        check_no_draws(source.dataset, f.name)
    if f.training:
        return _training(source, micro, f, size)
    return _inference(source, micro, f, size)


def _own_share(loader: DataLoader, size: int, f: Factors) -> bool:
    """An inference loader with a ``DistributedSampler`` of the run's processes (DDP's idiom):
    each instance reads its own share, as torch reads it."""
    sampler = loader.sampler
    return (
        not f.training
        and size > 1
        and isinstance(sampler, DistributedSampler)
        and sampler.num_replicas == size
    )


def _training(source: Source, micro: int, f: Factors, size: int) -> Measured:
    """A fit's reading: whole host calls of ``source``'s order (or stream), this instance reading
    its replicas' micro-batches of each host call of the ``size`` instances."""
    if size > 1 and f.alone.replication_factor % f.alone.input_group_size:
        raise ValueError(
            f"{f.name}: input replica groups of {f.alone.input_group_size} with "
            f"{f.alone.replication_factor} replicas per instance cannot be shared out "
            "between instances: use groups that divide the replicas of an instance."
        )
    per_call = source.per_call  # units of one host call of this instance
    combined = micro * f.factor
    per_step = per_call * size
    steps = None if source.full is None else source.full // per_step
    if source.rebatched and source.samples is not None:
        steps = source.samples // combined
    if steps is not None and not source.stream:
        _check_samples(source, micro, f, size, steps)
    custom = custom_name(source)
    shape = OneShape(
        f.name, source.unit, "drop" if source.stream else "refuse" if custom else "last", custom
    )
    return Measured(
        source=source,
        micro=micro,
        combined=combined,
        steps=steps,
        samples=source.samples,
        selection=Selection(
            share=input_groups(f.alone),  # (its replicas' micro-batches of an iteration)
            size=size,
            rank=f.opts.Distributed.processId if size > 1 else 0,
        ),
        per_step=per_step,
        shape=shape,
    )


def custom_name(source: Source) -> str:
    """The type of a custom batch sampler ``source`` reads ("" for torch's ``BatchSampler``)."""
    inner = None if source.order is None else source.order.inner
    if inner is None or type(inner) is BatchSampler:
        return ""
    return type(inner).__name__


def _check_samples(source: Source, micro: int, f: Factors, size: int, steps: int) -> None:
    """A training order makes at least one host call; its remainder is dropped, with a
    warning."""
    combined = micro * f.factor * size
    samples = source.samples if source.samples is not None else (source.full or 0) * micro
    where = ""
    if size > 1:
        rf = f.alone.replication_factor
        where = f" (replicationFactor {rf * size}: {rf} replica(s) on each of {size} instances)"
    if steps == 0:
        raise ValueError(
            f"{f.name} has {samples} samples, fewer than one host call needs: "
            f"{_describe_run(f, micro, size)}. Lower the micro-batch "
            f"size, deviceIterations, gradientAccumulation or replicas, or use more data.{where}"
        )
    dropped = samples - steps * combined
    if dropped > 0 and not custom_name(source):
        warnings.warn(
            f"{f.name}: {dropped} of {samples} samples are dropped each "
            f"epoch ({_describe_run(f, micro, size)}).",
            stacklevel=6,
        )


def _describe_run(f: Factors, micro: int, size: int) -> str:
    if size == 1:
        return f.describe(micro)
    every = f.alone.clone()
    every.replicationFactor(f.alone.replication_factor * size)
    return describe_factors(every, micro, training=f.training)


def _inference(source: Source, micro: int, f: Factors, size: int) -> Measured:
    """A validation's or predict's reading: every sample of ``source`` in its order, cut into host
    calls; several processes' validation (``size`` > 1) gives each a contiguous slice of the
    batches, padded to the same number of host calls."""
    combined = micro * f.factor
    selection = Selection()
    rows = _rows(source)
    samples = None if rows is None else sum(rows)
    calls = None
    if size > 1:
        rank = f.opts.Distributed.processId
        assert rows is not None  # (a map-style order)
        if len(rows) < size:
            raise ValueError(
                f"{f.name} has {len(rows)} batches, fewer than the {size} instances: every "
                "instance needs at least one."
            )
        cuts = [len(rows) * p // size for p in range(size + 1)]
        selection = Selection(span=(cuts[rank], cuts[rank + 1]))
        share = [sum(rows[a:b]) for a, b in zip(cuts, cuts[1:])]
        samples = share[rank]
        calls = max(-(-s // combined) for s in share)
    steps = calls if calls is not None else None if samples is None else -(-samples // combined)
    return Measured(
        source=source,
        micro=micro,
        combined=combined,
        steps=steps,
        samples=samples,
        selection=selection,
        per_step=source.per_call,
        shape=OneShape(f.name, source.unit, "keep", sampler=custom_name(source)),
        calls=calls,
    )


def _rows(source: Source) -> list[int] | None:
    """The samples of each batch of an inference's order (None: a stream): a ``BatchSampler``'s
    by its length, a custom batch sampler's by drawing its batches with the random state kept."""
    order = source.order
    if order is None or source.units is None:
        return None
    inner: Any = order.inner
    if type(inner) is BatchSampler and source.samples is not None:
        b, n = inner.batch_size, source.samples
        last = n - (source.units - 1) * b
        return [b] * (source.units - 1) + [last] if source.units else []
    with kept_random_state(source.gens):
        return [len(batch) for batch in iter(inner)]


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
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is not None:
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


def _built_micro_batch(loader: Any, f: Factors) -> int:
    """The micro-batch size a ``poptorch.DataLoader`` was built for; a ``ValueError`` when its
    host call is not the one the loop runs."""
    combined = loader.combinedBatchSize
    if not combined:
        raise ValueError(
            f"{f.name} is a poptorch.DataLoader without a batch size: the loop needs "
            "micro-batches. Pass the micro-batch size as batch_size."
        )
    built = loader.options
    micro = combined // host_call_factor(built, f.training)
    if combined != micro * f.factor:
        where = " per instance" if f.instances > 1 else ""
        raise ValueError(
            f"{f.name} was built for {describe_factors(built, micro, f.training)}, "
            f"but the loop runs {f.describe(micro)}{where}. Build the "
            "loader with the same options as the loop, or pass a torch DataLoader with the "
            "micro-batch size and let the loop build it."
        )
    return micro


def _check_last_batch(batch_sampler: object, count: int, name: str) -> None:
    """A ``BatchSampler(drop_last=False)`` given as ``batch_sampler=``, whose short last batch a
    host call would read (its batches make whole host calls of ``count``), is refused before any
    step."""
    if type(batch_sampler) is not BatchSampler or batch_sampler.drop_last:
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
