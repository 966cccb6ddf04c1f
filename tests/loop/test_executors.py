"""``ipuloop.executors.Executors``: the training and inference executors of one loop, each built
once (per call shape), one attached at a time, and the optimizer pushed only when it changed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ipuloop.executors import Executors


class StubExecutor:
    """An executor of ``poptorch_types.Executor``'s members that records what it is asked."""

    def __init__(self, model: torch.nn.Module, opts, optimizer=None) -> None:
        self.model, self.opts, self.optimizer = model, opts, optimizer
        self.built_training = model.training
        self.attached = False
        self.compiled = False
        self.rng_state = torch.zeros(2)
        self.calls: list = []
        self._dirty_host_weights = False

    def __call__(self, *args, **kwargs):
        self._dirty_host_weights = self.optimizer is not None  # a training call
        return self.model(*args, **kwargs)

    def copyWeightsToDevice(self) -> None:
        self.calls.append("copyWeightsToDevice")

    def compile(self, *args, **kwargs) -> None:
        self.compiled = self.attached = True

    def isCompiled(self) -> bool:
        return self.compiled

    def isAttachedToDevice(self) -> bool:
        return self.attached

    def detachFromDevice(self) -> None:
        self.calls.append("detach")
        self.attached = False

    def copyWeightsToHostIfNeeded(self) -> bool:
        return False

    def setOptimizer(self, optimizer) -> None:
        self.calls.append(("setOptimizer", optimizer.param_groups[0]["lr"]))

    def destroy(self) -> None:
        self.calls.append("destroy")
        self.compiled = self.attached = False

    def load_state_dict(self, state_dict, strict: bool = True):
        self.calls.append("load_state_dict")
        return self.model.load_state_dict(state_dict, strict)


def executors(lr=0.1) -> tuple[Executors, list]:
    built: list = []

    def make(model, opts, optimizer=None):
        lr = None if optimizer is None else optimizer.param_groups[0]["lr"]
        built.append((model.training, type(lr).__name__))
        return StubExecutor(model, opts, optimizer)

    model = torch.nn.Linear(2, 1)
    poptorch = SimpleNamespace(trainingModel=make, inferenceModel=make)
    return Executors(poptorch, model, torch.optim.SGD(model.parameters(), lr=lr)), built


def test_each_executor_is_built_once_per_key():
    ex, built = executors()
    train = ex.training_model("opts")
    assert ex.training_model("other opts") is train
    a = ex.inference_model(("validation", 8, 1), "opts")
    assert ex.inference_model(("validation", 8, 1), "opts") is a
    b = ex.inference_model(("predict", 4, 1), "opts")
    assert b is not a and ex.all() == (train, a, b)
    assert len(built) == 3 and built[0][0] is True  # the training one built in train mode


def test_inference_executors_are_built_in_eval_mode_and_train_mode_comes_back():
    ex, built = executors()
    with pytest.raises(ValueError), ex.eval_mode():  # (even when building fails)
        ex.inference_model(("validation", 1, 1), "opts")
        raise ValueError
    assert built == [(False, "NoneType")] and ex.model.training


def test_the_optimizers_tensor_numbers_are_floats_while_poptorch_reads_them():
    ex, built = executors(lr=torch.tensor(0.1))
    ex.training_model("opts")
    assert built == [(True, "float")]
    assert isinstance(ex.optimizer.param_groups[0]["lr"], torch.Tensor)  # put back after


def test_one_executor_attached_at_a_time():
    ex, _ = executors()
    train = ex.training_model("opts")
    ex.compile(train, (torch.ones(1, 2),), {})
    inference = ex.inference_model(("validation", 1, 1), "opts")
    ex.compile(inference, (torch.ones(1, 2),), {}, rng_state=torch.ones(2))
    assert not train.attached and inference.attached and train.calls == ["detach"]
    assert torch.equal(inference.rng_state, torch.ones(2))
    ex.activate(train)
    assert not inference.attached


def test_the_optimizer_is_pushed_only_when_a_hyperparameter_changed():
    ex, _ = executors()
    train = ex.training_model("opts")
    ex.compile(train, (torch.ones(1, 2),), {})
    ex.push_optimizer()
    ex.push_optimizer()
    assert ex.pushes == 0 and train.calls == []
    ex.optimizer.param_groups[0]["lr"] = 0.05
    ex.push_optimizer()
    ex.push_optimizer()
    assert ex.pushes == 1 and train.calls == [("setOptimizer", 0.05)]
    ex.optimizer.param_groups[0]["lr"] = torch.tensor(0.05, dtype=torch.float64)  # equal
    ex.push_optimizer()
    ex.optimizer.param_groups[0]["lr"].fill_(0.01)  # in place, as a scheduler may
    ex.push_optimizer()
    assert ex.pushes == 2 and train.calls[-1] == ("setOptimizer", 0.01)


def test_weights_load_into_the_training_executor_and_inference_ones_detach():
    ex, _ = executors()
    weights = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    ex.load_weights(weights)  # no executor yet: into the model
    assert torch.equal(ex.model.weight, torch.ones(1, 2))
    train = ex.training_model("opts")
    inference = ex.inference_model(("validation", 1, 1), "opts")
    inference.attached = True
    ex.load_weights({"weight": torch.full((1, 2), 2.0), "bias": torch.zeros(1)})
    assert train.calls == ["load_state_dict"] and not inference.attached
    assert torch.equal(ex.model.weight, torch.full((1, 2), 2.0))


def test_detach_raises_but_release_after_an_error_warns():
    ex, _ = executors()
    train = ex.training_model("opts")
    train.attached = True

    def fails() -> None:
        raise RuntimeError("device lost")

    train.detachFromDevice = fails
    with pytest.raises(RuntimeError, match="device lost"):
        ex.detach(train)
    with pytest.warns(UserWarning, match="Could not detach StubExecutor from the device"):
        ex.release()


def test_host_weights_go_to_the_device_only_when_the_host_synced_since_the_last_step():
    ex, _ = executors()
    train = ex.training_model("opts")
    ex.compile(train, (torch.ones(1, 2),), {})
    train(torch.ones(1, 2))  # a step: the host's weights are stale
    ex.push_host_weights()
    assert train.calls == []  # nothing read them: nothing to send
    train._dirty_host_weights = False  # a hook read them (PopTorch synced)
    ex.push_host_weights()
    assert train.calls == ["copyWeightsToDevice"]
    train.attached = False
    ex.push_host_weights()  # detached: attaching uploads them
    assert train.calls == ["copyWeightsToDevice"]


def test_a_parameter_replaced_since_compiling_is_refused_naming_it():
    ex, _ = executors()
    train = ex.training_model("opts")
    ex.compile(train, (torch.ones(1, 2),), {})
    ex.model.bias = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="parameter 'bias' is a new tensor"):
        ex.push_host_weights()
