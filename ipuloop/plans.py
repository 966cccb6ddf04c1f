"""Loaders as this process runs them: alone, or its share of a multi-process run's.

Also ``Loop.num_updates``, which counts a fit's optimizer updates from the same plan.
"""
from __future__ import annotations

from typing import Any

from . import distributed
from .backend import poptorch_module
from .data import Plan, build_plan, count_updates
from .options import layout, resolve_options

__all__ = ["build", "num_updates"]


def build(pt: Any, loader: Any, opts: Any, training: bool, name: str, pad: bool = False,
          partition: bool = True, async_options: dict[str, Any] | None = None) -> Plan:
    """``loader`` as this process runs it with ``opts``: alone (``data.build_plan``), or its
    share of several processes' (``distributed.build_plan``; ``partition=False``: every
    sample, as predict reads them); ``async_options``: a torch loader is read ahead
    (``Loop(async_data=...)``)."""
    if opts.Distributed.numProcesses > 1:
        return distributed.build_plan(pt, loader, opts, layout(opts, training),
                                      training=training, name=name, pad=pad, sequential=pad,
                                      partition=partition, async_options=async_options)
    return build_plan(pt, loader, opts, layout(opts, training), training=training, name=name,
                      pad=pad, sequential=pad, async_options=async_options)


def num_updates(loader: Any, opts: Any, epochs: int = 1) -> int:
    """Optimizer updates that ``fit(loader, epochs)`` runs from the first epoch, with the
    training options ``opts`` (``poptorch.Options``, an ``IPUConfig`` or None, as given to
    ``Loop``; a ``replicas=`` given to ``Loop`` instead must be set in them too).

    ``epochs`` x the steps of an epoch (``len(dataset) // (B * DI * GA * RF)``) x DI: the
    ``total_steps`` of a scheduler stepped per update (``LRScheduler``'s default), such
    as ``OneCycleLR``. A static method, so it can size the scheduler the ``Loop`` takes.
    (``len(loader) * epochs`` counts micro-batches: GA * RF times too many.)
    """
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1. Received: epochs={epochs!r}.")
    pt = poptorch_module()
    opts = distributed.configured(resolve_options(pt, opts, None)[0])
    return count_updates(build(pt, loader, opts, True, "loader"), opts, epochs)
