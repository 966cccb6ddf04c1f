"""A loader as this process runs it (``Plan``): built once per call, it hands out host calls.

``build`` checks a loader against the options (``Factors``: the options and their host-call
factor, the call's kind and name, instances, reading ahead, written once) and reads it as torch
reads it (``sources.py``): the micro-batches its own iterator yields, in its own order, joined
into host calls (``host_calls.py``). Under several processes each instance reads its share of
one global order: of each host call of the run, laid out ``[DI, GA, N*R]`` micro-batches, the
``R`` of its replicas (as one process with every instance's replicas reads them); validation
inside a fit gives each a contiguous slice of the batches, padded to the same number of host
calls. A stream (``IterableDataset``) and a ``poptorch.DataLoader`` are read by each instance on
its own. ``num_updates`` counts a fit's updates from the same measure, reading nothing.

``Plan.epoch`` draws an epoch's order from the random state as it is, and hands out the
epoch's host calls after the steps already run: a map-style order skips the batches of those
steps without reading them, a stream reads them again. A training epoch's draw (``Draw``)
records that random state (``Plan.drawn_from``: a checkpoint reads it there), or draws from a
resumed epoch's saved one (``random_state.Draw``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import ModuleType
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from .backend import poptorch_module
from .host_calls import OneShape, cut, joined
from .loop_options import inference_options, resolve_options
from .outputs import Layout, map_tensors
from .poptorch_types import Options
from .processes import configured
from .random_state import Draw, rng_state, set_rng_state
from .read_ahead import Ahead, async_of, buffer_size, check_no_draws
from .rules import describe_factors, host_call_factor, input_groups
from .sources import (
    Selection,
    Source,
    kept_random_state,
    kill_workers,
    poptorch_source,
    torch_source,
)

__all__ = [
    "Factors",
    "Plan",
    "build",
    "build_inference",
    "fit_iterations",
    "no_host_call",
    "num_updates",
    "training_steps",
]

PROBED = 4  # micro-batches the host check reads before compiling, each with the first's shapes


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


@dataclass
class Reading:
    """What a plan's running epoch leaves behind (the one part of a plan that changes)."""

    reader: Any = None  # the host calls of the epoch last started
    ended: bool = False  # they were all read (a stream of unknown length ended)
    drawn_from: dict[str, Any] | None = None  # the random state its last training epoch drew
    # its order from (the host's, with the states of its order's generators under "sampler")


@dataclass(frozen=True)
class Plan:
    """A loader as the loop runs it, built whole by ``build`` (frozen); its running epoch's
    host calls and draw are in ``reading``."""

    name: str
    source: Source  # the loader, read as torch reads it
    opts: Options  # the options of its host calls (this instance's)
    layout: Layout
    micro: int  # micro-batch size B
    combined: int  # samples per host call (this instance's)
    steps: int | None  # host calls per epoch (None: a stream of unknown length)
    samples: int | None  # the dataset's samples (an inference: this instance's), when known
    training: bool
    selection: Selection  # the units this instance reads of each epoch
    per_step: int  # units of the whole run's order that one step reads
    shape: OneShape
    calls: int | None = None  # an inference's host calls, padding included (several processes)
    reading: Reading = field(default_factory=Reading, compare=False)

    @property
    def own(self) -> bool:
        """Each instance reads its own loader (a stream, a ``poptorch.DataLoader``)."""
        return self.source.own

    @property
    def drawn_from(self) -> dict[str, Any] | None:
        """The random state its last training epoch drew its order from (a checkpoint's)."""
        return self.reading.drawn_from

    def epoch(
        self, skip_steps: int = 0, number: int | None = None, draw: Draw | None = None
    ) -> Iterator[Any]:
        """This training epoch's host calls, after ``skip_steps`` of them; a sampler with
        ``set_epoch`` is given the epoch's ``number`` first. ``draw`` records the random state
        the order is drawn from in ``reading.drawn_from``, or draws it from a resumed epoch's,
        then goes on from the saved step's (``draw.then``) once the steps are skipped."""
        self.reading.ended = False
        drawn = None if draw is None else self._draw(draw)
        then = None if draw is None else draw.then
        started = None if then is None else (lambda: set_rng_state(then))
        source = self.source
        by_reading = source.stream or source.rebatched  # (no batches to skip into, or stop at)
        shared = self.selection.size > 1  # (the run's last, incomplete call: read by none)
        stop = self.steps * self.per_step if shared and self.steps is not None else None
        skip = 0 if by_reading else skip_steps * self.per_step
        selection = replace(self.selection, skip=skip, stop=stop, started=started, drawn=drawn)
        units = source.start(selection, number)
        self.shape.epoch()
        if source.rebatched:  # PopTorch re-cuts its batches into host calls
            calls: Iterator[Any] = (c for c, _ in cut(units, self.combined, self.shape, pad=False))
        else:
            calls = joined(units, source.per_call, self.shape)
        if by_reading:  # nothing to skip into: the steps already run are read again
            for _ in range(skip_steps):
                next(calls, None)
            if started is not None:
                started()
        return self._ahead(calls)

    def counted(self) -> Iterator[tuple[Any, int]]:
        """An inference's host calls from the start, each with how many of its rows are
        samples: the rest (of the last call, or of a call past them, as several processes'
        validation runs) is padding."""
        units = self.source.start(self.selection, None)
        self.shape.epoch()
        return self._ahead(cut(units, self.combined, self.shape, pad=True, calls=self.calls))

    def _ahead(self, calls: Iterator[Any]) -> Iterator[Any]:
        prefetch = self.source.prefetch
        self.reading.reader = calls if prefetch is None else Ahead(calls, buffer_size(prefetch))
        return self.reading.reader

    def _draw(self, draw: Draw) -> list[Any] | None:
        """Set the random state the epoch's order is drawn from, and record it. A resumed
        epoch recorded by ipuloop 0.1 (no "seeded" entry) drew its whole order before its
        loader's base seed: it is drawn so again, and returned."""
        if draw.order is not None:  # a resumed epoch's order, drawn again
            set_rng_state(draw.order)
            self.set_generator_state(draw.order.get("sampler"))
            self.reading.drawn_from = draw.order
            if "seeded" in draw.order:  # its workers' base seed: drawn as the epoch began, or not
                self.source.seeded(drawn=bool(draw.order["seeded"]))
            elif self.source.order is not None:
                return list(iter(self.source.order.inner))
            return None
        self.set_generator_state(draw.sampler)  # (resumed at an epoch start; None: as is)
        drawn = rng_state()
        drawn["sampler"] = self.generator_state()
        drawn["seeded"] = self.source.was_seeded()
        self.reading.drawn_from = drawn
        return None

    def generator_state(self) -> list[torch.Tensor] | None:
        """The states of the generators its order draws from (None: it has none)."""
        gens = self.source.gens
        return [g.get_state() for g in gens] if gens else None

    def set_generator_state(self, state: object) -> None:
        """Its order's generators set to ``state`` (``generator_state``'s; a single tensor, as
        checkpoints held before, is the first's; None: as they are)."""
        if state is None:
            return
        states = [state] if isinstance(state, torch.Tensor) else list(state)  # type: ignore[call-overload]
        for g, s in zip(self.source.gens, states):
            g.set_state(s)

    def first_micro_batches(self, count: int = PROBED) -> list[Any]:
        """The dataset's first ``count`` micro-batches, as the device receives them (float64 as
        float32), read here with the random state kept, for the host check before compiling;
        none for a stream."""
        source = self.source
        n = source.samples
        if source.stream or not n or _custom_name(source):  # (a custom one's indices: its own)
            return []
        ds = source.dataset
        collate = source.reader.collate_fn
        out = []
        with kept_random_state(source.gens):
            for k in range(count):
                lo, hi = k * self.micro, min((k + 1) * self.micro, n)
                if lo >= hi or (k and hi - lo < self.micro):
                    break
                batch = collate([ds[i] for i in range(lo, hi)])
                out.append(
                    map_tensors(batch, lambda x: x.float() if x.dtype == torch.float64 else x)
                )
        return out

    def check_shapes(self, batches: list[Any]) -> None:
        """The micro-batches the host check read all have the first one's shapes (a collate
        function padding each batch to its longest is refused before compiling)."""
        where = (
            f"micro-batch {{}} in dataset order (of {self.micro} samples, read before compiling)"
        )
        check = OneShape(self.name, None, "refuse", where=where)
        for batch in batches:
            check.check(batch)

    def close(self, *, keep: bool = False) -> None:
        """Stop the read-ahead thread and the loader workers of the epoch last started;
        ``keep``: a persistent-workers loader keeps its workers (the call ended well)."""
        reader, self.reading.reader = self.reading.reader, None
        if isinstance(reader, Ahead):
            reader.terminate()
        self.source.close(keep=keep)
        if isinstance(reader, Ahead):
            reader.join()

    def kill_workers(self) -> None:
        """A second Ctrl-C: the process exits at once, and its loader workers go first."""
        kill_workers(self.source.live)
        kill_workers(self.reading.reader)
        if isinstance(self.reading.reader, Ahead):
            self.reading.reader.join(2.0)


def build(
    poptorch: ModuleType,
    loader: DataLoader,
    opts: Options,
    *,
    training: bool,
    name: str,
    partition: bool = True,
    async_options: dict[str, Any] | None = None,
) -> Plan:
    """``loader`` as this process runs it with ``opts``: alone, or its share of several
    processes' (``opts.Distributed.numProcesses`` > 1; ``partition=False``: every sample, as
    predict reads them); ``async_options``: a torch loader is read ahead
    (``Loop(async_data=...)``)."""
    f = Factors(
        poptorch=poptorch,
        opts=opts,
        training=training,
        name=name,
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
    partition: bool = True,
    async_options: dict[str, Any] | None = None,
) -> Plan:
    """``loader`` as a validation or predict runs it: with the ``inference`` options given
    to the loop, else the training options ``train`` less their training-only settings
    (``loop_options.inference_options``), with device iterations fitted to the loader
    (``fit_iterations``); an empty loader is refused."""
    f = Factors(
        poptorch=poptorch,
        opts=inference_options(poptorch, train, inference),
        training=False,
        name=name,
        partition=partition,
        async_options=async_options,
        fitted_to=train if inference is None else None,
    )
    return _built(loader, f)


def _built(loader: DataLoader, f: Factors) -> Plan:
    _check_loader(loader, f.name)
    if not f.training:
        if f.fitted_to is not None:
            fit_iterations(f.poptorch, loader, f.fitted_to, f.opts)
        _check_not_empty(loader, f.name)
    if f.instances > 1:
        with warnings.catch_warnings():  # (dropped samples...: said on instance 0 only)
            if f.opts.Distributed.processId != 0:
                warnings.simplefilter("ignore")
            return _plan(loader, f)
    return _plan(loader, f)


def _plan(loader: DataLoader, f: Factors) -> Plan:
    """The plan of ``loader`` with ``f``, measured and checked."""
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


def _training(source: Source, micro: int, f: Factors, size: int) -> Plan:
    """A fit's plan: whole host calls of ``source``'s order (or stream), this instance reading
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
    custom = _custom_name(source)
    shape = OneShape(
        f.name, source.unit, "drop" if source.stream else "refuse" if custom else "last", custom
    )
    return Plan(
        name=f.name,
        source=source,
        opts=f.opts,
        layout=Layout.of(f.opts, training=True),
        micro=micro,
        combined=combined,
        steps=steps,
        samples=source.samples,
        training=True,
        selection=Selection(
            share=input_groups(f.alone),  # (its replicas' micro-batches of an iteration)
            size=size,
            rank=f.opts.Distributed.processId if size > 1 else 0,
        ),
        per_step=per_step,
        shape=shape,
    )


def _custom_name(source: Source) -> str:
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
    if dropped > 0 and not _custom_name(source):
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


def _inference(source: Source, micro: int, f: Factors, size: int) -> Plan:
    """A validation's or predict's plan: every sample of ``source`` in its order, cut into host
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
    return Plan(
        name=f.name,
        source=source,
        opts=f.opts,
        layout=Layout.of(f.opts, training=False),
        micro=micro,
        combined=combined,
        steps=steps,
        samples=samples,
        training=False,
        selection=selection,
        per_step=source.per_call,
        shape=OneShape(f.name, source.unit, "keep", sampler=_custom_name(source)),
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


def no_host_call(plan: Plan, epoch: int) -> ValueError:
    """A stream that yielded less than one host call in an epoch."""
    return ValueError(
        f"{plan.name} yielded no complete host call in epoch {epoch}: one host call takes "
        f"{describe_factors(plan.opts, plan.micro, training=True)}. An "
        "IterableDataset must yield at least that many samples each time it is iterated (a "
        "generator can be iterated only once)."
    )


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


def num_updates(loader: DataLoader, opts: Options, epochs: int = 1) -> int:
    """Optimizer updates that ``fit(loader, epochs)`` runs from the first epoch, with the
    training options ``opts`` (``poptorch.Options``, an ``IPUConfig`` or None, as given to
    ``Loop``; a ``replicas=`` given to ``Loop`` instead must be set in them too).

    ``epochs`` x the steps of an epoch (its whole host calls: ``len(dataset) // (B * DI * GA
    * RF)`` for a map-style dataset; the micro-batches ``len(loader)`` counts, less a short
    last one, for an ``IterableDataset`` with a length) x DI: the ``total_steps`` of a
    scheduler stepped per update (``LRScheduler``'s default), such as ``OneCycleLR``.
    ``Loop.num_updates`` is this, a static method, so it can size the scheduler the ``Loop``
    takes. (``len(loader) * epochs`` counts micro-batches: GA * RF times too many.)
    """
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1. Received: epochs={epochs!r}.")
    pt = poptorch_module()
    opts = configured(resolve_options(pt, opts, None)[0])
    steps = training_steps(pt, loader, opts, "loader")
    if steps is None:
        raise ValueError(
            f"loader reads an {type(loader.dataset).__name__}, whose "
            "length is unknown, so neither is its number of updates. Count "
            "them as epochs x (samples per epoch // (B * DI * GA * RF)) x DI."
        )
    return epochs * steps * opts.device_iterations


def training_steps(
    poptorch: ModuleType, loader: DataLoader, opts: Options, name: str
) -> int | None:
    """The host calls of a training epoch of ``loader`` with ``opts`` (``build(...).steps``),
    measured with the same checks, reading nothing; None for a stream of unknown length."""
    return build(poptorch, loader, opts, training=True, name=name).steps
