"""The event order of the callbacks module docstring, on the paths that leave a scope early.

Each expected sequence is written out from the pseudocode; the loop's recorded calls must
equal it, event for event.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, CancelEpoch, CancelFit, CancelStep, Loop, poptorch
from ipuloop.callbacks.base import EVENTS

IN, OUT = 4, 3
N, B, DI, GA = 48, 2, 2, 2
STEPS = N // (B * DI * GA)  # 6 training steps an epoch
VAL_STEPS = 2  # 16 validation samples, micro-batch 2: DI*GA = 4 a call


class Recorder(Callback):
    """Records every hook call; ``react(event, loop)`` may then stop or raise."""

    def __init__(self, react=None) -> None:
        self.events: list[str] = []
        self.react = react


def _hook(name):
    def hook(self, loop):
        self.events.append(name)
        if self.react is not None:
            self.react(name, loop)

    return hook


for _e in EVENTS:
    setattr(Recorder, _e, _hook(_e))


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def run(react=None, epochs=2, **fit):
    torch.manual_seed(0)
    rec = Recorder(react)
    opts = poptorch.Options().deviceIterations(DI)
    opts.Training.gradientAccumulation(GA)
    loop = Loop(
        nn.Linear(IN, OUT), opts, loss_fn=nn.CrossEntropyLoss(), callbacks=[rec], progress=False
    )
    loop.fit(
        DataLoader(data(N, 1), batch_size=B),
        epochs=epochs,
        val_loader=DataLoader(data(16, 2), batch_size=B),
        **fit,
    )
    return loop, rec.events


COMPILE = ["on_compile_start", "on_compile_end"]
STEP = ["on_train_step_start", "on_train_step_end"]


def validation(first: bool) -> list[str]:
    return (
        ["on_validation_start"]
        + (COMPILE if first else [])
        + ["on_validation_step_end"] * VAL_STEPS
        + ["on_validation_end"]
    )


def epoch(first: bool, steps: int = STEPS, val: bool = True) -> list[str]:
    ev = ["on_epoch_start"] + (COMPILE if first else []) + STEP * steps
    return ev + (validation(first) if val else []) + ["on_epoch_end"]


def test_full_fit():
    loop, events = run(epochs=2)
    assert events == ["on_configure", "on_fit_start", *epoch(True), *epoch(False), "on_fit_end"]
    assert loop.state.epoch == 2 and [h["epoch"] for h in loop.state.history] == [1, 2]


@pytest.mark.parametrize("how", ["stop", "max_steps"])
def test_stop_mid_epoch_leaves_the_epoch_incomplete(how):
    at = STEPS + 2  # the third step of the second epoch

    def react(event, loop):
        if how == "stop" and event == "on_train_step_end" and loop.state.step == at:
            loop.stop()

    loop, events = run(react, epochs=3, **({"max_steps": at} if how == "max_steps" else {}))
    assert events == [
        "on_configure",
        "on_fit_start",
        *epoch(True),
        "on_epoch_start",
        *STEP * 2,
        "on_fit_end",
    ]
    st = loop.state
    assert (st.epoch, st.step, st.epoch_step, len(st.history)) == (1, at, 2, 1)


def test_stop_at_an_epochs_last_step_completes_it():
    def react(event, loop):
        if event == "on_train_step_end" and loop.state.step == STEPS:
            loop.stop()

    loop, events = run(react, epochs=3)
    assert events == ["on_configure", "on_fit_start", *epoch(True), "on_fit_end"]
    assert loop.state.epoch == 1 and "val_loss" in loop.state.history[0]


def test_cancel_step_skips_the_rest_of_that_step_only():
    cancelled = []

    def react(event, loop):
        if event == "on_train_step_start" and loop.state.step == 3 and not cancelled:
            cancelled.append(True)
            raise CancelStep  # the fourth batch is read but not run
        if event == "on_train_step_end" and loop.state.step == 4:
            raise CancelStep  # the step has run: nothing left to skip

    loop, events = run(react, epochs=1)
    first = ["on_epoch_start", *COMPILE, *STEP * 3, "on_train_step_start", *STEP * (STEPS - 4)]
    assert events == [
        "on_configure",
        "on_fit_start",
        *first,
        *validation(True),
        "on_epoch_end",
        "on_fit_end",
    ]
    assert loop.state.step == STEPS - 1


def test_cancel_epoch_from_a_step_still_validates():
    def react(event, loop):
        if event == "on_train_step_end" and loop.state.epoch_step == 2:
            raise CancelEpoch

    loop, events = run(react, epochs=2)
    assert events == [
        "on_configure",
        "on_fit_start",
        *epoch(True, steps=2),
        *epoch(False, steps=2),
        "on_fit_end",
    ]
    assert loop.state.epoch == 2 and loop.state.step == 4


def test_cancel_epoch_from_validation_skips_to_epoch_end_without_val_logs():
    def react(event, loop):
        if event == "on_validation_step_end" and loop.state.epoch == 0:
            raise CancelEpoch
        if event == "on_epoch_end":
            raise CancelEpoch  # the epoch is over: no effect

    loop, events = run(react, epochs=2)
    cut = [
        "on_epoch_start",
        *COMPILE,
        *STEP * STEPS,
        "on_validation_start",
        *COMPILE,
        "on_validation_step_end",
        "on_epoch_end",
    ]
    assert events == ["on_configure", "on_fit_start", *cut, *epoch(False), "on_fit_end"]
    h = loop.state.history
    assert "val_loss" not in h[0] and "val_loss" in h[1] and "train_loss" in h[0]


def test_cancel_epoch_before_any_step_logs_no_stale_train_loss():
    def react(event, loop):
        if event == "on_epoch_start" and loop.state.epoch == 1:
            raise CancelEpoch

    loop, events = run(react, epochs=2)
    second = ["on_epoch_start", *validation(False), "on_epoch_end"]
    assert events == ["on_configure", "on_fit_start", *epoch(True), *second, "on_fit_end"]
    h = loop.state.history
    assert "train_loss" in h[0] and "train_loss" not in h[1]


def test_cancel_fit_from_fit_start():
    def react(event, loop):
        if event == "on_fit_start":
            raise CancelFit

    loop, events = run(react, epochs=2)
    assert events == ["on_configure", "on_fit_start", "on_fit_end"] and loop.state.step == 0


def test_validate_and_predict_alone():
    rec = Recorder()
    loop = Loop(
        nn.Linear(IN, OUT),
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        callbacks=[rec],
        progress=False,
    )
    loop.validate(DataLoader(data(16, 2), batch_size=2))
    loop.validate(DataLoader(data(16, 2), batch_size=2))
    steps = ["on_validation_step_end"] * (16 // (2 * 2))  # micro-batch 2 x DI 2
    assert rec.events == [
        "on_validation_start",
        *COMPILE,
        *steps,
        "on_validation_end",
        "on_validation_start",
        *steps,
        "on_validation_end",
    ]
    rec.events.clear()
    loop.predict(DataLoader(data(9, 3), batch_size=2))
    loop.predict(DataLoader(data(9, 3), batch_size=2))
    assert rec.events == COMPILE


def test_exception_in_a_hook_fires_on_exception_once_then_propagates():
    def react(event, loop):
        if event == "on_train_step_end" and loop.state.step == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run(react, epochs=1)


def test_cancel_in_a_standalone_validation_ends_it_without_logs():
    def react(event, loop):
        if event == "on_validation_step_end":
            raise CancelEpoch

    rec = Recorder(react)
    loop = Loop(
        nn.Linear(IN, OUT),
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        callbacks=[rec],
        progress=False,
    )
    assert loop.validate(DataLoader(data(16, 2), batch_size=2)) == {}
    assert rec.events == ["on_validation_start", *COMPILE, "on_validation_step_end"]
    assert "val_loss" not in loop.state.logs
