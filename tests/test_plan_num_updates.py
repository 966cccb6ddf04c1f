"""``Loop.num_updates`` counts a fit's updates from the loader's length and the factors,
building no loader, and equals what the loader the fit builds gives (``Plan.steps``)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from ipuloop import Loop, poptorch
from ipuloop.plan import build, training_steps


class _Stream(IterableDataset):
    def __init__(self, n: int, sized: bool) -> None:
        self.n = n
        self.sized = sized

    def __iter__(self):
        return iter(zip(torch.randn(self.n, 2), torch.zeros(self.n, dtype=torch.long)))

    def __len__(self):
        if not self.sized:
            raise TypeError("no length")
        return self.n


def _loader(kind: str, n: int, b: int, drop_last: bool, opts) -> DataLoader:
    ds = TensorDataset(torch.randn(n, 2), torch.zeros(n, dtype=torch.long))
    if kind == "shuffle":
        return DataLoader(ds, batch_size=b, shuffle=True, drop_last=drop_last)
    if kind == "sequential":
        return DataLoader(ds, batch_size=b, drop_last=drop_last)
    if kind == "fewer-samples":  # a sampler shorter than its dataset
        return DataLoader(ds, batch_size=b, sampler=RandomSampler(ds, num_samples=n - 3))
    if kind == "distributed-sampler":
        size = opts.Distributed.numProcesses
        rank = opts.Distributed.processId
        return DataLoader(ds, batch_size=b, sampler=DistributedSampler(ds, size, rank))
    if kind == "batch-sampler":
        return DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), b, True))
    if kind == "poptorch":
        return poptorch.DataLoader(opts, ds, batch_size=b, shuffle=True)
    if kind in ("stream", "stream-unsized"):
        return DataLoader(_Stream(n, kind == "stream"), batch_size=b)
    raise AssertionError(kind)


def _opts(di: int, ga: int, rf: int, group: int, processes: tuple[int, int] | None):
    opts = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    if group > 1:
        opts.inputReplicaGrouping(group, poptorch.enums.CommGroupType.Consecutive)
    if processes is not None:
        opts.Distributed.configureProcessId(*processes)
        opts.randomSeed(0)  # (a poptorch.DataLoader shuffled across processes needs one)
    return opts


KINDS = [
    "shuffle",
    "sequential",
    "fewer-samples",
    "distributed-sampler",
    "batch-sampler",
    "poptorch",
    "stream",
    "stream-unsized",
]
FACTORS = [  # (n, b, di, ga, rf, input group, drop_last)
    (64, 2, 1, 1, 1, 1, True),
    (37, 2, 2, 3, 1, 1, False),
    (100, 1, 3, 2, 2, 1, True),
    (90, 4, 1, 1, 4, 2, False),
    (50, 5, 2, 1, 1, 1, True),
    (12, 4, 2, 1, 1, 1, True),  # one host call alone, too few samples for two processes
]
PROCESSES = [None, (0, 2), (1, 2), (2, 3)]


def _outcome(count):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            result = count()
        except (ValueError, TypeError) as e:
            result = (type(e), str(e))
    return result, sorted(str(w.message) for w in seen)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("factors", FACTORS)
def test_steps_counted_equal_the_built_loader_s(kind, factors):
    """Every case of the grid (loader kind x factors x one or several processes): the count,
    or the error and the warnings, of ``training_steps`` equal those of the built plan."""
    n, b, di, ga, rf, group, drop_last = factors
    for processes in PROCESSES:
        opts = _opts(di, ga, rf, group, processes)
        if kind == "distributed-sampler" and processes is None:
            continue  # (a DistributedSampler needs a process count: the several-process case)
        counted = _outcome(
            lambda: training_steps(poptorch, _loader(kind, n, b, drop_last, opts), opts, "loader")
        )
        built = _outcome(
            lambda: (
                build(
                    poptorch,
                    _loader(kind, n, b, drop_last, opts),
                    opts,
                    training=True,
                    name="loader",
                ).steps
            )
        )
        assert counted == built, (kind, factors, processes)


def test_the_grid_has_counts_and_errors():  # the grid above reaches both outcomes
    outcomes = set()
    for kind, factors in itertools.product(["shuffle", "batch-sampler"], FACTORS):
        n, b, di, ga, rf, group, drop_last = factors
        opts = _opts(di, ga, rf, group, (0, 2))
        counted, _ = _outcome(
            lambda: training_steps(poptorch, _loader(kind, n, b, drop_last, opts), opts, "loader")
        )
        outcomes.add(type(counted))
    assert outcomes == {int, tuple}


def test_num_updates_builds_no_loader(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("num_updates built a loader")

    monkeypatch.setattr(poptorch.DataLoader, "__init__", refuse)
    ds = TensorDataset(torch.randn(40, 2), torch.zeros(40, dtype=torch.long))
    opts = poptorch.Options().deviceIterations(2)
    assert Loop.num_updates(DataLoader(ds, batch_size=4, shuffle=True), opts, 3) == 3 * 5 * 2


@pytest.mark.parametrize("kind", ["shuffle", "batch-sampler"])
def test_a_several_process_plan_builds_one_loader(monkeypatch, kind):
    """The whole run's order is measured, not built: an instance's plan builds one
    ``poptorch.DataLoader``, its own, and counts the steps ``training_steps`` counts."""
    built = []
    init = poptorch.DataLoader.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    opts = _opts(1, 1, 2, 1, (1, 2))
    steps = training_steps(poptorch, _loader(kind, 32, 4, True, opts), opts, "loader")
    assert built == []
    monkeypatch.setattr(poptorch.DataLoader, "__init__", counted)
    plan = build(poptorch, _loader(kind, 32, 4, True, opts), opts, training=True, name="loader")
    assert built == [plan.loader] and plan.steps == steps == 2
