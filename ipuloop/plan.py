"""A loader as this process runs it (``Plan``): built once per call, it hands out host calls.

``build`` has the loader checked and measured (``measure.py``: its factors, this instance's
share of its batches) and reads it as torch reads it (``sources.py``): the micro-batches its
own iterator yields, in its own order, joined into host calls (``host_calls.py``). A stream
(``IterableDataset``) and a ``poptorch.DataLoader`` are read by each instance on its own.
``num_updates`` counts a fit's updates from the same measure, reading nothing.

``Plan.epoch`` draws an epoch's order from the random state as it is, and hands out the
epoch's host calls after the steps already run: a map-style order skips the batches of those
steps without reading them, a stream reads them again. A training epoch's draw (``Draw``)
records that random state (``Plan.drawn_from``: a checkpoint reads it there), or draws from a
resumed epoch's saved one (``random_state.Draw``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Iterator, Tuple

import torch
from torch.utils.data import DataLoader

from .backend import poptorch_module
from .host_calls import OneShape, cut, joined
from .loop_options import inference_options, resolve_options
from .measure import Factors, custom_name, measure
from .outputs import Layout, map_tensors
from .poptorch_types import Options
from .processes import configured
from .random_state import Draw, rng_state, set_rng_state
from .read_ahead import Ahead, buffer_size
from .rules import check_int, describe_factors
from .sources import Selection, Source, kept_random_state, kill_workers

__all__ = [
    "Plan",
    "build",
    "build_inference",
    "Plans",
    "no_host_call_error",
    "num_updates",
    "training_steps",
    "ValPlans",
    "val_steps",
]

PROBED = 4  # micro-batches the host check reads before compiling, each with the first's shapes


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
        if source.stream or not n or custom_name(source):  # (a custom one's indices: its own)
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

    def close(self) -> None:
        """Stop the read-ahead thread and the loader workers of the epoch last started."""
        reader, self.reading.reader = self.reading.reader, None
        if isinstance(reader, Ahead):
            reader.terminate()
        self.source.close()
        if isinstance(reader, Ahead):
            reader.join()

    def kill_workers(self) -> None:
        """A second Ctrl-C: the process exits at once, and its loader workers go first."""
        kill_workers(self.source.live)
        kill_workers(self.reading.reader)
        if isinstance(self.reading.reader, Ahead):
            self.reading.reader.join(2.0)

    def read_remainder(self, batches: Iterator[Any], epoch_step: int, *, preempted: bool) -> None:
        """A fit stopped (``max_steps``, ``stop()``) after its epoch's last step still reads the
        epoch's remainder, as the epoch read to its end does: the random state a dataset draws
        from moves as in one uninterrupted fit. (A SIGTERM, ``preempted``, leaves it to the
        resumed fit.)"""
        if self.source.stream or preempted or self.steps is None or epoch_step < self.steps:
            return
        for _ in batches:  # (an incomplete host call: dropped)
            pass
        self.reading.ended = True

    def warn_length(self, held: int, warned: set[str]) -> None:
        """A stream whose epoch held ``held`` host calls, another number than its length
        promised (``Loop.num_updates`` counts those); once per loader name in ``warned``."""
        if self.name in warned:
            return
        warned.add(self.name)
        warnings.warn(
            f"{self.name}: its epoch held {held} host call(s), but the length "
            f"of its {type(self.source.dataset).__name__} promised {self.steps} "
            f"(len(dataset) // micro-batch size, {self.source.full} micro-batches, over "
            f"{self.source.per_call} a host call), so Loop.num_updates counted other updates "
            "than the fit runs. Loader workers that each yield the whole stream, or end their "
            "shares with short batches, do this: shard the stream by worker "
            "(torch.utils.data.get_worker_info()) and pass drop_last=True, or give __len__ "
            "what the loader yields.",
            stacklevel=5,
        )


# The validation sets of a fit or a validate(): (log suffix, plan) each; one loader: ("", plan)
ValPlans = Tuple[Tuple[str, Plan], ...]  # (typing's: a runtime alias on Python 3.8)


def val_steps(val_plans: ValPlans) -> int | tuple[int | None, ...] | None:
    """The validation host calls the instances compare: one set's, or each set's."""
    steps = tuple(p.steps for _, p in val_plans)
    return steps[0] if len(steps) == 1 and not val_plans[0][0] else steps


def _built(loader: DataLoader, f: Factors) -> Plan:
    m = measure(loader, f)
    return Plan(
        name=f.name,
        source=m.source,
        opts=f.opts,
        layout=Layout.of(f.opts, training=f.training),
        micro=m.micro,
        combined=m.combined,
        steps=m.steps,
        samples=m.samples,
        training=f.training,
        selection=m.selection,
        per_step=m.per_step,
        shape=m.shape,
        calls=m.calls,
    )


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


@dataclass(frozen=True)
class Plans:
    """The plans of one loop's calls, each built from its loader with the loop's options: a
    fit's (``train``), a validation's or predict's (``inference``)."""

    poptorch: ModuleType
    train_opts: Options  # the training options (frozen when the first fit starts)
    inference_opts: Options | None  # the inference_opts given, or None: derived per loader
    async_options: dict[str, Any] | None  # torch loaders read ahead (``Loop(async_data=...)``)

    def train(self, loader: DataLoader) -> Plan:
        return build(
            self.poptorch,
            loader,
            self.train_opts,
            training=True,
            name="train_loader",
            async_options=self.async_options,
        )

    def inference(self, loader: DataLoader, name: str, *, partition: bool = True) -> Plan:
        return build_inference(
            self.poptorch,
            loader,
            self.train_opts,
            self.inference_opts,
            name,
            partition=partition,
            async_options=self.async_options,
        )


def no_host_call_error(plan: Plan, epoch: int) -> ValueError:
    """A stream that yielded less than one host call in an epoch."""
    return ValueError(
        f"{plan.name} yielded no complete host call in epoch {epoch}: one host call takes "
        f"{describe_factors(plan.opts, plan.micro, training=True)}. An "
        "IterableDataset must yield at least that many samples each time it is iterated (a "
        "generator can be iterated only once)."
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
    check_int("epochs", epochs)
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
