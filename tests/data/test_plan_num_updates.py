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
from ipuloop.random_state import Draw


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


def _trained(plan) -> int:
    """The host calls a training epoch of ``plan`` hands out (what a fit trains on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = sum(1 for _ in plan.epoch(0, 0, Draw()))
    plan.close()
    return calls


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("factors", FACTORS)
def test_steps_counted_are_the_host_calls_an_epoch_trains(kind, factors):
    """Every case of the grid (loader kind x factors x one or several processes): the count
    ``training_steps`` gives (``Loop.num_updates`` / DI) is the number of host calls an epoch
    of the plan hands out, or the error is raised before any is read; a length the loop
    cannot know (an unsized stream) is None."""
    n, b, di, ga, rf, group, drop_last = factors
    for processes in PROCESSES:
        opts = _opts(di, ga, rf, group, processes)
        if kind == "distributed-sampler" and processes is None:
            continue  # (a DistributedSampler needs a process count: the several-process case)
        counted, _ = _outcome(
            lambda: training_steps(poptorch, _loader(kind, n, b, drop_last, opts), opts, "loader")
        )
        if isinstance(counted, tuple):  # refused: so is the fit, before any step
            with pytest.raises(counted[0]):
                build(
                    poptorch,
                    _loader(kind, n, b, drop_last, opts),
                    opts,
                    training=True,
                    name="loader",
                )
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = build(
                poptorch, _loader(kind, n, b, drop_last, opts), opts, training=True, name="loader"
            )
        trained = _trained(plan)
        if kind == "stream-unsized":
            assert counted is None and trained >= 0, (kind, factors, processes)
        else:
            assert counted == trained, (kind, factors, processes)


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


class _Unreadable(TensorDataset):
    def __getitem__(self, i):
        raise AssertionError("num_updates read a sample")


def test_num_updates_reads_no_sample():
    ds = _Unreadable(torch.randn(40, 2), torch.zeros(40, dtype=torch.long))
    opts = poptorch.Options().deviceIterations(2)
    assert Loop.num_updates(DataLoader(ds, batch_size=4, shuffle=True), opts, 3) == 3 * 5 * 2


class _Sharded(IterableDataset):
    """An ``IterableDataset`` sharded by worker (torch's ``get_worker_info()`` idiom)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        return iter((torch.full((2,), float(i)), torch.tensor(i)) for i in ids)


def test_num_updates_of_a_stream_sharded_by_worker_is_what_the_fit_trains():
    """72 samples, B=4, DI=2, two workers each yielding every other sample: torch's loader
    yields 18 micro-batches (9 of each worker, in turn), 9 host calls of 2: 18 updates, the
    count ``num_updates`` gives and the fit runs, every sample once, in torch's order."""
    loader = DataLoader(_Sharded(72), batch_size=4, num_workers=2)
    opts = poptorch.Options().deviceIterations(2)
    assert Loop.num_updates(loader, opts) == 18
    model = torch.nn.Linear(2, 72)
    loop = Loop(model, opts, loss_fn=torch.nn.CrossEntropyLoss(), progress=False)
    loop.fit(loader, epochs=1)
    assert loop.state.update == 18 and loop.state.samples == 72
    plan = build(poptorch, loader, opts, training=True, name="loader")
    read = [int(i) for _, y in plan.epoch(0, 0, Draw()) for i in y]
    plan.close()
    torch_order = [int(i) for _, y in loader for i in y]
    assert read == torch_order and sorted(read) == list(range(72))
    assert torch_order[:8] == [0, 2, 4, 6, 1, 3, 5, 7]  # (worker 0's batch, then worker 1's)
