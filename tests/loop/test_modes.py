"""``ipuloop.modes``: each submodule's train/eval mode read and put back whole."""

from __future__ import annotations

import pytest
from torch import nn

from ipuloop.modes import eval_mode, modes, restore, warn_if_evaluating


def model() -> nn.Sequential:
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Sequential(nn.Dropout(), nn.ReLU()))
    m[1].eval()  # frozen
    m[2][0].eval()
    return m


def flags(m: nn.Module) -> list[bool]:
    return [x.training for x in m.modules()]


def test_restore_puts_back_each_modules_own_mode():
    m = model()
    before = flags(m)
    saved = modes(m)
    m.train()
    assert all(flags(m))
    restore(saved)
    assert flags(m) == before == [True, True, False, True, False, True]


def test_eval_mode_sets_every_module_to_eval_then_restores_each_even_after_an_error():
    m = model()
    before = flags(m)
    with pytest.raises(RuntimeError), eval_mode(m):
        assert not any(flags(m))
        raise RuntimeError
    assert flags(m) == before


def test_a_root_in_eval_mode_is_warned_of_and_a_frozen_submodule_is_not():
    m = model()
    warn_if_evaluating(m)  # the root trains: no warning (pytest fails on none here)
    m.eval()
    with pytest.warns(UserWarning, match="6 of 6 modules"):
        warn_if_evaluating(m)
