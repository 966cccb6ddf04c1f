"""Inputs, metrics, predict, hooks and failures: never a silently wrong result.

Float64 inputs, metrics that reject the output, multi-input predict, a fit with no epoch
left, misnamed hooks, on_exception on every failing call, and the update count a scheduler
needs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import LRScheduler

IN, CLASSES, N, B = 4, 3, 32, 2


def _data(n: int = N, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, IN, generator=g).to(dtype)
    return x, torch.randint(0, CLASSES, (n,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(IN, CLASSES)


def _loop(model: nn.Module, di: int = 2, ga: int = 1, **kwargs) -> Loop:
    opts = poptorch.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    kwargs.setdefault("loss_fn", nn.CrossEntropyLoss())
    kwargs.setdefault("optimizer", poptorch.optim.SGD(model.parameters(), lr=0.1))
    return Loop(model, opts, progress=False, **kwargs)


# -- float64 inputs ------------------------------------------------------------------------------
def test_float64_inputs_train_as_the_device_holds_them_float32():
    weights, outputs = [], []
    for dtype in (torch.float32, torch.float64):
        x, y = _data(dtype=dtype)
        model = _model()
        loop = _loop(model)
        loop.fit(DataLoader(TensorDataset(x, y), batch_size=B), epochs=2)
        weights.append([p.detach().clone() for p in model.parameters()])
        outputs.append(loop.predict(DataLoader(TensorDataset(x), batch_size=B)))
    for a, b in zip(*weights):
        assert torch.equal(a, b)
    assert outputs[1].dtype == torch.float32 and torch.equal(outputs[0], outputs[1])


# -- metrics checked before compiling ------------------------------------------------------------
class TupleOutput(nn.Module):
    """A model-with-loss whose output is a tuple: (logits, a score per sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = (logits, logits.sum(-1, keepdim=True))
        return out if labels is None else (out, nn.functional.cross_entropy(logits, labels))


@pytest.mark.parametrize(
    "model, metric, shapes",
    [
        (
            _model,
            torchmetrics.Accuracy(task="binary"),
            "output float32 [2, 3] and labels int64 [2]",
        ),
        (
            _model,
            torchmetrics.Accuracy(task="multiclass", num_classes=2),
            "output float32 [2, 3] and labels int64 [2]",
        ),
        (
            TupleOutput,
            torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES),
            "output tuple (float32 [2, 3], float32 [2, 1]) and labels int64 [2]",
        ),
    ],
)
def test_a_metric_that_rejects_the_output_fails_before_compiling(model, metric, shapes):
    model = model()
    loop = _loop(
        model,
        loss_fn=None if isinstance(model, TupleOutput) else nn.CrossEntropyLoss(),
        metrics={"acc": metric},
    )
    x, y = _data()
    with pytest.raises(
        ValueError, match=r"metrics\['acc'\] \(MulticlassAccuracy|BinaryAccuracy"
    ) as info:
        loop.fit(DataLoader(TensorDataset(x, y), batch_size=B))
    assert shapes in str(info.value) and "metric_output=" in str(info.value)
    assert loop.train_model is None  # nothing compiled, no step run
    assert loop.state.step == 0


def test_metric_output_picks_what_metrics_receive_in_training_and_validation():
    model = TupleOutput()
    loop = _loop(
        model,
        loss_fn=None,
        metric_output=lambda out: out[0],
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)},
    )
    x, y = _data()
    history = loop.fit(
        DataLoader(TensorDataset(x, y), batch_size=B),
        epochs=1,
        val_loader=DataLoader(TensorDataset(x, y), batch_size=B),
    )
    logits, _ = loop.predict(DataLoader(TensorDataset(x), batch_size=B))
    expected = (logits.argmax(-1) == y).double().mean().item()
    assert history[-1]["val_acc"] == pytest.approx(expected)
    assert 0 <= history[-1]["train_acc"] <= 1
    with pytest.raises(TypeError, match="metric_output must be a function"):
        _loop(_model(), metric_output=0)


# -- predict feeds every input -------------------------------------------------------------------
class TwoInputsWithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(IN, CLASSES), nn.Linear(IN, CLASSES)

    def forward(self, a, b=None, labels=None):  # b optional: dropping it would go unnoticed
        out = self.a(a) + (self.b(b) if b is not None else 0)
        return out if labels is None else (out, nn.functional.cross_entropy(out, labels))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(IN, CLASSES), nn.Linear(IN, CLASSES)

    def forward(self, a, b):
        return self.a(a) + self.b(b)


@pytest.mark.parametrize(
    "make, loss_fn", [(TwoInputsWithLoss, None), (TwoInputs, nn.CrossEntropyLoss())]
)
def test_predict_feeds_every_input_the_model_was_fit_with(make, loss_fn):
    model = make()
    loop = _loop(model, loss_fn=loss_fn)
    a, y = _data()
    b = torch.randn(N, IN)
    loop.fit(DataLoader(TensorDataset(a, b, y), batch_size=B))
    with torch.no_grad():
        expected = model.a(a) + model.b(b)
    for ds in (TensorDataset(a, b), TensorDataset(a, b, y)):  # labels, when given, ignored
        got = loop.predict(DataLoader(ds, batch_size=B))
        torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="batches of 1 elements, but the model was fit with 2"):
        loop.predict(DataLoader(TensorDataset(a), batch_size=B))


# -- a fit with no epoch left --------------------------------------------------------------------
def test_fit_with_no_more_epochs_than_done_says_so():
    model = _model()
    loop = _loop(model)
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    loop.fit(loader, epochs=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(
        UserWarning,
        match=r"fit\(epochs=2\) has no epoch to run: 2 epoch\(s\) "
        r"are already complete.*Pass epochs=4 to train 2 more",
    ):
        loop.fit(loader, epochs=2)
    assert loop.state.epoch == 2 and all(
        torch.equal(p, q) for p, q in zip(before, model.parameters())
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.fit(loader, epochs=3)  # one more epoch to run: no warning
    assert loop.state.epoch == 3


# -- misnamed hooks ------------------------------------------------------------------------------
def test_a_method_named_like_a_hook_warns_with_the_closest_event():
    class Mine(Callback):
        def on_train_batch_end(self, loop): ...
        def on_epoch_begin(self, loop): ...
        def on_train_step_end(self, loop): ...  # a real event
        def on_plateau(self): ...  # a helper, close to no event

    with pytest.warns(UserWarning) as record:
        Mine()
    messages = sorted(str(w.message) for w in record)
    assert messages == [
        "Mine.on_epoch_begin is not a loop event, so the loop never calls it. Did you mean "
        "on_epoch_start? (All events: ipuloop.callbacks.base.EVENTS.)",
        "Mine.on_train_batch_end is a Lightning hook, which the loop never calls: the nearest "
        "loop event is on_train_step_end (fires once per step: one host call of DI*GA*RF "
        "micro-batches, none of which the host sees alone). (All events: "
        "ipuloop.callbacks.base.EVENTS.)",
    ]
    assert record[0].filename == __file__  # points at the construction
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Mine()  # once per class

        class Fine(Callback):
            def on_fit_start(self, loop): ...

        Fine()


# -- on_exception on every failing call ----------------------------------------------------------
class FailsOnNaN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x):
        if torch.isnan(x).any():
            raise RuntimeError("NaN input")
        return self.net(x)


class Seen(Callback):
    def __init__(self) -> None:
        self.seen: list[BaseException] = []

    def on_exception(self, loop):
        self.seen.append(loop.exception)


def test_on_exception_fires_for_every_failing_fit_validate_and_predict():
    seen = Seen()
    loop = _loop(FailsOnNaN(), callbacks=[seen])
    x, y = _data()
    x[-1] = float("nan")  # the last sample: the host probe (first micro-batch) passes
    train, val = (DataLoader(TensorDataset(x, y), batch_size=B) for _ in range(2))
    test = DataLoader(TensorDataset(x), batch_size=B)
    calls = [lambda: loop.fit(train), lambda: loop.validate(val), lambda: loop.predict(test)]
    errors = []
    for call in calls * 2:
        with pytest.raises(RuntimeError, match="NaN input") as info:
            call()
        errors.append(info.value)
    assert seen.seen == errors  # each failing call, once, with its own error


# -- the number of updates a fit runs, and schedulers that cycle momentum ------------------------
@pytest.mark.parametrize(
    "n, b, di, ga, rf", [(32, 2, 2, 1, 1), (37, 2, 2, 3, 1), (64, 1, 3, 2, 2), (40, 4, 1, 1, 1)]
)
def test_num_updates_is_the_updates_fit_runs(n, b, di, ga, rf):
    x, y = _data(n)
    loader = DataLoader(TensorDataset(x, y), batch_size=b, shuffle=True)
    opts = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    model = _model()
    loop = Loop(
        model,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped remainder
        updates = Loop.num_updates(loader, opts, epochs=3)
        loop.fit(loader, epochs=3)
    assert updates == loop.state.update == 3 * (n // (b * di * ga * rf)) * di
    assert updates * ga * rf <= 3 * len(loader)  # micro-batches: GA * RF an update


def test_num_updates_needs_a_known_length():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(zip(*_data()))

    with pytest.raises(ValueError, match="Stream, whose length is unknown"):
        Loop.num_updates(DataLoader(Stream(), batch_size=B), None)


def _one_cycle_fit(opt_factory, **sched_kwargs):
    model = _model()
    opt = opt_factory(model.parameters())
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    opts = poptorch.Options().deviceIterations(2)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=Loop.num_updates(loader, opts, 2), **sched_kwargs
    )
    loop = Loop(
        model,
        opts,
        optimizer=opt,
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        callbacks=[LRScheduler(sched)],
    )
    loop.fit(loader, epochs=2)
    return loop, sched


@pytest.mark.parametrize(
    "factory, name, fix",
    [
        (lambda p: poptorch.optim.AdamW(p, lr=0.1), "betas", "AdamW(params, lr=..., betas=(0.9"),
        (lambda p: poptorch.optim.SGD(p, lr=0.1), "momentum", "SGD(params, lr=..., momentum=0.9)"),
        (lambda p: torch.optim.AdamW(p, lr=0.1), "betas", "use poptorch.optim.AdamW(params"),
    ],
)
def test_a_scheduler_cycling_a_constant_momentum_fails_before_any_step_naming_the_fix(
    factory, name, fix
):
    with pytest.raises(ValueError) as info:
        _one_cycle_fit(factory)
    msg = str(info.value)
    assert f"OneCycleLR with cycle_momentum=True changes {name} every update" in msg
    assert fix in msg and "cycle_momentum=False" in msg


@pytest.mark.parametrize(
    "factory, kwargs",
    [
        (lambda p: poptorch.optim.AdamW(p, lr=0.1, betas=(0.9, 0.999)), {}),
        (lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9), {}),
        (lambda p: poptorch.optim.AdamW(p, lr=0.1), {"cycle_momentum": False}),
    ],
)
def test_a_scheduler_cycling_a_variable_momentum_runs_the_whole_schedule(factory, kwargs):
    loop, sched = _one_cycle_fit(factory, **kwargs)
    assert sched.last_epoch == loop.state.update == sched.total_steps  # every update, no more


def test_a_hand_written_loss_fn_trains_as_a_torch_loss_function():
    """PopTorch finds a graph's loss only as a torch loss op or an ``identity_loss``
    (poptorch ``python/_impl.py``: "Couldn't find a loss in graph!"); the loop marks
    ``loss_fn``'s result, so arithmetic losses train like ``F.mse_loss``."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    weights = []
    for loss_fn in (lambda o, t: ((o - t) ** 2).mean(), F.mse_loss):
        torch.manual_seed(1)
        m = nn.Linear(4, 1)
        loop = Loop(
            m, loss_fn=loss_fn, optimizer=poptorch.optim.SGD(m.parameters(), lr=0.1), progress=False
        )
        loop.fit(DataLoader(TensorDataset(x, y), batch_size=8), epochs=1)
        weights.append(m.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1])
