"""``poptorch.optim``: SGD, Adam, AdamW, RMSprop and LAMB with PopTorch's extra arguments.

Each ``step()`` does what the IPU does with the gradients the executor leaves behind:

    grads /= loss_scaling            # the executor multiplied the loss by it before backward
    clip_grad_norm_(all params, max_grad_norm)      # SGD, Adam, AdamW only
    torch's update (or the PopART variant: AdamW without bias correction, RMSprop TF, LAMB)

Both are skipped at their defaults (1.0, inf), so a step costs what a plain torch step costs.
The helpers at the bottom are what the executor uses to snapshot, check and upload
hyper-parameters (docs/poptorch-semantics.md §4.5, §4.6).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from .. import rules as _rules
from . import _logging
from .device import precision as _precision

__all__ = [
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "LAMB",
    "VariableAttributes",
    "DEFAULT_SGD_LR",
    "default_optimizer",
    "check_supported",
    "hyperparameters",
    "constant_attributes",
    "changed_constants",
    "group_count_error",
    "apply_hyperparameters",
    "loss_scaling",
    "needs_running_mean",
    "has_16bit_params",
    "update_in_float32",
    "float32_step",
    "AttributeTracker",
]

logger = _logging.logger

DEFAULT_SGD_LR = 0.01  # PopTorch trains with SGD(lr=0.01) when given no optimizer
_ACCUM_TYPES = (torch.float16, torch.float32)
# Compiled into the graph (they pick the PopART optimizer or a tensor dtype): never variable.
_STRUCTURAL = {
    "use_combined_accum",
    "bias_correction",
    "use_tf_variant",
    "accum_type",
    "velocity_accum_type",
    "first_order_momentum_accum_type",
    "second_order_momentum_accum_type",
}


class VariableAttributes:
    """Which attributes may change after compilation (``opt.variable_attrs``, as in PopTorch)."""

    def __init__(self, variable_attributes: list[str], allowed_attributes: list[str]) -> None:
        self._variable = list(variable_attributes)
        self._allowed = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:
        return attr not in self._variable

    def markAsConstant(self, attr: str) -> None:
        self._check(attr)
        self._variable = [a for a in self._variable if a != attr]

    def markAsVariable(self, attr: str) -> None:
        self._check(attr)
        self._variable.append(attr)

    def _check(self, attr: str) -> None:
        assert attr in self._allowed, f"Unknown attribute {attr}, allowed values: {self._allowed}"


class Optimizer:
    """Base of every ``poptorch.optim`` optimizer (``isinstance(opt, poptorch.optim.Optimizer)``):
    PopTorch's extra arguments, their pickling, and the unscale/clip before the update."""

    _extras: tuple[str, ...] = ()  # global (not per group) attributes, stored on the instance
    loss_scaling: float  # (each one's extras include it: the static loss scale)
    _extra_defaults: ClassVar[dict[str, Any]] = {}  # every PopTorch-only argument, its default

    def _setup(self, init: Callable, args: dict[str, Any]) -> None:
        # ``args`` is the constructor's locals(). As in PopTorch, arguments passed explicitly
        # (not None) are variable after compilation, the others constant.
        args = {k: v for k, v in args.items() if k not in ("self", "__class__")}
        params = args.pop("params")
        init(
            self,
            params,
            **{k: v for k, v in args.items() if v is not None and k not in self._extra_defaults},
        )
        for name, default in self._extra_defaults.items():
            value = default if args[name] is None else args[name]
            if name.endswith("accum_type") and value not in _ACCUM_TYPES:
                raise ValueError(
                    f"{name} must be set to either torch.float16 or torch.float32. "
                    f"Received: {name}={value!r}."
                )
            if name in self._extras:
                setattr(self, name, value)
        self.variable_attrs = VariableAttributes(
            [k for k, v in args.items() if v is not None], [*self.defaults, *args]
        )

    def _group_default(self, name: str, value: Any) -> None:
        self.defaults.setdefault(name, value)
        for group in self.param_groups:
            group.setdefault(name, value)

    def __getstate__(self) -> dict[str, Any]:
        # torch's __getstate__ keeps only defaults/state/param_groups: deepcopy would drop ours.
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in (*self._extras, "variable_attrs")})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that the state of a 16-bit parameter keeps the dtype it was saved
        in: the IPU holds it in the accumulator type (float32 by default), where torch's
        loader would cast it to the parameter's float16 (a small ``exp_avg_sq`` becomes 0)."""
        super().load_state_dict(state_dict)
        saved = state_dict.get("state", {})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):  # torch's own pairing: the groups' order
            if p.dtype not in _16BIT or i not in saved:
                continue
            for k, v in saved[i].items():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                    self.state[p][k] = v.detach().to(p.device, copy=True)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = getattr(self, "loss_scaling", 1.0)
        max_norm = getattr(self, "max_grad_norm", math.inf)
        grad_was = torch.is_grad_enabled()  # torch.no_grad(), at a fraction of its cost per step
        torch._C._set_grad_enabled(False)
        try:
            if scale != 1.0 or max_norm != math.inf:  # both skipped at their defaults
                params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
                if params and scale != 1.0:  # undo the executor's loss * loss_scaling
                    torch._foreach_div_([p.grad for p in params], float(scale))
                if params and max_norm != math.inf:  # PopART global-norm clipping, all groups
                    torch.nn.utils.clip_grad_norm_(params, max_norm)
            half = self.__dict__.get("_has_16bit")
            if half is None:  # checked once per (device) optimizer: dtypes are fixed by then
                half = self._has_16bit = has_16bit_params(self)
            if half:  # the device sets ``_rounding`` for stochastic rounding (optimizer_sync)
                update_in_float32(self, self._update, self.__dict__.get("_rounding"))
            else:
                self._update()
        finally:
            torch._C._set_grad_enabled(grad_was)
        return loss

    def _update(self) -> None:
        # torch's step, minus the profiling/hook wrapper torch may have put on the base class:
        # our own step() already carries it, and hooks must run once per step. Called from
        # step() only, with grad mode off: torch's own grad-mode wrapper (``_use_grad``, which
        # turns it on for a differentiable optimizer) is skipped where it would turn it off.
        fns = _BASE_STEP.get(type(self))
        if fns is None:
            base = next(c for c in type(self).__mro__ if c.__module__.startswith("torch.optim"))
            fn = base.step.__wrapped__ if getattr(base.step, "hooked", False) else base.step
            inner = (
                getattr(fn, "__wrapped__", None)
                if getattr(fn, "__code__", None) is not None and fn.__code__.co_name == "_use_grad"
                else None
            )
            # the same functions whether or not torch hooks the step later
            fns = _BASE_STEP[type(self)] = (fn, inner)
        fn, inner = fns
        if inner is not None and not self.defaults.get("differentiable", False):
            inner(self)
        else:
            fn(self)


# class -> torch's step without the hook wrapper, and without its grad-mode wrapper too (or None)
_BASE_STEP: dict[type, tuple[Callable[..., Any], Callable[..., Any] | None]] = {}
_16BIT = (torch.float16, torch.bfloat16)


def has_16bit_params(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter is float16 / bfloat16 (``model.half()``)."""
    return any(p.dtype in _16BIT for g in optimizer.param_groups for p in g["params"])


def _as_float32(state: dict) -> dict:
    return {
        k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step" else v
        for k, v in state.items()
    }


def update_in_float32(
    optimizer: torch.optim.Optimizer,
    update: Callable[[], Any],
    rounding: torch.Generator | None = None,
) -> None:
    """Run ``update`` with 16-bit parameters seen as float32 (state kept in float32), then round
    the new values to the parameters' dtype: the IPU computes weight updates in float32, where
    torch's 16-bit update underflows (``eps`` rounds to 0 and Adam divides 0 by 0). Rounding is
    to nearest, or stochastic to float16 with ``rounding`` (the generator that draws it:
    ``Precision.enableStochasticRounding``)."""
    swaps = []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if p.dtype not in _16BIT or p.grad is None:
                continue
            proxy = torch.nn.Parameter(p.detach().float())
            proxy.grad = p.grad.float()
            state = optimizer.state.pop(p, None)
            if state:
                optimizer.state[proxy] = _as_float32(state)
            params[i] = proxy
            swaps.append((params, i, p, proxy))
    try:
        update()
    finally:
        for params, i, p, proxy in swaps:
            params[i] = p
            new = proxy.detach()
            if rounding is not None and p.dtype == torch.float16:
                new = _precision.stochastic_round_to_half(new, rounding)
            p.copy_(new)  # round to the parameter's dtype (grad mode is off here)
            state = optimizer.state.pop(proxy, None)
            if state is not None:
                optimizer.state[p] = state  # float32 moments, keyed by the real parameter


def float32_step(
    optimizer: torch.optim.Optimizer, rounding: torch.Generator | None = None
) -> Callable[..., Any]:
    """A ``step`` for a torch.optim optimizer of 16-bit parameters that updates in float32
    (``rounding``: as ``update_in_float32``'s)."""
    step = type(optimizer).step

    def float32_step_(closure: Callable[[], Any] | None = None) -> Any:
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            update_in_float32(optimizer, lambda: step(optimizer), rounding)
        finally:
            torch._C._set_grad_enabled(grad_was)

    return float32_step_


_F32 = torch.float32
_ADAM_EXTRAS = {
    "loss_scaling": 1.0,
    "accum_type": _F32,
    "first_order_momentum_accum_type": _F32,
    "second_order_momentum_accum_type": _F32,
}


class SGD(Optimizer, torch.optim.SGD):
    """SGD with loss scaling, velocity scaling and gradient clipping.

    Args: as ``torch.optim.SGD``, plus ``loss_scaling`` (1.0), ``velocity_scaling`` (1.0,
    honoured only with ``use_combined_accum=True``), ``use_combined_accum`` (False),
    ``accum_type`` / ``velocity_accum_type`` (torch.float32), ``max_grad_norm`` (inf).
    Example: ``SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=128.0)``
    """

    _extras = (
        "loss_scaling",
        "use_combined_accum",
        "accum_type",
        "velocity_accum_type",
        "max_grad_norm",
    )
    _extra_defaults: ClassVar[dict[str, Any]] = {
        "loss_scaling": 1.0,
        "velocity_scaling": 1.0,
        "use_combined_accum": False,
        "accum_type": _F32,
        "velocity_accum_type": _F32,
        "max_grad_norm": math.inf,
    }

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float | None = None,
        dampening: float | None = None,
        weight_decay: float | None = None,
        nesterov: bool | None = None,
        maximize: bool | None = None,
        foreach: bool | None = None,
        differentiable: bool | None = None,
        loss_scaling: float | None = None,
        velocity_scaling: float | None = None,
        use_combined_accum: bool | None = None,
        accum_type: torch.dtype | None = None,
        velocity_accum_type: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        self._setup(torch.optim.SGD.__init__, locals())
        if velocity_scaling is not None and not self.use_combined_accum:
            logger.warning(
                "velocity_scaling value ignored when using the separate variant "
                "(use_combined_accum=False). In future, this will lead to an error. "
                "Please update your code."
            )
        vs = 1.0 if velocity_scaling is None else velocity_scaling
        self._group_default("velocity_scaling", vs)  # per group, as in PopTorch

    def _update(self) -> None:
        # Combined variant: the velocity is stored scaled by velocity_scaling and unscaled when
        # applied, so a change of velocity_scaling mid-training mis-scales it once, as on an IPU.
        if not self.use_combined_accum:
            return super()._update()
        scaled = [g for g in self.param_groups if g["velocity_scaling"] != 1.0]
        for g in scaled:
            for buf in self._velocities(g):
                buf.div_(g["velocity_scaling"])
        super()._update()
        for g in scaled:
            for buf in self._velocities(g):
                buf.mul_(g["velocity_scaling"])

    def _velocities(self, group: dict) -> list[torch.Tensor]:
        return [
            b
            for p in group["params"]
            if (b := self.state.get(p, {}).get("momentum_buffer")) is not None
        ]


def _reject_amsgrad(amsgrad: bool | None) -> None:
    if amsgrad:
        raise ValueError(
            "Only non-amsgrad Adam/AdamW optimizers are supported. Received: "
            "amsgrad=True. Remove the argument."
        )


class Adam(Optimizer, torch.optim.Adam):
    """Adam with loss scaling and gradient clipping (``amsgrad`` unsupported).

    Args: as ``torch.optim.Adam``, plus ``loss_scaling`` (1.0), ``accum_type``,
    ``first_order_momentum_accum_type``, ``second_order_momentum_accum_type`` (torch.float32)
    and ``max_grad_norm`` (inf). Example: ``Adam(model.parameters(), lr=1e-3, max_grad_norm=1.0)``
    """

    _extras = (*_ADAM_EXTRAS, "max_grad_norm")
    _extra_defaults: ClassVar[dict[str, Any]] = {**_ADAM_EXTRAS, "max_grad_norm": math.inf}

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        amsgrad: bool | None = None,
        foreach: bool | None = None,
        maximize: bool | None = None,
        capturable: bool | None = None,
        differentiable: bool | None = None,
        fused: bool | None = None,
        loss_scaling: float | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        _reject_amsgrad(amsgrad)
        self._setup(torch.optim.Adam.__init__, locals())


class AdamW(Optimizer, torch.optim.AdamW):
    """AdamW with loss scaling, gradient clipping and optional bias correction.

    Args: as ``torch.optim.AdamW``, plus those of :class:`Adam` and ``bias_correction`` (True).
    Example: ``AdamW(model.parameters(), lr=1e-3, bias_correction=False)``
    """

    _extras = (*Adam._extras, "bias_correction")
    _extra_defaults: ClassVar[dict[str, Any]] = {**Adam._extra_defaults, "bias_correction": True}

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        amsgrad: bool | None = None,
        maximize: bool | None = None,
        foreach: bool | None = None,
        capturable: bool | None = None,
        differentiable: bool | None = None,
        fused: bool | None = None,
        loss_scaling: float | None = None,
        bias_correction: bool | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        _reject_amsgrad(amsgrad)
        self._setup(torch.optim.AdamW.__init__, locals())

    def _update(self) -> None:
        if self.bias_correction:
            return super()._update()
        for g in self.param_groups:  # PopART's AdamW without bias correction
            lr, wd, (b1, b2), eps = g["lr"], g["weight_decay"], g["betas"], g["eps"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if g["maximize"] else p.grad
                st = self.state[p]
                if not st:
                    st.update(
                        step=torch.tensor(0.0),
                        exp_avg=torch.zeros_like(p),
                        exp_avg_sq=torch.zeros_like(p),
                    )
                st["step"] += 1
                p.mul_(1 - lr * wd)
                st["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(eps), value=-lr)


class RMSprop(Optimizer, torch.optim.RMSprop):
    """RMSprop with loss scaling and an optional TensorFlow variant (no gradient clipping).

    Args: as ``torch.optim.RMSprop``, plus ``loss_scaling`` (1.0), the three accum types
    (torch.float32) and ``use_tf_variant`` (False). Every group must agree on ``centered``.
    Example: ``RMSprop(model.parameters(), lr=1e-2, use_tf_variant=True)``
    """

    _extras = (*_ADAM_EXTRAS, "use_tf_variant")
    _extra_defaults: ClassVar[dict[str, Any]] = {**_ADAM_EXTRAS, "use_tf_variant": False}

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        alpha: float | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        centered: bool | None = None,
        foreach: bool | None = None,
        maximize: bool | None = None,
        differentiable: bool | None = None,
        loss_scaling: float | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
        use_tf_variant: bool | None = None,
    ) -> None:
        self._setup(torch.optim.RMSprop.__init__, locals())

    def _update(self) -> None:
        if not self.use_tf_variant:
            return super()._update()
        # TensorFlow's RMSprop (PopTorch docstring): mean square initialised to ones, eps inside
        # the sqrt, and lr folded into the momentum buffer: buf = m*buf + lr*g/sqrt(ms + eps).
        for g in self.param_groups:
            lr, alpha, eps, mom = g["lr"], g["alpha"], g["eps"], g["momentum"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if g["maximize"] else p.grad
                if g["weight_decay"]:
                    grad = grad.add(p, alpha=g["weight_decay"])
                st = self.state[p]
                if not st:
                    st.update(
                        step=torch.tensor(0.0),
                        square_avg=torch.ones_like(p),
                        momentum_buffer=torch.zeros_like(p),
                        grad_avg=torch.zeros_like(p),
                    )
                st["step"] += 1
                ms = st["square_avg"].mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
                if g["centered"]:
                    mg = st["grad_avg"].mul_(alpha).add_(grad, alpha=1 - alpha)
                    denom = ms.addcmul(mg, mg, value=-1).add_(eps).sqrt_()
                else:
                    denom = ms.add(eps).sqrt_()
                if mom:
                    p.sub_(st["momentum_buffer"].mul_(mom).addcdiv_(grad, denom, value=lr))
                else:
                    p.addcdiv_(grad, denom, value=-lr)


def _optimizer_init(self: torch.optim.Optimizer, params: Iterable, **defaults: Any) -> None:
    torch.optim.Optimizer.__init__(self, params, defaults)


class LAMB(Optimizer, torch.optim.Optimizer):
    """LAMB (arXiv:1904.00962) with phi(z) = min(z, max_weight_norm); no ``max_grad_norm``.

    Args: ``lr`` (1e-3), ``betas`` ((0.9, 0.999)), ``eps`` (1e-8), ``weight_decay`` (1e-2),
    ``bias_correction`` (True), ``loss_scaling`` (1.0), ``max_weight_norm`` (65500.0, also a
    group hyper-parameter, as in PopTorch) and the three accum types (torch.float32).
    Example: ``LAMB(model.parameters(), lr=1e-3)``
    """

    _extras = (*_ADAM_EXTRAS, "bias_correction", "max_weight_norm")
    _extra_defaults: ClassVar[dict[str, Any]] = {
        **_ADAM_EXTRAS,
        "bias_correction": True,
        "max_weight_norm": 65500.0,
    }

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        bias_correction: bool | None = None,
        loss_scaling: float | None = None,
        max_weight_norm: float | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
    ) -> None:
        self._setup(_optimizer_init, locals())
        for name, value in {
            "lr": 1e-3,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 1e-2,
            "max_weight_norm": self.max_weight_norm,
        }.items():
            self._group_default(name, value)

    def _update(self) -> None:
        for g in self.param_groups:
            lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                m = st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                v = st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                bc1, bc2 = (
                    (1 - b1 ** st["step"], 1 - b2 ** st["step"])
                    if self.bias_correction
                    else (1.0, 1.0)
                )
                r = (m / bc1).div_((v.sqrt() / math.sqrt(bc2)).add_(eps)).add_(p, alpha=wd)
                w_norm = p.norm().clamp(max=g["max_weight_norm"])
                r_norm = r.norm()
                # Trust ratio 1 when either norm is 0; torch.where avoids a host sync on the test.
                ratio = torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, 1.0)
                p.sub_(r.mul_(ratio * lr))


def default_optimizer(params: Iterable) -> SGD:
    """The optimizer PopTorch trains with when ``trainingModel`` gets none."""
    return SGD(params, lr=DEFAULT_SGD_LR)


# -- helpers used by the executor ------------------------------------------------------------
_OURS = (SGD, Adam, AdamW, RMSprop, LAMB)
_NUMBERS = (
    "lr",
    "momentum",
    "dampening",
    "weight_decay",
    "eps",
    "alpha",
    "betas",
    "max_weight_norm",
    "velocity_scaling",
)  # hyper-parameters PopTorch reads as numbers
_TORCH = (torch.optim.SGD, torch.optim.AdamW, torch.optim.Adam, torch.optim.RMSprop)
_warned_subclasses: set[type] = set()


def _torch_base(optimizer: torch.optim.Optimizer) -> type | None:
    # AdamW before Adam: recent torch makes AdamW a subclass of Adam.
    return next((c for c in (*_TORCH, LAMB) if isinstance(optimizer, c)), None)


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise what PopTorch raises for an optimizer it cannot run; warn for subclasses."""
    base = _torch_base(optimizer)
    if base is None:
        names = [f"torch.optim.{c.__name__}" for c in _TORCH] + [
            f"poptorch.optim.{c.__name__}" for c in _OURS
        ]
        raise AssertionError(  # PopTorch asserts in convertOptimizerToDict
            f"Unsupported optimizer type. Types supported {names}. Received: "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. Use one of those."
        )
    cls = type(optimizer)
    direct = {torch.optim.Optimizer, Optimizer} & set(cls.__bases__)  # PopTorch's test
    if cls not in (*_OURS, *_TORCH) and not direct and cls not in _warned_subclasses:
        _warned_subclasses.add(cls)
        logger.warning(
            "Optimizer `%s` subclassed from classes in poptorch.optim or torch.optim "
            "are unlikely to behave as intended. Poptorch does not run Python "
            "optimizer code directly; but instead uses IPU native optimisers "
            "implemented in PopART. (The emulator runs the optimizer's own step(): "
            "an IPU applies the built-in %s update with the hyper-parameters read "
            "from param_groups instead.)",
            cls.__name__,
            base.__name__,
        )
    groups = optimizer.param_groups
    for where, group in (
        ("defaults", optimizer.defaults),
        *((f"param_groups[{i}]", g) for i, g in enumerate(groups)),
    ):
        for name in _NUMBERS:  # PopTorch's convertOptimizerToDict asserts numbers.Number
            values = group.get(name, 0.0)
            for value in values if isinstance(values, tuple) else (values,):
                assert isinstance(value, numbers.Number), (
                    f"Expected a number for {name} but got {value!r} instead (in the "
                    f"optimizer's {where}). Pass plain numbers, e.g. lr=float(lr)."
                )
    if isinstance(optimizer, torch.optim.Adam) and any(g.get("amsgrad") for g in groups):
        _reject_amsgrad(True)
    if isinstance(optimizer, torch.optim.RMSprop):
        for i, g in enumerate(groups):
            assert g["centered"] == groups[0]["centered"], (
                "All parameter groups must have the same value for the 'centered' attribute "
                f"(Group 0: {groups[0]['centered']} / Group {i}: {g['centered']})."
            )


class AttributeTracker:
    """PopTorch's check for attributes that appear on an optimizer after the wrap: the device
    never reads them, so each new set is reported once (at DEBUG, rather than WARNING, after
    ``Options.relaxOptimizerAttributesChecks()``). The first ``check`` records what is there."""

    # torch's own attributes, and the state_dict wrappers the executor puts on the optimizer
    _UPSTREAM = (
        "defaults",
        "state",
        "param_groups",
        "variable_attrs",
        "state_dict",
        "load_state_dict",
    )

    def __init__(self, relax: bool) -> None:
        self._log = logger.debug if relax else logger.warning
        self._group: list[str] = []
        self._optimizer: list[str] = []
        self._recording = True
        self._printed: set[str] = set()

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        attrs = [k for k in optimizer.__dict__ if k not in self._UPSTREAM and not k.startswith("_")]
        checks = [
            ("default group variable", self._group, list(optimizer.defaults)),
            ("optimizer attribute", self._optimizer, attrs),
        ]
        checks += [
            (f"group {i} attribute", self._group, [k for k in g if k != "params"])
            for i, g in enumerate(optimizer.param_groups)
        ]
        base = _torch_base(optimizer)
        for what, expected, provided in checks:
            extra = [a for a in provided if a not in expected]
            if self._recording:
                expected += extra
            elif extra:
                msg = f"Ignoring unexpected {what} in {base.__name__} optimizer: {extra}"
                if msg not in self._printed:
                    self._printed.add(msg)
                    self._log(msg)
        self._recording = False


_plain = _rules.plain_hyperparameter
# The snapshot PopTorch compares when it rereads an optimizer (one rule, in ``ipuloop.rules``).
hyperparameters = _rules.optimizer_hyperparameters


def constant_attributes(optimizer: torch.optim.Optimizer) -> set[str]:
    """Attributes that may not change after compilation (``lr`` never is)."""
    if isinstance(optimizer, Optimizer):
        va = optimizer.variable_attrs
        names = {*optimizer.defaults, *optimizer._extras}
        return ({n for n in names if va.isConstant(n)} | _STRUCTURAL) - {"lr"}
    # torch.optim: a hyper-parameter left at its constructor default is constant; PopTorch
    # also always treats betas and alpha as constant for them.
    base = _torch_base(optimizer)
    sig = inspect.signature(base.__init__).parameters if base else {}
    const = {"loss_scaling", *_STRUCTURAL} | ({"betas", "alpha"} & set(optimizer.defaults))
    for name, par in sig.items():
        if par.default is inspect.Parameter.empty or name not in optimizer.defaults:
            continue
        if all(_plain(g.get(name, par.default)) == par.default for g in optimizer.param_groups):
            const.add(name)
    return const - {"lr"}


_MISSING = object()
# What an attribute an optimizer lacks stands for: PopTorch's default for it. So a torch.optim
# optimizer swapped for the poptorch.optim one with the same values changes no constant.
_IMPLICIT = {k: v for cls in _OURS for k, v in cls._extra_defaults.items()}


def changed_constants(old_snapshot: dict, new_snapshot: dict, constants: set[str]) -> list[str]:
    """Names in ``constants`` whose value differs between two snapshots (sorted)."""
    if len(old_snapshot["groups"]) != len(new_snapshot["groups"]):
        return ["param_groups"]

    def differ(old: dict, new: dict, k: str) -> bool:
        implicit = _IMPLICIT.get(k, _MISSING)
        return old.get(k, implicit) != new.get(k, implicit)

    changed = {
        k
        for old, new in zip(old_snapshot["groups"], new_snapshot["groups"])
        for k in constants
        if differ(old, new, k)
    }
    changed |= {k for k in constants if differ(old_snapshot["global"], new_snapshot["global"], k)}
    return sorted(changed)


def _write(old: Any, new: Any) -> Any:
    if isinstance(old, torch.Tensor):
        return old.fill_(new)  # keep a tensor hyper-parameter a tensor (capturable/fused)
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return tuple(_write(o, n) for o, n in zip(old, new))
    return new


def group_count_error(now: int, compiled: int) -> str:
    """Why the compiled model refuses an optimizer with another number of parameter groups
    (``add_param_group`` after the wrap), and the fixes that work: its graph holds one set of
    hyper-parameters per group, fixed when it compiled."""
    return (
        f"The optimizer has {now} parameter group(s) but the compiled model's has {compiled}: "
        "the compiled graph holds the parameter groups it was compiled with, so a group added "
        "(add_param_group) or removed after the model is wrapped is never trained. Give the "
        "optimizer every parameter group before wrapping the model (a group whose parameters "
        "should not train yet with lr=0.0, raised later: lr is always variable), or call "
        "destroy() on the model and wrap it again with the new optimizer."
    )


def apply_hyperparameters(device_optimizer: torch.optim.Optimizer, snapshot: dict) -> None:
    """Write a host snapshot into the device optimizer's groups and global extras."""
    groups = device_optimizer.param_groups
    if len(groups) != len(snapshot["groups"]):
        raise ValueError(group_count_error(len(snapshot["groups"]), len(groups)))
    for group, values in zip(groups, snapshot["groups"]):
        for k, v in values.items():
            group[k] = _write(group[k], v) if k in group else v
    for k, v in snapshot["global"].items():
        setattr(device_optimizer, k, v)


def needs_running_mean(optimizer: torch.optim.Optimizer) -> bool:
    """A float16 ``accum_type`` (not the combined SGD variant) needs the Running mean strategy."""
    return getattr(optimizer, "accum_type", None) == torch.float16 and not getattr(
        optimizer, "use_combined_accum", False
    )


def loss_scaling(optimizer: torch.optim.Optimizer) -> float:
    """The factor the executor multiplies each loss by (1.0 for torch.optim optimizers)."""
    return float(getattr(optimizer, "loss_scaling", 1.0))
