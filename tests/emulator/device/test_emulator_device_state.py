"""device/device_state.py: the device's weights and their swap into the user's module, driven
by hand: the device's copies, a run's swap in and out, the copies each way, replicas' own
buffers, the wrapper class that syncs on read, the emulated device and its generator."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from ipuloop.emulator.device import device_state
from ipuloop.emulator.device.device_state import DeviceWeights
from ipuloop.emulator.errors import Error

CPU = torch.device("cpu")


class Executor:
    """What the device's weights and the wrapper class read of their executor."""

    def __init__(self) -> None:
        self._dirty_host_weights = False
        self.synced = 0

    def copyWeightsToHost(self) -> None:
        self.synced += 1
        self._dirty_host_weights = False

    def copyWeightsToHostIfNeeded(self) -> bool:
        dirty = self._dirty_host_weights
        if dirty:
            self.copyWeightsToHost()
        return dirty


def bound(model: nn.Module) -> DeviceWeights:
    weights = DeviceWeights(Executor(), model, CPU, wrap=False)
    weights.bind()
    return weights


def test_device_dtype_has_no_64_bit_floats():
    assert device_state.device_dtype(torch.float64) == torch.float32
    for dtype in (torch.float32, torch.float16, torch.int64, torch.bool):
        assert device_state.device_dtype(dtype) == dtype


def test_the_device_holds_copies_of_the_parameters_and_buffers():
    model = nn.BatchNorm1d(2).double()
    weights = bound(model)
    assert weights.param_names == ["weight", "bias"]
    named = weights.named()
    assert list(named) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert named["weight"].dtype == torch.float32  # float64 as float32
    assert named["num_batches_tracked"].dtype == torch.int64
    assert named["weight"].data_ptr() != model.weight.data_ptr()


def test_a_run_swaps_the_device_s_storage_in_and_out():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    weights = bound(model)
    weights.swap_in(training=True)
    with torch.no_grad():
        model.weight.add_(2.0)  # the run writes the device's weight
    weights.swap_out()
    assert model.weight.item() == 1.0 and weights.dev_params[0].item() == 3.0
    weights.to_host()
    assert model.weight.item() == 3.0
    with torch.no_grad():
        model.weight.fill_(-1.0)
    weights.to_device()
    assert weights.dev_params[0].item() == -1.0


def test_an_inference_run_is_in_eval_mode_and_the_flags_come_back():
    model = nn.Sequential(nn.Dropout(0.5))
    weights = bound(model)
    weights.swap_in(training=False)
    assert not model.training and not model[0].training
    weights.swap_out()
    assert model.training and model[0].training


def test_each_replica_has_its_own_buffers_the_first_the_device_s():
    weights = bound(nn.BatchNorm1d(2))
    assert weights.replica_sets(1) is None
    sets = weights.replica_sets(3)
    assert len(sets) == 3 and sets[0] is weights.dev_buffers
    assert all(torch.equal(a, b) and a is not b for a, b in zip(sets[0], sets[2]))


def test_a_parameter_replaced_since_the_bind_is_refused():
    model = nn.Linear(1, 1)
    weights = bound(model)
    model.bias = nn.Parameter(torch.zeros(1))
    with pytest.raises(Error, match="The model's 'bias' is not the tensor it had"):
        weights.to_device()


def test_the_wrapper_class_syncs_on_read_and_pickles_as_the_user_s():
    cls = device_state.wrapped_class(nn.Linear)
    assert cls is device_state.wrapped_class(nn.Linear) and cls.__name__ == "PoptorchLinear"
    model = nn.Linear(1, 1)
    ex = Executor()
    model.__dict__["_poptorch_executor"] = ex
    model.__class__ = cls
    model.weight  # noqa: B018 - clean: no sync
    assert ex.synced == 0
    ex._dirty_host_weights = True  # the device trained since the last sync
    model.weight  # noqa: B018
    assert ex.synced == 1
    ex._dirty_host_weights = True
    copy = pickle.loads(pickle.dumps(model))  # with the device's weights
    assert ex.synced == 2
    assert type(copy) is nn.Linear and "_poptorch_executor" not in copy.__dict__


def test_the_emulated_device_and_system(monkeypatch):
    monkeypatch.delenv("IPULOOP_EMULATOR_DEVICE", raising=False)
    monkeypatch.delenv("IPULOOP_EMULATOR_IPUS", raising=False)
    assert device_state.emulator_device() == CPU and device_state.system_ipus() == 0
    monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", "16")
    assert device_state.system_ipus() == 16
    for bad in ("-1", "many"):
        monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", bad)
        with pytest.raises(ValueError, match="IPULOOP_EMULATOR_IPUS must be"):
            device_state.system_ipus()
    if not torch.cuda.is_available():
        monkeypatch.setenv("IPULOOP_EMULATOR_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="asks for CUDA"):
            device_state.emulator_device()


def test_swap_rng_installs_a_state_and_returns_the_one_before():
    torch.manual_seed(3)
    seeded = device_state.rng_state(CPU)
    first = torch.rand(2)
    old = device_state.swap_rng(seeded, CPU)  # back to seed 3
    assert torch.equal(torch.rand(2), first)
    device_state.swap_rng(old, CPU)  # where the first draw left it
    torch.manual_seed(3)
    torch.rand(2)
    assert torch.equal(device_state.rng_state(CPU), old)
