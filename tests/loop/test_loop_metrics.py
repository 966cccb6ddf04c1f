"""Host-side metrics: a MetricCollection, per-class values, reset each epoch, against torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, poptorch

IN, OUT = 5, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, OUT))

    def forward(self, x, labels=None):
        out = self.net(x)
        return out if labels is None else (out, nn.functional.cross_entropy(out, labels))


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def plain_run(net, ds, b, di, ga, rf, epochs, lr):
    """Plain torch, the same updates; per epoch the (output, labels) of the micro-batches that
    OutputMode.Final returns: the last one (d = DI-1, a = GA-1) of each replica."""
    model = copy.deepcopy(net)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = ds.tensors
    per_call = b * di * ga * rf
    returned = []
    for _ in range(epochs):
        outs, labels = [], []
        for start in range(0, len(y) - per_call + 1, per_call):
            for d in range(di):
                for a in range(ga):
                    for r in range(rf):
                        i = start + ((d * ga + a) * rf + r) * b
                        out, loss = model(x[i : i + b], y[i : i + b])
                        (loss / (ga * rf)).backward()
                        if d == di - 1 and a == ga - 1:
                            outs.append(out.detach())
                            labels.append(y[i : i + b])
                opt.step()
                opt.zero_grad()
        returned.append((torch.cat(outs), torch.cat(labels)))
    return model, returned


def test_metric_collection_per_class_values_reset_each_epoch_final_mode():
    b, di, ga, rf, epochs, lr = 3, 2, 2, 2, 2, 0.2
    net, ds, val = Net(), data(96, 1), data(48, 2)
    ref_model, returned = plain_run(net, ds, b, di, ga, rf, epochs, lr)
    model = copy.deepcopy(net)
    metrics = torchmetrics.MetricCollection(
        {
            "acc": torchmetrics.Accuracy("multiclass", num_classes=OUT, average=None),
            "f1": torchmetrics.F1Score("multiclass", num_classes=OUT, average="macro"),
        }
    )
    opts = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    opts.outputMode(poptorch.OutputMode.Final)
    loop = Loop(
        model,
        opts,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        metrics=metrics,
        progress=False,
    )
    hist = loop.fit(
        DataLoader(ds, batch_size=b), epochs=epochs, val_loader=DataLoader(val, batch_size=b)
    )
    F = torchmetrics.functional
    for e, (out, y) in enumerate(returned):  # each epoch: that epoch's outputs only
        per_class = F.accuracy(out, y, "multiclass", num_classes=OUT, average=None)
        for c in range(OUT):
            assert hist[e][f"train_acc_{c}"] == pytest.approx(float(per_class[c]), abs=1e-6)
        f1 = F.f1_score(out, y, "multiclass", num_classes=OUT, average="macro")
        assert hist[e]["train_f1"] == pytest.approx(float(f1), abs=1e-6)
        # Final: one micro-batch per replica, so every training value is an estimate
        train = [k for k in hist[e] if k.startswith("train_")]
        assert hist[e]["estimated"].split() == ["loss", *train]
    with torch.no_grad():  # validation after the last epoch, with the trained weights
        out = ref_model(val.tensors[0])
    vy = val.tensors[1]
    per_class = F.accuracy(out, vy, "multiclass", num_classes=OUT, average=None)
    for c in range(OUT):
        assert hist[-1][f"val_acc_{c}"] == pytest.approx(float(per_class[c]), abs=1e-5)
    f1 = F.f1_score(out, vy, "multiclass", num_classes=OUT, average="macro")
    assert hist[-1]["val_f1"] == pytest.approx(float(f1), abs=1e-5)
    assert metrics["acc"]._update_count == 2  # reset per validation: 48 samples, 24 a call
