"""A ``torch.optim`` optimizer as the device runs it: its ``poptorch.optim`` twin.

PopTorch compiles a ``torch.optim`` SGD, Adam, AdamW or RMSprop as it compiles the
``poptorch.optim`` optimizer of the same class with the same hyper-parameters
(``_optimizer_attributes.py``: one reader per attribute, PopTorch's defaults for the attributes
torch has not, the torch optimizer's constants decided by value). It reads optimizer state
(momentum, moments) back to the host only for ``poptorch.optim`` optimizers, though. So the loop
hands PopTorch the twin (``make``), which it builds over the same parameters with every
hyper-parameter of the user's optimizer and the same constants, and keeps the user's optimizer
as the host's: its ``param_groups`` are what LR schedulers and callbacks change, and the twin
follows them before each ``setOptimizer`` (``follow``); after a fit and in a checkpoint the
user's optimizer holds the state the twin read back (``read_state``, ``state_dict``,
``load_state_dict``).

An optimizer is twinned only when nothing of it would be lost (``why_not``): exactly one of the
four torch classes (a subclass may change the update), each hyper-parameter one the twin takes
or at the value the twin has by default.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import torch

from .rules import plain_hyperparameter

__all__ = ["TWINNED", "make", "why_not", "follow", "read_state", "state_dict", "load_state_dict"]

TWINNED = ("SGD", "Adam", "AdamW", "RMSprop")  # the torch.optim classes PopTorch compiles

# PopTorch's rule for a torch.optim optimizer (``_optimizer_attributes.py``): which attributes
# are compiled as constants. A value equal to the reference is constant, any other variable;
# ``lr`` is always variable; ``betas``, ``alpha`` and ``nesterov`` are always constant.
_CONSTANT_AT = {
    "weight_decay": 0.0,
    "momentum": 0.0,
    "dampening": 0.0,
    "eps": 1e-08,
    "velocity_scaling": 1.0,
    "max_weight_norm": 65500.0,
}
_ALWAYS_CONSTANT = ("betas", "alpha", "nesterov")
_ADAMW_WEIGHT_DECAY = 1e-2  # AdamW's reference: torch's default for it


def _torch_class(opt: object) -> type | None:
    """The ``torch.optim`` class of ``opt`` when it is exactly one that PopTorch compiles."""
    cls = type(opt)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in TWINNED:
        return cls
    return None


def _twin_class(pt: ModuleType, opt: object) -> type | None:
    cls = _torch_class(opt)  # (a stand-in PopTorch without optim has no twins)
    return None if cls is None else getattr(getattr(pt, "optim", None), cls.__name__, None)


def _plain(value: Any) -> Any:
    return plain_hyperparameter(value)


def _build(pt: ModuleType, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    twin_cls: Any = _twin_class(pt, opt)  # a poptorch.optim class
    assert twin_cls is not None  # (checked by the callers)
    takes = set(inspect.signature(twin_cls.__init__).parameters) - {"self", "params"}
    kwargs = {k: _plain(v) for k, v in opt.defaults.items() if k in takes and v is not None}
    groups = [
        {k: (v if k == "params" else _plain(v)) for k, v in g.items()} for g in opt.param_groups
    ]
    return twin_cls(groups, **kwargs)


def _lost(opt: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> list[str]:
    """The hyper-parameters of ``opt`` that ``twin`` does not hold at the same value."""
    lost = [
        k
        for k, v in opt.defaults.items()
        if k not in twin.defaults or _plain(twin.defaults[k]) != _plain(v)
    ]
    for g, t in zip(opt.param_groups, twin.param_groups):
        lost += [
            k
            for k, v in g.items()
            if k != "params" and k not in lost and (k not in t or _plain(t[k]) != _plain(v))
        ]
    return lost


def why_not(pt: ModuleType, opt: object) -> str | None:
    """None when ``opt`` has a twin (or is a ``poptorch.optim`` optimizer, or None); else why
    it has none, as a clause to put after its name."""
    po = pt.optim
    if opt is None or isinstance(opt, (po.SGD, po.Adam, po.AdamW, po.RMSprop, po.LAMB)):
        return None
    if _twin_class(pt, opt) is None:
        return (
            "is no torch.optim SGD, Adam, AdamW or RMSprop itself (a subclass or another "
            "class), so it has no poptorch.optim twin the loop could run instead"
        )
    assert isinstance(opt, torch.optim.Optimizer)
    if any(g.get("amsgrad") for g in opt.param_groups):
        return "has amsgrad=True, which PopTorch does not run"
    lost = _lost(opt, _build(pt, opt))
    if lost:
        return (
            f"has {', '.join(lost)} at a value its poptorch.optim twin does not take, so "
            "the twin would train otherwise"
        )
    return None


def make(pt: ModuleType, opt: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The ``poptorch.optim`` twin of ``opt`` (None when ``opt`` is none of the four torch
    classes, or ``why_not`` names a reason), with PopTorch's constants for a torch optimizer:
    each attribute marked constant or variable as PopTorch decides it for ``opt`` itself."""
    if _twin_class(pt, opt) is None or why_not(pt, opt) is not None:
        return None
    twin: Any = _build(pt, opt)  # a poptorch.optim optimizer
    va = twin.variable_attrs
    adamw = type(opt).__name__ == "AdamW"
    for name in twin.defaults:
        if name == "params":
            continue
        values = [_plain(g.get(name, twin.defaults[name])) for g in twin.param_groups]
        values.append(_plain(twin.defaults[name]))
        if name == "lr":
            constant = False
        elif name in _ALWAYS_CONSTANT:
            constant = True
        elif name == "weight_decay" and adamw:
            constant = all(v == _ADAMW_WEIGHT_DECAY for v in values)
        elif name in _CONSTANT_AT:
            constant = all(v == _CONSTANT_AT[name] for v in values)
        else:  # what PopTorch does not read (amsgrad, maximize, foreach...): fixed
            constant = True
        if constant != va.isConstant(name):
            (va.markAsConstant if constant else va.markAsVariable)(name)
    if not va.isConstant("loss_scaling"):  # 1.0: a torch optimizer has no loss scaling
        va.markAsConstant("loss_scaling")
    return twin


def follow(opt: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> None:
    """Give ``twin`` the hyper-parameters ``opt``'s groups have now (an LR a scheduler set)."""
    for g, t in zip(opt.param_groups, twin.param_groups):
        for k, v in g.items():
            if k != "params":
                t[k] = v


def _state_by_index(sd: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    return [(n, sd["state"][i]) for n, i in enumerate(ids) if i in sd["state"]]


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def read_state(opt: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> dict[str, Any]:
    """Copy the state the twin holds (read back from the device: PopTorch's ``state_dict()``)
    into ``opt.state``, parameter by parameter (the groups hold the same parameters in the same
    order); ``opt``'s hyper-parameters stay its own. Returns the twin's ``state_dict()``."""
    sd = twin.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    opt.state.clear()
    for n, state in _state_by_index(sd):
        opt.state[params[n]] = _clone(state)
    return sd


def state_dict(opt: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> dict[str, Any]:
    """``opt.state_dict()`` holding the state the device has (``read_state``), and PopTorch's
    own form of it (``ipu_state``, ``ipu_param``) where the twin has one."""
    twin_sd = read_state(opt, twin)
    sd = opt.state_dict()
    sd.update({k: v for k, v in twin_sd.items() if k not in ("state", "param_groups")})
    return sd


def load_state_dict(
    opt: torch.optim.Optimizer, twin: torch.optim.Optimizer, sd: dict[str, Any]
) -> None:
    """Load ``sd`` (a ``state_dict``) into ``opt`` (hyper-parameters and state), then into the
    twin with ``opt``'s hyper-parameters: PopTorch uploads it when the model next attaches."""
    opt.load_state_dict({"state": sd["state"], "param_groups": sd["param_groups"]})
    follow(opt, twin)
    groups = torch.optim.Optimizer.state_dict(twin)["param_groups"]  # (no read from a device)
    ids = [i for g in groups for i in g["params"]]
    state = {ids[n]: _clone(s) for n, s in _state_by_index(sd)}
    twin.load_state_dict({**sd, "state": state, "param_groups": groups})
