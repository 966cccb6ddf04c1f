"""A differential test of ``Loop.fit`` against plain torch: a drawn configuration, trained by
the loop on the emulator and by an independent plain-torch loop written here, must end with the
same weights, log the same losses and compute the same metrics.

What is drawn (``configs``): device iterations (1-3), gradient accumulation (1-3), replicas (1-2,
through the options or ``Loop(replicas=)``), the output mode (Final, All, Sum, Default), the
micro-batch size (1-4), the steps of an epoch (2-5, plus a dropped remainder), epochs (1-2),
shuffle, loader workers (0; 0 or 1, a quarter of the time, in the slow variant), the task
(classification: cross entropy and Accuracy; regression: MSE and MeanSquaredError), a metric
or none, the API (a model-with-loss, or a plain model with ``loss_fn=``), the optimizer
(``poptorch.optim`` SGD, SGD with momentum, Adam), the learning rate's course (constant;
``LRScheduler(LambdaLR)`` per update; a callback setting it in ``on_epoch_start``; a callback
changing it at one step's end), the loss expression, an interruption (a stop with
``fit(max_steps=k)`` and a second ``fit`` on the same loop; a ``state_dict`` taken at step k,
after ``fit(max_steps=k)`` or by a callback in the running fit, loaded into a new loop with a
fresh model and loader), a callback halving a weight in ``on_epoch_end``, a validation at each
epoch end or none, and a BatchNorm the user put in eval mode.

The reference's rules (``reference``), from docs/poptorch-semantics.md §2 and docs/loop.md:

- One step reads ``B*DI*GA*RF`` samples of the epoch's order; micro-batch ``(d, a, r)`` is the
  ``B`` samples at ``((d*GA + a)*RF + r)*B``. The remainder of an epoch is dropped.
- Each of the DI updates of a step is one ``torch.optim`` step on the Mean of its GA x RF
  micro-batch gradients (each micro-batch loss divided by GA*RF before its backward).
- The step loss (``state.logs["loss"]``) is the mean of the losses of the micro-batches the
  output mode returns: all of them under All and Sum (and Default, which is All with metrics
  and Sum without), the last micro-batch (d = DI-1, a = GA-1) of each replica under Final.
  ``train_loss`` and ``train_<metric>`` are over the same micro-batches of the epoch.
- Validation runs at each epoch end, in eval mode, after the epoch's last step and before
  ``on_epoch_end``: ``val_loss`` is the mean of the micro-batch losses (the validation set is
  whole host calls, so no padding), ``val_<metric>`` the metric over every sample.
- The learning rate: ``LRScheduler`` steps its scheduler DI times after each step, so step s
  runs the schedule's LR of update ``s*DI``; an ``on_epoch_start`` callback sets it before the
  epoch's first step; a step-end callback at step k sets it for the steps after k.
- A callback's in-place weight edit in ``on_epoch_end`` happens after that epoch's validation
  and is in the next step's weights (and the final ones).
- A user's ``eval()`` on a submodule stays: the frozen BatchNorm uses its running statistics
  and never updates them.
- An interruption changes nothing: a stopped and continued fit, and a fit resumed from a
  ``state_dict`` in a new loop, train and log as the uninterrupted fit does.

The sample order: plain torch's. The reference iterates a torch ``DataLoader`` made as the
loop's is (the same sampler, over a generator seeded as the loader's) each epoch
(``epoch_orders``); it never reads the loop's order. ``test_the_loop_reads_the_order_the_
reference_draws`` pins the loop's order down against it. The loaders' own settings (workers,
samplers, collate functions, streams) are searched in ``test_differential_data.py``.

Replaying a failure: Hypothesis prints the falsifying ``Config(...)`` (and a
``@reproduce_failure`` blob); ``check(Config(...))`` runs that one configuration alone, e.g.
``python -c "import sys; sys.path.insert(0, 'tests'); from test_differential import *;
check(Config(...))"``.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import LRScheduler

# -- sizes ----------------------------------------------------------------------------------------
IN, HIDDEN, CLASSES = 3, 4, 3
LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01}
EDIT = 0.5  # the weight edit's factor
LR_CHANGE = 0.3  # the step-end callback's LR, as a fraction of the base LR
# Tolerances. The weights are compared exactly: in 600 drawn configurations (814 loops, the
# resumed ones too), and 1,500 more since, the loop's weights were bitwise the reference's.
# The reference's ``loss / (GA*RF)`` and the emulator's ``loss * (1 / (GA*RF))`` seed their
# backward with the same float32 number (1 / (GA*RF) rounded once), and the gradients add up in
# the same [DI, GA, RF] order. Should a change reorder float32 additions (a fused reduction over the
# micro-batches, say), relax this to a few float32 ulps, rtol 1e-6 and atol 1e-7 (not to hide a
# wrong factor: a wrong Mean is off by 10% or more). The logged losses: the loop's float32
# means against the reference's float64 sums of the float32 micro-batch losses; the largest
# difference seen was 1.45e-7 relative (one float32 ulp), so 1e-7 flakes and 1e-6 is one step
# looser.
WEIGHTS_TOL = {"rtol": 0.0, "atol": 0.0}
LOSS_REL = 1e-6


# -- the model and data ---------------------------------------------------------------------------
def base_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) if task == "cls" else F.mse_loss(out, y)


def second_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.multi_margin_loss(out, y) if task == "cls" else F.l1_loss(out, y)


def loss_expression(model: Net, expr: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss a model-with-loss returns (and the reference trains): ``expr`` of its loss."""
    task = model.task
    if expr == "plain":
        return base_loss(task, out, y)
    if expr == "scaled":
        return 0.25 * base_loss(task, out, y)
    if expr == "l2":
        return base_loss(task, out, y) + 0.01 * (model.fc1.weight**2).sum()
    assert expr == "two"
    return 0.7 * base_loss(task, out, y) + 0.3 * second_loss(task, out, y)


class Net(nn.Module):
    """Linear, an optional BatchNorm (frozen: in eval mode, with non-trivial running
    statistics), tanh, Linear; with ``expr`` a model-with-loss, without a plain model."""

    def __init__(self, task: str, expr: str | None, frozen_bn: bool) -> None:
        super().__init__()
        self.task, self.expr = task, expr
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.bn: nn.Module = nn.BatchNorm1d(HIDDEN) if frozen_bn else nn.Identity()
        self.fc2 = nn.Linear(HIDDEN, CLASSES if task == "cls" else 1)
        if frozen_bn:
            with torch.no_grad():
                self.bn.running_mean.uniform_(-0.5, 0.5)
                self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.eval()

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.fc2(torch.tanh(self.bn(self.fc1(x))))
        if self.expr is None or y is None:
            return out
        return out, loss_expression(self, self.expr, out, y)


def make_model(cfg: Config, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(cfg.task, None if cfg.api == "loss_fn" else cfg.expr, cfg.frozen_bn)


def make_data(cfg: Config, n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    if cfg.task == "cls":
        y = torch.randint(0, CLASSES, (n,), generator=g)
    else:
        y = x[:, :1] - 0.5 * x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_metric(cfg: Config) -> torchmetrics.Metric:
    if cfg.task == "cls":
        return torchmetrics.Accuracy("multiclass", num_classes=CLASSES)
    return torchmetrics.MeanSquaredError()


def make_loss_fn(cfg: Config) -> nn.Module:
    return nn.CrossEntropyLoss() if cfg.task == "cls" else nn.MSELoss()


# -- the configuration ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    di: int
    ga: int
    rf: int
    rf_via_loop: bool  # Loop(replicas=) rather than opts.replicationFactor
    mode: str  # Final, All, Sum, Default
    micro: int
    steps: int  # host calls per epoch
    remainder: int  # samples dropped each epoch
    epochs: int
    shuffle: bool
    workers: int
    task: str  # cls, reg
    metric: bool
    api: str  # with_loss, loss_fn
    expr: str  # plain, scaled, l2, two
    optimizer: str  # sgd, momentum, adam
    lr_course: str  # constant, lambda, epoch, step_change
    lr_step: int  # step_change: the step whose end changes the LR (1-based)
    validate: bool  # a val_loader (validation at each epoch end)
    interrupt: str  # none, continue, resume_stop, resume_cb
    at: int  # the interruption's step (1-based, before the last step)
    weight_edit: bool
    frozen_bn: bool
    seed: int  # data, weights and the loader's generator

    @property
    def combined(self) -> int:
        return self.micro * self.di * self.ga * self.rf

    @property
    def samples(self) -> int:
        return self.steps * self.combined + self.remainder

    @property
    def total_steps(self) -> int:
        return self.steps * self.epochs

    @property
    def val_samples(self) -> int:  # whole inference host calls: no padding
        return 2 * self.combined

    @property
    def metrics_on(self) -> bool:
        return self.metric and self.mode != "Sum"  # Sum returns no outputs: refused


@st.composite
def configs(draw: st.DrawFn, workers: tuple[int, ...] = (0,)) -> Config:
    di, ga, rf = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    micro = draw(st.integers(1, 4))
    epochs = draw(st.integers(1, 2))
    steps = draw(st.integers(2, 5))
    api = draw(st.sampled_from(["with_loss", "loss_fn"]))
    expr = "plain" if api == "loss_fn" else draw(st.sampled_from(["plain", "scaled", "l2", "two"]))
    shuffle = draw(st.booleans())
    interrupts = ["none", "resume_stop", "resume_cb", "continue"]
    total = steps * epochs
    validate = draw(st.booleans())
    edit = draw(st.booleans())
    return Config(
        di=di,
        ga=ga,
        rf=rf,
        rf_via_loop=draw(st.booleans()),
        mode=draw(st.sampled_from(["Default", "All", "Sum", "Final"])),
        micro=micro,
        steps=steps,
        remainder=draw(st.integers(0, micro * di * ga * rf - 1)),
        epochs=epochs,
        shuffle=shuffle,
        workers=draw(st.sampled_from(workers)),
        task=draw(st.sampled_from(["cls", "reg"])),
        metric=draw(st.booleans()),
        api=api,
        expr=expr,
        optimizer=draw(st.sampled_from(["sgd", "momentum", "adam"])),
        lr_course=draw(st.sampled_from(["constant", "lambda", "epoch", "step_change"])),
        lr_step=draw(st.integers(1, total)),
        validate=validate,
        interrupt=draw(st.sampled_from(interrupts)),
        at=draw(st.integers(1, total - 1)),
        weight_edit=edit,
        frozen_bn=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def lr_factor(update: int) -> float:
    """The ``LambdaLR`` schedule: the LR of ``update`` as a fraction of the base LR."""
    return 1.0 / (1.0 + 0.3 * update)


# -- the reference: plain torch -------------------------------------------------------------------
def epoch_orders(cfg: Config, generator_seed: int) -> list[list[int]]:
    """Each epoch's sample order: plain torch's, iterating a loader made as ``make_loader``
    makes the loop's (over the indices, the same sampler and generator)."""
    g = torch.Generator().manual_seed(generator_seed)
    loader = DataLoader(range(cfg.samples), batch_size=cfg.micro, shuffle=cfg.shuffle, generator=g)
    return [[int(i) for batch in loader for i in batch] for _ in range(cfg.epochs)]


def set_train(model: Net) -> None:
    """Train mode, but for the frozen BatchNorm the user left in eval mode."""
    model.train()
    if isinstance(model.bn, nn.BatchNorm1d):
        model.bn.eval()


def reference(cfg: Config, model: Net, data: TensorDataset, val: TensorDataset) -> dict:
    """The fit, in plain torch: its final weights, step losses and epoch logs."""
    model = copy.deepcopy(model)
    model.expr = cfg.expr  # (the loss_fn API computes the same loss)
    base = LR[cfg.optimizer]
    params = list(model.parameters())
    if cfg.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=base)
    else:
        momentum = 0.9 if cfg.optimizer == "momentum" else 0.0
        opt = torch.optim.SGD(params, lr=base, momentum=momentum)
    x, y = data.tensors
    di, ga, rf, b = cfg.di, cfg.ga, cfg.rf, cfg.micro
    step_losses: list[float] = []
    history: list[dict[str, float]] = []
    lr = base
    step = 0
    set_train(model)
    for epoch, order in enumerate(epoch_orders(cfg, cfg.seed)):
        if cfg.lr_course == "epoch":
            lr = base * 0.5**epoch
        selected: list[tuple[float, torch.Tensor, torch.Tensor]] = []
        for s in range(cfg.steps):
            if cfg.lr_course == "lambda":
                lr = base * lr_factor(step * di)
            elif cfg.lr_course == "step_change":
                lr = base * LR_CHANGE if step >= cfg.lr_step else base
            for group in opt.param_groups:
                group["lr"] = lr
            host = order[s * cfg.combined : (s + 1) * cfg.combined]
            rows = []
            for d in range(di):
                for a in range(ga):
                    for r in range(rf):
                        at = ((d * ga + a) * rf + r) * b
                        idx = host[at : at + b]
                        out, loss = model(x[idx], y[idx])
                        (loss / (ga * rf)).backward()
                        returned = cfg.mode != "Final" or (d == di - 1 and a == ga - 1)
                        if returned:
                            rows.append((loss.item(), out.detach(), y[idx]))
                opt.step()
                opt.zero_grad()
            step_losses.append(math.fsum(r[0] for r in rows) / len(rows))
            selected += rows
            step += 1
        logs = {"train_loss": math.fsum(r[0] for r in selected) / len(selected)}
        if cfg.metrics_on:
            metric = make_metric(cfg)
            for _, out, labels in selected:
                metric.update(out, labels)
            logs["train_metric"] = float(metric.compute())
        if cfg.validate:
            logs.update(validation(cfg, model, val))
        history.append(logs)
        if cfg.weight_edit:
            with torch.no_grad():
                model.fc1.weight.mul_(EDIT)
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "step_losses": step_losses,
        "history": history,
    }


def validation(cfg: Config, model: Net, val: TensorDataset) -> dict[str, float]:
    """val_loss and val_metric, in eval mode, over micro-batches of B."""
    b = cfg.micro
    vx, vy = val.tensors
    outs, losses = [], []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(vy), b):
            out, loss = model(vx[i : i + b], vy[i : i + b])
            outs.append(out)
            losses.append(loss.item())
    set_train(model)
    logs = {"val_loss": math.fsum(losses) / len(losses)}
    if cfg.metrics_on:
        metric = make_metric(cfg)
        metric.update(torch.cat(outs), vy)
        logs["val_metric"] = float(metric.compute())
    return logs


# -- the loop -------------------------------------------------------------------------------------
class Recorder(Callback):
    """Each step's logged loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, loop: Loop) -> None:
        self.losses.append(loop.state.logs["loss"])


class EpochLR(Callback):
    def __init__(self, base: float) -> None:
        self.base = base

    def on_epoch_start(self, loop: Loop) -> None:
        for group in loop.optimizer.param_groups:
            group["lr"] = self.base * 0.5**loop.state.epoch


class ChangeLR(Callback):
    def __init__(self, base: float, step: int) -> None:
        self.base, self.step = base, step

    def on_train_step_end(self, loop: Loop) -> None:
        if loop.state.step == self.step:
            for group in loop.optimizer.param_groups:
                group["lr"] = self.base * LR_CHANGE


class EditWeight(Callback):
    def __init__(self, model: Net) -> None:
        self.model = model

    def on_epoch_end(self, loop: Loop) -> None:
        with torch.no_grad():
            self.model.fc1.weight.mul_(EDIT)


class Snapshot(Callback):
    """``loop.state_dict()`` at the end of step ``at``, after the other callbacks' step ends."""

    order = 90

    def __init__(self, at: int) -> None:
        self.at, self.sd = at, None

    def on_train_step_end(self, loop: Loop) -> None:
        if loop.state.step == self.at:
            self.sd = loop.state_dict()


def make_loop(cfg: Config, model: Net, extra: tuple[Callback, ...] = ()) -> tuple[Loop, Recorder]:
    """A loop over ``model`` with the configuration's options, optimizer and callbacks."""
    opts = poptorch.Options().deviceIterations(cfg.di)
    opts.Training.gradientAccumulation(cfg.ga)
    if not cfg.rf_via_loop:
        opts.replicationFactor(cfg.rf)
    opts.outputMode(getattr(poptorch.OutputMode, cfg.mode))
    base = LR[cfg.optimizer]
    if cfg.optimizer == "adam":
        opt = poptorch.optim.Adam(model.parameters(), lr=base)
    elif cfg.optimizer == "momentum":
        opt = poptorch.optim.SGD(model.parameters(), lr=base, momentum=0.9)
    else:
        opt = poptorch.optim.SGD(model.parameters(), lr=base)
    recorder = Recorder()
    callbacks: list[Callback] = [recorder, *extra]
    if cfg.lr_course == "lambda":
        callbacks.append(LRScheduler(torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)))
    elif cfg.lr_course == "epoch":
        callbacks.append(EpochLR(base))
    elif cfg.lr_course == "step_change":
        callbacks.append(ChangeLR(base, cfg.lr_step))
    if cfg.weight_edit:
        callbacks.append(EditWeight(model))
    loop = Loop(
        model,
        opts,
        optimizer=opt,
        loss_fn=make_loss_fn(cfg) if cfg.api == "loss_fn" else None,
        metrics={"metric": make_metric(cfg)} if cfg.metrics_on else None,
        callbacks=callbacks,
        replicas=cfg.rf if cfg.rf_via_loop else None,
        progress=False,
    )
    return loop, recorder


def make_loader(cfg: Config, data: TensorDataset, generator_seed: int) -> DataLoader:
    return DataLoader(
        data,
        batch_size=cfg.micro,
        shuffle=cfg.shuffle,
        num_workers=cfg.workers,
        generator=torch.Generator().manual_seed(generator_seed),
    )


@dataclass
class Run:
    """What one loop that finished the fit ends with: its weights, the losses its recorders
    saw (from step ``first`` on, 0-based) and its history."""

    name: str
    weights: dict[str, torch.Tensor]
    losses: list[float]
    first: int
    history: list[dict[str, float]]
    counters: dict[str, int]


def run_loop(cfg: Config, init: Net, data: TensorDataset, val: TensorDataset) -> list[Run]:
    """Fit as ``cfg`` says (interrupted or not); every loop that ends the fit is a ``Run``."""
    model = copy.deepcopy(init)
    snapshot = Snapshot(cfg.at) if cfg.interrupt == "resume_cb" else None
    loop, rec = make_loop(cfg, model, (snapshot,) if snapshot else ())
    loader = make_loader(cfg, data, cfg.seed)
    val_loader = DataLoader(val, batch_size=cfg.micro) if cfg.validate else None
    fit = {"epochs": cfg.epochs, "val_loader": val_loader}
    runs = []
    if cfg.interrupt in ("continue", "resume_stop"):
        loop.fit(loader, max_steps=cfg.at, **fit)
        assert loop.state.step == cfg.at
    if cfg.interrupt != "resume_stop":
        history = loop.fit(loader, **fit)
        runs.append(Run("loop", weights_of(model), rec.losses, 0, history, counters(loop)))
    if cfg.interrupt in ("resume_stop", "resume_cb"):
        sd = snapshot.sd if snapshot else loop.state_dict()
        assert sd is not None, "no state_dict taken"
        fresh = make_model(cfg, cfg.seed + 1)  # other weights, overwritten by the state
        loop2, rec2 = make_loop(cfg, fresh)
        loop2.load_state_dict(sd)
        # another generator: the checkpoint's order and generator state must win
        history = loop2.fit(make_loader(cfg, data, cfg.seed + 7), **fit)
        losses = (rec.losses if cfg.interrupt == "resume_stop" else []) + rec2.losses
        first = 0 if cfg.interrupt == "resume_stop" else cfg.at
        runs.append(Run("resumed", weights_of(fresh), losses, first, history, counters(loop2)))
    return runs


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def counters(loop: Loop) -> dict[str, int]:
    return {k: loop.state.counters()[k] for k in ("epoch", "step", "update")}


# -- the checks -----------------------------------------------------------------------------------
def check(cfg: Config) -> None:
    init = make_model(cfg, cfg.seed)
    data = make_data(cfg, cfg.samples, cfg.seed)
    val = make_data(cfg, cfg.val_samples, cfg.seed + 1)
    expected = reference(cfg, init, data, val)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*samples are dropped each epoch")
        runs = run_loop(cfg, init, data, val)
    assert runs, "no loop finished the fit"
    for run in runs:
        where = f"{run.name} loop"
        assert run.counters == {
            "epoch": cfg.epochs,
            "step": cfg.total_steps,
            "update": cfg.total_steps * cfg.di,
        }, where
        for name, want in expected["weights"].items():
            torch.testing.assert_close(
                run.weights[name],
                want,
                **WEIGHTS_TOL,
                msg=lambda m, w=f"{where}, {name}": f"{w}: {m}",
            )
        want_losses = expected["step_losses"][run.first :]
        assert run.losses == pytest.approx(want_losses, rel=LOSS_REL), f"{where}: step losses"
        assert len(run.history) == cfg.epochs, f"{where}: history rows"
        for e, (row, want) in enumerate(zip(run.history, expected["history"])):
            got = {k: row[k] for k in want}  # (a KeyError: a log the loop did not write)
            assert not {"val_loss", "val_metric"} & set(row) - set(want), f"{where}: val logs"
            assert got == pytest.approx(want, rel=LOSS_REL), f"{where}: epoch {e}"
            # (Final returns every micro-batch when DI*GA is 1: then the loss is exact too)
            exact = cfg.mode != "Final" or cfg.di * cfg.ga == 1
            estimated = row.get("estimated", "").split()
            train = [k for k in row if k.startswith("train_")]
            assert estimated == ([] if exact else ["loss", *train]), f"{where}: epoch {e}"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(configs())
def test_fit_equals_plain_torch(cfg: Config) -> None:
    note(repr(cfg))  # one line to paste into check(...)
    check(cfg)


@pytest.mark.slow
@pytest.mark.threads  # loader workers (num_workers=1) are drawn
@settings(max_examples=200, deadline=None, print_blob=True)
@given(configs(workers=(0, 0, 0, 1)))
def test_fit_equals_plain_torch_many(cfg: Config) -> None:
    note(repr(cfg))  # one line to paste into check(...)
    check(cfg)


def test_the_loop_reads_the_order_the_reference_draws() -> None:
    """The reference's ``epoch_orders`` is the order the loop reads: a dataset that logs the
    indices it is asked for, over two shuffled epochs with a remainder dropped."""

    class Logged(TensorDataset):
        log: ClassVar[list[int]] = []

        def __getitem__(self, i: int) -> Any:
            self.log.append(int(i))
            return super().__getitem__(i)

    cfg = Config(
        di=2, ga=1, rf=1, rf_via_loop=False, mode="Sum", micro=2, steps=3, remainder=3,
        epochs=2, shuffle=True, workers=0, task="reg", metric=False, api="loss_fn",
        expr="plain", optimizer="sgd", lr_course="constant", lr_step=1, validate=False,
        interrupt="none", at=1, weight_edit=False, frozen_bn=False, seed=11,
    )  # fmt: skip
    data = make_data(cfg, cfg.samples, 0)
    logged = Logged(*data.tensors)
    loop, _ = make_loop(cfg, make_model(cfg, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*samples are dropped each epoch")
        loop.fit(make_loader(cfg, logged, cfg.seed), epochs=2)
    read = logged.log[-2 * cfg.samples :]  # (the loop's probe reads some first)
    # plain torch's order: its iterator draws the workers' base seed, then the permutation;
    # each epoch read whole, its remainder too
    g = torch.Generator().manual_seed(cfg.seed)
    torch_loader = DataLoader(range(cfg.samples), batch_size=2, shuffle=True, generator=g)
    assert read == [int(i) for _ in range(2) for batch in torch_loader for i in batch]
