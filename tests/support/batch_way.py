"""The way a batch takes through the loop: the modules that hand on what ends in the logs.

``trace(run, start)`` runs ``run()`` under a profiler hook (``sys.setprofile``) that follows
values from ``start`` (the loaders given to ``fit``): a Python call that takes a followed value
(as an argument, or inside a tuple, list or dict argument) is recorded, and what it returns (or
yields) is followed in turn; an ``add...`` or ``update...`` method that takes one and returns
nothing has filled its object, which is followed too (an accumulator's, a metric's). The options, models and optimizers are read
on the way but hold no sample: they are not followed. Afterwards, ``Way.modules(values)`` walks back from the logged
values (e.g. ``state.logs["loss"]``) through the calls that made them, to the loaders: the
ipuloop modules outside ``emulator/`` (PopTorch's stand-in) whose functions are on those chains
are the modules the batch crosses. Side trips are not on them: a check that reads a batch and
returns nothing (the host probe), a record that reads the loader's factors (resume).

``Way.relays`` lists detours: a call into module B (not ``loop.py``, the one that carries
values from call to call) that returns what a call it made into another module C returned, so
the value went loop -> B -> C -> B on its way instead of loop -> C.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch

import ipuloop

ROOT = str(Path(ipuloop.__file__).parent) + "/"
HUB = "loop"
_ATOMS = (bool, int, str, bytes, type(None), type)


def _carried(v: Any) -> bool:
    """Whether ``v`` can carry the data: not a number, string or type, and not the options, a
    model, an executor or an optimizer (read on the way, but they hold no sample)."""
    if isinstance(v, _ATOMS) or isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
        return False
    cls = type(v)  # (the class's attributes: an instance's __getattr__ may do anything)
    if hasattr(cls, "isCompiled") and hasattr(cls, "detachFromDevice"):  # a PopTorch executor
        return False
    return not (hasattr(cls, "deviceIterations") and hasattr(cls, "toDict"))  # the options


# The leaf the emulated device computes 16-bit ops with: PopTorch's stand-in runs it in a call
DEVICE_LEAVES = ("/mixed_float.py",)


def module_of(filename: str) -> str | None:
    """``filename``'s ipuloop module ("plan", "callbacks.base"), None outside the loop side."""
    if not filename.startswith(ROOT) or "/emulator/" in filename or "/_binding/" in filename:
        return None
    if filename.endswith(DEVICE_LEAVES):
        return None
    return filename[len(ROOT) : -3].replace("/", ".")


class Way:
    def __init__(self, start: list[Any]) -> None:
        self.keep: list[Any] = list(start)  # followed objects stay alive: ids stay unique
        self.followed = {id(x) for x in start}
        self.made_by: dict[int, list[int]] = {}  # object id -> records that made or filled it
        self.returned_by: dict[int, list[int]] = {}  # object id -> records that returned it
        self.records: list[tuple[str | None, str, tuple[int, ...]]] = []  # module, name, inputs
        self.spans: list[list[int]] = []  # per record: [start tick, end tick]
        self.open: dict[Any, tuple[int, int | None]] = {}  # frame -> (record, object filled)
        self.tick = 0
        self.relays: list[str] = []

    def _follow(self, value: Any, record: int, returned: bool = True) -> None:
        for v in (
            value,
            *(
                value
                if isinstance(value, (tuple, list))
                else value.values()
                if isinstance(value, dict)
                else ()
            ),
        ):
            if not _carried(v):
                continue
            if id(v) not in self.followed:
                self.followed.add(id(v))
                self.keep.append(v)
            self.made_by.setdefault(id(v), []).append(record)
            if returned:
                self.returned_by.setdefault(id(v), []).append(record)

    def _inputs(self, frame: Any) -> tuple[tuple[int, ...], Any]:
        code = frame.f_code
        n = (
            code.co_argcount
            + code.co_kwonlyargcount
            + bool(code.co_flags & 4)
            + bool(code.co_flags & 8)
        )
        found, this = [], None
        for i, name in enumerate(code.co_varnames[:n]):
            v = frame.f_locals.get(name)
            if i == 0 and name == "self":
                this = v
            for x in (
                v,
                *(v if isinstance(v, (tuple, list)) else v.values() if isinstance(v, dict) else ()),
            ):
                if _carried(x) and id(x) in self.followed:
                    found.append(id(x))
        filled = None
        if (
            this is not None
            and code.co_name.startswith(("add", "update"))
            and any(i != id(this) for i in found)
        ):
            filled = this  # an accumulator's (or a metric's) add or update: it holds the value
        return tuple(found), filled

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        self.tick += 1
        if event == "call":
            inputs, filled = self._inputs(frame)
            if inputs:
                index = len(self.records)
                self.records.append(
                    (
                        module_of(frame.f_code.co_filename),
                        getattr(frame.f_code, "co_qualname", frame.f_code.co_name),
                        inputs,
                    )
                )
                self.spans.append([self.tick, 0])
                self.open[frame] = (index, filled)
        elif event == "return" and frame in self.open:
            index, filled = self.open.pop(frame)
            self.spans[index][1] = self.tick
            self._check_relay(index, arg)
            self._follow(arg, index)
            if filled is not None and arg is None:
                self._follow(filled, index, returned=False)

    def _check_relay(self, index: int, value: Any) -> None:
        module, name, _ = self.records[index]
        if module is None or module == HUB or isinstance(value, _ATOMS):
            return
        start, given = self.spans[index][0], self.records[index][2]
        if id(value) in given:  # what it was given: its own reduction of one (no detour)
            return
        for inner in self.returned_by.get(id(value), ()):
            other, other_name, _ = self.records[inner]
            if "<locals>" in other_name or "<lambda>" in other_name:
                continue  # a function it was given (map_tensors' fn), or a decorator's
            if other is not None and other != module and self.spans[inner][0] > start:
                self.relays.append(f"{module}.{name} passes on {other}.{other_name}'s value")

    def chain(self, values: list[Any]) -> list[int]:
        """The records on the chains that made ``values``, in call order."""
        seen: set[int] = set()
        todo = [r for v in values for r in self.made_by.get(id(v), ())]
        while todo:
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            for i in self.records[r][2]:
                todo.extend(self.made_by.get(i, ()))
        return sorted(seen, key=lambda r: self.spans[r][0])

    def modules(self, values: list[Any]) -> list[str]:
        """The loop-side modules on the chains that made ``values``, in the order first met."""
        out: list[str] = []
        for r in self.chain(values):
            module = self.records[r][0]
            if module is not None and module not in out:
                out.append(module)
        return out


def trace(run: Callable[[], Any], start: list[Any]) -> Way:
    way = Way(start)
    previous = sys.getprofile()
    sys.setprofile(way.profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return way
