"""Less-travelled data paths: streams in validation and predict, a poptorch.DataLoader's mode."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from torch_versions import newer_torch
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ipuloop import Callback, Loop, NonFiniteLossError, poptorch
from ipuloop.callbacks import EarlyStopping, LRScheduler, ModelCheckpoint

IN, OUT = 6, 3


def options(di: int = 1, rf: int = 1, ga: int = 1) -> poptorch.Options:
    o = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    return o


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Linear(8, OUT))


class Rows(IterableDataset):
    """The rows of ``x`` and ``y`` as a stream, each worker taking every k-th sample."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, len(self.x), step):
            yield (self.x[i],) if self.y is None else (self.x[i], self.y[i])


def stream_data(n: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g)


def in_loader_order(loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``loader`` yields, joined: the order a user lines outputs up with."""
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


# -- validation over a stream counts every sample -------------------------------------------------
@pytest.mark.parametrize("di,rf,workers", [(1, 1, 0), (2, 2, 0), (1, 1, 2), (2, 1, 2)])
def test_validation_over_a_stream_counts_every_sample(di, rf, workers):
    # 66 samples, micro-batches of 8: host calls of 8 * DI * RF; the last one is padded
    x, y = stream_data(66)
    net = classifier()
    loop = Loop(
        copy.deepcopy(net),
        options(di, rf),
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
    )
    loader = DataLoader(Rows(x, y), batch_size=8, num_workers=workers)
    logs = loop.validate(loader)
    with torch.no_grad():
        out = net(x)
    assert logs["val_loss"] == pytest.approx(float(nn.functional.cross_entropy(out, y)), rel=1e-6)
    acc = torchmetrics.functional.accuracy(out, y, "multiclass", num_classes=OUT)
    assert logs["val_acc"] == pytest.approx(float(acc), abs=1e-7)


def test_validation_over_a_stream_with_a_model_with_loss_leaves_out_only_the_padded_part():
    # Without loss_fn the samples sharing a micro-batch with padding have no loss of their
    # own: 66 = 8 whole micro-batches and 2 samples; the metrics still see all 66.
    class WithLossNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = classifier()

        def forward(self, x, labels=None):
            out = self.net(x)
            return out if labels is None else (out, nn.functional.cross_entropy(out, labels))

    x, y = stream_data(66)
    net = WithLossNet()
    loop = Loop(
        copy.deepcopy(net),
        options(),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
    )
    with pytest.warns(UserWarning, match="covers 64 of the 66"):
        logs = loop.validate(DataLoader(Rows(x, y), batch_size=8))
    with torch.no_grad():
        out = net(x)
    assert logs["val_loss"] == pytest.approx(
        float(nn.functional.cross_entropy(out[:64], y[:64])), rel=1e-6
    )
    acc = torchmetrics.functional.accuracy(out, y, "multiclass", num_classes=OUT)
    assert logs["val_acc"] == pytest.approx(float(acc), abs=1e-7)


def test_fit_validates_a_stream_whole_each_epoch():
    x, y = stream_data(66)
    net = classifier()
    loop = Loop(
        net,
        options(2),
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
    )
    history = loop.fit(
        DataLoader(TensorDataset(*stream_data(32, 5)), batch_size=4),
        epochs=2,
        val_loader=DataLoader(Rows(x, y), batch_size=8, num_workers=2),
    )
    with torch.no_grad():  # the weights after the last epoch are the ones it validated
        expected = float(nn.functional.cross_entropy(net(x), y))
    assert history[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)


# -- predict over a stream keeps its loader's order -----------------------------------------------
@pytest.mark.parametrize(
    "kind,batch,di,rf",
    [("torch", 2, 2, 2), ("torch", 5, 2, 1), ("torch", 8, 3, 1), ("poptorch", 4, 2, 1)],
)
def test_predict_over_a_stream_with_workers_keeps_the_loaders_order(kind, batch, di, rf):
    x, y = stream_data(53)
    net = classifier()
    opts = options(di, rf)
    loop = Loop(copy.deepcopy(net), opts, loss_fn=nn.CrossEntropyLoss(), progress=False)
    if kind == "torch":
        loader = DataLoader(Rows(x, y), batch_size=batch, num_workers=2)
    else:  # its workers each read whole host calls (B * DI * RF samples): that is its order
        loader = poptorch.DataLoader(
            opts,
            Rows(x, y),
            batch_size=batch,
            num_workers=2,
            drop_last=False,
            worker_init_fn=lambda _: None,
        )
    xs, _ = in_loader_order(DataLoader(Rows(x, y), batch_size=loader.batch_size, num_workers=2))
    assert not torch.equal(xs, x)  # the workers interleave: not the dataset's order
    out = loop.predict(loader)
    with torch.no_grad():
        torch.testing.assert_close(out, net(xs))  # row i is the loader's i-th sample


# -- a poptorch.DataLoader's Async mode is kept ---------------------------------------------------
def regression_data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, 1, generator=g))


def regressor() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(IN, 4), nn.Dropout(0.3), nn.Linear(4, 1))


class Readers(Callback):
    """The loader each training step was read from: the running epoch's iterator (the last
    of ``epochs``, the ``epoch_readers`` fixture)."""

    def __init__(self, epochs: list) -> None:
        self.epochs = epochs
        self.seen: list = []

    def on_train_step_end(self, loop) -> None:
        threads = {t.name for t in threading.enumerate() if t.is_alive()}
        self.seen.append((self.epochs[-1], "ipuloop-read-ahead" in threads))


def train(
    mode, async_options=None, worker_size=None, epochs=2, max_steps=None, sd=None, callbacks=()
):
    opts = options(di=2).randomSeed(5)
    net = regressor()
    loop = Loop(
        net,
        opts,
        loss_fn=nn.MSELoss(),
        progress=False,
        callbacks=callbacks,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
    )
    torch.manual_seed(8)
    # The shuffle draws from a generator of its own (without one, the emulator's Async loader
    # seeds a private one from the global RNG), seeded after the loader is built: the
    # emulator's accessor reads its first batch at once, drawing from it in this process.
    g = torch.Generator()
    loader = poptorch.DataLoader(
        opts,
        regression_data(),
        batch_size=3,
        shuffle=True,
        mode=mode,
        async_options=async_options,
        rebatched_worker_size=worker_size,
        generator=g,
    )
    g.manual_seed(9)
    if sd is not None:
        loop.load_state_dict(sd)
    loop.fit(loader, epochs=epochs, max_steps=max_steps)
    return loop, [p.detach().clone() for p in net.parameters()]


def test_async_mode_and_its_options_are_kept(epoch_readers):
    """A ``poptorch.DataLoader`` in ``Async`` mode is read ahead with its ``buffer_size``, each
    epoch by a thread of its own that ends with the epoch."""
    readers = Readers(epoch_readers)
    train(
        poptorch.DataLoaderMode.Async,
        {"buffer_size": 5, "early_preload": True},
        callbacks=[readers],
    )
    assert readers.seen and any(prefetching for _, prefetching in readers.seen)
    aheads = {id(r.calls): r.calls for r, _ in readers.seen}
    assert len(aheads) == 2  # one per epoch, started once its order is drawn
    for ahead in aheads.values():
        assert ahead.waiting.maxsize == 5 and not ahead.thread.is_alive()


def test_async_rebatched_and_its_worker_size_are_kept(epoch_readers):
    """``AsyncRebatched`` with ``rebatched_worker_size=2``: its batches of 2 are re-cut into
    host calls of 6, as PopTorch's accessor re-cuts them."""
    readers = Readers(epoch_readers)
    loop, _ = train(
        poptorch.DataLoaderMode.AsyncRebatched, worker_size=2, epochs=1, callbacks=[readers]
    )
    units = readers.seen[0][0].units
    assert units._index_sampler.inner.batch_size == 2  # (torch reads batches of 2)
    assert loop.state.steps_per_epoch == 40 // 6 and loop.state.samples == 36


@pytest.mark.parametrize(
    "mode,worker_size",
    [  # (the quick suite runs one; each starts loader worker processes)
        ("Async", None),
        pytest.param("AsyncRebatched", None, marks=pytest.mark.slow),
        pytest.param("AsyncRebatched", 2, marks=pytest.mark.slow),
    ],
)
def test_async_modes_train_as_sync_and_resume_exactly(mode, worker_size):
    mode = getattr(poptorch.DataLoaderMode, mode)
    _, sync = train(poptorch.DataLoaderMode.Sync)
    _, asynchronous = train(mode, worker_size=worker_size)
    for a, b in zip(sync, asynchronous):
        assert torch.equal(a, b)  # the same samples in the same order, the same dropout
    cut, _ = train(mode, worker_size=worker_size, max_steps=4)  # mid-epoch 1 (3 steps each)
    sd = cut.state_dict()
    _, resumed = train(mode, worker_size=worker_size, sd=sd)
    for a, b in zip(sync, resumed):
        assert torch.equal(a, b)


def test_validate_and_predict_read_an_async_loader_through_its_mode():
    opts = options(di=2)
    net = regressor()
    ds = regression_data(41)  # the last host call is padded
    sync = poptorch.DataLoader(opts, ds, batch_size=3)
    asynchronous = poptorch.DataLoader(opts, ds, batch_size=3, mode=poptorch.DataLoaderMode.Async)
    seen = []

    class Threads(Callback):
        def on_validation_step_end(self, loop) -> None:
            seen.append(
                sum(t.name == "ipuloop-read-ahead" for t in threading.enumerate() if t.is_alive())
            )

    loop = Loop(net, opts, loss_fn=nn.MSELoss(), progress=False, callbacks=[Threads()])
    assert loop.validate(asynchronous) == loop.validate(sync)
    # 41 samples: 7 calls each; the Async loader is read ahead by the loop's thread (which may
    # end before the steps), the Sync one by none
    assert len(seen) == 14 and seen[0] == 1 and seen[7:] == [0] * 7
    torch.testing.assert_close(loop.predict(asynchronous), loop.predict(sync), rtol=0, atol=0)


class FakePopTorchAccessor:
    """PopTorch 3.4's accessor layout: its settings live on the worker process object."""

    def __init__(self, rebatched_size=None, terminated=False) -> None:
        class Process:
            _buffer_size, _miss_sleep_time_in_ms, load_indefinitely = 7, 0.5, True
            _early_preload, _sharing_strategy = True, poptorch.SharingStrategy.FileSystem

        class Worker:
            _process = Process()

        self.rebatched_size = rebatched_size
        self._worker = None if terminated else Worker()

    def terminate(self) -> None:
        pass


def test_async_settings_are_read_from_poptorchs_accessor_layout():
    from ipuloop.read_ahead import async_of
    from ipuloop.sources import _rebatched

    loader = poptorch.DataLoader(options(di=2), regression_data(), batch_size=3)
    assert async_of(loader, "loader") is None  # Sync
    assert async_of(DataLoader(regression_data()), "loader") is None
    loader._accessor = FakePopTorchAccessor()
    assert async_of(loader, "loader") == {
        "buffer_size": 7,
        "miss_sleep_time_in_ms": 0.5,
        "early_preload": True,
        "sharing_strategy": poptorch.SharingStrategy.FileSystem,
    }
    assert not _rebatched(loader)
    loader._accessor = FakePopTorchAccessor(rebatched_size=6)  # batch_size 6: the default size
    assert not _rebatched(loader)
    loader._accessor = FakePopTorchAccessor(rebatched_size=12)  # batches re-cut into 12
    assert _rebatched(loader)
    loader._accessor = FakePopTorchAccessor(terminated=True)
    with pytest.warns(UserWarning, match="cannot be read"):
        assert async_of(loader, "loader") == {}
    loader._accessor = None


# -- the host check refuses only what would broadcast ---------------------------------------------
class Regression(nn.Module):
    """A model-with-loss with a [N, 1] output and [N] labels; ``squeeze``: reshaped itself."""

    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.lin, self.squeeze = nn.Linear(IN, 1), squeeze

    def forward(self, x, labels=None):
        out = self.lin(x)
        if labels is None:
            return out
        pred = out.squeeze(-1) if self.squeeze else out
        return out, nn.functional.mse_loss(pred, labels)


def test_a_model_with_loss_that_reshapes_its_labels_trains():
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(32, IN, generator=g), torch.randn(32, generator=g)
    model = Regression(squeeze=True)
    reference = copy.deepcopy(model)
    loop = Loop(model, progress=False, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    history = loop.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)  # the same steps in plain torch
    losses = []
    for i in range(0, 32, 8):
        opt.zero_grad()
        _, loss = reference(x[i : i + 8], y[i : i + 8])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert history[0]["train_loss"] == pytest.approx(sum(losses) / 4, rel=1e-5)
    torch.testing.assert_close(model.lin.weight, reference.lin.weight)


def test_a_model_with_loss_that_broadcasts_is_still_refused():
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(32, IN, generator=g), torch.randn(32, generator=g)
    loop = Loop(Regression(squeeze=False), progress=False)
    with pytest.raises(ValueError, match=r"would broadcast the labels.*\[8\]"):
        loop.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    assert loop.train_model is None


# -- a non-finite loss says what likely happened --------------------------------------------------
NEEDS_CPU_HALF_BACKWARD = newer_torch("torch < 2.1 has no float16 backward kernels on the CPU")


def fit_error(x, y, precision="32", loss_scaling=None, epochs=1) -> str:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), nn.Linear(16, 1))
    extra = {} if loss_scaling is None else {"loss_scaling": loss_scaling}
    loop = Loop(
        net,
        loss_fn=nn.MSELoss(),
        progress=False,
        precision=precision,
        optimizer=poptorch.optim.SGD(net.parameters(), lr=0.01, **extra),
    )
    with pytest.raises(NonFiniteLossError) as e:
        loop.fit(DataLoader(TensorDataset(x, y), batch_size=4), epochs=epochs)
    return str(e.value)


def regression_xy(n: int = 32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, IN, generator=g), torch.randn(n, 1, generator=g)


@NEEDS_CPU_HALF_BACKWARD
@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_an_input_beyond_float16_is_named(precision):
    x, y = regression_xy()
    x[13, 2] = 1.0e5  # sample 13: step 3 of micro-batches of 4
    msg = fit_error(x, y, precision)
    assert "step 3" in msg and "input 0" in msg and "100000" in msg, msg
    assert "float16" in msg and "65504" in msg and "Lower the learning rate" not in msg, msg


@NEEDS_CPU_HALF_BACKWARD
def test_a_loss_scale_that_overflows_is_named():
    x, y = regression_xy()
    msg = fit_error(x * 10, y * 100, "16-mixed", loss_scaling=1.0e4)
    # the first step's loss times 1e4 is beyond 65504: its gradients overflowed
    assert "step 1" in msg and "loss_scaling=10000" in msg and "beyond it" in msg, msg
    assert "Lower loss_scaling" in msg and "input 0" not in msg, msg


def test_non_finite_data_is_named():
    x, y = regression_xy()
    y[21, 0] = float("nan")
    msg = fit_error(x, y)
    assert "step 5" in msg and "the labels" in msg and "have NaN or infinite values" in msg, msg


# -- python -m ipuloop.emulate: workers of every start method see the emulator --------------------
SPAWNING = textwrap.dedent("""
    import json, sys
    import poptorch
    import torch
    from torch.utils.data import DataLoader, Dataset
    from ipuloop import Loop


    class Squares(Dataset):  # defined here: a spawned worker imports this script again
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return torch.tensor([float(i)]), torch.tensor([float(i * i)])


    def check_binding(worker_id):  # runs in each worker
        assert sys.modules["poptorch"].__name__ == "ipuloop.emulator", sys.modules["poptorch"]


    if __name__ == "__main__":
        opts = poptorch.Options().deviceIterations(2)
        loader = poptorch.DataLoader(opts, Squares(), batch_size=2, num_workers=1,
                                     multiprocessing_context="forkserver",
                                     worker_init_fn=check_binding)
        out = {"forkserver": [b[0].reshape(-1).tolist() for b in loader]}
        torch.manual_seed(0)  # the loop's loader keeps the start method
        loop = Loop(torch.nn.Linear(1, 1), loss_fn=torch.nn.MSELoss(), progress=False)
        history = loop.fit(DataLoader(Squares(), batch_size=4, num_workers=1,
                                      multiprocessing_context="spawn",
                                      worker_init_fn=check_binding))
        out["spawn"] = len(history)
        print(json.dumps(out))
""")


@pytest.mark.slow
def test_emulate_binds_poptorch_in_spawned_and_forkserver_workers(tmp_path):
    (tmp_path / "train.py").write_text(SPAWNING)
    fake = tmp_path / "fake"  # an importable poptorch that is not the emulator
    fake.mkdir()
    (fake / "poptorch.py").write_text("raise RuntimeError('the real poptorch was imported')\n")
    repo = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k not in ("IPULOOP_BACKEND", "PYTHONPATH")}
    env.update(PYTHONPATH=os.pathsep.join([str(fake), repo]), IPULOOP_BACKEND="auto")
    r = subprocess.run(
        [sys.executable, "-m", "ipuloop.emulate", "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    order = [[float(i) for i in range(j, j + 4)] for j in range(0, 16, 4)]
    assert out == {"forkserver": order, "spawn": 1}


# -- misconfigured callbacks are found when the fit starts ----------------------------------------
class Steps(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_compile_start(self, loop) -> None:
        self.events.append("compile")

    def on_train_step_end(self, loop) -> None:
        self.events.append("step")


@pytest.mark.parametrize(
    "make",
    [
        lambda net, opt, tmp: EarlyStopping(monitor="val_loss"),
        lambda net, opt, tmp: ModelCheckpoint(tmp / "ckpt", monitor="val_loss"),
        lambda net, opt, tmp: LRScheduler(
            torch.optim.lr_scheduler.ReduceLROnPlateau(opt), monitor="val_loss"
        ),
    ],
    ids=["EarlyStopping", "ModelCheckpoint", "ReduceLROnPlateau"],
)
def test_a_validation_monitor_without_val_loader_fails_before_any_step(make, tmp_path):
    net = regressor()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    steps, callback = Steps(), make(net, opt, tmp_path)
    loop = Loop(
        net,
        options(),
        loss_fn=nn.MSELoss(),
        optimizer=opt,
        progress=False,
        callbacks=[callback, steps],
    )
    with pytest.raises(
        ValueError,
        match=rf"{type(callback).__name__}: monitor='val_\w+' is "
        "a validation log, but this fit has no val_loader",
    ):
        loop.fit(DataLoader(regression_data(), batch_size=4))
    assert steps.events == [] and loop.state.step == 0
    loop.fit(
        DataLoader(regression_data(), batch_size=4),  # with one: no error
        val_loader=DataLoader(regression_data(8), batch_size=4),
    )
    assert loop.state.epoch == 1


def test_lightning_hooks_warn_at_construction_with_the_nearest_event_or_none():
    class FromLightning(Callback):
        def transfer_batch_to_device(self, batch, device, dataloader_idx): ...
        def on_before_batch_transfer(self, batch, dataloader_idx): ...
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx): ...
        def training_step(self, batch, batch_idx): ...
        def configure_optimizers(self): ...
        def on_fit_start(self, trainer, pl_module): ...  # an event, with Lightning's arguments
        def on_epoch_end(self, loop): ...  # an event as the loop calls it

    with pytest.warns(UserWarning) as record:
        FromLightning()
    messages = {str(w.message).split(" ")[0]: str(w.message) for w in record}
    assert sorted(messages) == [
        f"FromLightning.{n}"
        for n in (
            "configure_optimizers",
            "on_before_batch_transfer",
            "on_fit_start",
            "on_train_batch_start",
            "training_step",
            "transfer_batch_to_device",
        )
    ]
    assert all(w.filename == __file__ for w in record)  # at the construction
    assert (
        "nearest loop event is on_train_step_start"
        in messages["FromLightning.on_train_batch_start"]
    )
    for name in ("transfer_batch_to_device", "on_before_batch_transfer"):
        assert "no such event" in messages[f"FromLightning.{name}"]
        assert "collate_fn" in messages[f"FromLightning.{name}"]
    assert "forward" in messages["FromLightning.training_step"]
    assert "Loop(optimizer=)" in messages["FromLightning.configure_optimizers"]
    assert "takes (trainer, pl_module)" in messages["FromLightning.on_fit_start"]
    assert "on_fit_start(self, loop)" in messages["FromLightning.on_fit_start"]
