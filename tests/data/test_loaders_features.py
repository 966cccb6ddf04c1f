"""Data features: torch loaders read ahead (``Loop(async_data=...)``), and a custom batch
sampler with replicas (alone and shared out between processes)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading

import pytest
import torch
import torch.nn as nn
from launch import clean_env, command
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler, TensorDataset
import warm

from ipuloop import Callback, Loop, poptorch
from ipuloop.plan import build as build_plan

IN, OUT = 6, 3
READ_AHEAD = "ipuloop-read-ahead"  # the thread that reads host calls ahead


def options(di: int = 1, rf: int = 1, ga: int = 1) -> poptorch.Options:
    o = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    return o


def dataset(n: int, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def network(dropout: float = 0.3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, OUT))


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def readers_alive() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name == READ_AHEAD and t.is_alive()}


class Reads(Callback):
    """Each training step: the running epoch's iterator (the last of ``epochs``, the
    ``epoch_readers`` fixture) and whether a prefetching thread runs."""

    def __init__(self, epochs: list) -> None:
        self.epochs = epochs
        self.seen: list = []

    def on_train_step_end(self, loop) -> None:
        self.seen.append((self.epochs[-1], bool(readers_alive())))


def train(
    make_loader,
    *,
    async_data=False,
    opts=None,
    epochs=2,
    max_steps=None,
    sd=None,
    callbacks=(),
    seed=5,
):
    opts = options(di=2) if opts is None else opts
    net = network()
    loop = Loop(
        net,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        seed=seed,
        callbacks=list(callbacks),
        async_data=async_data,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
    )
    loader = make_loader()
    if sd is not None:
        loop.load_state_dict(sd)
    loop.fit(loader, epochs=epochs, max_steps=max_steps)
    return loop, weights(net)


def shuffled(n: int = 48, workers: int = 0, ds: Dataset | None = None):
    return lambda: DataLoader(
        dataset(n) if ds is None else ds, batch_size=3, shuffle=True, num_workers=workers
    )


# -- 5. torch loaders read ahead ---------------------------------------------------------------
@pytest.mark.slow  # (several fits, each starting its loader worker processes)
def test_async_data_reads_the_same_batches_and_resumes_exactly(epoch_readers):
    _, sync = train(shuffled())
    reads = Reads(epoch_readers)
    loop, ahead = train(shuffled(), async_data={"buffer_size": 5}, callbacks=[reads])
    assert_equal(sync, ahead)  # the same samples in the same order, the same dropout masks
    assert reads.seen and any(alive for _, alive in reads.seen)  # read ahead, in a thread
    aheads = {id(it.calls): it.calls for it, _ in reads.seen}
    assert len(aheads) == 2  # one per epoch, started once its order is drawn
    for ahead in aheads.values():
        assert ahead.waiting.maxsize == 5  # buffer_size host calls at most
        assert ahead.stopped.is_set() and not ahead.thread.is_alive()  # ended with its epoch
    assert loop.state.steps_per_epoch == 8 and loop.state.samples == 96
    cut, _ = train(shuffled(), async_data=True, max_steps=11)  # mid-epoch 2 (8 steps each)
    _, resumed = train(shuffled(), async_data=True, sd=cut.state_dict(), seed=9)
    assert_equal(sync, resumed)


class Noisy(Dataset):
    """Samples with noise drawn from the global torch generator as they are read."""

    def __init__(self, n: int = 24) -> None:
        self.base = dataset(n)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x + 0.1 * torch.randn(IN), y


def test_async_data_gives_loader_workers_the_seeds_of_a_synchronous_read():
    """With workers the noise comes from each worker's generator, seeded from the loop's random
    state: reading ahead seeds them as reading synchronously does."""
    _, sync = train(shuffled(ds=Noisy(), workers=1), epochs=1)
    _, ahead = train(shuffled(ds=Noisy(), workers=1), async_data=True, epochs=1)
    assert_equal(sync, ahead)


def test_what_cannot_be_pickled_is_read_ahead(epoch_readers):
    """The read-ahead thread reads in the loop's process: a dataset class defined in a function
    and a lambda collate function (neither pickles) are read ahead, as synchronously."""

    class Squares(Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            return torch.full((IN,), float(i) / 48), torch.tensor(i % OUT)

    def collate(samples):
        return torch.utils.data.default_collate(samples)

    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(Squares())
    kw = {"batch_size": 3, "shuffle": True, "collate_fn": lambda b: collate(b)}
    _, ahead = train(lambda: DataLoader(Squares(), **kw), async_data=True, epochs=1)
    assert type(epoch_readers[0].calls).__name__ == "Ahead"
    _, sync = train(lambda: DataLoader(Squares(), **kw), epochs=1)
    assert_equal(sync, ahead)


def test_a_dataset_drawing_random_numbers_is_not_read_ahead_without_workers():
    loop = Loop(
        network(), options(di=2), loss_fn=nn.CrossEntropyLoss(), progress=False, async_data=True
    )
    with pytest.raises(ValueError, match="draws random numbers.*num_workers >= 1"):
        loop.fit(shuffled(ds=Noisy())())
    assert loop.train_model is None  # refused before anything compiled
    user_async = poptorch.DataLoader(
        options(di=2), Noisy(), batch_size=3, mode=poptorch.DataLoaderMode.Async
    )
    sync_loop = Loop(network(), options(di=2), loss_fn=nn.CrossEntropyLoss(), progress=False)
    with pytest.raises(ValueError, match="DataLoaderMode.Async.*draws random numbers"):
        sync_loop.fit(user_async)  # the user's own Async mode: the same rule
    user_async.terminate()
    sync_loop.fit(shuffled(ds=Noisy())())  # read synchronously: in the loop's order, exact


def test_async_data_settings_are_checked_and_a_poptorch_loader_keeps_its_mode(epoch_readers):
    with pytest.raises(ValueError, match=r"\['load_indefinitely'\]"):
        Loop(network(), async_data={"load_indefinitely": True})
    with pytest.raises(TypeError, match="async_data must be a bool or a dict"):
        Loop(network(), async_data="yes")
    reads = Reads(epoch_readers)
    sync_loader = poptorch.DataLoader(options(di=2), dataset(24), batch_size=3)
    loop = Loop(
        network(),
        options(di=2),
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        async_data=True,
        callbacks=[reads],
    )
    loop.fit(sync_loader)
    assert reads.seen and not any(alive for _, alive in reads.seen)  # Sync: its own mode


class Exit(Callback):
    """Leaves the fit at step 2, or in the second validation step, one way or another."""

    def __init__(self, how: str) -> None:
        self.how = how

    def _leave(self, loop) -> None:
        if self.how.startswith("second_ctrl_c"):
            self.second_ctrl_c[-1]()  # what it runs before the process exits
            assert not readers_alive() - self.before
            raise RuntimeError("exited")
        if self.how in ("exception", "validation"):
            raise RuntimeError("exited")
        if self.how == "ctrl_c":
            raise KeyboardInterrupt
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if self.how == "stop":
            loop.stop()

    def on_train_step_end(self, loop) -> None:
        if loop.state.step == 2 and not self.how.endswith("validation"):
            self._leave(loop)

    def on_validation_step_end(self, loop) -> None:
        self.val_steps += 1
        if self.val_steps == 2 and self.how.endswith("validation"):
            self._leave(loop)

    def on_fit_start(self, loop) -> None:
        self.val_steps = 0


@pytest.mark.parametrize(
    "how",
    [
        "end",
        "stop",
        "exception",
        "ctrl_c",
        "sigterm",
        pytest.param("validation", marks=pytest.mark.slow),  # (the quick suite: the others)
        "second_ctrl_c",
        pytest.param("second_ctrl_c_in_validation", marks=pytest.mark.slow),
    ],
)
def test_the_read_ahead_thread_stops_on_every_exit_path(how, second_ctrl_c):
    before = readers_alive()
    exit_ = Exit(how)
    exit_.before = before
    exit_.second_ctrl_c = second_ctrl_c
    net = network()
    loop = Loop(
        net,
        options(di=2),
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        async_data={"buffer_size": 1},
        callbacks=[exit_],
    )
    val = DataLoader(dataset(60), batch_size=3)  # 10 validation calls
    raises = {
        "exception": RuntimeError,
        "validation": RuntimeError,
        "ctrl_c": KeyboardInterrupt,
        "second_ctrl_c": RuntimeError,
        "second_ctrl_c_in_validation": RuntimeError,
        "sigterm": SystemExit,
    }
    if how in raises:
        with pytest.raises(raises[how]):
            loop.fit(shuffled(n=96)(), epochs=2, val_loader=val)
    else:
        loop.fit(shuffled(n=96)(), epochs=2, val_loader=val)
    assert not readers_alive() - before


def test_async_data_validates_and_predicts_as_synchronous_reading():
    seen = []

    class Threads(Callback):
        def on_validation_step_end(self, loop) -> None:
            seen.append(bool(readers_alive()))

    before = readers_alive()
    ds = dataset(41)  # the last host call is padded
    sync = Loop(network(), options(di=2), loss_fn=nn.CrossEntropyLoss(), progress=False)
    ahead = Loop(
        network(),
        options(di=2),
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        async_data=True,
        callbacks=[Threads()],
    )
    loader = DataLoader(ds, batch_size=3)
    assert ahead.validate(loader) == sync.validate(loader)
    assert len(seen) == 7 and seen[0]  # (read ahead: the thread may end before the steps)
    torch.testing.assert_close(ahead.predict(loader), sync.predict(loader), rtol=0, atol=0)
    assert not readers_alive() - before


# -- 8. a custom batch sampler with replicas ---------------------------------------------------
class Recorded(TensorDataset):
    """``dataset(n)`` logging each index read."""

    def __init__(self, n: int) -> None:
        super().__init__(*dataset(n).tensors)
        self.log: list[int] = []

    def __getitem__(self, i):
        self.log.append(int(i))
        return super().__getitem__(i)


class Shuffled:
    """A custom batch sampler: batches of ``batch_size`` in a shuffled order of its own."""

    def __init__(self, n: int, batch_size: int, seed: int = 4) -> None:
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator).tolist()
        return iter(
            [
                order[i : i + self.batch_size]
                for i in range(0, self.n - self.batch_size + 1, self.batch_size)
            ]
        )

    def __len__(self) -> int:
        return self.n // self.batch_size


def test_a_batch_sampler_gives_each_micro_batch_of_each_replica_its_own_batch():
    """RF 2, DI 2, GA 2: each host call is 8 of the sampler's batches laid out [DI, GA, RF];
    each update averages the gradients of its GA x RF batches: a plain torch loop doing that
    with the sampler's batches in order gives the same weights."""
    ds, b, (di, ga, rf) = dataset(60), 3, (2, 2, 2)
    net = network(dropout=0.0)
    loop = Loop(
        net,
        options(di, rf, ga),
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
    )
    loop.fit(DataLoader(ds, batch_sampler=Shuffled(60, b)), epochs=2)
    assert loop.state.steps_per_epoch == 2  # 20 batches: 2 host calls of 8, 4 left over
    assert loop.state.samples == 2 * 2 * b * di * ga * rf and loop.state.update == 8

    ref = network(dropout=0.0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sampler = Shuffled(60, b)
    for _ in range(2):
        batches = list(sampler)
        for call in range(2):
            group = batches[call * 8 : (call + 1) * 8]
            for d in range(di):
                opt.zero_grad()
                for a in range(ga):
                    for r in range(rf):
                        x, y = ds[group[(d * ga + a) * rf + r]]
                        (nn.functional.cross_entropy(ref(x), y) / (ga * rf)).backward()
                opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("async_data", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_batch_sampler_with_replicas_resumes_exactly_without_reading_samples_again(async_data):
    def run(max_steps=None, sd=None):
        ds = Recorded(72)  # 24 batches of 3: 6 host calls of DI 2 x RF 2 batches an epoch
        loader = lambda: DataLoader(ds, batch_sampler=Shuffled(72, 3))  # noqa: E731
        loop, w = train(
            loader, opts=options(di=2, rf=2), max_steps=max_steps, sd=sd, async_data=async_data
        )
        return loop, w, ds.log

    _, full, full_log = run()
    cut, _, cut_log = run(max_steps=8)  # epoch 2, after its second host call
    _, resumed, resumed_log = run(sd=cut.state_dict())
    assert cut.state.epoch == 1 and cut.state.epoch_step == 2
    assert_equal(full, resumed)
    if not async_data:  # (reading ahead reads batches that a stopped fit does not use)
        assert cut_log + resumed_log == full_log  # nothing read twice, nothing skipped


class Buckets:
    """Batches of ``sizes[k]`` consecutive samples (declaring ``batch_size``)."""

    def __init__(self, sizes: list[int], batch_size: int = 4) -> None:
        self.sizes, self.batch_size = sizes, batch_size

    def __iter__(self):
        start = 0
        for s in self.sizes:
            yield list(range(start, start + s))
            start += s

    def __len__(self) -> int:
        return len(self.sizes)


def pad_to_longest(samples):
    """Sequences of length 2 + (index % 3) padded to the longest of the batch."""
    length = max(len(x) for x, _ in samples)
    x = torch.stack([nn.functional.pad(x, (0, length - len(x))) for x, _ in samples])
    return x, torch.stack([y for _, y in samples])


class Sequences(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return torch.ones(2 + i // 12), torch.tensor(i % 2)


class MeanModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 2)

    def forward(self, x):
        return self.linear(x.mean(dim=1, keepdim=True))


@pytest.mark.parametrize(
    "kind,async_data,where",
    [
        ("rows", False, "batch 4 of this epoch has shapes [[3, 6], [3]]"),
        ("rows", True, "batch 4 of this epoch has shapes [[3, 6], [3]]"),  # (read ahead)
        ("length", False, "batch 3 of this epoch has shapes [[4, 3], [4]]"),
    ],
)
def test_batches_of_different_shapes_are_refused_at_the_first_that_differs(kind, async_data, where):
    steps = []

    class Steps(Callback):
        def on_train_step_end(self, loop) -> None:
            steps.append(loop.state.step)

    if kind == "rows":  # a bucketing sampler of variable batch sizes
        model, loader = network(), DataLoader(dataset(40), batch_sampler=Buckets([4] * 4 + [3, 4]))
    else:  # a fixed number of samples, sequences padded to each batch's longest
        model = MeanModel()
        loader = DataLoader(Sequences(), batch_sampler=Buckets([4] * 6), collate_fn=pad_to_longest)
    loop = Loop(
        model,
        options(rf=2),
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        async_data=async_data,
        callbacks=[Steps()],
    )
    with pytest.raises(ValueError, match="different shapes") as e:
        loop.fit(loader)
    assert where in str(e.value) and "collate_fn" in str(e.value)
    assert steps == ([1, 2] if kind == "rows" else [1])  # the calls before it ran


def test_a_short_last_batch_that_a_host_call_would_read_is_refused_before_any_step():
    loader = DataLoader(
        dataset(30), batch_sampler=BatchSampler(SequentialSampler(range(30)), 4, drop_last=False)
    )
    loop = Loop(network(), options(rf=2), loss_fn=nn.CrossEntropyLoss(), progress=False)
    with pytest.raises(ValueError, match="last batch holds 2 samples, not 4.*drop_last=True"):
        loop.fit(loader)  # 8 batches: whole host calls of 2, the last one read
    assert loop.train_model is None
    odd = DataLoader(
        dataset(26), batch_sampler=BatchSampler(SequentialSampler(range(26)), 4, drop_last=False)
    )
    loop.fit(odd)  # 7 batches: the short one is in the dropped incomplete host call
    assert loop.state.step == 3


def test_each_instance_reads_the_batches_its_replicas_read_in_one_process():
    """2 instances x 2 replicas, DI 2, GA 2: of each host call of one process with 4 replicas
    ([DI, GA, 4, B]), instance p reads [:, :, 2p:2p+2]; resuming skips into the same order."""
    ds, b, di, ga = dataset(100), 2, 2, 2

    def host_calls(opts, skip=0):
        plan = build_plan(
            poptorch,
            DataLoader(ds, batch_sampler=Shuffled(100, b)),
            opts,
            training=True,
            name="train_loader",
        )
        return plan, [x for x, _ in plan.epoch(skip)]

    whole, calls = host_calls(options(di, 4, ga))
    assert whole.steps == 3 and len(calls) == 3  # 50 batches: 3 calls of 16
    for p in range(2):
        o = options(di, 2, ga)
        o.Distributed.configureProcessId(p, 2)
        mine, own = host_calls(o)
        assert mine.steps == 3 and mine.combined == b * di * ga * 2
        for g, m in zip(calls, own):
            expected = g.view(di, ga, 4, b, IN)[:, :, 2 * p : 2 * p + 2].reshape(-1, IN)
            assert torch.equal(m, expected)
        _, tail = host_calls(o, skip=1)
        assert len(tail) == 2 and all(torch.equal(x, y) for x, y in zip(tail, own[1:]))


SCRIPT = r"""
import json, os, sys
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from ipuloop import Loop, poptorch



class Shuffled:
    def __init__(self, n, batch_size):
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(4)

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator).tolist()
        return iter([order[i:i + self.batch_size]
                     for i in range(0, self.n - self.batch_size + 1, self.batch_size)])

    def __len__(self):
        return self.n // self.batch_size


# (guarded: the accessor's worker process, started by forkserver, imports this file again)
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(90, 5, generator=g), torch.randint(0, 2, (90,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    loop = Loop(model, poptorch.Options().deviceIterations(2), loss_fn=nn.CrossEntropyLoss(),
                replicas=cfg["replicas"], seed=1, progress=False, async_data=cfg["async_data"],
                optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loop.fit(DataLoader(TensorDataset(x, y), batch_sampler=Shuffled(90, 3)), epochs=2)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"weights": model.state_dict(), "counters": loop.state.counters()},
                   os.path.join(cfg["out"], "result.pt"))
"""


@pytest.mark.slow
def test_two_processes_share_out_a_batch_sampler_as_one_process_with_twice_the_replicas(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = clean_env(IPULOOP_DIST_TIMEOUT="30", PYTHONWARNINGS="ignore")
    results = {}
    for name, procs, cfg in (
        ("one", 1, {"replicas": 2, "async_data": False}),
        ("two", 2, {"replicas": 1, "async_data": True}),
    ):
        out = tmp_path / name
        out.mkdir()
        arg = json.dumps(dict(cfg, out=str(out)))
        proc = warm.run(
            command(script, arg, processes=procs),
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        results[name] = torch.load(out / "result.pt")
    one, two = results["one"], results["two"]
    assert one["counters"] == two["counters"]  # 30 batches: 7 host calls of 4 an epoch
    assert one["counters"]["step"] == 14 and one["counters"]["samples"] == 14 * 12
    for k, v in one["weights"].items():  # the same batches per update; sums in another order
        torch.testing.assert_close(two["weights"][k], v, rtol=0, atol=1e-6)
