"""The options lifecycle and ``replicas=``: clones, lazy executors built once, one attached."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, IPUConfig, Loop, poptorch

IN, OUT = 4, 3


def data(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def make_loop(opts=None, **kwargs) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(IN, OUT)
    return Loop(
        model,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        **kwargs,
    )


def test_user_options_untouched_and_executors_built_lazily_once(monkeypatch):
    built: list[str] = []
    real_train, real_inf = poptorch.trainingModel, poptorch.inferenceModel

    def training(*args, **kwargs):
        built.append("training")
        return real_train(*args, **kwargs)

    def inference(*args, **kwargs):
        built.append("inference")
        return real_inf(*args, **kwargs)

    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    inf_opts = poptorch.Options().deviceIterations(4)
    before = copy.deepcopy((opts._values, opts.Training._values, inf_opts._values))
    loop = make_loop(opts, inference_opts=inf_opts)
    monkeypatch.setattr(loop.poptorch, "trainingModel", training)
    monkeypatch.setattr(loop.poptorch, "inferenceModel", inference)
    assert built == []  # nothing built before the first step
    train, val = DataLoader(data(64), batch_size=2), DataLoader(data(32, 2), batch_size=2)
    loop.fit(train, epochs=2, val_loader=val)
    loop.validate(val)
    loop.fit(train, epochs=3, val_loader=val)
    assert built == ["training", "inference"]  # the inference one after the training one
    loop.predict(DataLoader(data(5, 3), batch_size=2))
    loop.predict(DataLoader(data(7, 3), batch_size=2))
    assert built == ["training", "inference", "inference"]  # predict: one more, once
    assert (opts._values, opts.Training._values, inf_opts._values) == before
    opts.deviceIterations(5)  # still the user's: not frozen by the loop
    inf_opts.deviceIterations(5)


def test_only_the_running_executor_is_attached():
    seen = []

    class Check(Callback):
        def attached(self, loop):
            return [
                m.isAttachedToDevice()
                for m in (loop.train_model, *loop.executors.inference.values())
            ]

        def on_train_step_end(self, loop):
            seen.append(("train", self.attached(loop)))

        def on_validation_step_end(self, loop):
            seen.append(("val", self.attached(loop)))

    loop = make_loop(poptorch.Options().deviceIterations(2), callbacks=[Check()])
    loop.fit(
        DataLoader(data(8), batch_size=2), epochs=2, val_loader=DataLoader(data(8, 2), batch_size=2)
    )
    assert [k for k, _ in seen] == ["train", "train", "val", "val"] * 2
    assert seen[0][1] == [True]
    assert all(a == ([True, False] if k == "train" else [False, True]) for k, a in seen[2:])


def test_set_optimizer_not_called_for_an_equal_value():
    pushes = []

    class Touch(Callback):
        def on_train_step_start(self, loop):
            group = loop.optimizer.param_groups[0]
            if loop.state.step == 1:
                group["lr"] = float(group["lr"])  # the same value, set anew: no change
            if loop.state.step == 3:
                group["lr"] = 0.05

        def on_train_step_end(self, loop):
            pushes.append(loop.optimizer_pushes)

    loop = make_loop(poptorch.Options().deviceIterations(2), callbacks=[Touch()])
    loop.fit(DataLoader(data(24), batch_size=2))
    assert pushes == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("replicas", [3, 6, 12])
def test_replicas_not_a_power_of_two_rejected_before_compiling(replicas):
    with pytest.raises(ValueError, match=rf"replicas={replicas}: PopTorch reserves a power of 2"):
        make_loop(replicas=replicas)


def test_replicas_not_a_power_of_two_with_auto_rounding_or_ipu_model():
    for opts in (poptorch.Options().autoRoundNumIPUs(True), poptorch.Options().useIpuModel(True)):
        loop = make_loop(opts, replicas=3)
        loop.fit(DataLoader(data(24), batch_size=2))
        assert loop.train_opts.replication_factor == 3


@pytest.mark.parametrize(
    "replicas,match",
    [
        (0, "int >= 1 or 'auto'"),
        ("two", "int >= 1 or 'auto'"),
        (True, "int >= 1 or 'auto'"),
        (128, "at most 64"),
    ],
)
def test_bad_replicas(replicas, match):
    with pytest.raises(ValueError, match=match):
        make_loop(replicas=replicas)


def test_replicas_contradicting_the_options():
    with pytest.raises(ValueError, match=r"contradicts opts.replicationFactor\(4\)"):
        make_loop(poptorch.Options().replicationFactor(4), replicas=2)


def test_replicas_auto_without_ipus_is_one():
    assert make_loop(replicas="auto").train_opts.replication_factor == 1


def test_replicas_on_an_ipu_system(monkeypatch):
    monkeypatch.setattr(poptorch, "ipuHardwareIsAvailable", lambda num_ipus=1: num_ipus <= 16)
    assert make_loop(replicas="auto").train_opts.replication_factor == 16
    cfg = IPUConfig(layers_per_ipu=[1, 1, 1, 1])  # 4 IPUs a replica
    assert make_loop(cfg, replicas="auto").train_opts.replication_factor == 4
    with pytest.raises(ValueError, match="needs 32 IPUs, more than this system has"):
        make_loop(replicas=32)
    with pytest.raises(ValueError, match="needs 32 IPUs"):
        make_loop(cfg, replicas=8)


class _Builder:
    """Builds options as IPUConfig does, and is no IPUConfig: the loop names no such class."""

    def __init__(self, ipus: int) -> None:
        self.ipus, self.built = ipus, []

    def to_options(self, for_inference: bool = False):
        self.built.append(for_inference)
        return poptorch.Options().deviceIterations(4 if for_inference else 2)

    def ipus_used(self, for_inference: bool = False) -> int:
        return self.ipus


def test_opts_may_be_any_object_that_builds_options(monkeypatch):
    monkeypatch.setattr(poptorch, "ipuHardwareIsAvailable", lambda num_ipus=1: num_ipus <= 16)
    builder = _Builder(ipus=8)
    loop = make_loop(builder, replicas="auto")
    assert sorted(builder.built) == [False, True]  # training and inference, each built once
    assert loop.train_opts.device_iterations == 2
    assert loop.train_opts.replication_factor == 2  # 16 IPUs / 8 a replica
    with pytest.raises(TypeError, match="opts must be poptorch.Options, an ipuloop.IPUConfig"):
        make_loop(object())


def test_poptorch_loader_built_for_other_options_names_every_factor():
    opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(4), data(96), batch_size=2)
    with pytest.raises(
        ValueError,
        match=(
            r"built for micro-batch 2 x deviceIterations 4 x replicationFactor 1 x "
            r"gradientAccumulation 1 = 8 samples .* runs micro-batch 2 x deviceIterations 2 x "
            r"replicationFactor 2 x gradientAccumulation 3 = 24 samples"
        ),
    ):
        make_loop(opts).fit(loader)
    ok = poptorch.DataLoader(opts, data(96), batch_size=2, shuffle=True)
    assert len(make_loop(opts).fit(ok)) == 1


def test_validation_before_training_sees_the_trained_weights_after():
    loop = make_loop(poptorch.Options().deviceIterations(2))
    val = data(16, 2)
    first = loop.validate(DataLoader(val, batch_size=2))["val_loss"]
    loop.fit(DataLoader(data(64), batch_size=2), epochs=3)
    after = loop.validate(DataLoader(val, batch_size=2))["val_loss"]
    x, y = val.tensors
    with torch.no_grad():
        losses = [
            nn.functional.cross_entropy(loop.model(x[i : i + 2]), y[i : i + 2])
            for i in range(0, 16, 2)
        ]
    assert after == pytest.approx(float(torch.stack(losses).mean()), rel=1e-6)
    assert after != pytest.approx(first)
