"""How a wrapped model's inputs are bound and matched, as PopTorch's argument parser does.

The first call binds its arguments to ``forward``'s signature (defaults fill what is not
given) and compiles for that structure. Later calls are bound the same way and must match it:
same types, dicts with the same keys (in any order), tensors of the same dtype and shape, and
the same non-tensor values (constants of the compiled graph). The model then runs with the
bound arguments: positional ones in ``forward``'s order (a keyword argument naming a
parameter is passed in its place), keyword ones for what follows a ``*args`` or falls into
``**kwargs``. PopTorch passes a keyword-only parameter (after a bare ``*``) by position too,
which Python refuses: the emulator raises that ``TypeError`` before tracing, saying why.
A dict argument compiles with PopTorch's warning that dicts are only partly supported.

The tensors of a structure are its leaves, found through tuples, lists and dicts (any dict
subclass, such as ``OrderedDict``, keeps its type); everything else is a constant.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, Callable, Iterator, Sequence

import torch

from ..data import _custom_parser
from ..errors import Error

__all__ = ["Signature", "unflatten"]

_END = (
    "\nThis error occurred because the inputs passed at runtime don't match the inputs used "
    "to compile the model.\nTo recompile the model for the new inputs create a new "
    "inferenceModel / trainingModel wrapper or call destroy() on the current one and try "
    "again."
)


class _Meta:
    """What the compiled graph knows of an input tensor."""

    __slots__ = ("type", "shape", "dtype")

    def __init__(self, t: torch.Tensor) -> None:
        self.type, self.shape, self.dtype = type(t), t.shape, t.dtype


class _Custom:
    """An input of a type with a registered ``ICustomArgParser``: its tensors' templates."""

    __slots__ = ("type", "parser", "obj", "items")

    def __init__(self, x: Any, parser: Any) -> None:
        self.type, self.parser, self.obj = type(x), parser, x
        self.items = [_template(v) for v in parser.yieldTensors(x)]


def _template(x: Any) -> Any:
    """``x`` with each tensor replaced by its ``_Meta`` (containers rebuilt, constants kept)."""
    if isinstance(x, torch.Tensor):
        return _Meta(x)
    parser = _custom_parser(x)
    if parser is not None:
        return _Custom(x, parser)
    if isinstance(x, dict):
        out = copy.copy(x)
        for k, v in x.items():
            out[k] = _template(v)
        return out
    if isinstance(x, (tuple, list)):
        return _rebuild(x, [_template(v) for v in x])
    return x


def _rebuild(seq: tuple | list, items: list) -> tuple | list:
    if isinstance(seq, tuple):
        if hasattr(seq, "_fields"):  # a namedtuple
            return type(seq)(*items)
        return type(seq)(items)
    out = copy.copy(seq)
    out[:] = items
    return out


def _leaves(x: Any, t: Any, out: list) -> None:
    """Append the tensors of ``x`` to ``out`` in the order of the template ``t``."""
    if isinstance(t, _Meta):
        out.append(x)
    elif isinstance(t, _Custom):
        for xv, tv in zip(t.parser.yieldTensors(x), t.items):
            _leaves(xv, tv, out)
    elif isinstance(t, dict):
        for k, v in t.items():
            _leaves(x[k], v, out)
    elif isinstance(t, (tuple, list)):
        for xv, tv in zip(x, t):
            _leaves(xv, tv, out)


def _fill(t: Any, it: Iterator) -> Any:
    """The template ``t`` with its tensors taken from ``it``."""
    if isinstance(t, _Meta):
        return next(it)
    if isinstance(t, _Custom):
        return t.parser.reconstruct(t.obj, iter([_fill(v, it) for v in t.items]))
    if isinstance(t, dict):
        out = copy.copy(t)
        for k, v in t.items():
            out[k] = _fill(v, it)
        return out
    if isinstance(t, (tuple, list)):
        return _rebuild(t, [_fill(v, it) for v in t])
    return t


def _validate(name: str, t: Any, x: Any) -> None:
    """Raise ``Error`` unless ``x`` matches the compiled template ``t``."""
    ttype = t.type if isinstance(t, (_Meta, _Custom)) else type(t)
    if ttype is not type(x):
        raise Error(f"Type mismatch for {name}: expected {ttype} but got {type(x)}.{_END}")
    if isinstance(t, _Meta):
        if x.dtype != t.dtype:  # checked before the shape, as PopTorch does
            raise Error(
                f"Data type mismatch for {name}: expected {t.dtype} but got {x.dtype}.{_END}"
            )
        if x.shape != t.shape:
            raise Error(f"Shape mismatch for {name}: expected {t.shape} but got {x.shape}.{_END}")
    elif isinstance(t, _Custom):
        tensors = list(t.parser.yieldTensors(x))
        if len(tensors) != len(t.items):
            raise Error(
                f"Length mismatch for {name}: expected {len(t.items)} tensors but got "
                f"{len(tensors)}.{_END}"
            )
        for i, (tv, xv) in enumerate(zip(t.items, tensors)):
            _validate(f"{name}[{i}]", tv, xv)
    elif isinstance(t, dict) and isinstance(x, dict):  # (x is: its type is t's)
        _check_keys(name, t, x)
        for k, v in t.items():
            _validate(f"{name}[{k}]", v, x[k])
    elif isinstance(t, (tuple, list)):
        if len(t) != len(x):
            raise Error(
                f"Length mismatch for {name}: expected {len(t)} elements but got {len(x)}.{_END}"
            )
        for i, (tv, xv) in enumerate(zip(t, x)):
            _validate(f"{name}[{i}]", tv, xv)
    elif not _same_constant(t, x):
        raise Error(f"Value mismatch for {name}: expected {t} but got {x}.{_END}")


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a truthy ==: compare identities
        return a is b


def _check_keys(name: str, expected: dict, got: dict) -> None:
    if expected.keys() == got.keys():
        return
    details = []
    extra = set(got) - set(expected)
    if extra:
        details.append("Unexpected arguments: " + ", ".join(sorted(map(str, extra))))
    missing = set(expected) - set(got)
    if missing:
        details.append("Missing arguments: " + ", ".join(sorted(map(str, missing))))
    raise Error(f"Keys mismatch for {name}: {'. '.join(details)}.{_END}")


class _Binder:
    """``forward``'s signature: binds a call's arguments as PopTorch's parser does."""

    def __init__(self, forward: Callable) -> None:
        try:
            params = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):  # no signature (a builtin): take anything
            params = [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        self.params = params
        self.names = [p.name for p in params]
        self.variadic = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
        star = next((i for i, p in enumerate(params) if p.kind == p.VAR_POSITIONAL), len(params))
        by_position = [p.name for p in params[:star] if p.kind == p.KEYWORD_ONLY]
        if by_position:
            # PopTorch 3.4 binds every parameter before a *args by position, a keyword-only
            # one included, given or defaulted; Python then refuses the call to forward.
            name = getattr(forward, "__qualname__", "forward")
            raise TypeError(
                f"{name}() has the keyword-only parameter(s) {', '.join(by_position)}, which "
                "PopTorch passes by position (it binds every parameter of forward that does "
                "not follow a *args so), and Python refuses: on an IPU the call fails with "
                "'takes N positional arguments but M were given'. Make them ordinary "
                "parameters: remove the bare * from forward's signature."
            )

    def bind(self, args: Sequence[Any], kwargs: dict) -> tuple[list, list[str], dict]:
        """(positional values, their names, keyword values) for ``forward(*args, **kwargs)``."""
        if not self.variadic:
            assert len(args) + len(kwargs) <= len(self.names), (
                f"Too many arguments provided: expected {self.names} ({len(self.names)}) but "
                f"got {len(args) + len(kwargs)}"
            )
            for k in kwargs:
                assert k in self.names, (
                    f"{k} is not a valid parameter. Allowed values are {self.names}"
                )
        values: list[Any] = []
        names: list[str] = []
        named: dict[str, Any] = {}
        after_star = False
        args = list(args)
        for i, p in enumerate(self.params):
            if p.kind == p.VAR_KEYWORD:
                named.update((k, v) for k, v in kwargs.items() if k not in self.names[:i])
            elif p.kind == p.VAR_POSITIONAL:
                after_star = True
                for j, v in enumerate(args[i:]):
                    values.append(v)
                    names.append(f"*{p.name}[{j}]")
                args = []
            elif i < len(args):
                assert p.name not in kwargs, f"Parameter {p.name} was passed more than once"
                values.append(args[i])
                names.append(p.name)
            else:
                if p.name in kwargs:
                    v = kwargs[p.name]
                elif p.default is not p.empty:
                    v = p.default
                else:
                    raise Error(
                        f"Mandatory parameter {p.name} missing: forward() of the wrapped "
                        f"model has no default for it. Pass {p.name} to the call."
                    )
                if after_star or p.kind == p.KEYWORD_ONLY:
                    named[p.name] = v
                else:
                    values.append(v)
                    names.append(p.name)
        return values, names, named


class Signature:
    """What the first call compiled for; ``check`` binds and matches a later call to it.

    ``spec`` is what ``unflatten`` turns leaves back into ``(args, kwargs)`` with: an int (the
    number of arguments) when the call was positional tensors only, else the template. ``fast``
    is then the ``(shape, dtype)`` of each argument, for callers that compare them directly."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict) -> None:
        self._binder = _Binder(forward)
        values, self.names, named = self._binder.bind(args, kwargs)
        given = [*args, *(v for k, v in kwargs.items() if k in self._binder.names)]
        for value in given:  # as PopTorch's parser, once per argument holding a dict
            if _holds_dict(value):
                logging.getLogger("poptorch").warning(
                    "Dicts as inputs only have partial support, they can be accessed using "
                    "literal keys, but full Python functionality is not enabled. Consider "
                    "changing dict inputs to tuple."
                )
        self.template = (_template(tuple(values)), _template(named))
        positional = (
            not named and len(values) == len(args) and all(type(v) is torch.Tensor for v in values)
        )
        self.spec: Any = len(values) if positional else self
        self.fast = [(v.shape, v.dtype) for v in values] if positional else None
        for x in self.flatten(args, kwargs):
            if any(d == 0 for d in x.shape):
                raise Error(
                    f"Zero-sized tensors are unsupported (Got shape "
                    f"[{', '.join(map(str, x.shape))}]). Inputs of a wrapped model "
                    "must have no dimension of size 0."
                )

    def arg_name(self, i: int) -> str:
        return repr(self.names[i]) if i < len(self.names) else f"#{i}"

    def flatten(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors of a call that matches (no checks), in the compiled order."""
        values, _, named = self._binder.bind(args, kwargs)
        out: list = []
        _leaves((tuple(values), named), self.template, out)
        return out

    def check(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """Bind a call, check it matches the compiled one, and return its tensors."""
        fast = self.fast
        if (
            fast is not None
            and not kwargs
            and len(args) == len(fast)
            and all(
                type(x) is torch.Tensor and x.dtype == dt and x.shape == sh
                for x, (sh, dt) in zip(args, fast)
            )
        ):
            return list(args)  # the common case; anything else gets the full check below
        values, names, named = self._binder.bind(args, kwargs)
        tvalues, tnamed = self.template
        if len(values) != len(tvalues):
            raise Error(
                f"Number of positional arguments mismatch: expected {len(tvalues)} "
                f"arguments but got {len(values)}.{_END}"
            )
        for name, t, x in zip(names, tvalues, values):
            _validate(name, t, x)
        _check_keys("named arguments", tnamed, named)
        for k, t in tnamed.items():
            _validate(k, t, named[k])
        out: list = []
        _leaves((tuple(values), named), self.template, out)
        return out

    def unflatten(self, leaves: list) -> tuple[tuple, dict]:
        return _fill(self.template, iter(leaves))


def _holds_dict(x: Any) -> bool:
    """Whether ``x`` is a dict, or tuples and lists holding one."""
    if isinstance(x, dict):
        return True
    return isinstance(x, (tuple, list)) and any(_holds_dict(v) for v in x)


def unflatten(leaves: list, spec: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``forward`` from the tensors ``leaves`` of a bound call."""
    if isinstance(spec, int):
        return tuple(leaves), {}
    return spec.unflatten(leaves)
