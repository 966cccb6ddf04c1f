"""The per-call shortcuts of the executor and the loop compute what their general paths do.

* ``PoplarExecutor._run_single`` (DI = GA = RF = 1) against the general ``_run``;
* ``inputs.as_ready`` (inputs taken as they are) against ``Signature.check`` and
  ``_prepare``: every input it cannot take goes the general way (checks, warnings, conversions);
* the device generator, swapped in and out only for models whose trace drew random numbers;
* the loss's backward run by the autograd engine directly, and gradients cleared after each
  update without ``zero_grad()`` where it is torch's own and no profiler records it;
* ``Loop``'s per-step test of the optimizer's hyper-parameters against ``_hyper``.

(``Layout.align`` / ``Layout.step_loss``, computed once per layout: ``test_outputs.py``.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchmetrics
from test_emulator_executor import (
    Dropper,  # Linear + Dropout(0.5), loss identity_loss(out.pow(2), "mean")
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ipuloop.emulator as poptorch
from ipuloop import Callback, Loop

IN, OUT, B = 5, 3, 4


class Outputs(nn.Module):
    """Returns a dict of outputs of several dtypes (int64 and float64 are narrowed), a
    non-tensor, and the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, y):
        out = self.fc(x)
        loss = nn.functional.cross_entropy(out, y)
        return (
            {"out": out, "pred": out.argmax(1), "wide": out.detach().double().sum(1)},
            "tag",
            loss,
        )


def _data(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, IN, generator=g), torch.randint(0, OUT, (B,), generator=g))
        for _ in range(n)
    ]


def _train(single: bool, mode, loss_scaling: float):
    model = Outputs()
    opts = poptorch.Options().outputMode(mode)
    ex = poptorch.trainingModel(
        model,
        opts,
        poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=loss_scaling),
    )
    batches = _data()
    ex.compile(*batches[0])
    assert ex._single  # DI = GA = RF = 1
    ex._single = single  # False: the general _run
    results = [ex(x, y) for x, y in batches]
    return results, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "mode",
    [
        poptorch.OutputMode.All,
        poptorch.OutputMode.Final,
        poptorch.OutputMode.Sum,
        poptorch.OutputMode.Default,
    ],
)
@pytest.mark.parametrize("loss_scaling", [1.0, 8.0])
def test_single_micro_batch_path_equals_general_path(mode, loss_scaling):
    fast, w_fast = _train(True, mode, loss_scaling)
    slow, w_slow = _train(False, mode, loss_scaling)
    for a, b in zip(fast, slow):
        (da, ta, la), (db, tb, lb) = a, b
        assert ta == tb == "tag" and set(da) == set(db) == {"out", "pred", "wide"}
        assert da["pred"].dtype == torch.int32 and da["wide"].dtype == torch.float32
        for k in da:
            assert da[k].dtype == db[k].dtype and torch.equal(da[k], db[k])
            assert not da[k].requires_grad
        assert la.dtype == lb.dtype and torch.equal(la, lb) and not la.requires_grad
    for k in w_fast:
        assert torch.equal(w_fast[k], w_slow[k])


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.fc(x)


def test_inputs_the_shortcut_cannot_take_get_the_general_checks():
    x = torch.randn(B, IN)
    model = poptorch.inferenceModel(Plain())
    expected = model(x)
    assert model._ready is not None  # float32 positional tensors on the CPU: the shortcut
    assert torch.equal(model(x.clone()), expected)
    got = model(x.clone().requires_grad_())  # detached (PopTorch warns once)
    assert torch.equal(got, expected) and not got.requires_grad
    strided = torch.cat([x, x], 1)[:, ::2]  # shape [B, IN], not contiguous
    strided.copy_(x)
    assert not strided.is_contiguous()
    assert torch.equal(model(strided), expected)  # made contiguous (PopTorch warns once)
    with pytest.raises(poptorch.Error, match="Data type mismatch"):
        model(x.double())
    with pytest.raises(poptorch.Error, match="Shape mismatch"):
        model(torch.randn(B, IN + 1))
    with pytest.raises(AssertionError, match="Too many arguments provided"):
        model(x, x)  # bound to forward(x), as PopTorch's argument parser does
    with pytest.raises(AssertionError, match="extra is not a valid parameter"):
        model(extra=x)


def test_float64_inputs_are_converted_on_every_call():
    x = torch.randn(B, IN, dtype=torch.float64)
    model = poptorch.inferenceModel(Plain())
    first = model(x)
    assert model._ready is None  # the shortcut never takes inputs that _prepare converts
    assert first.dtype == torch.float32
    assert torch.equal(model(x), first)
    assert torch.equal(first, Plain()(x.float()))


class NoRandom(Dropper):
    def forward(self, x, y):
        out = self.fc(x)
        return out, poptorch.identity_loss(out.pow(2), reduction="mean")


def _inputs(module):
    return torch.ones(B, module.fc.in_features), torch.zeros(B, 16)


def _calls(cls, seed, consume_host_rng=False):
    module = cls()
    model = poptorch.trainingModel(module, poptorch.Options().randomSeed(seed))
    x, y = _inputs(module)
    model.compile(x, y)
    if consume_host_rng:
        torch.rand(1000)
    host = torch.get_rng_state()
    states, outs = [model.rng_state], []
    for _ in range(2):
        outs.append(model(x, y)[0])
        states.append(model.rng_state)
    assert torch.equal(torch.get_rng_state(), host)  # calls never touch the host generator
    return model, outs, states


def test_random_model_draws_from_the_device_generator_each_call():
    model, a, states = _calls(Dropper, 42)
    assert model._draws_random
    _, b, _ = _calls(Dropper, 42, consume_host_rng=True)
    _, c, _ = _calls(Dropper, 43)
    assert all(torch.equal(p, q) for p, q in zip(a, b))  # the device's stream, not the host's
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0].eq(0), a[1].eq(0))  # each call drew a new mask
    assert not torch.equal(states[0], states[1]) and not torch.equal(states[1], states[2])


def test_model_without_random_ops_leaves_the_device_generator_as_it_was():
    model, outs, states = _calls(NoRandom, 42)
    assert not model._draws_random
    assert torch.equal(states[0], states[1]) and torch.equal(states[1], states[2])
    state = torch.Generator().manual_seed(5).get_state()
    model.rng_state = state  # still settable and readable
    model(*_inputs(model))
    assert torch.equal(model.rng_state, state)


class ScalarLoss(nn.Module):
    """The loss is a 0-dim parameter summed (its gradient a view of backward's seed) plus a
    regular loss: autograd may keep the seed's storage as that parameter's gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, OUT)
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, y):
        loss = self.w.sum() + nn.functional.cross_entropy(self.fc(x), y)
        return poptorch.identity_loss(loss, "sum") if poptorch.isRunningOnIpu() else loss


@pytest.mark.parametrize("ga,loss_scaling", [(1, 1.0), (3, 1.0), (3, 4.0)])
def test_engine_backward_equals_torch_backward(ga, loss_scaling):
    model = ScalarLoss()
    ref = ScalarLoss()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(ga)
    ex = poptorch.trainingModel(
        model,
        opts,
        poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=loss_scaling),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data(4):
        xs, ys = torch.cat([x] * ga), torch.cat([y] * ga)
        ex(xs, ys)
        for a in range(ga):
            (ref(xs[a * B : (a + 1) * B], ys[a * B : (a + 1) * B]) / ga).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)


class CountingSGD(poptorch.optim.SGD):
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.cleared = getattr(self, "cleared", 0) + 1
        super().zero_grad(set_to_none)


def test_an_optimizer_with_its_own_zero_grad_has_it_called_each_update():
    model = Outputs()
    ex = poptorch.trainingModel(
        model, poptorch.Options().deviceIterations(2), CountingSGD(model.parameters(), lr=0.1)
    )
    for x, y in _data(2):
        ex(torch.cat([x, x]), torch.cat([y, y]))
    assert ex._device_optimizer.cleared == 4  # DI = 2 updates per call
    assert all(p.grad is None for p in model.parameters())


def test_zero_grad_is_recorded_when_profiling():
    model = Outputs()
    ex = poptorch.trainingModel(
        model, poptorch.Options(), poptorch.optim.SGD(model.parameters(), lr=0.1)
    )
    x, y = _data(1)[0]
    ex(x, y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ex(x, y)
    names = {e.key for e in prof.key_averages()}
    assert any(n.startswith("Optimizer.zero_grad#") for n in names), sorted(names)
    assert any(n.startswith("Optimizer.step#") for n in names), sorted(names)


# ---------------------------------------------------------------------------------------------
# The loop's per-step test of the optimizer


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, y=None):
        out = self.fc(x)
        return out if y is None else (out, nn.functional.cross_entropy(out, y))


class Edit(Callback):
    """Runs ``edit(optimizer)`` before step ``at``; records the device's lr after each step."""

    def __init__(self, at: int, edit) -> None:
        self.at, self.edit, self.lrs, self.scaling = at, edit, [], []

    def on_train_step_start(self, loop):
        if loop.state.step == self.at:
            self.edit(loop.optimizer)

    def on_train_step_end(self, loop):
        dev = loop.train_model._device_optimizer
        self.lrs.append(float(dev.param_groups[0]["lr"]))
        self.scaling.append(float(getattr(dev, "loss_scaling", 1.0)))


def _fit(optimizer_factory, edit, at=3, steps=6):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(
        torch.randn(steps * B, IN, generator=g), torch.randint(0, OUT, (steps * B,), generator=g)
    )
    model = Mlp()
    cb = Edit(at, edit)
    loop = Loop(
        model, optimizer=optimizer_factory(model.parameters()), callbacks=[cb], progress=False
    )
    loop.fit(DataLoader(ds, batch_size=B), epochs=1)
    return loop, cb


def test_an_epoch_of_one_step_fits():
    loop, cb = _fit(lambda p: poptorch.optim.SGD(p, lr=0.1), lambda o: None, steps=1)
    assert loop.state.step == 1 and len(loop.state.history) == 1 and cb.lrs == [0.1]


def test_a_tensor_lr_changed_in_place_is_pushed():
    loop, cb = _fit(
        lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)),
        lambda o: o.param_groups[0]["lr"].fill_(0.05),
    )
    assert loop.optimizer_pushes == 1
    assert cb.lrs == pytest.approx([0.1] * 3 + [0.05] * 3)


def test_an_lr_set_to_an_equal_value_is_not_pushed_and_a_new_value_is():
    loop, _ = _fit(
        lambda p: poptorch.optim.SGD(p, lr=0.1),
        lambda o: o.param_groups[0].__setitem__("lr", float("0.1")),
    )
    assert loop.optimizer_pushes == 0
    loop, cb = _fit(
        lambda p: poptorch.optim.SGD(p, lr=0.1),
        lambda o: o.param_groups[0].__setitem__("lr", 0.025),
    )
    assert loop.optimizer_pushes == 1 and cb.lrs == pytest.approx([0.1] * 3 + [0.025] * 3)


def test_a_changed_optimizer_attribute_is_pushed():
    loop, cb = _fit(
        lambda p: poptorch.optim.SGD(p, lr=0.1, loss_scaling=2.0),
        lambda o: setattr(o, "loss_scaling", 4.0),
    )
    assert loop.optimizer_pushes == 1
    assert cb.scaling == [2.0] * 3 + [4.0] * 3


class EpochLr(Callback):
    """Sets the lr as each epoch starts (no hook runs between steps); records the lr the
    device used in each epoch and the steps' losses."""

    def __init__(self) -> None:
        self.device_lrs: list[float] = []

    def on_epoch_start(self, loop):
        loop.optimizer.param_groups[0]["lr"] = 0.1 / (loop.state.epoch + 1)

    def on_epoch_end(self, loop):
        dev = loop.train_model._device_optimizer
        self.device_lrs.append(float(dev.param_groups[0]["lr"]))


def test_an_lr_set_as_an_epoch_starts_is_pushed_before_its_first_step_without_step_hooks():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * B, IN, generator=g), torch.randint(0, OUT, (4 * B,), generator=g)
    model = Mlp()
    ref = copy.deepcopy(model)
    cb = EpochLr()
    loop = Loop(
        model,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5),
        callbacks=[cb],
        progress=False,
    )
    loop.fit(DataLoader(TensorDataset(x, y), batch_size=B), epochs=3)
    assert cb.device_lrs == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert loop.optimizer_pushes == 2  # compiled at 0.1 (after the hook), then each later epoch
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for epoch in range(3):  # the same math in plain torch
        opt.param_groups[0]["lr"] = 0.1 / (epoch + 1)
        for i in range(4):
            opt.zero_grad()
            ref(x[i * B : (i + 1) * B], y[i * B : (i + 1) * B])[1].backward()
            opt.step()
    for a, b in zip(loop.model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("callbacks", "metrics", "compares"),
    [
        ([], None, 3),  # no user code between steps: each epoch's first step
        ([EpochLr()], None, 3),  # epoch hooks only: the same
        ([Edit(99, lambda o: None)], None, 12),  # step hooks: every step
        ([], "acc", 12),  # metrics (user code) between steps: every step
    ],
)
def test_the_optimizer_is_compared_where_user_code_ran_between_steps(
    monkeypatch, callbacks, metrics, compares
):
    from ipuloop.executors import Executors

    calls = []
    push = Executors.push_optimizer
    monkeypatch.setattr(Executors, "push_optimizer", lambda self: calls.append(1) or push(self))
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(4 * B, IN, generator=g), torch.randint(0, OUT, (4 * B,)))
    model = Mlp()
    loop = Loop(
        model,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=callbacks,
        metrics=None
        if metrics is None
        else {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=OUT)},
        progress=False,
    )
    loop.fit(DataLoader(ds, batch_size=B), epochs=3)
    assert len(calls) == compares


def test_a_new_key_in_a_group_is_a_change():
    loop, _ = _fit(
        lambda p: poptorch.optim.SGD(p, lr=0.1),
        lambda o: o.param_groups[0].__setitem__("initial_lr", 0.1),
    )
    assert loop.optimizer_pushes == 1
