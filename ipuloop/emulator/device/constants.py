"""A wrapped module's plain attributes as PopTorch's graph holds them: frozen when it compiles.

PopTorch runs ``forward``'s Python once, to trace it; each call then runs the graph. A tensor
kept as a plain attribute (not a parameter or buffer) enters that graph as a constant with the
value it had when traced, and Python-side state that ``forward`` changes (``self.i += 1``, a
list it appends to, a cache it fills) changes once, during the trace (user guide, "PyTorch
buffers"). The emulator re-runs ``forward`` on each micro-batch, so it replays that:

    capture(model)          before the trace: every plain attribute, a copy of each tensor
    settle(capture)         after it: the attributes the trace changed, and tensor constants
    saved = enter()         each call: forward sees the attributes as the trace found them
    refresh()               each further micro-batch of the call: the same again
    exit(saved)             the host's attributes back, as the trace (or the host) left them

Attributes held directly, or in lists, tuples and dicts, are covered; parameters and buffers
(the device's weights, ``device_state``) are never frozen, wherever they are referenced from.
A model without such attributes gets no plan, and its calls no work.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Constants", "capture", "settle"]

_MISSING = object()  # an attribute absent before the trace
_DEPTH = 4  # containers nested deeper than this are compared and copied by identity
_internal: frozenset[str] | None = None


def _internal_names() -> frozenset[str]:
    """``torch.nn.Module``'s own ``__dict__`` entries (and PopTorch's wrapper mark)."""
    global _internal
    if _internal is None:
        _internal = frozenset(torch.nn.Module().__dict__) | {"_poptorch_executor"}
    return _internal


def _plain(module: torch.nn.Module) -> dict[str, Any]:
    d = module.__dict__
    internal = _internal_names()
    return {k: v for k, v in d.items() if k not in internal and not k.startswith("__")}


def _fingerprint(v: Any, depth: int = 0) -> Any:
    """What changes when ``v`` is changed in place: its members' identities, tensor versions."""
    if isinstance(v, torch.Tensor):
        return id(v), v._version
    if depth < _DEPTH and type(v) in (list, tuple):
        return type(v), tuple(_fingerprint(x, depth + 1) for x in v)
    if depth < _DEPTH and type(v) is dict:
        return dict, tuple((k, _fingerprint(x, depth + 1)) for k, x in v.items())
    return id(v)


def _copy(v: Any, live: set[int], depth: int = 0) -> Any:
    """``v`` with its own copy of every tensor but the ``live`` ones (parameters, buffers)."""
    if isinstance(v, torch.Tensor):
        return v if id(v) in live else v.detach().clone()
    if depth < _DEPTH and type(v) in (list, tuple):
        return type(v)(_copy(x, live, depth + 1) for x in v)
    if depth < _DEPTH and type(v) is dict:
        return {k: _copy(x, live, depth + 1) for k, x in v.items()}
    return v


def _has_constant(v: Any, live: set[int], depth: int = 0) -> bool:
    """Whether ``v`` holds a tensor that is not a parameter or buffer."""
    if isinstance(v, torch.Tensor):
        return id(v) not in live
    if depth < _DEPTH and type(v) in (list, tuple):
        return any(_has_constant(x, live, depth + 1) for x in v)
    if depth < _DEPTH and type(v) is dict:
        return any(_has_constant(x, live, depth + 1) for x in v.values())
    return False


class _Capture:
    """The plain attributes of a module tree before its trace (``capture``)."""

    def __init__(self, model: torch.nn.Module, live: set[int]) -> None:
        self.live = live
        self.modules = list(model.modules())
        # (attribute dict, name, value, fingerprint, copy) of every plain attribute
        self.slots = [
            (m.__dict__, k, v, _fingerprint(v), _copy(v, live))
            for m in self.modules
            for k, v in _plain(m).items()
        ]


def capture(model: torch.nn.Module, live: list[torch.Tensor]) -> _Capture:
    """Before a trace: ``model``'s plain attributes; ``live`` are its parameters and buffers."""
    return _Capture(model, {id(t) for t in live})


class Constants:
    """The attributes a compiled model's calls freeze (see the module doc). Each entry is
    (attribute dict, name, value as traced or ``_MISSING``, whether the trace changed it)."""

    def __init__(self, entries: list[tuple[dict, str, Any, bool]], live: set[int]) -> None:
        self._entries = entries
        self._changed = [e for e in entries if e[3]]
        self._live = live
        self.changing = bool(self._changed)  # ``refresh`` before each micro-batch

    def _install(self, d: dict, name: str, value: Any, changed: bool) -> None:
        if value is _MISSING:
            d.pop(name, None)
        else:  # a fresh copy where forward changes it: each micro-batch starts from the trace's
            d[name] = _copy(value, self._live) if changed else value

    def enter(self) -> list[Any]:
        """Give ``forward`` the attributes as traced; returns the host's, for ``exit``."""
        saved = []
        for d, name, value, changed in self._entries:
            saved.append(d.get(name, _MISSING))
            self._install(d, name, value, changed)
        return saved

    def refresh(self) -> None:
        """Before another micro-batch of the call: undo what the last one changed."""
        for d, name, value, changed in self._changed:
            self._install(d, name, value, changed)

    def exit(self, saved: list[Any]) -> None:
        """Put the host's attributes back (as the trace, or the host since, left them)."""
        for (d, name, _, _), value in zip(self._entries, saved):
            if value is _MISSING:
                d.pop(name, None)
            else:
                d[name] = value


def settle(before: _Capture) -> Constants | None:
    """After the trace: what each call must freeze, or None when nothing is."""
    live = before.live
    entries = []
    seen: dict[int, set[str]] = {}
    for d, name, value, fingerprint, copy in before.slots:
        seen.setdefault(id(d), set()).add(name)
        now = d.get(name, _MISSING)
        if now is not value or _fingerprint(now) != fingerprint:
            entries.append((d, name, copy, True))  # changed by the trace
        elif _has_constant(value, live):
            # Read-only as traced: the graph's constant is the tensor the trace saw (the host
            # rebinding the attribute later changes nothing), so no copy is kept.
            entries.append((d, name, value, False))
    for m in before.modules:  # attributes the trace added
        for name in _plain(m):
            if name not in seen.get(id(m.__dict__), ()):
                entries.append((m.__dict__, name, _MISSING, True))
    return Constants(entries, live) if entries else None
