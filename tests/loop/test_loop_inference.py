"""Loop.predict and validation against plain torch: every sample, dataset order, any layout."""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, poptorch

IN, OUT = 6, 3


class Net(nn.Module):
    """A model-with-loss with dropout and batch norm, so train and eval mode differ."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(IN, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, OUT)
        )
        with torch.no_grad():  # running statistics far from a batch's own
            self.net[1].running_mean.fill_(3.0)
            self.net[1].running_var.fill_(4.0)

    def forward(self, x, labels=None):
        out = self.net(x)
        return out if labels is None else (out, nn.functional.cross_entropy(out, labels))


def data(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def options(di=1, ga=1, rf=1, group=None, orthogonal=False):
    o = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    if group is not None:
        kinds = poptorch.CommGroupType
        o.inputReplicaGrouping(group, kinds.Orthogonal if orthogonal else kinds.Consecutive)
    return o


def plain_eval(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    net = copy.deepcopy(net).eval()
    with torch.no_grad():
        return net(x)


@pytest.mark.parametrize(
    "di,ga,rf,n,b", [(1, 1, 1, 7, 2), (3, 2, 1, 53, 4), (2, 2, 2, 53, 3), (4, 1, 2, 5, 2)]
)
def test_predict_every_sample_in_dataset_order(di, ga, rf, n, b):
    net = Net()
    ds = data(n)
    loop = Loop(copy.deepcopy(net), options(di, ga, rf), progress=False)
    out = loop.predict(DataLoader(ds, batch_size=b, shuffle=True))
    assert out.shape == (n, OUT)
    torch.testing.assert_close(out, plain_eval(net, ds.tensors[0]), rtol=1e-5, atol=1e-6)


def test_predict_after_fit_uses_trained_weights_in_eval_mode():
    net = Net()
    ds = data(64)
    loop = Loop(
        net, options(2, 2, 2), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), progress=False
    )
    loop.fit(DataLoader(ds, batch_size=4), epochs=1)
    out = loop.predict(DataLoader(data(21, 3), batch_size=4))
    torch.testing.assert_close(
        out, plain_eval(loop.model, data(21, 3).tensors[0]), rtol=1e-5, atol=1e-6
    )
    assert loop.model.training  # left ready to train


@pytest.mark.parametrize("orthogonal", [False, True])
def test_predict_and_validate_with_input_replica_grouping(orthogonal):
    net = Net()
    ds = data(37)
    loop = Loop(
        copy.deepcopy(net),
        options(2, 1, 4, group=2, orthogonal=orthogonal),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
    )
    out = loop.predict(DataLoader(ds, batch_size=3))
    expected = plain_eval(net, ds.tensors[0])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    logs = loop.validate(DataLoader(data(48, 4), batch_size=3))
    x, y = data(48, 4).tensors
    acc = torchmetrics.functional.accuracy(plain_eval(net, x), y, "multiclass", num_classes=OUT)
    assert logs["val_acc"] == pytest.approx(float(acc), abs=1e-6)


Pair = namedtuple("Pair", "logits probs")


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(IN, OUT)
        self.kind = kind

    def forward(self, x, labels=None):
        logits = self.lin(x)
        if labels is not None:
            return logits, nn.functional.cross_entropy(logits, labels)
        probs = logits.softmax(-1)
        if self.kind == "dict":
            return {"logits": logits, "probs": probs}
        if self.kind == "namedtuple":
            return Pair(logits, probs)
        return logits, probs


@pytest.mark.parametrize("kind", ["tuple", "dict", "namedtuple"])
def test_predict_structured_outputs(kind):
    model = Structured(kind)
    x = data(19).tensors[0]
    out = Loop(model, options(2, 1, 2), progress=False).predict(
        DataLoader(TensorDataset(x), batch_size=2)
    )
    logits = model.lin(x).detach()
    if kind == "dict":
        got = (out["logits"], out["probs"])
    elif kind == "namedtuple":
        assert isinstance(out, Pair)
        got = (out.logits, out.probs)
    else:
        assert isinstance(out, tuple)
        got = out
    torch.testing.assert_close(got[0], logits)
    torch.testing.assert_close(got[1], logits.softmax(-1))


def test_inference_model_is_compiled_with_the_modules_in_eval_mode(monkeypatch):
    # PopTorch's inference wrapper shares the submodules and traces them in their current
    # mode; the emulator's own copy hides a mistake here, so watch the shared modules.
    seen = []
    real = poptorch.inferenceModel

    def spy(model, options=None):
        executor = real(model, options)
        compile_ = executor.compile

        def compile(*args):
            seen.append({type(m).__name__: m.training for m in model.modules()})
            return compile_(*args)

        executor.compile = compile
        return executor

    net = Net()
    loop = Loop(net, options(2), progress=False)
    monkeypatch.setattr(loop.poptorch, "inferenceModel", spy)
    loop.fit(DataLoader(data(32), batch_size=2), val_loader=DataLoader(data(16), batch_size=2))
    loop.predict(DataLoader(data(5), batch_size=2))
    assert len(seen) == 2 and all(not any(modes.values()) for modes in seen), seen
    assert all(m.training for m in net.modules())


class Stream(torch.utils.data.IterableDataset):
    """Samples 0..n-1 (sample i is a row filled with i), split between loader workers."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield (torch.full((IN,), float(i)),)


def identity_model() -> nn.Linear:
    lin = nn.Linear(IN, IN)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(IN))
        lin.bias.zero_()
    return lin


@pytest.mark.parametrize("workers", [0, 2])
def test_predict_iterable_dataset_keeps_the_tail(workers):
    n = 23  # one host call is 2 x 2 x 2 = 8 samples: 7 would be dropped
    loop = Loop(identity_model(), options(2, 1, 2), loss_fn=nn.MSELoss(), progress=False)
    loader = DataLoader(Stream(n), batch_size=2, num_workers=workers)
    out = loop.predict(loader)
    ids = out[:, 0]
    order = [int(i) for (batch,) in loader for i in batch[:, 0]]  # workers' batches in turn
    assert sorted(order) == list(range(n))
    assert ids.tolist() == order  # the loader's order: each sample once
    assert torch.equal(out, ids[:, None].expand(-1, IN))


def test_predict_empty_iterable_dataset_is_an_error():
    loop = Loop(identity_model(), loss_fn=nn.MSELoss(), progress=False)
    with pytest.raises(ValueError, match="no samples"):
        loop.predict(DataLoader(Stream(0), batch_size=2))


@pytest.mark.parametrize("n,group", [(50, None), (37, None), (3, None), (45, 2)])
def test_validation_counts_every_sample(n, group):
    # 4 samples a micro-batch, 2 x 4 replicas (2 input groups with grouping): the last host
    # call is padded; metrics see every sample, the loss every whole micro-batch of samples.
    net = Net()
    ds = data(n, 8)
    loop = Loop(
        copy.deepcopy(net),
        options(2, 1, 4 if group else 2, group=group),
        progress=False,
        metrics={
            "acc": torchmetrics.Accuracy("multiclass", num_classes=OUT),
            "f1": torchmetrics.F1Score("multiclass", num_classes=OUT, average="macro"),
        },
    )
    g = torch.Generator().manual_seed(2)
    logs = loop.validate(DataLoader(ds, batch_size=4, shuffle=True, generator=g))
    g.manual_seed(2)  # the samples in the order the loader yields them, as plain torch reads it
    order = [
        int(i) for b in DataLoader(range(n), batch_size=4, shuffle=True, generator=g) for i in b
    ]
    x, y = (t[order] for t in ds.tensors)
    out = plain_eval(net, x)
    losses = [
        nn.functional.cross_entropy(out[i : i + 4], y[i : i + 4]) for i in range(0, n - n % 4, 4)
    ]
    if losses:
        assert logs["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-6)
    else:  # fewer samples than one micro-batch: no whole micro-batch to take a loss from
        assert "val_loss" not in logs
    F = torchmetrics.functional
    assert logs["val_acc"] == pytest.approx(
        float(F.accuracy(out, y, "multiclass", num_classes=OUT)), abs=1e-6
    )
    assert logs["val_f1"] == pytest.approx(
        float(F.f1_score(out, y, "multiclass", num_classes=OUT, average="macro")), abs=1e-6
    )


def test_validation_device_iterations_need_no_padding_when_they_can(recwarn):
    # Training runs 4 x 2 replicas x 4 = 32 samples a call; 48 samples would need 16 of
    # padding with DI=4, so validation takes DI=3 (24 samples a call).
    net = Net()
    ds = data(48, 7)
    loop = Loop(
        copy.deepcopy(net),
        options(4, 1, 2),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
    )
    logs = loop.validate(DataLoader(ds, batch_size=4))
    assert not [w for w in recwarn if "dropped" in str(w.message)]
    (inference,) = loop.executors.inference.values()
    assert inference.options.device_iterations == 3
    x, y = ds.tensors
    out = plain_eval(net, x)
    losses = [nn.functional.cross_entropy(out[i : i + 4], y[i : i + 4]) for i in range(0, 48, 4)]
    assert logs["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-6)
    acc = torchmetrics.functional.accuracy(out, y, "multiclass", num_classes=OUT)
    assert logs["val_acc"] == pytest.approx(float(acc), abs=1e-6)


class TrainingOnlyLoss(nn.Module):
    """The PopTorch tutorials' pattern: the loss only in training mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(IN, OUT)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        x = self.lin(x)
        if self.training:
            return x, self.loss(x, labels)
        return x


def test_validation_of_a_model_without_a_loss_in_eval_mode():
    net = TrainingOnlyLoss()
    loop = Loop(
        net,
        options(2, 1, 2),
        progress=False,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
    )
    val = data(16, 2)
    with pytest.warns(UserWarning, match="no val_loss"):
        hist = loop.fit(
            DataLoader(data(32), batch_size=2), epochs=2, val_loader=DataLoader(val, batch_size=2)
        )
    x, y = val.tensors
    acc = torchmetrics.functional.accuracy(
        plain_eval(loop.model, x), y, "multiclass", num_classes=OUT
    )
    assert hist[-1]["val_acc"] == pytest.approx(float(acc), abs=1e-6)
    assert "val_loss" not in hist[-1] and "train_loss" in hist[-1]
    torch.testing.assert_close(
        loop.predict(DataLoader(TensorDataset(x), batch_size=2)), plain_eval(loop.model, x)
    )


def test_validate_and_predict_from_a_hook_leave_the_fit_alone():
    """A ``validate(test)`` and a ``predict`` in ``on_epoch_end`` return their own results; the
    fit's logs, history, early stopping and checkpoint ranking stay on the fit's validation,
    no validation hook fires for them, and the fit trains as it does without them."""
    from ipuloop import Callback
    from ipuloop.callbacks import EarlyStopping

    train, val, test = data(64), data(24, 2), data(20, 3)
    got = []

    class Events(Callback):
        def __init__(self):
            self.events = []

        def on_validation_start(self, loop):
            self.events.append("start")

        def on_validation_end(self, loop):
            self.events.append(("end", loop.state.logs["val_loss"]))

    class Nested(Callback):
        def on_epoch_end(self, loop):
            logs = loop.validate(DataLoader(test, batch_size=4))
            out = loop.predict(DataLoader(test, batch_size=4))
            got.append((logs, out.shape))

    def fit(*extra):
        net = Net()
        events, stop = Events(), EarlyStopping("val_loss", patience=5)
        loop = Loop(
            net,
            options(2),
            progress=False,
            callbacks=[events, stop, *extra],
            metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=OUT)},
            optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1),
        )
        history = loop.fit(
            DataLoader(train, batch_size=4), epochs=3, val_loader=DataLoader(val, batch_size=4)
        )
        return loop, history, events.events, stop

    alone, history, events, stop = fit()
    nested, nested_history, nested_events, nested_stop = fit(Nested())
    assert nested_history == history and nested_events == events and len(events) == 6
    assert nested_stop.best == stop.best
    assert all(
        torch.equal(a, b) for a, b in zip(nested.model.parameters(), alone.model.parameters())
    )
    assert len(got) == 3 and all(shape == (20, OUT) for _, shape in got)
    own = {k: v for k, v in got[-1][0].items()}
    assert set(own) == {"val_loss", "val_acc"} and own["val_loss"] != history[-1]["val_loss"]
    assert own == nested.validate(DataLoader(test, batch_size=4))  # what validate() returns
