"""Validation every N steps, dict batches with keyword inputs, and values logged by the model.

Each feature is checked against what it must equal: the recorded event order written out
from the pseudocode, a host computation with the step's weights, a plain-torch loop doing
the same math, and an uninterrupted run for the resumed ones (bitwise).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import logging
import os
import signal
import warnings
from pathlib import Path

import helpers_train as H
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from launch import clean_env, command
from test_callbacks_checkpoint import assert_same
from torch.utils.data import DataLoader, Dataset, TensorDataset
import warm

from ipuloop import Callback, CancelEpoch, Loop, poptorch
from ipuloop.callbacks import CSVLogger, EarlyStopping, ModelCheckpoint
from ipuloop.callbacks.base import EVENTS
from ipuloop.checkpoint_io import read_manifest

IN, OUT, B = 4, 3, 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels in every run compared bitwise
    yield
    torch.set_num_threads(n)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


class Recorder(Callback):
    """Every event with the step it fired at; ``react(event, loop)`` may stop or raise."""

    def __init__(self, react=None) -> None:
        self.events: list[tuple[str, int]] = []
        self.react = react
        self.val: list[tuple[int, dict]] = []  # (step, val logs) at each on_validation_end
        self.weights: list[dict] = []  # the model's weights at each on_validation_end


def _hook(name):
    def hook(self, loop):
        self.events.append((name, loop.state.step))
        if name == "on_validation_end":
            self.val.append(
                (
                    loop.state.step,
                    {k: v for k, v in loop.state.logs.items() if k.startswith("val_")},
                )
            )
            self.weights.append({k: v.clone() for k, v in loop.model.state_dict().items()})
        if self.react is not None:
            self.react(name, loop)

    return hook


for _e in EVENTS:
    setattr(Recorder, _e, _hook(_e))


# -- 1. validation every N steps ---------------------------------------------------------------
STEPS = 6  # training steps an epoch: 24 samples, micro-batch 2, DI 2
VAL = 2  # validation steps: 10 samples, micro-batch 2, DI 3 (the last call padded)


def fit_linear(react=None, epochs=2, steps=STEPS, callbacks=(), metrics=None, **fit):
    torch.manual_seed(0)
    rec = Recorder(react)
    model = nn.Linear(IN, OUT)
    opts = poptorch.Options().deviceIterations(2)
    loop = Loop(
        model,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        callbacks=[rec, *callbacks],
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.2),
        progress=False,
        inference_opts=poptorch.Options().deviceIterations(3),
        metrics=metrics,
    )
    history = loop.fit(
        DataLoader(data(steps * 4, 1), batch_size=B),
        epochs=epochs,
        val_loader=DataLoader(data(10, 2), batch_size=B),
        **fit,
    )
    return loop, rec, history


def validation(step: int, first: bool = False) -> list[tuple[str, int]]:
    compile_ = [("on_compile_start", step), ("on_compile_end", step)] if first else []
    return (
        [("on_validation_start", step)]
        + compile_
        + [("on_validation_step_end", step)] * VAL
        + [("on_validation_end", step)]
    )


def steps(first: int, last: int, val_every: int, first_val: int | None) -> list:
    """The step events of steps ``first``..``last``, a validation before on_train_step_end at
    every multiple of ``val_every`` (compiled at ``first_val``)."""
    out = []
    for s in range(first, last + 1):
        out.append(("on_train_step_start", s - 1))
        if s % val_every == 0:
            out += validation(s, first=s == first_val)
        out.append(("on_train_step_end", s))
    return out


@pytest.mark.parametrize("every", [4, 3])
def test_validation_every_n_steps_runs_before_that_steps_end(every):
    """every=4: validations at steps 4, 8, 12 and at the end of epoch 1 (step 6); every=3: at
    3, 6, 9, 12, the epoch ends (6 and 12) validating no second time."""
    loop, rec, history = fit_linear(val_every_n_steps=every)
    train_compile = [("on_compile_start", 0), ("on_compile_end", 0)]
    first_val = every
    epoch1 = [("on_epoch_start", 0), *train_compile, *steps(1, STEPS, every, first_val)]
    if STEPS % every:
        epoch1 += validation(STEPS)
    epoch2 = [("on_epoch_start", STEPS), *steps(STEPS + 1, 2 * STEPS, every, first_val)]
    expected = [
        ("on_configure", 0),
        ("on_fit_start", 0),
        *epoch1,
        ("on_epoch_end", STEPS),
        *epoch2,
        ("on_epoch_end", 2 * STEPS),
        ("on_fit_end", 2 * STEPS),
    ]
    assert rec.events == expected
    validated = sorted({*range(every, 2 * STEPS + 1, every), STEPS})
    assert [s for s, _ in rec.val] == validated
    # history: one row per epoch, holding the epoch's last validation
    assert [h["epoch"] for h in history] == [1, 2]
    assert history[0]["val_loss"] == dict(rec.val)[STEPS]["val_loss"]
    assert history[1]["val_loss"] == dict(rec.val)[2 * STEPS]["val_loss"]
    assert loop.state.val_every_n_steps == every


def test_each_validation_scores_the_weights_of_its_step():
    """val_loss and val_acc at each validation equal a host computation over every one of
    the 10 samples with the weights the model had at that step."""
    acc = torchmetrics.Accuracy(task="multiclass", num_classes=OUT)
    loop, rec, _ = fit_linear(val_every_n_steps=4, metrics={"acc": acc})
    x, y = data(10, 2).tensors
    assert len(rec.weights) == 4  # steps 4, 6 (epoch end), 8, 12
    for (step, logs), weights in zip(rec.val, rec.weights):
        out = F.linear(x, weights["weight"], weights["bias"])
        assert logs["val_loss"] == pytest.approx(float(F.cross_entropy(out, y)), abs=1e-6)
        assert logs["val_acc"] == pytest.approx(float((out.argmax(-1) == y).float().mean()))
    assert len({logs["val_loss"] for _, logs in rec.val}) == 4  # the weights did change


def test_max_steps_at_a_validation_step_validates_and_leaves_the_epoch_incomplete():
    loop, rec, history = fit_linear(val_every_n_steps=2, max_steps=4)
    assert [s for s, _ in rec.val] == [2, 4]
    assert rec.events[-3:] == [
        ("on_validation_end", 4),
        ("on_train_step_end", 4),
        ("on_fit_end", 4),
    ]
    assert (loop.state.epoch, loop.state.step, history) == (0, 4, [])


def test_cancel_epoch_in_a_steps_validation_ends_the_epoch_without_val_logs():
    def react(event, loop):
        if event == "on_validation_start" and loop.state.step == 3:
            raise CancelEpoch

    loop, rec, history = fit_linear(react, epochs=1, val_every_n_steps=3)
    # the epoch ends at step 3: its logs, no other validation (step 3 had one), on_epoch_end
    assert rec.events[-4:] == [
        ("on_train_step_start", 2),
        ("on_validation_start", 3),
        ("on_epoch_end", 3),
        ("on_fit_end", 3),
    ]
    assert (loop.state.step, loop.state.epoch) == (3, 1)
    assert "val_loss" not in history[0] and "train_loss" in history[0]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"val_every_n_steps": 0}, "val_every_n_steps must be an int >= 1"),
        ({"val_every_n_steps": 2.0}, "val_every_n_steps must be an int >= 1"),
        ({"val_every_n_steps": True}, "val_every_n_steps must be an int >= 1"),
    ],
)
def test_val_every_n_steps_is_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        fit_linear(**kw)


def test_val_every_n_steps_needs_a_val_loader():
    model = nn.Linear(IN, OUT)
    loop = Loop(model, loss_fn=nn.CrossEntropyLoss(), progress=False)
    with pytest.raises(
        ValueError, match="val_every_n_steps=2 validates on val_loader, but this fit has none"
    ):
        loop.fit(DataLoader(data(8, 1), batch_size=B), val_every_n_steps=2)
    assert loop.train_model is None  # before anything compiled


class Count(torchmetrics.Metric):
    """A scripted validation log: its compute gives 1, 2, 3, ..., one more each time."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("seen", torch.tensor(0), dist_reduce_fx="sum")
        self.computed = 0

    def update(self, output, labels) -> None:
        self.seen += 1

    def compute(self) -> torch.Tensor:
        self.computed += 1
        return torch.tensor(float(self.computed))


def test_early_stopping_checks_each_validation_and_stops_mid_epoch(capsys):
    """val_count is 1, then 2: the validation at step 6 does not improve on the one at step
    3, so patience=1 stops the fit after step 6, in the middle of the 8-step epoch."""
    stop = EarlyStopping("val_count", patience=1)
    loop, rec, history = fit_linear(
        epochs=2, steps=8, callbacks=[stop], val_every_n_steps=3, metrics={"count": Count()}
    )
    assert [(s, logs["val_count"]) for s, logs in rec.val] == [(3, 1.0), (6, 2.0)]
    assert (loop.state.step, loop.state.epoch, history) == (6, 0, [])
    assert stop.stopped_epoch == 1 and stop.reason.endswith("for 1 validations")
    assert "EarlyStopping: stopping at step 6 (epoch 1)" in capsys.readouterr().out


def test_early_stopping_counts_an_epoch_end_validation_once(capsys):
    """every=3 over 6-step epochs: steps 3, 6, 9, 12 validate (val_count 1, 2, 3, 4) and the
    epoch ends at 6 and 12 are no further checks: patience=3 stops at the fourth."""
    stop = EarlyStopping("val_count", patience=3)
    fit_linear(callbacks=[stop], val_every_n_steps=3, metrics={"count": Count()})
    assert stop.stopped_epoch == 2 and stop.wait == 3
    assert "EarlyStopping: stopping at step 12 (epoch 2)" in capsys.readouterr().out


def test_step_saves_at_validation_steps_are_ranked_by_that_validation(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path, every_n_epochs=None, every_n_steps=3, monitor="val_loss", save_top_k=-1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "kept unranked" warning
        loop, rec, _ = fit_linear(callbacks=[ckpt], val_every_n_steps=3)
    scores = {s: logs["val_loss"] for s, logs in rec.val}
    assert {p.name: v for p, v in ckpt.best_k.items()} == {
        f"epoch{(s - 1) // STEPS}-step{s}": scores[s] for s in (3, 6, 9, 12)
    }
    assert ckpt.best_score == min(scores.values())


def test_step_saves_named_by_their_steps_validation(tmp_path):
    """``{val_loss}`` in the filename of step saves at multiples of val_every_n_steps: each
    folder is named by the validation of its own weights."""
    ckpt = ModelCheckpoint(
        tmp_path,
        every_n_epochs=None,
        every_n_steps=6,
        filename="step{step}-{val_loss:.4f}",
        save_top_k=-1,
    )
    loop, rec, _ = fit_linear(callbacks=[ckpt], val_every_n_steps=3)
    scores = {s: logs["val_loss"] for s, logs in rec.val}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"step{s}-{scores[s]:.4f}" for s in (6, 12)
    )


@pytest.mark.parametrize("val_every", [None, 4])
def test_step_saves_named_by_a_validation_log_need_a_validation_at_each(tmp_path, val_every):
    """Refused when the fit starts, before any step, unless val_every_n_steps divides
    every_n_steps."""
    ckpt = ModelCheckpoint(
        tmp_path, every_n_epochs=None, every_n_steps=6, filename="step{step}-{val_loss:.4f}"
    )
    with pytest.raises(ValueError, match=r"names \{val_loss\}, a validation log, and every_n_st"):
        fit_linear(callbacks=[ckpt], val_every_n_steps=val_every)
    assert list(tmp_path.iterdir()) == []


def test_csv_logger_writes_a_row_at_each_steps_validation(tmp_path):
    path = tmp_path / "log.csv"
    fit_linear(callbacks=[CSVLogger(path)], val_every_n_steps=4)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    # rows: validation at step 4 (mid-epoch), epoch 1 end (6), validation at 8, at 12, epoch 2
    assert [(r["epoch"], r["step"]) for r in rows] == [
        ("0", "4"),
        ("1", "6"),
        ("1", "8"),
        ("1", "12"),
        ("2", "12"),
    ]
    assert all(r["val_loss"] and r["loss"] for r in rows)
    assert [bool(r["train_loss"]) for r in rows] == [False, True, False, False, True]


def test_tensorboard_writes_val_logs_at_each_validation(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    from ipuloop.integrations.tensorboard import TensorBoardLogger

    loop, rec, _ = fit_linear(callbacks=[TensorBoardLogger(tmp_path)], val_every_n_steps=4)
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    val = [(e.step, e.value) for e in acc.Scalars("val_loss")]
    # at the update of each validation's step (2 updates a step)
    assert val == [(2 * s, pytest.approx(logs["val_loss"])) for s, logs in rec.val]
    assert [e.step for e in acc.Scalars("train_loss")] == [2 * STEPS, 4 * STEPS]
    assert all(e.value > 0 for e in acc.Scalars("samples_per_second"))
    assert len(acc.Scalars("samples_per_second")) == 2 * STEPS


# -- 1. exact resume around a step's validation -------------------------------------------------
def resume_run(callbacks=(), **kw):
    """The checkpoint tests' model (dropout, AdamW, shuffled data), 4 steps an epoch, with a
    validation every 3 steps: at 3, 6, 9, 12 and at the end of epochs 1 and 2 (4, 8)."""
    rec = Recorder()
    loop, loader, _ = H.make_loop(callbacks=[rec, *callbacks], **kw)
    val = DataLoader(H.IndexedData(12, seed=5), batch_size=H.MICRO)
    return rec, loop, loader, val


def reference():
    rec, loop, loader, val = resume_run()
    loop.fit(loader, 3, val_loader=val, val_every_n_steps=3)
    return rec, H.comparable(loop.state_dict()), loop.state.history


def test_a_checkpoint_between_two_validations_resumes_exactly(tmp_path):
    ref_rec, ref_state, ref_history = reference()
    assert [s for s, _ in ref_rec.val] == [3, 4, 6, 8, 9, 12]
    rec1, loop, loader, val = resume_run([ModelCheckpoint(tmp_path, every_n_steps=1)])
    loop.fit(loader, 3, val_loader=val, val_every_n_steps=3, max_steps=5)
    rec2, loop, loader, val = resume_run([ModelCheckpoint(tmp_path)], init_seed=3, seed=3)
    loop.fit(loader, 3, val_loader=val, val_every_n_steps=3, resume_from="last")
    assert rec1.val + rec2.val == ref_rec.val  # the same val logs at the same steps
    assert_same(H.comparable(loop.state_dict()), ref_state)
    assert loop.state.history == ref_history


class TermInValidation(Callback):
    """SIGTERM at the second validation step of the validation at step ``at``."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_validation_step_end(self, loop) -> None:
        if loop.state.step == self.at:
            self.seen += 1
            if self.seen == 2:
                os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("at", [6, 12], ids=["mid-epoch", "last-step"])
def test_sigterm_during_a_steps_validation_resumes_exactly(tmp_path, at):
    """The checkpoint is taken inside the validation of step ``at`` (before that step's
    on_train_step_end); the resumed fit runs the validation again from its start, then the
    step's on_train_step_end, and ends as the uninterrupted one, bitwise."""
    ref_rec, ref_state, ref_history = reference()
    rec1, loop, loader, val = resume_run([TermInValidation(at), ModelCheckpoint(tmp_path)])
    with pytest.raises(SystemExit) as e:
        loop.fit(loader, 3, val_loader=val, val_every_n_steps=3)
    assert e.value.code == 143
    assert ("on_train_step_end", at) not in rec1.events
    m = read_manifest(ModelCheckpoint(tmp_path).latest())
    assert (m["step"], m["epoch_step"]) == (at, (at - 1) % H.STEPS_PER_EPOCH + 1)
    rec2, loop, loader, val = resume_run([ModelCheckpoint(tmp_path)], init_seed=3, seed=3)
    loop.fit(loader, 3, val_loader=val, val_every_n_steps=3, resume_from="last")
    first = rec2.events.index(("on_validation_start", at))
    assert rec2.events[first - 2 : first] == [("on_fit_start", at), ("on_epoch_start", at)]
    assert ("on_train_step_start", at - 1) not in rec2.events  # the step itself ran before
    assert rec2.events[rec2.events.index(("on_validation_end", at)) + 1] == (
        "on_train_step_end",
        at,
    )
    assert rec1.val + rec2.val == ref_rec.val
    assert_same(H.comparable(loop.state_dict()), ref_state)
    assert loop.state.history == ref_history


# -- 3. dict batches and keyword inputs ---------------------------------------------------------
class ModelOutput(collections.OrderedDict):
    """Transformers' ``ModelOutput`` in short: a dataclass whose fields that are not None are
    also its dict entries; built from (key, value) pairs too. Not registered with torch's
    pytree (Transformers registers its own; PopTorch takes any dict apart by its keys)."""

    def __post_init__(self) -> None:
        fields = dataclasses.fields(self)
        first = getattr(self, fields[0].name)
        if (
            first is not None
            and not isinstance(first, torch.Tensor)
            and all(getattr(self, f.name) is None for f in fields[1:])
        ):
            object.__setattr__(self, fields[0].name, None)  # (key, value) pairs, or a dict
            for k, v in first.items() if isinstance(first, dict) else first:
                setattr(self, k, v)
        for f in fields:
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)


@dataclasses.dataclass
class ClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logs: dict | None = None


VOCAB, LEN = 11, 5


class TokenClassifier(nn.Module):
    """A Transformers-style model: ``forward(input_ids, attention_mask=None, labels=None)``
    returns an output with ``.loss`` (when given labels) and ``.logits``; ``return_dict=False``
    gives Transformers' tuple ``(loss, logits)``; ``log=True`` adds a "logs" entry."""

    def __init__(self, return_dict: bool = True, log: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, OUT)
        self.return_dict, self.log = return_dict, log

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(h.mean(1))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        if not self.return_dict:
            return (logits,) if loss is None else (loss, logits)
        logs = None
        if self.log and labels is not None:
            logs = {"acc": (logits.argmax(-1) == labels).float().mean()}
        return ClassifierOutput(loss=loss, logits=logits, logs=logs)


class Tokens(Dataset):
    """A Hugging Face-style dataset: each sample a dict of tensors."""

    def __init__(
        self, n: int, seed: int = 0, label_key: str = "labels", extra: str | None = None
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LEN), generator=g)
        self.mask = (torch.rand(n, LEN, generator=g) > 0.2).float()
        self.y = self.ids[:, 0] % OUT
        self.label_key, self.extra = label_key, extra

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        out = {"input_ids": self.ids[i], "attention_mask": self.mask[i], self.label_key: self.y[i]}
        if self.extra:
            out[self.extra] = torch.tensor(i)
        return out


def token_loop(model=None, di=2, metrics=None, **kw):
    if model is None:
        torch.manual_seed(0)
        model = TokenClassifier()
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(di),
        metrics=metrics,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5),
        progress=False,
        **kw,
    )
    return loop, model


def reference_sgd(model: nn.Module, batches: list[dict], lr: float = 0.5) -> None:
    """Plain torch: one SGD update per micro-batch (DI updates a host call, GA = RF = 1)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for b in batches:
        opt.zero_grad()
        out = model(**b)
        (out.loss if isinstance(out, dict) else out[0]).backward()
        opt.step()


def micro_batches(ds: Dataset, epochs: int = 1) -> list[dict]:
    loader = DataLoader(ds, batch_size=B)
    return [b for _ in range(epochs) for b in loader]


@pytest.mark.parametrize("return_dict", [True, False], ids=["ModelOutput", "tuple"])
def test_a_transformers_style_model_trains_on_dict_batches_as_plain_torch(return_dict):
    """``model(**batch)``, labels included; the loss from the output's "loss" entry, or with
    loss_key=0 from Transformers' (loss, logits) tuple: the same weights as plain torch."""
    ds = Tokens(24)
    torch.manual_seed(0)
    loop, model = token_loop(
        TokenClassifier(return_dict=return_dict), loss_key="loss" if return_dict else 0
    )
    torch.manual_seed(0)
    ref = TokenClassifier(return_dict=return_dict)
    history = loop.fit(DataLoader(ds, batch_size=B), epochs=2)
    reference_sgd(ref, micro_batches(ds, 2))
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    assert history[-1]["train_loss"] > 0


def test_a_tuple_loss_first_without_loss_key_is_refused_naming_it():
    loop, _ = token_loop(TokenClassifier(return_dict=False))
    with pytest.raises(ValueError, match=r"scalar per micro-batch.*Loop\(loss_key=0\)"):
        loop.fit(DataLoader(Tokens(8), batch_size=B))
    assert loop.train_model is None


def test_metrics_validation_and_predict_read_dict_batches():
    """Metrics get the labels from label_key and the logits (the output less its loss);
    val_loss and val_acc count all 14 samples (the last host call of 6 padded with 4);
    predict drops the labels, pads, and returns the model's output type with one row per
    sample, in order."""
    acc = torchmetrics.Accuracy(task="multiclass", num_classes=OUT)
    loop, model = token_loop(
        metrics={"acc": acc}, inference_opts=poptorch.Options().deviceIterations(3)
    )
    val = Tokens(14, seed=3)
    loop.fit(DataLoader(Tokens(24), batch_size=B), epochs=1)
    logs = loop.validate(DataLoader(val, batch_size=B))
    with torch.no_grad():
        ref = model(val.ids, val.mask, val.y)
    assert logs["val_loss"] == pytest.approx(float(ref.loss), abs=1e-6)
    assert logs["val_acc"] == pytest.approx(float((ref.logits.argmax(-1) == val.y).float().mean()))
    out = loop.predict(DataLoader(val, batch_size=B))
    assert type(out) is ClassifierOutput and list(out) == ["logits"]  # no labels: no loss
    assert torch.allclose(out.logits, ref.logits, atol=1e-6)


def test_a_plain_model_with_loss_fn_gets_the_other_keys():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = TokenClassifier()

        def forward(self, input_ids, attention_mask):  # no labels parameter
            return self.net(input_ids, attention_mask).logits

    torch.manual_seed(0)
    model = Plain()
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        label_key="label",
        progress=False,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5),
    )
    ds = Tokens(24, label_key="label")
    loop.fit(DataLoader(ds, batch_size=B), epochs=1)
    torch.manual_seed(0)
    ref = Plain()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for b in micro_batches(ds):
        opt.zero_grad()
        F.cross_entropy(ref(b["input_ids"], b["attention_mask"]), b["label"]).backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert loop.predict(DataLoader(ds, batch_size=B)).shape == (24, OUT)


def test_a_dict_batch_without_the_label_key_is_an_error_naming_its_keys():
    acc = torchmetrics.Accuracy(task="multiclass", num_classes=OUT)
    loop, _ = token_loop(metrics={"acc": acc})
    with pytest.raises(
        ValueError,
        match=r"without the labels' key label_key='labels' \(keys "
        r"\['input_ids', 'attention_mask', 'label'\]\).*"
        r"Loop\(label_key=\.\.\.\)",
    ):
        loop.fit(DataLoader(Tokens(8, label_key="label"), batch_size=B))


def test_a_model_computing_its_loss_needs_no_labels():
    """An autoencoder-style model-with-loss: the batch has no labels and the loop needs
    none (no loss_fn, no metrics)."""

    class Reconstruct(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(IN, IN)

        def forward(self, x):
            return {"loss": F.mse_loss(self.net(x), x), "out": self.net(x)}

    class Points(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"x": torch.full((IN,), float(i) / 16)}

    torch.manual_seed(0)
    model = Reconstruct()
    loop = Loop(model, progress=False, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1))
    history = loop.fit(DataLoader(Points(), batch_size=4), epochs=2)
    assert history[1]["train_loss"] < history[0]["train_loss"]


def test_a_key_forward_does_not_take_fails_before_compiling_with_the_fix():
    loop, _ = token_loop()
    with pytest.raises(
        ValueError,
        match=r"unexpected keyword argument 'index'.*each of its "
        r"keys must be a parameter of forward",
    ):
        loop.fit(DataLoader(Tokens(8, extra="index"), batch_size=B))
    assert loop.train_model is None


def test_dict_inputs_of_different_batch_sizes_are_named():
    def collate(samples):  # a mask of two rows a sample
        batch = torch.utils.data.default_collate(samples)
        return {**batch, "attention_mask": torch.ones(2 * len(samples), LEN)}

    loop, _ = token_loop()
    with pytest.raises(
        ValueError, match="input 'attention_mask' has batch size 4 but the labels have 2"
    ):
        loop.fit(DataLoader(Tokens(8), batch_size=B, collate_fn=collate))


# -- 3. keyword inputs on the emulator, as PopTorch binds them -----------------------------------
def test_a_keyword_only_parameter_fails_as_it_would_on_an_ipu():
    class KeywordOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(IN, OUT)

        def forward(self, x, *, scale=1.0):
            return self.net(x) * scale

    with pytest.raises(
        TypeError,
        match=r"keyword-only parameter\(s\) scale, which PopTorch "
        r"passes by position",
    ):
        poptorch.inferenceModel(KeywordOnly())(torch.ones(2, IN), scale=2.0)


def test_a_dict_input_compiles_with_poptorchs_warning(caplog):
    class Divide(nn.Module):
        def forward(self, d):
            return d["x"] / d["y"]

    with caplog.at_level(logging.WARNING, logger="poptorch"):
        poptorch.inferenceModel(Divide())({"x": torch.ones(2), "y": torch.ones(2)})
    assert "Dicts as inputs only have partial support" in caplog.text


def test_a_dict_subclass_output_is_taken_apart_and_keeps_its_type():
    """A training model called with keyword inputs and returning a ModelOutput that torch's
    pytree does not know: its loss is found and trained, and each call returns the same type
    with its entries; keyword inputs bind to forward's parameters in any order."""
    torch.manual_seed(0)
    model = TokenClassifier()
    train = poptorch.trainingModel(
        model,
        poptorch.Options().deviceIterations(2),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5),
    )
    ds = Tokens(4)
    before = model.head.weight.detach().clone()
    out = train(input_ids=ds.ids, attention_mask=ds.mask, labels=ds.y)
    assert type(out) is ClassifierOutput and list(out) == ["loss", "logits"]
    assert out.loss.shape == () and out.logits.shape == (2, OUT)  # Final: the last micro-batch
    again = train(labels=ds.y, attention_mask=ds.mask, input_ids=ds.ids)  # the same bound call
    assert type(again) is ClassifierOutput and float(again.loss) != float(out.loss)
    train.copyWeightsToHost()
    assert not torch.equal(model.head.weight, before)  # trained
    with pytest.raises(
        poptorch.Error,
        match=r"Type mismatch for attention_mask: expected "
        r"<class 'torch.Tensor'> but got <class 'NoneType'>",
    ):
        train(ds.ids, labels=ds.y)  # compiled with a mask: the default None is another graph


# -- 7. values logged by the model --------------------------------------------------------------
class LoggingLinear(nn.Module):
    """A model-with-loss that returns (output, loss, logs): the accuracy of the micro-batch
    and the mean of its first input column (a value known in closed form per micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(IN, OUT)

    def forward(self, x, labels=None):
        out = self.net(x)
        if labels is None:
            return out
        logs = {"acc": (out.argmax(-1) == labels).float().mean(), "x0": x[:, 0].mean()}
        return out, F.cross_entropy(out, labels), logs


def logging_fit(mode=None, di=2, ga=2, n=32, epochs=1, callbacks=(), **fit):
    torch.manual_seed(0)
    model = LoggingLinear()
    opts = poptorch.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    if mode is not None:  # (EveryN: every 2nd device iteration)
        opts.outputMode(mode, 2 if mode == poptorch.OutputMode.EveryN else None)
    loop = Loop(
        model,
        opts,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=list(callbacks),
        progress=False,
    )
    ds = data(n, 1)
    history = loop.fit(DataLoader(ds, batch_size=B), epochs=epochs, **fit)
    return loop, history, ds


def x0_per_micro_batch(ds: TensorDataset) -> torch.Tensor:
    return ds.tensors[0][:, 0].reshape(-1, B).mean(1).double()


@pytest.mark.parametrize(
    "mode, exact", [("All", True), ("Sum", True), ("Final", False), ("EveryN", False)]
)
def test_logged_values_reduce_over_the_step_as_the_loss_does(mode, exact):
    """x0 is known per micro-batch: All and Sum log the exact mean over the step's 4
    micro-batches; Final logs the step's last micro-batch, EveryN(2) the last device
    iteration's two (estimates, which the logs name)."""

    class StepLogs(Callback):
        def __init__(self):
            self.x0 = []

        def on_train_step_end(self, loop):
            self.x0.append(loop.state.logs["x0"])

    rec = StepLogs()
    loop, history, ds = logging_fit(getattr(poptorch.OutputMode, mode), callbacks=[rec])
    per_step = x0_per_micro_batch(ds).reshape(-1, 4)  # 2 device iterations x 2 accumulation
    expected = {
        "All": per_step.mean(1),
        "Sum": per_step.mean(1),
        "Final": per_step[:, 3],
        "EveryN": per_step[:, 2:].mean(1),
    }[mode]
    assert rec.x0 == pytest.approx(expected.tolist(), abs=1e-6)
    h = history[0]
    estimated = h.get("estimated", "").split()
    train = [k for k in h if k.startswith("train_")]
    assert sorted(estimated) == ([] if exact else sorted(["loss", "x0", "acc", *train]))
    assert h["train_x0"] == pytest.approx(float(expected.mean()), abs=1e-6)
    assert 0 <= h["train_acc"] <= 1 and "acc" in h


def test_logged_values_are_validated_over_every_micro_batch_without_padding():
    """val_x0: the mean over the 5 micro-batches of the 11 samples that hold no padding (the
    sixth shares its micro-batch with a padded copy), with a warning saying so."""
    torch.manual_seed(0)
    loop, _, _ = logging_fit()
    val = data(11, 2)
    with pytest.warns(
        UserWarning,
        match=r"val_acc, val_x0: the mean over the micro-batches "
        r"without padding; the last 1 samples",
    ):
        logs = loop.validate(DataLoader(val, batch_size=B))
    x0 = val.tensors[0][:10, 0].reshape(5, B).mean(1)
    assert logs["val_x0"] == pytest.approx(float(x0.mean()), abs=1e-6)


def test_a_dict_output_logs_its_logs_entry():
    acc = torchmetrics.Accuracy(task="multiclass", num_classes=OUT)
    loop, model = token_loop(TokenClassifier(log=True), metrics={"top1": acc})
    history = loop.fit(
        DataLoader(Tokens(24), batch_size=B),
        epochs=1,
        val_loader=DataLoader(Tokens(8, seed=4), batch_size=B),
    )
    h = history[0]
    # the model's accuracy over every micro-batch (the metrics ask for All) equals the metric's
    # over every sample: micro-batches of the same size
    assert h["train_acc"] == pytest.approx(h["train_top1"], abs=1e-6)
    assert h["val_acc"] == pytest.approx(h["val_top1"], abs=1e-6)
    assert 0 < h["train_acc"] < 1


@pytest.mark.parametrize(
    "logs, match",
    [
        ({"loss": 1}, "'loss' would clash with the loop's own logs"),
        ({"step": 1}, "'step' would clash with the loop's own logs"),
        ({"val_acc": 1}, "'val_acc' would clash with the train_/val_ prefixes"),
        ({"acc": 1}, "'acc' would clash with a metric's name"),
        ({"two words": 1}, "must be an identifier"),
        ({"acc2": "vector"}, r"'acc2' has shape \[2\]: a logged value must be a scalar"),
    ],
)
def test_logged_values_are_checked_before_compiling(logs, match):
    class Logs(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(IN, OUT)

        def forward(self, x, labels=None):
            out = self.net(x)
            if labels is None:
                return out
            values = {
                k: (out[:, :2].mean(0) if v == "vector" else out.mean()) for k, v in logs.items()
            }
            return out, F.cross_entropy(out, labels), values

    model = Logs()
    loop = Loop(
        model,
        progress=False,
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=OUT)},
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1),
    )
    with pytest.raises(ValueError, match=match):
        loop.fit(DataLoader(data(8, 1), batch_size=B))
    assert loop.train_model is None


def test_an_interrupted_epoch_resumes_its_logged_values_exactly(tmp_path):
    _, whole, _ = logging_fit(epochs=2, n=48)
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, every_n_epochs=None)
    logging_fit(epochs=2, n=48, callbacks=[ckpt], max_steps=4)  # 3 steps an epoch
    loop, resumed, _ = logging_fit(
        epochs=2, n=48, callbacks=[ModelCheckpoint(tmp_path)], resume_from="last"
    )
    assert resumed == whole  # train_acc and train_x0 of epoch 2 summed before and after


def test_csv_logger_writes_the_step_logs(tmp_path):
    path = tmp_path / "log.csv"
    logging_fit(callbacks=[CSVLogger(path, every_n_steps=1)])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:6] == ["epoch", "step", "update", "loss", "acc", "x0"]
    assert all(r["x0"] for r in rows) and rows[-1]["train_x0"]


# -- 1, 3, 7 on two processes -------------------------------------------------------------------
SCRIPT = r"""
import json, os, sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from ipuloop import Callback, Loop, poptorch

cfg = json.loads(sys.argv[1])
rank = int(os.environ.get("RANK", "0"))


class Tokens(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(5, 2)

    def forward(self, features, labels=None):
        logits = self.net(features)
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits,
                "logs": {"x0": features[:, 0].mean()}}


class Val(Callback):
    def __init__(self):
        self.val = []

    def on_validation_end(self, loop):
        self.val.append([loop.state.step, loop.state.logs["val_loss"], loop.state.logs["val_x0"]])


torch.manual_seed(0)
model = Model()
val = Val()
loop = Loop(model, poptorch.Options().deviceIterations(2), replicas=cfg["replicas"], seed=1,
            optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1), callbacks=[val],
            progress=False)
history = loop.fit(DataLoader(Tokens(64, 1), batch_size=4, shuffle=True), epochs=2,
                   val_loader=DataLoader(Tokens(24, 2), batch_size=4), val_every_n_steps=3)
with open(os.path.join(cfg["out"], f"result{rank}.json"), "w") as f:
    json.dump({"val": val.val, "history": history,
               "weight": model.net.weight.tolist()}, f)
"""


def _run(tmp_path: Path, name: str, replicas: int, processes: int) -> Path:
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cfg = json.dumps({"replicas": replicas, "out": str(out)})
    proc = warm.run(
        command(script, cfg, processes=processes),
        env=clean_env(IPULOOP_DIST_TIMEOUT="30", PYTHONWARNINGS="ignore"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_processes_validate_at_the_same_steps_as_one_with_two_replicas(tmp_path):
    """Dict batches, a loss and logs in a dict output, a validation every 3 steps: both
    instances validate at the same steps, and every logged number (val_loss, val_x0, the
    epoch's train_x0) equals the one-process run with 2 replicas."""
    one = json.loads((_run(tmp_path, "one", 2, 1) / "result0.json").read_text())
    out = _run(tmp_path, "two", 1, 2)
    two = [json.loads((out / f"result{r}.json").read_text()) for r in (0, 1)]
    assert two[0]["val"] == two[1]["val"] and two[0]["history"] == two[1]["history"]
    assert [v[0] for v in one["val"]] == [v[0] for v in two[0]["val"]] == [3, 4, 6, 8]
    for a, b in zip(one["val"], two[0]["val"]):
        assert a == pytest.approx(b, abs=1e-6)
    for a, b in zip(one["history"], two[0]["history"]):
        assert a.keys() == b.keys() and "train_x0" in a
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-6)
    assert torch.allclose(torch.tensor(one["weight"]), torch.tensor(two[0]["weight"]), atol=1e-6)
