"""The host's random state, read and set whole (python, numpy, torch, CUDA), and ``Draw``:
how a training epoch draws its order (from the state as it is, or a resumed epoch's again)."""

from __future__ import annotations

import contextlib
import random
from typing import Any, NamedTuple

import torch

__all__ = ["rng_state", "set_rng_state", "Draw"]


def _plain(x: object) -> object:
    return [_plain(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuple(x: object) -> Any:
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


def rng_state() -> dict[str, Any]:
    """The host's random state (python, numpy when installed, torch, CUDA when in use)."""
    state: dict[str, Any] = {"python": _plain(random.getstate()), "torch": torch.get_rng_state()}
    with contextlib.suppress(ImportError):
        import numpy as np

        legacy: Any = np.random.get_state()  # (a tuple: the legacy MT19937 generator's)
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Set the host's random state to ``state`` (``rng_state``'s)."""
    random.setstate(_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Draw(NamedTuple):
    """How a training epoch draws its order: from the random state as it is (``Draw()``), or
    a resumed epoch's again. ``order``: the host's random state (with the loader generator's
    under "sampler") as the saved epoch drew its order (a resume in the middle of it);
    ``sampler``: the loader generator's alone (a resume at an epoch start: the host's is set
    already); ``then``: the host's random state to go on from once the order is drawn (the
    saved step's)."""

    order: dict[str, Any] | None = None
    sampler: object = None  # (a list of generator states; one tensor in older checkpoints)
    then: dict[str, Any] | None = None
