"""``ipuloop.accumulators``: a phase's numbers reduced over the step and the epoch, each
against a hand computation (a training epoch's loss under each output mode, a validation's
loss over a padded host call, a predict's joined outputs)."""

from __future__ import annotations

import math
import warnings
from collections import namedtuple
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from ipuloop import NonFiniteLossError, State
from ipuloop.accumulators import (
    Predictions,
    TrainEpoch,
    Validation,
    concat,
    mark_estimates,
    metric_logs,
    upgrade_logs,
)
from ipuloop.outputs import ALL, EVERY_N, FINAL, SUM, Layout, Returns
from ipuloop.processes import Processes


class Total:
    """A metric of the torchmetrics kind: the sum of the outputs it was updated with."""

    _defaults: ClassVar[dict] = {"total": 0.0}

    def __init__(self) -> None:
        self.total = 0.0

    def clone(self) -> Total:
        return Total()

    def reset(self) -> None:
        self.total = 0.0

    def update(self, output, labels) -> None:
        self.total += float(output.sum())

    def compute(self):
        return self.total


class Doubled(Processes):
    """Two instances, the other's numbers the same as this one's (``other`` in its place:
    another loss)."""

    size = 2

    def __init__(self, other: float | None = None) -> None:
        self.other = other

    def sum(self, values, what):
        if self.other is not None:
            return [values[0] + self.other, values[1] * 2]
        return [2 * v for v in values]


def train_epoch(processes=None, metrics=None) -> TrainEpoch:
    return TrainEpoch(
        metrics=metrics or {},
        metric_output=None,
        returns=Returns(),
        processes=processes or Processes(),
        state=State(),
    )


# The micro-batch losses of two steps of [DI, GA, RF] = [2, 1, 2], by (iteration, replica):
# step 1 [[1, 2], [3, 4]], step 2 [[5, 6], [7, 8]]; what each mode returns of them.
@pytest.mark.parametrize(
    "mode,period,returned,means,epoch_loss,exact",
    [
        (ALL, 1, [[1, 2, 3, 4], [5, 6, 7, 8]], [2.5, 6.5], 36 / 8, 1.0),
        (SUM, 1, [[1 + 3, 2 + 4], [5 + 7, 6 + 8]], [2.5, 6.5], 36 / 8, 1.0),
        (FINAL, 1, [[3, 4], [7, 8]], [3.5, 7.5], 22 / 4, 0.0),
        (EVERY_N, 2, [[3, 4], [7, 8]], [3.5, 7.5], 22 / 4, 0.0),
    ],
    ids=["All", "Sum", "Final", "EveryN2"],
)
def test_train_loss_under_each_output_mode(mode, period, returned, means, epoch_loss, exact):
    te, layout = train_epoch(), Layout(2, 1, 2, mode, period)
    assert te.logs() == {}  # no step yet: no logs
    got = [
        te.add(te.step_loss(torch.tensor(r, dtype=torch.float32), layout, check_finite=True))
        for r in returned
    ]
    assert got == means
    assert te.logs() == {"train_loss": epoch_loss}
    assert layout.exact is bool(exact)  # Final, EveryN: the logs are estimates
    te.reset()
    assert te.logs() == {}


def test_the_estimates_are_named_and_older_flags_read_as_names():
    logs = {"loss": 1.0, "x0": 2.0, "train_loss": 1.5, "train_acc": 0.5, "val_loss": 3.0}
    mark_estimates(logs, logged={"x0"})
    assert logs["estimated"] == "loss x0 train_loss train_acc"  # never a val_ value
    mark_estimates(logs, logged={"x0"})  # again: the same names, not itself
    assert logs["estimated"] == "loss x0 train_loss train_acc"
    # a checkpoint written before: train_loss_exact 0.0 (estimates) or 1.0 (exact)
    old = {"epoch": 1, "loss": 1.0, "train_loss": 1.5, "train_loss_exact": 0.0, "val_loss": 3.0}
    assert upgrade_logs(old) == {
        "epoch": 1,
        "loss": 1.0,
        "train_loss": 1.5,
        "val_loss": 3.0,
        "estimated": "loss train_loss",
    }
    assert upgrade_logs({"train_loss": 1.5, "train_loss_exact": 1.0}) == {"train_loss": 1.5}


def test_train_logged_values_are_reduced_as_the_loss():
    te, layout = train_epoch(), Layout(2, 1, 1, ALL)
    assert te.add_logs({"acc": torch.tensor([0.5, 1.0])}, layout) == {"acc": 0.75}
    assert te.add_logs({"acc": torch.tensor([0.0, 0.5])}, layout) == {"acc": 0.25}
    te.add(te.step_loss(torch.tensor([1.0, 3.0]), layout, check_finite=True))
    assert te.logs()["train_acc"] == 0.5


def test_train_loss_sums_over_the_instances_and_names_another_ones_non_finite_loss():
    layout = Layout(2, 1, 1, ALL)
    te = train_epoch(Doubled())
    step = te.step_loss(torch.tensor([1.0, 3.0]), layout, check_finite=True)
    assert (step.total, step.count, step.exact) == (8.0, 4, True)
    te = train_epoch(Doubled(other=math.nan))
    with pytest.raises(NonFiniteLossError, match="on another instance"):
        te.step_loss(torch.tensor([1.0, 3.0]), layout, check_finite=True)
    assert math.isnan(te.step_loss(torch.tensor([1.0, 3.0]), layout, check_finite=False).total)


def test_train_epoch_state_dict_gives_the_same_logs_back():
    te, layout = train_epoch(metrics={"total": Total()}), Layout(1, 1, 1, ALL)
    te.add(te.step_loss(torch.tensor(2.0), layout, check_finite=True))
    te.add_logs({"acc": torch.tensor(0.5)}, layout)
    te.update_metrics(torch.tensor([1.0, 2.0]), torch.zeros(2), layout)
    again = train_epoch(metrics={"total": Total()})
    again.load_state_dict(te.state_dict())
    assert (
        again.logs()
        == te.logs()
        == {
            "train_loss": 2.0,
            "train_total": 3.0,
            "train_acc": 0.5,
        }
    )


def _validation(loss_fn, warned: set) -> Validation:
    plan = SimpleNamespace(layout=Layout(2, 1, 1, ALL), micro=2, combined=4)
    return Validation(
        plan, metrics={}, metric_output=None, loss_fn=loss_fn, warned=warned, returns=Returns()
    )


def test_val_loss_of_a_padded_call_is_the_mean_over_its_samples():
    output = torch.tensor([[1.0], [2.0], [3.0], [0.0]])  # the last row: padding
    labels = torch.tensor([[0.0], [0.0], [1.0], [0.0]])
    # the device's loss per micro-batch (the mean squared error), the padding in the second
    loss = torch.tensor([(1 + 4) / 2, (4 + 0) / 2])
    val = _validation(lambda o, y: ((o - y) ** 2).mean(), set())
    val.add((output, loss), labels, valid=3)
    assert val.logs(Processes()) == {"val_loss": (1 + 4 + 4) / 3}  # the third on the host
    val = _validation(None, set())  # no loss_fn: the micro-batch with padding is left out
    val.add((output, loss), labels, valid=3)
    with pytest.warns(UserWarning, match="val_loss covers 2 of the 3 validation samples"):
        assert val.logs(Processes()) == {"val_loss": 2.5}


def test_val_without_a_loss_warns_once():
    warned: set = set()
    val = _validation(None, warned)
    with pytest.warns(UserWarning, match="no val_loss"):
        val.add(torch.ones(4, 1), torch.zeros(4, 1), valid=4)
    assert val.logs(Processes()) == {} and warned == {"no_val_loss"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second validation of the loop: no warning
        _validation(None, warned).add(torch.ones(4, 1), torch.zeros(4, 1), valid=4)


def test_metric_logs_name_each_value_of_a_metric():
    metric = SimpleNamespace
    logs = metric_logs(
        "val_",
        {
            "acc": metric(compute=lambda: torch.tensor(0.5)),
            "per_class": metric(compute=lambda: torch.tensor([0.25, 0.75])),
            "parts": metric(compute=lambda: {"p": 1.0, "r": (2.0, 3.0)}),
        },
    )
    assert logs == {
        "val_acc": 0.5,
        "val_per_class_0": 0.25,
        "val_per_class_1": 0.75,
        "val_parts_p": 1.0,
        "val_parts_r_0": 2.0,
        "val_parts_r_1": 3.0,
    }


def test_concat_joins_each_call_in_host_batch_order_and_keeps_the_samples():
    Out = namedtuple("Out", "a b")
    parts = [
        {"x": torch.tensor([0, 1]), "o": Out(torch.tensor([0, 1]), torch.tensor(5))},
        {"x": torch.tensor([2, 3]), "o": Out(torch.tensor([2, 3]), torch.tensor(6))},
    ]
    got = concat(parts, slice(None, 3), lambda t: t.flip(0))  # ``rows`` reorders each call's
    assert got["x"].tolist() == [1, 0, 3] and type(got["o"]) is Out
    assert got["o"].a.tolist() == [1, 0, 3] and got["o"].b.tolist() == [5, 6]
    assert concat(["a", "b"], slice(None), lambda t: t) == ["a", "b"]  # not tensors: as returned


def test_predictions_join_the_samples_without_the_padding():
    pred = Predictions(Layout(1, 1, 1, ALL), dataset=[])
    with pytest.raises(ValueError, match="list was empty"):
        pred.result()
    pred.add((torch.tensor([1, 2]),), 2)
    pred.add((torch.tensor([3, 0]),), 1)  # the last call: one sample, one row of padding
    assert pred.result()[0].tolist() == [1, 2, 3]
