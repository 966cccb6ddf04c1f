"""callbacks/base.py: the checkpoint contract of ``Callback.state_dict`` and
``Callback.load_state_dict``, as their docstrings state it, through a real save and resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, Loop, WithLoss
from ipuloop.callbacks import CheckpointError, ModelCheckpoint, load_checkpoint

# one value of each kind ``torch.load(weights_only=True)`` gives back
STATE = {
    "count": 3,
    "rate": 0.25,
    "name": "best",
    "flag": True,
    "none": None,
    "history": [1.0, 2.0],
    "pair": (1, "a"),
    "nested": {"t": torch.arange(3.0)},
}


class Recorder(Callback):
    """Records when the loop reads and gives back its state, among the checkpoint events."""

    def __init__(self, state: dict | None = None) -> None:
        self.state = state
        self.events: list[str] = []
        self.loaded: dict | None = None

    def on_fit_start(self, loop):
        self.events.append("on_fit_start")

    def on_save_checkpoint(self, loop):
        self.events.append("on_save_checkpoint")

    def on_load_checkpoint(self, loop):
        self.events.append("on_load_checkpoint")

    def state_dict(self):
        self.events.append("state_dict")
        return self.state if self.state is not None else {}

    def load_state_dict(self, state):
        self.events.append("load_state_dict")
        self.loaded = state


class Other(Recorder):
    """A second callback, keyed by its own class name."""


class Opaque:
    """An object ``weights_only=True`` does not unpickle."""


def _loop(*callbacks: Callback) -> Loop:
    torch.manual_seed(0)
    model = WithLoss(torch.nn.Linear(4, 2), torch.nn.CrossEntropyLoss())
    return Loop(model, progress=False, callbacks=list(callbacks))


def _data() -> DataLoader:
    ds = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    return DataLoader(ds, batch_size=4)


def test_the_docstrings_state_the_contract():
    saving, loading = Callback.state_dict.__doc__ or "", Callback.load_state_dict.__doc__ or ""
    for words in ("on_save_checkpoint", "state_key", "weights_only=True", "main_instance_only"):
        assert words in saving, words
    for words in ("on_load_checkpoint", "on_fit_start", "state_key", "main_instance_only"):
        assert words in loading, words


def test_state_is_read_after_on_save_checkpoint_and_given_back_before_on_load_checkpoint(
    tmp_path,
):
    """What ``state_dict`` returns is read after ``on_save_checkpoint``, stored under
    ``state_key`` and given back whole to ``load_state_dict`` on a resume, before
    ``on_load_checkpoint`` and ``on_fit_start``; a callback whose key the checkpoint lacks is
    not called and keeps its own state."""
    saver = Recorder(STATE)
    ckpt = ModelCheckpoint(tmp_path / "ck")
    _loop(saver, ckpt).fit(_data(), epochs=1)
    assert saver.events[1:] == ["on_save_checkpoint", "state_dict"]  # (after on_fit_start)
    stored = load_checkpoint(ckpt.last_path)["callbacks"]
    assert set(stored["Recorder"]) == set(STATE)
    assert torch.equal(stored["Recorder"]["nested"]["t"], STATE["nested"]["t"])

    taker, newcomer = Recorder(), Other()
    _loop(taker, newcomer, ModelCheckpoint(tmp_path / "ck")).fit(
        _data(), epochs=2, resume_from=str(ckpt.last_path)
    )
    assert taker.events[:3] == ["load_state_dict", "on_load_checkpoint", "on_fit_start"]
    assert taker.loaded is not None
    assert {k: v for k, v in taker.loaded.items() if k != "nested"} == {
        k: v for k, v in STATE.items() if k != "nested"
    }
    assert torch.equal(taker.loaded["nested"]["t"], STATE["nested"]["t"])
    assert "load_state_dict" not in newcomer.events and newcomer.loaded is None


def test_a_state_weights_only_cannot_load_saves_but_fails_to_load(tmp_path):
    ckpt = ModelCheckpoint(tmp_path / "ck")
    _loop(Recorder({"obj": Opaque()}), ckpt).fit(_data(), epochs=1)
    assert ckpt.last_path is not None
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_checkpoint(ckpt.last_path)
