"""``ipuloop.poptorch_types``: the members each protocol names are there on the emulator's
objects (PopTorch's stand-in) and on the stub executor of ``test_executors.py``.

The protocols are not ``runtime_checkable`` (mypy checks them where the loop's code is typed
with them): here each member is looked up by name."""

from __future__ import annotations

import types

import torch
from test_executors import StubExecutor
from torch.utils.data import TensorDataset

import ipuloop.emulator as poptorch
from ipuloop import poptorch_types as pt


def members(protocol: type) -> set[str]:
    """The attributes, properties and methods ``protocol`` declares."""
    names = set(vars(protocol).get("__annotations__", {}))
    for name, value in vars(protocol).items():
        if isinstance(value, (property, types.FunctionType)) and name not in (
            "__init__",  # (typing's, on every protocol class)
            "__subclasshook__",
        ):
            names.add(name)
    return names


def missing(obj: object, protocol: type) -> list[str]:
    return sorted(n for n in members(protocol) if not hasattr(obj, n))


def test_members_are_read_from_the_protocol():
    assert members(pt.TrainingOptions) == {"gradient_accumulation"}
    assert {"rng_state", "__call__", "setOptimizer", "isAttachedToDevice"} <= members(pt.Executor)
    assert {"dataset", "options", "__len__", "terminate"} <= members(pt.DataLoader)


def _emulator_objects() -> list[tuple[object, type]]:
    with torch.random.fork_rng(devices=[]):
        opts = poptorch.Options().randomSeed(0)  # (random_seed exists once set, as in PopTorch)
    model = torch.nn.Linear(2, 1)
    loader = poptorch.DataLoader(opts, TensorDataset(torch.ones(4, 2)), batch_size=2)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    return [
        (opts, pt.Options),
        (opts.Training, pt.TrainingOptions),
        (opts.Distributed, pt.DistributedOptions),
        (loader, pt.DataLoader),
        (training, pt.Executor),
        (poptorch.inferenceModel(model, opts), pt.Executor),
    ]


def test_the_emulators_objects_have_every_member():
    for obj, protocol in _emulator_objects():
        assert missing(obj, protocol) == [], type(obj).__name__


def test_the_stub_executor_has_every_member_and_one_without_is_found():
    stub = StubExecutor(torch.nn.Linear(2, 1), None)
    assert missing(stub, pt.Executor) == []

    without = {k: v for k, v in vars(StubExecutor).items() if k != "setOptimizer"}
    partial = type("Partial", (), without)(torch.nn.Linear(2, 1), None)
    assert missing(partial, pt.Executor) == ["setOptimizer"]
