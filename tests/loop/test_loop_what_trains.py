"""What the user wrote is what trains: each case against plain torch on the same data and weights,
or against one uninterrupted fit.

- a fit continued on the same loop (after ``max_steps``, ``stop()``, an error or Ctrl-C) goes on
  in the epoch's order, as a resume from a checkpoint does;
- weights a callback writes between steps reach the device, and the fit's end keeps them;
- each submodule keeps the train/eval mode the user set (a frozen BatchNorm stays frozen);
- the loss a model-with-loss returns is the loss that trains (``0.25 * ce``, ``ce + l2``...).
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, Loop, poptorch

X = torch.randn(96, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randn(96, 1, generator=torch.Generator().manual_seed(1))


def net(seed: int = 1, norm: bool = False, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    middle = nn.BatchNorm1d(8) if norm else nn.Dropout(dropout)
    return nn.Sequential(nn.Linear(6, 8), middle, nn.ReLU(), nn.Linear(8, 1))


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k].float() - b[k].float()).abs().max())


def plain_torch(model: nn.Module, epochs: int, micro: int, lr: float, between=None) -> None:
    """SGD on micro-batches of ``micro`` in order, one update each (DI > 1, GA 1: the same)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for epoch in range(epochs):
        for i in range(0, len(X), micro):
            opt.zero_grad()
            F.mse_loss(model(X[i : i + micro]), Y[i : i + micro]).backward()
            opt.step()
        if between is not None:
            between(model, epoch)


# -- a fit continued on the same loop ----------------------------------------------------------


class Interrupt(Callback):
    """Ends the fit after steps ``at`` (once each): ``stop()``, an error or Ctrl-C."""

    def __init__(self, at: set[int], how: str) -> None:
        self.at, self.how, self.done = at, how, set()

    def on_train_step_end(self, loop) -> None:
        step = loop.state.step
        if step not in self.at or step in self.done:
            return
        self.done.add(step)
        if self.how == "stop":
            loop.stop()
        elif self.how == "error":
            raise RuntimeError("interrupted")
        else:
            raise KeyboardInterrupt


def continued(how: str | None, workers: int = 0, async_data: bool = False) -> tuple:
    """A shuffled fit of 2 epochs (12 steps each, dropout drawing from the RNG), ended after
    steps 3 and 7 (and 14 with ``max_steps``) and continued each time on the same loop."""
    torch.manual_seed(5)
    model = net(dropout=0.2)
    callbacks = [Interrupt({3, 7, 14}, how)] if how not in (None, "max_steps") else []
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.MSELoss(),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05),
        progress=False,
        callbacks=callbacks,
        async_data=async_data,
    )
    loader = DataLoader(
        TensorDataset(X, Y),
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(3),
    )
    stops = [3, 7, 14] if how == "max_steps" else []
    for _ in range(5):
        try:
            loop.fit(loader, epochs=2, max_steps=stops.pop(0) if stops else None)
        except (RuntimeError, KeyboardInterrupt):
            continue
        if loop.state.epoch == 2:
            break
    losses = [h["train_loss"] for h in loop.state.history]
    return weights(model), loop.state.step, loop.state.samples, losses


@pytest.mark.parametrize("how", ["max_steps", "stop", "error", "ctrl_c"])
def test_a_fit_continued_after_it_ended_mid_epoch_equals_one_uninterrupted_fit(how):
    whole = continued(None)
    parts = continued(how)
    assert parts[1:3] == whole[1:3] == (24, 24 * 8)
    assert_same(parts[0], whole[0])
    assert parts[3] == whole[3]  # the epochs' losses too: each sample read once


@pytest.mark.parametrize(("workers", "async_data"), [(1, False), (0, True)])
def test_a_continued_fit_reading_with_workers_or_ahead_equals_one_uninterrupted_fit(
    workers, async_data
):
    whole = continued(None, workers, async_data)
    parts = continued("stop", workers, async_data)
    assert parts[1] == whole[1] == 24
    assert_same(parts[0], whole[0])


def test_a_continued_fit_with_a_loader_of_other_factors_is_refused_naming_them():
    model = net()
    loop = Loop(model, loss_fn=nn.MSELoss(), progress=False)
    loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True), max_steps=3)
    with pytest.raises(ValueError, match="micro-batch size 4 -> 5"):
        loop.fit(DataLoader(TensorDataset(X, Y), batch_size=5, shuffle=True))


# -- weights written by a callback -------------------------------------------------------------


class Surgery(Callback):
    """Writes the weights in place at each epoch end, as ``edit(model, epoch)`` says."""

    def __init__(self, model: nn.Module, edit) -> None:
        self.model, self.edit = model, edit

    def on_epoch_end(self, loop) -> None:
        self.edit(self.model, loop.state.epoch - 1)


def halve(model: nn.Module, epoch: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(0.5)  # (``.data``: no version counter records it)


def reinit_head(model: nn.Module, epoch: int) -> None:
    torch.manual_seed(100 + epoch)
    model[3].reset_parameters()  # a head re-initialised


def clamp_running_var(model: nn.Module, epoch: int) -> None:
    model[1].running_var.clamp_(max=0.5)  # a buffer written


@pytest.mark.parametrize("edit", [halve, reinit_head, clamp_running_var])
@pytest.mark.parametrize("validate", [False, True])
def test_weights_a_callback_writes_between_steps_train_on_and_are_kept(edit, validate):
    norm = edit is clamp_running_var
    model, reference = net(norm=norm), net(norm=norm)
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.MSELoss(),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05),
        progress=False,
        callbacks=[Surgery(model, edit)],
    )
    val = DataLoader(TensorDataset(X, Y), batch_size=4) if validate else None
    loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4), epochs=3, val_loader=val)
    plain_torch(reference, 3, 4, 0.05, between=edit)
    assert_same(weights(model), weights(reference))


class Replace(Callback):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def on_epoch_end(self, loop) -> None:
        self.model[3] = nn.Linear(8, 1)


def test_a_parameter_replaced_by_a_callback_is_refused_naming_it():
    model = net()
    loop = Loop(model, loss_fn=nn.MSELoss(), progress=False, callbacks=[Replace(model)])
    with pytest.raises(ValueError, match=r"parameter '(model\.)?3\.weight' is a new tensor"):
        loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4), epochs=2)


def test_a_loop_that_only_reads_the_weights_between_steps_trains_as_without():
    class Read(Callback):
        def on_train_step_end(self, loop) -> None:
            self.norm = sum(float(p.norm()) for p in model.parameters())

    runs = []
    for callbacks in ([], [Read()]):
        model = net(norm=True)
        loop = Loop(model, loss_fn=nn.MSELoss(), progress=False, callbacks=callbacks)
        loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4), epochs=2)
        runs.append(weights(model))
    assert_same(*runs)


# -- each submodule's mode -----------------------------------------------------------------------


def frozen_norm() -> nn.Sequential:
    model = net(norm=True)
    model[1].eval()  # the usual fine-tuning recipe: statistics and affine frozen
    model[1].requires_grad_(False)
    return model


def test_a_frozen_batchnorm_stays_frozen_through_training_validation_and_predict():
    model, reference = frozen_norm(), frozen_norm()
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.MSELoss(),
        optimizer=poptorch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05),
        progress=False,
    )
    val = DataLoader(TensorDataset(X, Y), batch_size=4)
    loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4), epochs=2, val_loader=val)
    plain_torch(reference, 2, 4, 0.05)
    assert_same(weights(model), weights(reference))  # running statistics untouched
    assert [m.training for m in model.modules()] == [True, True, False, True, True]
    loop.predict(DataLoader(TensorDataset(X), batch_size=4))
    loop.validate(val)
    assert [m.training for m in model.modules()] == [True, True, False, True, True]


def test_a_model_in_eval_mode_trains_in_it_with_a_warning_naming_the_fix():
    model, reference = net(norm=True), net(norm=True)
    model.eval()
    reference.eval()
    loop = Loop(model, loss_fn=nn.MSELoss(), progress=False)
    with pytest.warns(UserWarning, match=r"eval mode as the fit starts.*model\.train\(\)"):
        loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4))
    plain_torch(reference, 1, 4, 0.01)
    assert_same(weights(model), weights(reference))
    assert not any(m.training for m in model.modules())


def test_a_model_in_train_mode_gets_no_mode_warning():
    loop = Loop(frozen_norm(), loss_fn=nn.MSELoss(), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4), max_steps=2)


# -- the returned loss is the loss that trains ---------------------------------------------------


class WithExpression(nn.Module):
    """A model-with-loss returning a loss expression (``expression``)."""

    def __init__(self, expression: str, returns: str = "tuple") -> None:
        super().__init__()
        self.net = net()
        self.expression = expression
        self.returns = returns

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mse = F.mse_loss(out, y)
        if self.expression == "scaled":
            return 0.25 * mse
        if self.expression == "l2":
            return mse + 0.01 * sum((p**2).sum() for p in self.net.parameters())
        if self.expression == "weighted":
            return 0.7 * mse + 0.3 * F.l1_loss(out, y)
        if self.expression == "identity":
            return poptorch.identity_loss((out - y) ** 2, reduction="mean")
        return mse

    def forward(self, x, y=None):
        out = self.net(x)
        if y is None:
            return out
        loss = self.loss(out, y)
        if self.returns == "dict":
            return {"loss": loss, "logits": out}
        return out, loss


@pytest.mark.parametrize("expression", ["plain", "scaled", "l2", "weighted", "identity"])
@pytest.mark.parametrize("returns", ["tuple", "dict"])
def test_the_returned_loss_is_the_loss_that_trains(expression, returns):
    model, reference = WithExpression(expression, returns), WithExpression(expression)
    opts = poptorch.Options().deviceIterations(2)
    opts.outputMode(poptorch.OutputMode.All)  # every micro-batch's loss: exact epoch losses
    opts.Training.gradientAccumulation(2)
    loop = Loop(
        model,
        opts,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05),
        progress=False,
    )
    history = loop.fit(DataLoader(TensorDataset(X, Y), batch_size=3), epochs=2)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    logged = []
    for _ in range(2):
        total = 0.0
        for i in range(0, len(X), 6):  # one update on the mean of 2 micro-batches of 3
            opt.zero_grad()
            a = reference.loss(reference.net(X[i : i + 3]), Y[i : i + 3])
            b = reference.loss(reference.net(X[i + 3 : i + 6]), Y[i + 3 : i + 6])
            ((a + b) / 2).backward()
            opt.step()
            total += float(a) + float(b)
        logged.append(total / (len(X) // 3))
    torch.testing.assert_close(weights(model), weights(reference), rtol=1e-5, atol=1e-6)
    # the logs show the value that trained
    assert [h["train_loss"] for h in history] == pytest.approx(logged, rel=1e-5)


def test_the_loss_is_marked_only_while_a_fit_runs_and_the_model_still_pickles():
    model = WithExpression("scaled")
    loop = Loop(model, progress=False)
    loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4), max_steps=1)
    assert not model._forward_hooks
    pickle.loads(pickle.dumps(WithExpression("scaled")))


def test_programs_calling_poptorch_directly_keep_poptorchs_rule():
    """Outside the loop, PopTorch's rule holds: the graph's final loss is the torch loss
    function's output, not arithmetic done on it after (docs/poptorch-semantics.md)."""
    model, reference = WithExpression("scaled"), WithExpression("plain")
    opts = poptorch.Options()
    trained = poptorch.trainingModel(
        model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1)
    )
    trained(X[:4], Y[:4])
    trained.detachFromDevice()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.mse_loss(reference.net(X[:4]), Y[:4]).backward()  # the bare loss, as PopTorch trains it
    opt.step()
    torch.testing.assert_close(weights(model.net), weights(reference.net))


@pytest.mark.parametrize(("expression", "hooked"), [("plain", False), ("scaled", True)])
def test_the_mark_stays_only_where_the_returned_loss_needs_it(expression, hooked):
    """A loss op's own output needs no mark: the hook leaves after the first training call, so
    the model's calls take torch's fast path again; an expression keeps it."""
    seen = []

    class Look(Callback):
        def on_train_step_end(self, loop) -> None:
            seen.append(bool(model._forward_hooks))

    model = WithExpression(expression)
    loop = Loop(model, progress=False, callbacks=[Look()])
    loop.fit(DataLoader(TensorDataset(X, Y), batch_size=4), max_steps=3)
    assert seen == [hooked] * 3


# -- nothing before the first step changes the model -----------------------------------------------
class WithAverage(nn.Module):
    """A model-with-loss keeping a running average of its outputs as a parameter, written in
    place under ``no_grad`` in ``forward`` (a target network's EMA), and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(6, 1)
        self.bn = nn.BatchNorm1d(1)
        self.avg = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, x, y=None):
        out = self.bn(self.lin(x))
        with torch.no_grad():
            self.avg.mul_(0.9).add_(0.1 * out.mean())
        return out if y is None else (out, F.mse_loss(out, y))


def test_the_host_check_and_the_compile_leave_every_weight_as_it_was():
    """The host check runs a micro-batch through the model and the compile traces one: neither
    moves a parameter or a buffer, so the first step starts from the user's weights and the
    fit's in-place writes are those of plain torch, one per micro-batch."""
    model = WithAverage()
    before = weights(model)
    seen = {}

    class AtCompileEnd(Callback):
        def on_compile_end(self, loop):
            loop.train_model.copyWeightsToHost()
            seen.update(weights(loop.model))

    loop = Loop(
        model,
        progress=False,
        callbacks=[AtCompileEnd()],
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05),
    )
    loop.fit(DataLoader(TensorDataset(X, Y), batch_size=8), epochs=2)
    assert_same(seen, before)
    reference = WithAverage()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(2):
        for i in range(0, len(X), 8):
            opt.zero_grad()
            reference(X[i : i + 8], Y[i : i + 8])[1].backward()
            opt.step()
    for k, v in weights(reference).items():
        torch.testing.assert_close(weights(model)[k], v, rtol=2e-5, atol=1e-7, msg=k)
