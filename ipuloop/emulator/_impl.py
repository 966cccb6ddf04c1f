"""``poptorch._impl``: the part of PopTorch's internals that libraries built on PopTorch import.

A ``trainingModel`` wraps the user's module: the module, and its parameters, get PopTorch's
wrapper classes (subclasses of their own, which copy the trained weights back to the host when
read). ``unwrapModelIfNecessary`` gives them their own classes back for a while (so that the
module can be wrapped for inference, traced or copied as a plain module) and remembers the
wrapper of each; ``rewrapModelIfNecessary`` restores those wrappers. While unwrapped, reading
the module does not copy the device's weights back.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

__all__ = ["isWrapped", "rewrapModelIfNecessary", "unwrapModelIfNecessary"]

# id(object) -> (a weak reference to it, its wrapper class), for each object unwrapped by
# ``unwrapModelIfNecessary``: by identity, as tensors compare by value.
_unwrapped: dict[int, tuple[weakref.ref, type]] = {}


def _base(cls: type) -> type | None:
    """The class a wrapper class wraps (None: ``cls`` is not a wrapper)."""
    d = cls.__dict__
    return d.get("_poptorch_wrapped_base") or d.get("_poptorch_base")


def isWrapped(obj: Any) -> bool:
    """Whether ``obj`` (a module, parameter or buffer) has one of PopTorch's wrapper classes."""
    return _base(type(obj)) is not None


def _unwrap_and_remember(obj: Any) -> None:
    cls = type(obj)
    base = _base(cls)
    if base is None:
        return
    key = id(obj)

    def forget(ref: weakref.ref, key: int = key) -> None:
        entry = _unwrapped.get(key)
        if entry is not None and entry[0] is ref:
            del _unwrapped[key]

    _unwrapped[key] = (weakref.ref(obj, forget), cls)
    if isinstance(obj, torch.nn.Module):
        object.__setattr__(obj, "__class__", base)
    else:
        obj.__class__ = base


def _restore(obj: Any) -> None:
    entry = _unwrapped.get(id(obj))
    if entry is None or entry[0]() is not obj:
        return
    if isinstance(obj, torch.nn.Module):
        object.__setattr__(obj, "__class__", entry[1])
    else:
        obj.__class__ = entry[1]


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Give ``model``, its parameters and its buffers their own classes back, where they have
    PopTorch's wrapper classes (a ``trainingModel``'s); ``rewrapModelIfNecessary`` restores
    them. Nothing is copied from the device."""
    for tensor in itertools.chain(model.buffers(), model.parameters()):
        _unwrap_and_remember(tensor)
    _unwrap_and_remember(model)


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Give back the wrapper classes that ``unwrapModelIfNecessary`` took from ``model``, its
    parameters and its buffers (those it did not unwrap are left as they are)."""
    for tensor in itertools.chain(model.buffers(), model.parameters()):
        _restore(tensor)
    _restore(model)
