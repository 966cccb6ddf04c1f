"""The Loop: event order and counts, output-mode reduction, metrics, equivalence, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ipuloop import Callback, CancelEpoch, Loop, NonFiniteLossError, poptorch
from ipuloop.callbacks.base import EVENTS

IN, OUT = 6, 3


class Net(nn.Module):
    """A model-with-loss: (output, loss) with labels, output without."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = (
            [nn.Linear(IN, 8)]
            + ([nn.BatchNorm1d(8)] if batchnorm else [])
            + [nn.ReLU(), nn.Linear(8, OUT)]
        )
        self.net = nn.Sequential(*layers)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out = self.net(x)
        return out if labels is None else (out, self.loss(out, labels))


def data(n: int = 96, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    return TensorDataset(x, torch.randint(0, OUT, (n,), generator=g))


def options(di=1, ga=1, rf=1, mode=None, period=1):
    o = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    if mode is not None:
        o.outputMode(mode, period) if mode == poptorch.OutputMode.EveryN else o.outputMode(mode)
    return o


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name):
        if name in EVENTS and name not in ("on_save_checkpoint", "on_load_checkpoint"):
            return lambda loop: object.__getattribute__(self, "events").append(name)
        return object.__getattribute__(self, name)


for _e in EVENTS:  # the loop calls only overridden hooks: override them all
    setattr(Recorder, _e, lambda self, loop: None)


def expected_events(epochs: int, steps: int, val_steps: int) -> list[str]:
    ev = ["on_configure", "on_fit_start"]
    for e in range(epochs):
        ev.append("on_epoch_start")
        for s in range(steps):
            if e == 0 and s == 0:
                ev += ["on_compile_start", "on_compile_end"]
            ev += ["on_train_step_start", "on_train_step_end"]
        if val_steps:
            ev.append("on_validation_start")
            if e == 0:
                ev += ["on_compile_start", "on_compile_end"]
            ev += ["on_validation_step_end"] * val_steps
            ev.append("on_validation_end")
        ev.append("on_epoch_end")
    return ev + ["on_fit_end"]


def inference_device_iterations(target: int, n: int, per_iteration: int) -> int:
    """The documented choice: DI*GA down to half of it, the least padding (ties: larger)."""
    if n < target * per_iteration:
        return max(1, n // per_iteration)
    candidates = [d for d in range(1, target + 1) if 2 * d >= target]

    def padding(d: int) -> int:
        call = d * per_iteration
        return (call - n % call) % call

    return max(candidates, key=lambda d: (-padding(d), d))


@pytest.mark.parametrize(
    "di,ga,rf,epochs", [(1, 1, 1, 1), (2, 3, 1, 2), (4, 1, 2, 3), (2, 2, 2, 2)]
)
def test_event_order_and_counts_by_formula(di, ga, rf, epochs):
    n, b = 96, 2
    rec = Recorder()
    loop = Loop(Net(), options(di, ga, rf), callbacks=[rec], progress=False)
    loop.fit(
        DataLoader(data(n), batch_size=b),
        epochs=epochs,
        val_loader=DataLoader(data(48, 2), batch_size=4),
    )
    steps = n // (b * di * ga * rf)
    val_di = inference_device_iterations(di * ga, 48, 4 * rf)
    val_steps = -(-48 // (4 * val_di * rf))  # the last call padded
    assert rec.events == expected_events(epochs, steps, val_steps)
    st = loop.state
    assert (st.epoch, st.step, st.epoch_step) == (epochs, steps * epochs, 0)
    assert st.update == steps * epochs * di
    assert st.micro_batch == steps * epochs * di * ga * rf
    assert st.samples == steps * epochs * b * di * ga * rf
    assert len(st.history) == epochs


def reference(model: nn.Module, ds: TensorDataset, b, di, ga, rf, steps, lr, reduction="mean"):
    """Plain torch, the same math: per step the micro-batch losses, outputs and labels."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = ds.tensors
    per_step = []
    for s in range(steps):
        base = s * b * di * ga * rf
        rows = []
        for d in range(di):
            for a in range(ga):
                for r in range(rf):
                    i = base + ((d * ga + a) * rf + r) * b
                    out, loss = model(x[i : i + b], y[i : i + b])
                    scale = 1.0 / (ga * rf) if reduction == "mean" else 1.0
                    (loss * scale if scale != 1.0 else loss).backward()
                    rows.append((d, a, r, loss.item(), out.detach(), y[i : i + b]))
            opt.step()
            opt.zero_grad(set_to_none=True)
        per_step.append(rows)
    return model, per_step


def selected(rows, mode, di, ga, rf, period):
    if mode in ("All", "Sum"):
        return rows
    if mode == "Final":
        return [row for row in rows if row[0] == di - 1 and row[1] == ga - 1]
    return [row for row in rows if (row[0] + 1) % period == 0]


@pytest.mark.parametrize("rf", [1, 2])
@pytest.mark.parametrize("mode", ["All", "Final", "Sum", "EveryN"])
def test_losses_and_metrics_equal_plain_torch(mode, rf):
    di, ga, b, n, lr, period = 4, 2, 3, 96 * 2, 0.05, 2
    ds = data(n)
    steps = n // (b * di * ga * rf)
    net = Net()
    ref_model, per_step = reference(net, ds, b, di, ga, rf, steps, lr)
    pmode = getattr(poptorch.OutputMode, mode)
    metrics = (
        {}
        if mode == "Sum"
        else {
            "acc": torchmetrics.Accuracy("multiclass", num_classes=OUT),
            "f1": torchmetrics.F1Score("multiclass", num_classes=OUT, average="macro"),
        }
    )
    val = data(48, 9)
    model = copy.deepcopy(net)
    step_losses = []

    class Losses(Callback):
        def on_train_step_end(self, loop):
            step_losses.append(loop.state.logs["loss"])

    loop = Loop(
        model,
        options(di, ga, rf, pmode, period),
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        metrics=metrics,
        callbacks=[Losses()],
        progress=False,
    )
    hist = loop.fit(
        DataLoader(ds, batch_size=b), epochs=1, val_loader=DataLoader(val, batch_size=b)
    )
    all_sel = []
    for s, rows in enumerate(per_step):
        sel = selected(rows, mode, di, ga, rf, period)
        all_sel += sel
        assert step_losses[s] == pytest.approx(sum(r[3] for r in sel) / len(sel), rel=1e-5)
    assert hist[0]["train_loss"] == pytest.approx(
        sum(r[3] for r in all_sel) / len(all_sel), rel=1e-5
    )
    assert ("estimated" in hist[0]) is (mode not in ("All", "Sum"))
    if metrics:
        acc = torchmetrics.Accuracy("multiclass", num_classes=OUT)
        for r in all_sel:
            acc.update(r[4], r[5])
        assert hist[0]["train_acc"] == pytest.approx(float(acc.compute()), abs=1e-6)
        out = torch.cat([r[4] for r in all_sel])
        f1 = torchmetrics.functional.f1_score(
            out, torch.cat([r[5] for r in all_sel]), "multiclass", num_classes=OUT, average="macro"
        )
        assert hist[0]["train_f1"] == pytest.approx(float(f1), abs=1e-6)
    for p, q in zip(loop.model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    vx, vy = val.tensors  # validation after the epoch: the trained weights, every sample
    with torch.no_grad():
        vout = ref_model.net(vx)
        vloss = torch.stack(
            [ref_model.loss(vout[i : i + b], vy[i : i + b]) for i in range(0, len(vy), b)]
        ).mean()
    assert hist[0]["val_loss"] == pytest.approx(float(vloss), rel=1e-5)
    F = torchmetrics.functional
    for name, value in (
        ("acc", F.accuracy(vout, vy, "multiclass", num_classes=OUT)),
        ("f1", F.f1_score(vout, vy, "multiclass", num_classes=OUT, average="macro")),
    ):
        if metrics:
            assert hist[0][f"val_{name}"] == pytest.approx(float(value), abs=1e-5)


def test_validation_loss_and_metrics_equal_plain_torch():
    net = Net()
    ds = data(64, 5)
    loop = Loop(
        copy.deepcopy(net),
        options(2, 1, 2),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
    )
    logs = loop.validate(DataLoader(ds, batch_size=4))
    x, y = ds.tensors
    with torch.no_grad():
        net.eval()
        losses = [net(x[i : i + 4], y[i : i + 4])[1] for i in range(0, 64, 4)]
        acc = torchmetrics.functional.accuracy(net(x), y, "multiclass", num_classes=OUT)
    assert logs["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-6)
    assert logs["val_acc"] == pytest.approx(float(acc), abs=1e-6)


@pytest.mark.parametrize(
    "di,ga,rf,mode", [(2, 3, 1, None), (2, 2, 2, "Final"), (4, 1, 2, "EveryN")]
)
def test_fit_equals_hand_written_poptorch_loop_bitwise(di, ga, rf, mode):
    ds = data(96)
    net = Net(batchnorm=True)
    a, b = copy.deepcopy(net), copy.deepcopy(net)
    pmode = getattr(poptorch.OutputMode, mode) if mode else None
    opts = options(di, ga, rf, pmode, 2)
    opt_a = poptorch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)

    class Decay(Callback):  # an lr change mid-fit: the hand-written loop calls setOptimizer
        def on_epoch_end(self, loop):
            opt_a.param_groups[0]["lr"] = 0.05

    loop = Loop(a, opts, optimizer=opt_a, callbacks=[Decay()], progress=False)
    loop.fit(DataLoader(ds, batch_size=4), epochs=2)
    opt_b = poptorch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    tm = poptorch.trainingModel(b, opts.clone(), optimizer=opt_b)
    loader = poptorch.DataLoader(opts.clone(), ds, batch_size=4)
    for epoch in range(2):
        if epoch == 1:
            opt_b.param_groups[0]["lr"] = 0.05
            tm.setOptimizer(opt_b)
        for x, y in loader:
            tm(x, y)
    for (k, p), q in zip(loop.model.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), k


def test_user_options_are_not_mutated_and_loop_picks_output_mode():
    opts = options(2, 2, 1)
    Loop(Net(), opts, progress=False)
    opts.deviceIterations(3)  # still the user's, unfrozen
    assert opts.output_mode == poptorch.OutputMode.Default
    plain = Loop(Net(), opts, progress=False)
    assert plain.train_opts.output_mode == poptorch.OutputMode.Sum
    with_metrics = Loop(
        Net(),
        opts,
        progress=False,
        metrics={"a": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
    )
    assert with_metrics.train_opts.output_mode == poptorch.OutputMode.All


def test_inference_options_cloned_with_ga_1():
    loop = Loop(Net(), options(2, 4, 1), progress=False)
    loop.fit(
        DataLoader(data(64), batch_size=2), epochs=1, val_loader=DataLoader(data(64), batch_size=2)
    )
    (inf,) = loop.executors.inference.values()
    o = inf._options
    assert o.Training.gradient_accumulation == 1 and o.device_iterations == 8
    assert o.output_mode == poptorch.OutputMode.All


def test_setoptimizer_only_when_hyperparameters_change():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Halve(Callback):
        def on_train_step_start(self, loop):
            if loop.state.step in (2, 5):
                opt.param_groups[0]["lr"] /= 2

    loop = Loop(model, options(2), optimizer=opt, callbacks=[Halve()], progress=False)
    loop.fit(DataLoader(data(96), batch_size=4), epochs=1)
    assert loop.optimizer_pushes == 2
    assert loop.train_model._device_optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_predict_returns_every_sample_in_the_loaders_order():
    """One output per sample, in the order plain torch iterating the loader yields them (a
    shuffled loader's too), the last host call padded; in dataset order for a sequential one."""
    net = Net()
    ds = data(50)
    loop = Loop(copy.deepcopy(net), options(4), progress=False)
    net.eval()
    with torch.no_grad():
        assert torch.allclose(loop.predict(DataLoader(ds, batch_size=4)), net(ds.tensors[0]))
        g = torch.Generator().manual_seed(3)
        out = loop.predict(DataLoader(ds, batch_size=4, shuffle=True, generator=g))
        g.manual_seed(3)
        order = [
            i for b in DataLoader(range(50), batch_size=4, shuffle=True, generator=g) for i in b
        ]
        assert len(set(order)) == 50 and order != list(range(50))
        assert torch.allclose(out, net(ds.tensors[0][order]), atol=1e-6)


def test_plain_model_with_loss_fn_and_replicas_argument():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(IN, OUT))
    loop = Loop(
        plain,
        loss_fn=nn.CrossEntropyLoss(),
        replicas=2,
        progress=False,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
    )
    hist = loop.fit(DataLoader(data(32), batch_size=4), epochs=2)
    assert loop.train_opts.replication_factor == 2
    assert hist[1]["train_loss"] < hist[0]["train_loss"]
    assert loop.predict(DataLoader(data(10), batch_size=2)).shape == (10, OUT)


def test_cancel_epoch_and_stop():
    class StopAt(Callback):
        def on_train_step_end(self, loop):
            if loop.state.step == 3:
                loop.stop()

    loop = Loop(Net(), progress=False, callbacks=[StopAt()])
    loop.fit(DataLoader(data(96), batch_size=4), epochs=5)
    assert loop.state.step == 3 and loop.state.epoch == 0

    class Cancel(Callback):
        def on_train_step_end(self, loop):
            if loop.state.epoch_step == 2:
                raise CancelEpoch

    loop = Loop(Net(), progress=False, callbacks=[Cancel()])
    loop.fit(DataLoader(data(96), batch_size=4), epochs=2)
    assert (loop.state.epoch, loop.state.step) == (2, 4)


def test_callback_error_names_the_callback_and_runs_on_exception():
    seen = []

    class Boom(Callback):
        def on_train_step_end(self, loop):
            raise RuntimeError("boom")

    class Watch(Callback):
        def on_exception(self, loop):
            seen.append(type(loop.exception).__name__)

    loop = Loop(Net(), progress=False, callbacks=[Boom(), Watch()])
    with pytest.raises(RuntimeError) as info:
        loop.fit(DataLoader(data(96), batch_size=4))
    assert "Boom.on_train_step_end" in "".join(getattr(info.value, "__notes__", []))
    assert seen == ["RuntimeError"]


class NaNAt(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.index = index

    def forward(self, x, labels=None):
        out = self.lin(x)
        if labels is None:
            return out
        loss = nn.functional.cross_entropy(out, labels)
        bad = (x[:, 0] == self.index).any()  # the sample tagged with this index is poisoned
        return out, torch.where(bad, torch.full_like(loss, float("nan")), loss)


def test_non_finite_loss_names_epoch_step_and_micro_batch():
    x = torch.randn(64, IN)
    x[:, 0] = torch.arange(64).float()
    y = torch.zeros(64, dtype=torch.long)
    model = NaNAt(index=2 * 16 + 5 * 2)  # step 2 (16 samples a step), micro-batch 5 (B=2)
    loop = Loop(model, options(4, 2, 1, poptorch.OutputMode.All), progress=False)
    with pytest.raises(
        NonFiniteLossError,
        match=r"epoch 0, step 2 .*micro-batch 5 .*"
        r"device iteration 2, accumulation step 1",
    ):
        loop.fit(DataLoader(TensorDataset(x, y), batch_size=2))
    # Sum (the default without metrics) returns one sum per replica: the replica is named.
    loop = Loop(NaNAt(index=2 * 16 + 5 * 2), options(4, 2, 1), progress=False)
    with pytest.raises(NonFiniteLossError, match=r"epoch 0, step 2 .*replica 0.*OutputMode.All"):
        loop.fit(DataLoader(TensorDataset(x, y), batch_size=2))


class OnlyX(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.randn(IN)


class NoTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x, labels=None):
        return self.lin(x)


@pytest.mark.parametrize(
    "case,match",
    [
        ("empty", "fewer than one host call"),
        ("short", "fewer than one host call"),
        ("no_labels", "must yield \\(inputs..., labels\\)"),
        ("no_loss", "must return \\(output, loss\\)"),
        ("two_optimizers", "only support one optimizer"),
        ("epochs0", "epochs must be an int >= 1"),
        ("label_batch", "input 0 has batch size"),
        ("broadcast", "would broadcast"),
        ("clip_torch", "Gradient clipping runs on the device only"),
        ("sum_metrics", "OutputMode.Sum"),
        (
            "every_n_period",
            r"must divide deviceIterations \(4\)\. Received: output_return_period=3",
        ),
    ],
)
def test_bad_input_rejected_before_the_first_step(case, match):
    calls = []

    class Spy(Callback):
        def on_compile_start(self, loop):
            calls.append("compile")

    model, loader, kwargs, fit = Net(), DataLoader(data(96), batch_size=4), {}, {}
    if case == "empty":
        loader = DataLoader(data(0), batch_size=4)
    elif case == "short":
        kwargs["opts"] = options(4, 4)
        loader = DataLoader(data(40), batch_size=4)
    elif case == "no_labels":
        loader = DataLoader(OnlyX(), batch_size=4)
    elif case == "no_loss":
        model = NoTuple()
    elif case == "two_optimizers":
        kwargs["optimizer"] = [torch.optim.SGD(model.parameters(), lr=1)] * 2
    elif case == "epochs0":
        fit["epochs"] = 0
    elif case == "label_batch":
        loader = DataLoader(
            data(96), batch_size=4, collate_fn=lambda b: (torch.randn(8, IN), torch.zeros(4).long())
        )
    elif case == "broadcast":
        model = nn.Linear(IN, 1)
        kwargs["loss_fn"] = nn.MSELoss()
        loader = DataLoader(TensorDataset(torch.randn(32, IN), torch.randn(32)), batch_size=4)
    elif case == "clip_torch":
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
        kwargs["max_grad_norm"] = 1.0
    elif case == "every_n_period":
        kwargs["opts"] = options(4, mode=poptorch.OutputMode.EveryN, period=3)
    elif case == "sum_metrics":
        kwargs["opts"] = options(mode=poptorch.OutputMode.Sum)
        kwargs["metrics"] = {"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)}
    with pytest.raises((ValueError, TypeError), match=match):
        loop = Loop(model, callbacks=[Spy()], progress=False, **kwargs)
        loop.fit(loader, **fit)
    assert calls == []


def test_plain_batch_sampler_gives_the_micro_batch():
    """DataLoader(batch_sampler=BatchSampler(...)) has batch_size None: the sampler's is used."""
    from torch.utils.data import BatchSampler, SequentialSampler

    loader = DataLoader(data(32), batch_sampler=BatchSampler(SequentialSampler(range(32)), 4, True))
    loop = Loop(Net(), options(di=2), progress=False)
    loop.fit(loader)
    assert loop.state.samples == 32 and loop.state.step == 4


def test_device_clipping_sets_max_grad_norm():
    model = Net()
    opt = poptorch.optim.AdamW(model.parameters(), lr=1e-3)
    Loop(model, optimizer=opt, max_grad_norm=0.5, progress=False)
    assert opt.max_grad_norm == 0.5


def test_progress_lines_when_not_a_terminal(capsys):
    Loop(Net(), progress=2).fit(DataLoader(data(96), batch_size=4), epochs=1)
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("epoch 1 step") for line in out) == 12  # 24 steps, every 2
    assert out[-1].startswith("epoch 1: train_loss")


def test_describe_lists_callbacks_at_their_events():
    text = Loop(Net(), callbacks=[Recorder()], progress=True).describe()
    assert "on_train_step_end" in text and "ProgressBar" in text and "Recorder" in text
