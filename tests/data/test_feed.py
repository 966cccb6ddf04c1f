"""``ipuloop.feed``: a batch as the model's call and its labels (``split_batch``, ``Feed``),
predict's inputs (``predict_inputs``) and float inputs as the device gets them (``as_sent``)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from ipuloop import WithLoss
from ipuloop.feed import Feed, as_sent, predict_inputs, split_batch

X, Y = torch.ones(4, 3), torch.tensor([0, 1, 0, 1])


def test_a_tuple_batch_is_the_inputs_then_the_labels():
    for batch in ((X, X, Y), [X, X, Y]):
        args, kwargs, labels = split_batch(batch, "train_loader")
        assert args == (X, X, Y) and kwargs == {} and labels is Y


def test_a_dict_batch_is_keyword_inputs_with_the_labels_under_label_key():
    args, kwargs, labels = split_batch({"input_ids": X, "labels": Y}, "train_loader")
    assert args == () and kwargs == {"input_ids": X, "labels": Y} and labels is Y
    args, kwargs, labels = split_batch(OrderedDict(x=X, target=Y), "loader", "target")
    assert type(kwargs) is dict and labels is Y  # any mapping
    assert split_batch({"x": X}, "loader", need_labels=False) == ((), {"x": X}, None)
    with pytest.raises(ValueError, match=r"val_loader yields dict batches without .*'labels'"):
        split_batch({"x": X, "y": Y}, "val_loader")


@pytest.mark.parametrize("batch,what", [(X, "a Tensor"), ((X,), "a tuple of length 1")])
def test_other_batches_are_refused_naming_what_came(batch, what):
    with pytest.raises(ValueError, match=f"train_loader must yield .* Received {what}"):
        split_batch(batch, "train_loader")


def test_predict_takes_the_inputs_the_fit_had():
    assert predict_inputs((X, Y), None, "loader") == ((X,), {})  # before a fit: labels last
    assert predict_inputs(X, None, "loader") == ((X,), {})
    assert predict_inputs((X, X), 2, "loader") == ((X, X), {})  # after a fit with 2 inputs
    assert predict_inputs((X, X, Y), 2, "loader") == ((X, X), {})
    assert predict_inputs({"x": X, "labels": Y}, None, "loader") == ((), {"x": X})
    with pytest.raises(ValueError, match="batches of 4 elements, but the model was fit with 2"):
        predict_inputs((X, X, X, Y), 2, "predict_loader")


def test_as_sent_casts_the_float_tensors_only():
    args, kwargs = as_sent((X, Y, 3), {"m": X}, torch.float16)
    assert args[0].dtype == kwargs["m"].dtype == torch.float16
    assert args[1] is Y and args[2] == 3
    assert as_sent((X,), {}, None) == ((X,), {})


def test_feed_tells_a_with_loss_model_its_inputs_and_sends_float_labels_as_cast():
    model = WithLoss(torch.nn.Identity(), torch.nn.functional.mse_loss)
    feed = Feed(model, "labels", needs_labels=True, dtype=torch.float16)
    floats = X.sum(1)
    args, _, labels = feed.split((X, X, floats), "train_loader")
    assert feed.num_inputs == model.num_inputs == 2
    assert [a.dtype for a in args] == [torch.float16] * 3 and labels is args[-1]
    _, _, labels = feed.split((X, floats), "train_loader", cast=False)  # as in the loader
    assert labels is floats and model.num_inputs == 1
    feed = Feed(
        WithLoss(torch.nn.Identity(), torch.nn.functional.mse_loss),
        "labels",
        needs_labels=True,
        dtype=None,
    )
    args, _ = feed.predict((X, X, X), "predict_loader", first=True)  # no fit: labels last
    assert len(args) == 2 and feed.model.num_inputs == 2 and args[0] is X
