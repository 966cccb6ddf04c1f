"""LRScheduler: the LR the device used, per update and per epoch; pushes; resume; state."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.optim import lr_scheduler as L
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import LRScheduler

N = 24  # samples; micro-batch 1


class Probe(nn.Module):
    """loss = w, so each update does w -= lr: the weight change reveals the LR used."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x, y):
        out = x * self.w
        return out, poptorch.identity_loss(self.w.sum() + 0 * out.sum(), reduction="sum")


class Record(Callback):
    """Per host step: the LR on the device and the weight change (the sum of the LRs used)."""

    order = -100  # before LRScheduler steps the host scheduler

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.deltas: list[float] = []
        self.prev = 0.0

    def on_train_step_end(self, loop):
        self.lrs.append(loop.train_model._device_optimizer.param_groups[0]["lr"])
        w = float(loop.model.w.detach())  # copies the device weights to the host (test only)
        self.deltas.append(self.prev - w)
        self.prev = w


def fit(make_sched, di=1, ga=1, epochs=2, interval=None, monitor=None, callbacks=(), **kw):
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    sched = make_sched(opt)
    rec = Record()
    opts = poptorch.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    loop = Loop(
        model,
        opts,
        optimizer=opt,
        progress=False,
        callbacks=[rec, LRScheduler(sched, interval, monitor), *callbacks],
    )
    loop.fit(
        DataLoader(TensorDataset(torch.ones(N), torch.ones(N)), batch_size=1), epochs=epochs, **kw
    )
    return loop, rec, sched


def reference(make_sched, count, metrics=None):
    """The LR a plain torch loop uses at each of ``count`` scheduler periods."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
    sched = make_sched(opt)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(count):
            lrs.append(opt.param_groups[0]["lr"])
            sched.step(*([metrics[i]] if metrics else []))
    return lrs


SCHEDULERS = {
    "step": lambda o: L.StepLR(o, step_size=3, gamma=0.5),
    "warmup": lambda o: L.LambdaLR(o, lambda u: min(1.0, (u + 1) / 5)),
    "onecycle": lambda o: L.OneCycleLR(o, max_lr=0.8, total_steps=2 * N, cycle_momentum=False),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("di,ga", [(1, 1), (2, 1), (4, 2)])
def test_lr_per_update_is_what_the_device_used(name, di, ga):
    make = SCHEDULERS[name]
    loop, rec, sched = fit(make, di=di, ga=ga)
    steps = 2 * N // (di * ga)
    assert loop.state.update == steps * di and sched.last_epoch == loop.state.update
    ref = reference(make, steps * di)  # LR per optimizer update
    # Constant within a host step: its DI updates run the LR of the step's first update.
    expected = [ref[k * di] for k in range(steps)]
    assert rec.lrs == pytest.approx(expected, rel=1e-6)
    assert rec.deltas == pytest.approx([di * lr for lr in expected], rel=1e-4, abs=2e-6)


# The LR the device runs at each host step, written out (lr 0.4). Per update: StepLR(step_size=3,
# gamma=0.5) over updates 0, 1, 2, ...; with DI=2 host step k runs updates 2k and 2k+1, both at
# the LR of update 2k (constant within a host call), whatever the gradient accumulation.
PER_UPDATE_TABLE = [0.4, 0.4, 0.2, 0.1, 0.1, 0.05, 0.025, 0.025, 0.0125, 0.00625, 0.00625, 0.003125]
# Per epoch: StepLR(step_size=1, gamma=0.5), DI=4: 6 host steps an epoch, 3 epochs.
PER_EPOCH_TABLE = [0.4] * 6 + [0.2] * 6 + [0.1] * 6


@pytest.mark.parametrize("ga,epochs", [(1, 1), (2, 2)])  # 12 host steps either way
def test_lr_table_per_update(ga, epochs):
    loop, rec, _ = fit(lambda o: L.StepLR(o, step_size=3, gamma=0.5), di=2, ga=ga, epochs=epochs)
    assert rec.lrs == pytest.approx(PER_UPDATE_TABLE, rel=1e-7)
    assert rec.deltas == pytest.approx([2 * lr for lr in PER_UPDATE_TABLE], rel=1e-4, abs=2e-6)
    changes = sum(a != b for a, b in zip(PER_UPDATE_TABLE, PER_UPDATE_TABLE[1:]))
    assert loop.optimizer_pushes == changes == 7  # setOptimizer only when the LR changed


def test_lr_table_per_epoch():
    loop, rec, _ = fit(
        lambda o: L.StepLR(o, step_size=1, gamma=0.5), di=4, epochs=3, interval="epoch"
    )
    assert rec.lrs == pytest.approx(PER_EPOCH_TABLE, rel=1e-7)
    assert rec.deltas == pytest.approx([4 * lr for lr in PER_EPOCH_TABLE], rel=1e-4, abs=2e-6)
    assert loop.optimizer_pushes == 2


def test_lr_per_epoch_is_what_the_device_used():
    make = lambda o: L.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
    loop, rec, _ = fit(make, di=2, epochs=3, interval="epoch")
    per_epoch = N // 2
    expected = [lr for lr in reference(make, 3) for _ in range(per_epoch)]
    assert rec.lrs == pytest.approx(expected)
    assert rec.deltas == pytest.approx([2 * lr for lr in expected], rel=1e-4, abs=2e-6)


def test_reduce_on_plateau_steps_on_the_monitored_log():
    # train_loss = w keeps falling, so in "max" mode every epoch after the first is worse.
    make = lambda o: L.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0)  # noqa: E731
    loop, rec, _ = fit(make, di=4, epochs=4, monitor="train_loss")
    values = [h["train_loss"] for h in loop.state.history]
    per_epoch = N // 4
    expected = [lr for lr in reference(make, 4, values) for _ in range(per_epoch)]
    assert rec.lrs == pytest.approx(expected)
    assert len(set(expected)) == 3  # the LR really changed


def test_setoptimizer_called_exactly_when_the_lr_changes():
    calls: list[int] = []

    class Spy(Callback):
        def on_compile_end(self, loop):
            push = loop.train_model.setOptimizer

            def spy(opt):
                calls.append(loop.state.step)  # the host step about to run
                push(opt)

            loop.train_model.setOptimizer = spy

    # DI 2, LR halves every 4 updates: it changes before host steps 2, 4, 6, ...
    loop, rec, _ = fit(
        lambda o: L.StepLR(o, step_size=4, gamma=0.5), di=2, epochs=1, callbacks=[Spy()]
    )
    changed = [k for k in range(1, len(rec.lrs)) if rec.lrs[k] != rec.lrs[k - 1]]
    assert changed == list(range(2, N // 2, 2))
    assert calls == changed and loop.optimizer_pushes == len(changed)


def test_constant_lr_never_pushes():
    loop, rec, _ = fit(lambda o: L.LambdaLR(o, lambda u: 1.0), di=2)
    assert loop.optimizer_pushes == 0 and set(rec.lrs) == {0.4}


def test_no_optimizer_order_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SCHEDULERS["step"], epochs=1)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_resume_puts_the_restored_lr_on_the_device_before_the_first_step():
    make = lambda o: L.StepLR(o, step_size=3, gamma=0.5)  # noqa: E731
    _, full, _ = fit(make, di=2, epochs=2)

    class StopAt5(Callback):  # mid-epoch (max_steps would mark the epoch complete)
        def on_train_step_end(self, loop):
            if loop.state.step == 5:
                loop.stop()

    first, _, _ = fit(make, di=2, epochs=2, callbacks=[StopAt5()])
    assert first.state.epoch_step == 5
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # taken between steps: the device LR lags the schedule
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    rec = Record()
    rec.prev = float(sd["model"]["w"])
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        optimizer=opt,
        progress=False,
        callbacks=[rec, LRScheduler(make(opt))],
    )
    loop.load_state_dict(sd)
    loop.fit(DataLoader(TensorDataset(torch.ones(N), torch.ones(N)), batch_size=1), epochs=2)
    assert rec.lrs == full.lrs[5:]  # the first resumed step already runs the restored LR
    assert rec.deltas == pytest.approx(full.deltas[5:], rel=1e-4, abs=2e-6)


def test_a_second_fit_continues_the_schedule():
    # Detaching at fit end reads the device optimizer back; the stepped LR must survive it.
    make = lambda o: L.StepLR(o, step_size=4, gamma=0.5)  # noqa: E731
    _, full, _ = fit(make, di=2, epochs=2)
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    rec = Record()
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        optimizer=opt,
        progress=False,
        callbacks=[rec, LRScheduler(make(opt))],
    )
    dl = DataLoader(TensorDataset(torch.ones(N), torch.ones(N)), batch_size=1)
    loop.fit(dl, epochs=1)
    loop.fit(dl, epochs=2)
    assert rec.lrs == full.lrs


def test_state_dict_loads_with_weights_only():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    class Obj:
        def __init__(self):
            self.k = np.float32(0.5)

        def __call__(self, e):
            return float(self.k)

    for sched in (
        L.LambdaLR(opt, Obj()),
        L.OneCycleLR(opt, 1.0, total_steps=9),
        L.SequentialLR(opt, [L.LinearLR(opt, 0.1, total_iters=2), L.ExponentialLR(opt, 0.9)], [2]),
    ):
        buf = io.BytesIO()
        torch.save(LRScheduler(sched).state_dict(), buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=True)["_last_lr"] == sched.state_dict()["_last_lr"]


def test_unserialisable_scheduler_state_is_a_clear_error():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    class Obj:
        def __init__(self):
            self.table = object()

        def __call__(self, e):
            return 1.0

    with pytest.raises(TypeError, match=r"lr_lambdas'\]\[0\]\['table'\] is a object"):
        LRScheduler(L.LambdaLR(opt, Obj())).state_dict()


def test_missing_monitor_lists_the_logs():
    make = lambda o: L.ReduceLROnPlateau(o)  # noqa: E731
    # (a validation log without val_loader is refused when the fit starts: test_loaders_paths)
    with pytest.raises(ValueError, match=r"monitor='train_acc'.*Available: \['loss', 'train_loss"):
        fit(make, epochs=1, monitor="train_acc")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"interval": "step"}, "interval must be"),
        ({"monitor": "val_loss"}, "monitor is only used with ReduceLROnPlateau"),
    ],
)
def test_bad_arguments(kw, match):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=match):
        LRScheduler(L.StepLR(opt, 2), **kw)
    with pytest.raises(ValueError, match="ReduceLROnPlateau steps on a monitored log"):
        LRScheduler(L.ReduceLROnPlateau(opt), interval="update", monitor="val_loss")


def test_scheduler_over_another_optimizer_is_rejected():
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    model = Probe()
    loop = Loop(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        progress=False,
        callbacks=[LRScheduler(L.StepLR(other, 2))],
    )
    with pytest.raises(ValueError, match="another optimizer"):
        loop.fit(DataLoader(TensorDataset(torch.ones(4), torch.ones(4)), batch_size=1))
