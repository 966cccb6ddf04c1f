"""``ipuloop.random_state``: the host's random state read and set whole, as a checkpoint
holds it (``torch.load(weights_only=True)`` reads it back)."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from ipuloop.random_state import Draw, rng_state, set_rng_state


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3)


def test_a_restored_state_gives_the_same_draws_of_python_numpy_and_torch():
    state = rng_state()
    first = draws()
    set_rng_state(state)
    again = draws()
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])
    assert draws()[0] != first[0]  # (the draws go on from there)


def test_the_state_survives_a_weights_only_checkpoint():
    np.random.randn()  # numpy holds a cached Gaussian: part of the state too
    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    first = draws()
    set_rng_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    again = draws()
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])


def test_draw_defaults_to_the_state_as_it_is():
    assert Draw() == (None, None, None)
