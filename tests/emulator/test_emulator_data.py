"""poptorch.DataLoader / AsynchronousDataAccessor emulation: docs/poptorch-semantics.md §3, §8.10."""

from __future__ import annotations

import gc
import inspect
import logging
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler, TensorDataset

from ipuloop.emulator.data import AsynchronousDataAccessor, DataLoader
from ipuloop.emulator.enums import CommGroupType, DataLoaderMode
from ipuloop.emulator.errors import Error
from ipuloop.emulator.options import Options


def dataset(n=10):
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


def opts(di=1, rf=1, ga=1):
    o = Options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    return o


def firsts(batches):
    return [b[0].tolist() for b in batches]


def accessor_threads():
    return [t for t in threading.enumerate() if t.name == "poptorch.AsynchronousDataAccessor"]


class Counting(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).unsqueeze(1))

    def __len__(self):
        return self.n


# -- combined batch, len, drop_last -----------------------------------------------------------
def test_combined_batch_and_len():
    loader = DataLoader(opts(di=2, rf=2, ga=3), dataset(100), batch_size=2)
    assert loader.combinedBatchSize == 24 and len(loader) == 4
    batches = list(loader)
    assert len(batches) == 4 and all(len(x) == 24 for x, _ in batches)
    assert torch.equal(torch.cat([x for x, _ in batches]), torch.arange(96))


def test_input_replica_grouping_divides_the_replicas():
    o = opts(di=2, rf=4).inputReplicaGrouping(2, CommGroupType.Consecutive)
    assert DataLoader(o, dataset(100), batch_size=3).combinedBatchSize == 3 * 2 * (4 // 2)


def test_drop_last_defaults_to_true():
    assert inspect.signature(DataLoader.__init__).parameters["drop_last"].default is True
    loader = DataLoader(opts(di=4), dataset(10), batch_size=1)
    assert len(loader) == 2 and firsts(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_remainder_warning_without_drop_last(caplog):
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        loader = DataLoader(opts(di=4), dataset(10), drop_last=False)
    assert (
        "The number of elements in the dataset (10) is not divisible by the number of "
        "elements processed per step (4) and drop_last=False. The last tensor will have a "
        "batch size of 2"
    ) in caplog.text
    assert len(loader) == 3 and firsts(loader)[-1] == [8, 9]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        DataLoader(opts(di=5), dataset(10), drop_last=False)
    assert caplog.text == ""


def test_loader_freezes_options_and_keeps_them():
    o = opts(di=2)
    loader = DataLoader(o, dataset(), batch_size=1)
    assert loader.options is o
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        o.deviceIterations(3)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        loader.options.Training.gradientAccumulation(2)
    o.clone().deviceIterations(3)
    with pytest.raises(AssertionError):
        DataLoader({"device_iterations": 2}, dataset())


def test_batch_size_none_disables_combining_and_shuffle_none_is_false():
    loader = DataLoader(opts(di=4), dataset(5), batch_size=None)
    assert loader.combinedBatchSize is None and len(loader) == 5
    assert [int(x) for x, _ in loader] == [0, 1, 2, 3, 4]
    assert firsts(DataLoader(opts(di=2), dataset(6), shuffle=None)) == [[0, 1], [2, 3], [4, 5]]


def test_shuffle_uses_the_generator():
    def order(seed):
        g = torch.Generator().manual_seed(seed)
        return firsts(DataLoader(opts(di=2), dataset(20), shuffle=True, generator=g))

    assert order(1) == order(1) != order(2)
    assert sorted(sum(order(1), [])) == list(range(20))


# -- batch_sampler -------------------------------------------------------------------------------
def test_batch_sampler_rules_and_concatenation(caplog):
    sampler = BatchSampler(SequentialSampler(range(11)), batch_size=2, drop_last=False)  # 6 batches
    for bad in ({"batch_size": 2}, {"shuffle": True}):
        with pytest.raises(ValueError, match="mutually exclusive with batch_size, shuffle"):
            DataLoader(opts(di=4), dataset(11), batch_sampler=sampler, **bad)
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        loader = DataLoader(opts(di=4), dataset(11), batch_sampler=sampler)
    assert "not divisible" in caplog.text
    # len() is the sampler's (PopTorch's DataLoader.__len__: super().__len__()); iterating joins
    assert loader.combinedBatchSize == 8 and len(loader) == 6
    assert firsts(loader) == [list(range(8))]
    kept = DataLoader(opts(di=4), dataset(11), batch_sampler=sampler, drop_last=False)
    assert len(kept) == 6 and firsts(kept) == [list(range(8)), [8, 9, 10]]
    distributed = opts(di=4)
    distributed.Distributed.configureProcessId(0, 2)
    with pytest.raises(ValueError, match="auto_distributed_partitioning"):
        DataLoader(distributed, dataset(11), batch_sampler=sampler)


# -- multi-process partitioning ------------------------------------------------------------------
def process_opts(rank, seed=None):
    o = opts(di=2)
    o.Distributed.configureProcessId(rank, 2)
    return o if seed is None else o.randomSeed(seed)


def test_each_process_gets_a_contiguous_slice():
    per_rank = [sum(firsts(DataLoader(process_opts(r), dataset(10))), []) for r in (0, 1)]
    assert per_rank == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(AssertionError, match="randomSeed"):
        DataLoader(process_opts(0), dataset(10), shuffle=True)
    with pytest.raises(AssertionError, match="auto_distributed_partitioning not supported"):
        DataLoader(process_opts(0), Counting(10))


def test_distributed_shuffle_shares_a_permutation_and_rotates_leftovers():
    loaders = [DataLoader(process_opts(r, seed=5), dataset(10), shuffle=True) for r in (0, 1)]
    epochs = [[sum(firsts(loader), []) for loader in loaders] for _ in range(2)]
    for rank0, rank1 in epochs:
        assert len(rank0) == len(rank1) == 4 and not set(rank0) & set(rank1)
    used = set().union(*epochs[0], *epochs[1])
    assert len(used) > 8  # the 2 left-over elements of epoch 1 are used in epoch 2


# -- Async mode ------------------------------------------------------------------------------
def test_async_yields_the_same_batches_in_the_same_order_as_sync():
    def epochs(mode):
        g = torch.Generator().manual_seed(3)
        loader = DataLoader(
            opts(di=2, ga=2), dataset(50), batch_size=2, shuffle=True, generator=g, mode=mode
        )
        out = [[(x.clone(), y.clone()) for x, y in loader] for _ in range(3)]
        loader.terminate()
        return out, len(loader)

    (sync, sync_len), (asyn, async_len) = epochs(DataLoaderMode.Sync), epochs(DataLoaderMode.Async)
    assert sync_len == async_len == 6
    assert [len(e) for e in asyn] == [6, 6, 6]
    for sync_epoch, async_epoch in zip(sync, asyn):
        for (sx, sy), (ax, ay) in zip(sync_epoch, async_epoch):
            assert torch.equal(sx, ax) and torch.equal(sy, ay)
    assert not torch.equal(sync[0][0][0], sync[1][0][0])  # epochs really are reshuffled


def test_async_leaves_the_global_rng_alone_and_is_seeded_by_it():
    def epoch():
        loader = DataLoader(opts(di=2), dataset(20), shuffle=True, mode=DataLoaderMode.Async)
        state = torch.get_rng_state()
        batches = firsts(loader)
        assert torch.equal(torch.get_rng_state(), state)  # the thread drew from its own generator
        loader.terminate()
        return batches

    torch.manual_seed(11)
    first = epoch()
    torch.manual_seed(11)
    assert epoch() == first


def test_async_prefetches_in_the_background():
    loader = DataLoader(
        opts(),
        dataset(10),
        mode=DataLoaderMode.Async,
        async_options={"buffer_size": 4, "early_preload": True},
    )
    deadline = time.monotonic() + 5
    while len(loader._accessor._channel.buf) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(loader._accessor._channel.buf) == 4  # filled before anything was requested
    assert firsts(loader) == [[i] for i in range(10)]
    loader.terminate()


def test_async_early_break_does_not_hang_and_restarts_the_epoch():
    loader = DataLoader(opts(), dataset(30), mode=DataLoaderMode.Async)
    for i, (x, _) in enumerate(loader):
        if i == 2:
            break
    assert firsts(loader) == [[i] for i in range(30)]  # a fresh, complete epoch
    thread = loader._accessor._thread
    start = time.monotonic()
    loader.terminate()
    assert time.monotonic() - start < 2 and not thread.is_alive()
    with pytest.raises(Error, match="terminated"):
        iter(loader)


def test_async_stops_its_thread_when_garbage_collected():
    before = len(accessor_threads())
    loader = DataLoader(opts(), dataset(30), mode=DataLoaderMode.Async)
    next(iter(loader))
    thread = loader._accessor._thread
    assert len(accessor_threads()) == before + 1
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


class BrokenAt3(torch.utils.data.Dataset):
    """(At module level: the accessor's worker process gets the dataset pickled.)"""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 3:
            raise KeyError("bad sample 3")
        return torch.tensor([i])


def test_async_producer_exceptions_reach_the_consumer():
    loader = DataLoader(opts(), BrokenAt3(), mode=DataLoaderMode.Async)
    seen = []
    with pytest.raises(
        AssertionError, match="An error occurred in the data fetcher: KeyError: 'bad sample 3'"
    ) as info:
        for x in loader:
            seen.append(int(x))
    assert seen == [0, 1, 2] and isinstance(info.value.__cause__, KeyError)
    loader.terminate()


def test_async_without_load_indefinitely_runs_several_epochs():
    loader = DataLoader(
        opts(di=2),
        dataset(6),
        mode=DataLoaderMode.Async,
        async_options={"load_indefinitely": False},
    )
    assert [firsts(loader) for _ in range(3)] == [[[0, 1], [2, 3], [4, 5]]] * 3
    loader.terminate()


# -- rebatching --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "drop_last, expected",
    [(True, [[0, 1, 2, 3], [4, 5, 6, 7]]), (False, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]])],
)
def test_async_rebatched_lengths_and_content(drop_last, expected):
    loader = DataLoader(
        opts(di=4), dataset(10), mode=DataLoaderMode.AsyncRebatched, drop_last=drop_last
    )
    assert loader.batch_size == 4 and loader._accessor.rebatched_size == 4  # PopTorch's size
    assert len(loader) == len(expected) and firsts(loader) == expected
    assert firsts(loader) == expected  # and again in the next epoch
    loader.terminate()


def test_async_without_drop_last_is_rebatched_automatically():
    loader = DataLoader(opts(di=4), dataset(10), mode=DataLoaderMode.Async, drop_last=False)
    assert loader._accessor.rebatched_size == 4 and len(loader) == 3
    assert [len(x) for x, _ in loader] == [4, 4, 2]
    loader.terminate()


def test_rebatched_worker_size_and_iterable_datasets():
    with pytest.raises(AssertionError, match="rebatched_worker_size"):
        DataLoader(
            opts(di=4), dataset(10), mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=5
        )
    loader = DataLoader(
        opts(di=4),
        dataset(10),
        mode=DataLoaderMode.AsyncRebatched,
        rebatched_worker_size=3,
        drop_last=False,
    )
    assert loader.batch_size == 3 and firsts(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader.terminate()
    iterable = DataLoader(
        opts(di=4), Counting(10), mode=DataLoaderMode.AsyncRebatched, drop_last=False
    )
    assert len(iterable) == 3
    assert [x.flatten().tolist() for x in iterable] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    iterable.terminate()


class Dicts(torch.utils.data.Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"x": torch.tensor([i]), "name": f"s{i}"}


def test_dict_batches_are_rebatched():
    loader = DataLoader(opts(di=2), Dicts(), mode=DataLoaderMode.AsyncRebatched, drop_last=False)
    batches = list(loader)
    assert [b["x"].flatten().tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert [b["name"] for b in batches] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    loader.terminate()


# -- the accessor on its own -----------------------------------------------------------------
def test_accessor_asserts():
    async_loader = DataLoader(opts(), dataset(), mode=DataLoaderMode.Async)
    with pytest.raises(Error, match="already uses an AsynchronousDataAccessor"):
        AsynchronousDataAccessor(async_loader)
    async_loader.terminate()
    with pytest.raises(AssertionError, match="only works if 'rebatched_size' is specified"):
        AsynchronousDataAccessor(DataLoader(opts(di=2), dataset(), drop_last=False))
    with pytest.raises(AssertionError, match="greater than 1"):
        AsynchronousDataAccessor(dataset(), rebatched_size=1)
    with pytest.raises(AssertionError, match="rebatched_size in async_options"):
        DataLoader(
            opts(), dataset(), mode=DataLoaderMode.Async, async_options={"rebatched_size": 2}
        )


def test_accessor_over_torch_loader_and_rebatching():
    torch_loader = torch.utils.data.DataLoader(dataset(10), batch_size=3)
    accessor = AsynchronousDataAccessor(torch_loader)
    assert len(accessor) == 4 and firsts(accessor) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    accessor.terminate()
    rebatched = AsynchronousDataAccessor(torch_loader, rebatched_size=2)
    assert len(rebatched) == 5 and firsts(rebatched) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    rebatched.terminate()
    sync_loader = DataLoader(opts(di=2), dataset(6))
    wrapped = AsynchronousDataAccessor(sync_loader)
    assert len(wrapped) == 3 and firsts(wrapped) == firsts(sync_loader)
    del wrapped  # garbage collection terminates it
    sync_loader.terminate()  # no effect in Sync mode


def test_the_forkserver_preloads_torch_and_the_accessor_keeping_a_programs_own_list():
    """An Async loader's worker is forked by a forkserver that already imported torch and the
    accessor (benchmarks/async_start.py: a program's later loaders start in well under a
    second); a program's own preload list is kept, and a running forkserver is left alone."""
    code = (
        "import multiprocessing, multiprocessing.forkserver as fs, torch\n"
        "from torch.utils.data import TensorDataset\n"
        "from ipuloop import poptorch\n"
        "multiprocessing.set_forkserver_preload(['json'])\n"
        "data = TensorDataset(torch.arange(8.0).reshape(8, 1))\n"
        "for _ in range(2):\n"
        "    loader = poptorch.DataLoader(poptorch.Options(), data, batch_size=2,\n"
        "                                 mode=poptorch.DataLoaderMode.Async)\n"
        "    next(iter(loader)); loader.terminate()\n"
        "print(fs._forkserver._preload_modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "['json', 'torch', 'ipuloop.emulator.data']"
