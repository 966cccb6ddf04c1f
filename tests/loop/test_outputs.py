"""``ipuloop.outputs``: what a model returns (``WithLoss``, ``Returns``, ``check_logged``) and
what a host call returns, reduced over the step (``Layout``), and the non-finite loss's error."""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch

from ipuloop.outputs import (
    ALL,
    EVERY_N,
    FINAL,
    SUM,
    Layout,
    Returns,
    WithLoss,
    check_logged,
    map_tensors,
    non_finite_error,
)

# -- what a model returns -------------------------------------------------------------------------


def test_map_tensors_reaches_every_tensor_and_keeps_the_containers():
    Pair = namedtuple("Pair", "t tag")
    t = torch.ones(2)
    got = map_tensors({"a": (t, [t, 3]), "n": Pair(t, "s")}, lambda x: x * 2)
    assert type(got["a"]) is tuple and type(got["a"][1]) is list and type(got["n"]) is Pair
    assert torch.equal(got["a"][0], t * 2) and torch.equal(got["a"][1][0], t * 2)
    assert got["a"][1][1] == 3 and got["n"].tag == "s" and torch.equal(got["n"].t, t * 2)


def test_with_loss_returns_the_output_alone_or_with_the_loss_of_the_labels():
    model = WithLoss(torch.nn.Identity(), lambda out, y: (out - y).abs().sum(), num_inputs=1)
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])
    assert torch.equal(model(x), x)  # no labels: the output
    out, loss = model(x, y)
    assert torch.equal(out, x) and float(loss) == 3.0
    out, loss = model(input=x, labels=y)  # a dict batch: the labels under label_key
    assert float(loss) == 3.0
    with pytest.raises(TypeError, match="expected 1 input"):
        model(x, y, y)


def test_returns_split_by_the_loss_key():
    loss, z, acc = torch.tensor(0.5), torch.ones(2, 3), torch.tensor(1.0)
    r = Returns()
    assert r.split((z, loss)) == (z, loss, None)
    assert r.split((z, loss, {"acc": acc})) == (z, loss, {"acc": acc})
    assert r.split({"loss": loss, "logits": z}) == (z, loss, None)  # one output left: itself
    output, got, logs = r.split({"loss": loss, "logits": z, "h": z, "logs": {"acc": acc}})
    assert output == {"logits": z, "h": z} and got is loss and logs == {"acc": acc}
    assert r.split({"loss": None, "logits": z})[1] is None  # no loss: all output
    assert r.split(z) == (z, None, None)
    first = Returns(0)  # Transformers' (loss, logits, ...)
    assert first.split((loss, z)) == (z, loss, None)
    assert first.split((loss, z, z))[0] == (z, z)
    assert first.split(z) == (z, None, None)
    for bad in ("", True, 1.5):
        with pytest.raises(TypeError, match="loss_key must be a str"):
            Returns(bad)


@pytest.mark.parametrize(
    "logs,clash",
    [
        ([torch.tensor(1.0)], "must be a dict"),
        ({"2x": torch.tensor(1.0)}, "must be an identifier"),
        ({"loss": torch.tensor(1.0)}, "the loop's own logs"),
        ({"epoch": torch.tensor(1.0)}, "the loop's own logs"),
        ({"val_acc": torch.tensor(1.0)}, "train_/val_ prefixes"),
        ({"acc": torch.tensor(1.0)}, "a metric's name"),
        ({"x": 1.0}, "must be a tensor"),
    ],
)
def test_check_logged_refuses_what_would_not_be_a_log_of_its_own(logs, clash):
    with pytest.raises(ValueError, match=clash):
        check_logged(logs, {"acc": None})


def test_check_logged_takes_named_tensors():
    check_logged({"x": torch.tensor(1.0), "grad_norm": torch.tensor(2.0)}, {"acc": None})


# -- a host call's returns, over the step ----------------------------------------------------------


@pytest.mark.parametrize("mode,period", [(ALL, 1), (EVERY_N, 1)])
def test_align_every_micro_batch_is_the_labels_in_order(mode, period):
    labels = torch.arange(2 * 3 * 4)
    layout = Layout(2, 3, 1, mode, period)
    assert torch.equal(layout.align(labels), labels)
    replicated = Layout(2, 3, 2, mode, period, group=2)  # 2 replicas read 1 input group
    got = replicated.align(labels)
    assert torch.equal(got, labels.reshape(2, 3, 1, 4).repeat(1, 1, 2, 1).reshape(-1))


@pytest.mark.parametrize(
    "mode,period,returned,count,exact",
    [
        (SUM, 1, 2, 24, True),
        (FINAL, 1, 2, 2, False),
        (ALL, 1, 24, 24, True),
        (EVERY_N, 2, 12, 12, False),
    ],
)
def test_step_loss_counts(mode, period, returned, count, exact):
    layout = Layout(4, 3, 2, mode, period)  # DI=4, GA=3, RF=2: 24 micro-batches
    for _ in range(2):  # computed once, then reused
        got = layout.step_loss(torch.full((returned,), 0.5))
        assert (got.count, got.exact) == (count, exact)
        assert got.total == pytest.approx(0.5 * returned)
        assert got.mean == pytest.approx(0.5 * returned / count)


def test_align_keeps_the_labels_of_the_returned_micro_batches():
    labels = torch.arange(8)  # micro-batches of 2 samples
    assert Layout(2, 2, 1, FINAL).align(labels).tolist() == [6, 7]  # the last micro-batch
    every_2nd = Layout(4, 1, 1, EVERY_N, 2)  # device iterations 1 and 3
    assert every_2nd.align(labels).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match=r"OutputMode\.Sum returns per-replica sums"):
        Layout(2, 2, 1, SUM).align(labels)


def test_input_rows_keep_one_copy_per_input_group():
    two_replicas_one_group = Layout(1, 1, 2, ALL, group=2)
    rows = two_replicas_one_group.input_rows(torch.tensor([1.0, 2.0, 1.0, 2.0]))
    assert rows.tolist() == [1.0, 2.0]
    assert Layout(1, 1, 2, ALL).input_rows(torch.arange(4)).tolist() == [0, 1, 2, 3]


def test_step_loss_refuses_what_is_not_a_scalar_per_micro_batch():
    layout = Layout(2, 1, 1, ALL)
    with pytest.raises(ValueError, match=r"as 3 value\(s\), where .* gives 2"):
        layout.step_loss(torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="returned no loss where the loop looks"):
        layout.step_loss(None)


# -- a non-finite loss ----------------------------------------------------------------------------


def test_non_finite_error_names_the_micro_batch_and_the_replica_under_sum():
    layout = Layout(2, 2, 1, ALL)  # [DI, GA, RF] = [2, 2, 1]
    text = str(non_finite_error(torch.tensor([1.0, 1.0, math.nan, 1.0]), layout, 3, 7))
    assert "at epoch 3, step 7" in text
    assert "micro-batch 2 of the step (device iteration 1, accumulation step 0, replica 0)" in text
    assert "Lower the learning rate" in text
    text = str(non_finite_error(torch.tensor([1.0, math.inf]), Layout(2, 1, 2, SUM), 0, 0))
    assert "replica 1 of the step (a replica's sum" in text


def test_non_finite_error_says_what_in_the_batch_explains_it():
    layout = Layout(1, 1, 1, ALL)
    nan = torch.tensor([math.nan])
    x, y = torch.ones(2, 3), torch.tensor([0.0, math.nan])
    text = str(non_finite_error(nan, layout, 0, 0, batch=(x, y)))
    assert "the labels of this step's host batch have NaN or infinite values" in text
    big = (torch.full((2, 3), 1e5), torch.zeros(2))
    text = str(non_finite_error(nan, layout, 0, 0, batch=big, precision="16-mixed"))
    assert "input 0 of this step's host batch has values up to 100000, beyond float16's" in text
    text = str(
        non_finite_error(
            nan, layout, 0, 0, batch=(x, x), precision="16-true", loss_scaling=1000, last_loss=100
        )
    )
    assert "times the optimizer's loss_scaling=1000 is 100000" in text
    assert "Lower loss_scaling (below 655 for that loss)" in text
