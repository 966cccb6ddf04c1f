"""Indexing inside a model (``aten::index``, which PopTorch lowers): a traced model sees it on
every torch version. torch < 2.1 shows function modes no ``Tensor.__getitem__``; the
emulator's trace must still know an indexed graph tensor for one (device/checks.py
``_IndexWatch``, a dispatch mode beside the trace's function mode), without changing torch's
classes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipuloop.emulator as poptorch
from ipuloop.emulator.device import checks

VOCAB, HIDDEN, CLASSES, PAD = 11, 8, 3, 0


class LastTokenClassifier(nn.Module):
    """Logits of each sequence's last token that is not padding, pooled by advanced indexing
    (``logits[arange(B), lengths - 1]``), as Transformers' GPT-2 for sequence classification
    pools them; its loss, cross entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.score = nn.Linear(HIDDEN, CLASSES, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        logits = self.score(torch.tanh(self.mix(self.embed(ids))))
        lengths = torch.ne(ids, PAD).sum(-1)
        pooled = logits[torch.arange(ids.shape[0]), lengths - 1]
        return pooled, F.cross_entropy(pooled, labels)


def batches(steps: int, batch: int = 4, length: int = 6) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (batch, length), generator=g)
        for row, n in enumerate(torch.randint(1, length + 1, (batch,), generator=g)):
            ids[row, n:] = PAD
        out.append((ids, torch.randint(0, CLASSES, (batch,), generator=g)))
    return out


def test_a_model_pooling_by_advanced_indexing_trains_as_plain_torch():
    torch.manual_seed(0)
    model = LastTokenClassifier()
    reference = copy.deepcopy(model)
    data = batches(5)

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected = []
    for ids, labels in data:
        optimizer.zero_grad()
        pooled, loss = reference(ids, labels)
        loss.backward()
        optimizer.step()
        expected.append((pooled.detach(), loss.detach()))

    training = poptorch.trainingModel(
        model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5)
    )
    for (ids, labels), (pooled, loss) in zip(data, expected):
        got_pooled, got_loss = training(ids, labels)
        torch.testing.assert_close(got_pooled, pooled)
        torch.testing.assert_close(got_loss, loss)
    training.copyWeightsToHost()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)


class Pick(nn.Module):
    """``index(out)`` of the logits, then cross entropy."""

    def __init__(self, index) -> None:
        super().__init__()
        self.linear = nn.Linear(4, CLASSES)
        self.index = index

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        out = self.index(self.linear(x))
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize(
    "index",
    [
        lambda out: out[torch.arange(2)],
        lambda out: out[torch.tensor([3, 1])],
        lambda out: out[1:3],
        lambda out: out[[0, 2]],
    ],
    ids=["arange", "tensor", "slice", "list"],
)
def test_indexed_logits_feed_the_loss_on_the_device(index):
    torch.manual_seed(0)
    model = Pick(index)
    x, y = torch.randn(4, 4), torch.tensor([0, 2])
    expected = F.cross_entropy(index(model.linear(x)), y)
    inference = poptorch.inferenceModel(model)
    out, loss = inference(x, y)
    torch.testing.assert_close(loss, expected)
    assert out.shape == (2, CLASSES)


def test_a_boolean_mask_is_refused_as_a_dynamic_shape_on_every_torch():
    """``out[mask]`` has a shape the data decides: PopTorch cannot compile it (the emulator
    refuses it as torch >= 2.1 shows it, whatever the torch)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    model = Pick(lambda out: out[out[:, 0] > -100])
    inference = poptorch.inferenceModel(model)
    with pytest.raises(DynamicOutputShapeException):
        inference(torch.randn(2, 4), torch.tensor([0, 2]))


def test_indexing_outside_a_traced_model_is_torchs_own():
    """Once the trace ends, ``Tensor.__getitem__`` is torch's again."""
    before = torch.Tensor.__dict__.get("__getitem__")
    inference = poptorch.inferenceModel(Pick(lambda out: out[torch.arange(2)]))
    inference(torch.randn(4, 4), torch.tensor([0, 2]))
    assert torch.Tensor.__dict__.get("__getitem__") is before


def _scalars_make_a_tensor() -> None:
    """torch 2.0 reads a list of 0-d tensors as numbers, unless ``torch.Tensor`` was left
    with a sequence slot (``len() of a 0-d tensor``)."""
    made = torch.tensor([torch.tensor(1.0), torch.tensor(2.0)])
    assert made.tolist() == [1.0, 2.0]


def _train_last_token_classifier() -> poptorch.PoplarExecutor:
    model = LastTokenClassifier()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ids, labels = batches(1)[0]
    training(ids, labels)
    return training


def test_a_tensor_is_made_of_scalar_tensors_after_a_compile_and_after_a_detach():
    training = _train_last_token_classifier()
    _scalars_make_a_tensor()
    training.detachFromDevice()
    _scalars_make_a_tensor()


def _class_attributes() -> dict[str, dict[str, object]]:
    classes = (torch.Tensor, torch.nn.Parameter, *torch.Tensor.__bases__)  # TensorBase
    return {c.__name__: dict(vars(c)) for c in classes}


def test_compiling_and_detaching_leave_torchs_classes_as_they_were():
    before = _class_attributes()
    training = _train_last_token_classifier()
    training.detachFromDevice()
    after = _class_attributes()
    for name, attributes in before.items():
        assert after[name].keys() == attributes.keys(), name
        changed = [k for k, v in attributes.items() if after[name][k] is not v]
        assert changed == [], (name, changed)


def test_where_modes_do_not_see_indexing_the_dispatch_watch_does(monkeypatch):
    """torch 2.0's case on any torch: the trace learns advanced indexing from the dispatch
    watch (the indexed logits feed the loss, a boolean mask is refused), and torch's classes
    are left alone."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    monkeypatch.setattr(checks, "_getitem_shown", [False])
    watched = []
    monkeypatch.setattr(checks.TraceChecks, "indexed", _recording(watched))
    test_a_tensor_is_made_of_scalar_tensors_after_a_compile_and_after_a_detach()
    assert watched, "the dispatch watch saw no advanced indexing"
    model = Pick(lambda out: out[out[:, 0] > -100])
    with pytest.raises(DynamicOutputShapeException):
        poptorch.inferenceModel(model)(torch.randn(2, 4), torch.tensor([0, 2]))
    _scalars_make_a_tensor()


def _recording(seen: list):
    indexed = checks.TraceChecks.indexed

    def record(self, t, index, out):
        seen.append(out.shape)
        return indexed(self, t, index, out)

    return record


class Positions(nn.Module):
    """BERT's position ids: a buffer that is itself a view (``arange(...).expand``), sliced in
    ``forward`` (basic indexing: a view of a view, whose ``_base`` is the arange, not the
    buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.register_buffer("position_ids", torch.arange(8).expand((1, -1)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self.position_ids[:, : ids.shape[1]]
        return self.embed(ids) + self.embed(positions)


@pytest.mark.parametrize("modes_see_indexing", [True, False], ids=["torch", "watch"])
def test_a_slice_of_a_buffer_that_is_a_view_stays_on_the_device(monkeypatch, modes_see_indexing):
    if not modes_see_indexing:  # torch 2.0's case on any torch
        monkeypatch.setattr(checks, "_getitem_shown", [False])
    elif not checks.modes_see_indexing():
        pytest.skip("this torch's function modes do not see indexing")
    torch.manual_seed(0)
    model = Positions()
    ids = torch.randint(0, 8, (2, 5))
    expected = model(ids)
    torch.testing.assert_close(poptorch.inferenceModel(model)(ids), expected)
