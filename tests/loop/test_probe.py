"""``ipuloop.probe``: the first micro-batch through the model on the host before anything
compiles, failing with the shapes received; under "16-mixed", the dtypes the matmuls compute in."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ipuloop import WithLoss
from ipuloop.mixed_advice import check_mixed
from ipuloop.outputs import Returns
from ipuloop.probe import MicroBatch, probe, shape

X, Y = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 0, 1])


def run(model, args, labels=None, *, loop_loss=False, metrics=None, kwargs=None) -> None:
    labels = args[-1] if labels is None and args else labels
    probe(
        model,
        MicroBatch(args=args, kwargs=kwargs or {}, labels=labels, name="train_loader"),
        copy_float=False,
        metrics=metrics or {},
        metric_output=None,
        returns=Returns(),
        loop_loss=loop_loss,
    )


class Returning(nn.Module):
    """Returns ``make(output, labels)``."""

    def __init__(self, make) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.make = make

    def forward(self, x, y):
        return self.make(self.fc(x), y)


def test_shape_names_dtypes_and_shapes():
    assert shape(torch.ones(4, 6)) == "float32 [4, 6]"
    assert shape((torch.ones(1), 3)) == "tuple (float32 [1], int)"
    assert shape({"ids": torch.zeros(2, dtype=torch.int64)}) == "dict {'ids': int64 [2]}"


def test_a_good_batch_passes_and_leaves_the_buffers_rng_and_mode_as_they_were():
    model = WithLoss(
        nn.Sequential(nn.BatchNorm1d(3), nn.Dropout(0.5), nn.Linear(3, 2)),
        nn.functional.cross_entropy,
    )
    model.eval()
    before = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    run(model, (X, Y), loop_loss=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state()) and not model.training


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda out, y: (out, nn.functional.cross_entropy(out, y, reduction="none")),
            r"must be a scalar per micro-batch. Received a loss of shape \[4\]",
        ),
        (
            lambda out, y: (nn.functional.cross_entropy(out, y), out),
            r"shape \[4, 2\]: reduce it .*needs Loop\(loss_key=0\)",
        ),
        (lambda out, y: out, "the model must return"),
        (
            lambda out, y: (out, out.sum(), {"acc": out.sum(1)}),
            r"the logged value 'acc' has shape \[4\]",
        ),
        (
            lambda out, y: (out, out.sum(), {"loss": out.sum()}),
            "the logged value 'loss' would clash",
        ),
    ],
    ids=["loss-per-sample", "loss-first", "no-loss", "logged-per-sample", "logged-as-loss"],
)
def test_what_the_model_returns_is_checked(make, message):
    with pytest.raises(ValueError, match=message):
        run(Returning(make), (X, Y))


def test_a_failing_model_or_mismatched_batch_is_named_with_its_shapes():
    with pytest.raises(ValueError, match=r"input 0 has batch size 3 but the labels have 4"):
        run(Returning(lambda out, y: (out, out.sum())), (X[:3], Y))
    with pytest.raises(
        ValueError,
        match=r"failed on the first micro-batch.*with input \(float32 \[4, 3\]\) and labels "
        r"int64 \[4\]: RuntimeError",
    ):
        run(WithLoss(nn.Linear(5, 2), nn.functional.cross_entropy), (X, Y))


def test_float_labels_that_would_broadcast_against_the_output_are_refused():
    model = WithLoss(nn.Linear(3, 1), lambda out, y: (out - y).pow(2).mean())
    floats = Y.float()
    with pytest.raises(ValueError, match=r"would broadcast to \[4, 4\] in the loss"):
        run(model, (X, floats), loop_loss=True)
    run(model, (X, floats.unsqueeze(-1)), loop_loss=True)


class Rejects:
    def update(self, output, labels) -> None:
        raise RuntimeError("expected 3 classes")


def test_a_metric_that_rejects_the_output_is_named():
    model = WithLoss(nn.Linear(3, 2), nn.functional.cross_entropy)
    with pytest.raises(
        ValueError, match=r"metrics\['acc'\] \(Rejects\) rejects .*float32 \[4, 2\]"
    ):
        run(model, (X, Y), metrics={"acc": Rejects()})


class Embedded(nn.Module):
    """A float32 position embedding added to the (float16) input: everything after it float32,
    unless ``cast`` casts it to the activations' dtype."""

    def __init__(self, cast: bool) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(3))
        self.fc = nn.Linear(3, 2)
        self.cast = cast

    def forward(self, x):
        return self.fc(x + (self.pos.to(x.dtype) if self.cast else self.pos))


def test_check_mixed_names_the_float32_tensor_that_promotes_the_activations():
    with pytest.warns(UserWarning, match=r"1 of the model's 1 matmuls.*the parameter 'pos'"):
        record = check_mixed(Embedded(cast=False), (X.half(),), {})
    assert record is not None and record.matmuls == [("linear", torch.float32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = check_mixed(Embedded(cast=True), (X.half(),), {})
    assert record is not None and record.matmuls == [("linear", torch.float16)]
