"""How an IPU computes an op with float16 and float32 operands (and int32 indices), as PopTorch 3.x
takes them: ``MixedFloat``, the rule the emulator's device runs each op under and the loop's
"16-mixed" advice (``mixed_advice.py``) runs a micro-batch under on the host, written once.

A leaf: it imports only torch and ``rules``, so the emulator (which imports nothing else of
ipuloop) and the loop read the same rule, and the loop reaches the emulator only through
``backend.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .rules import NO_HALF_KERNEL, in_float32_as_float16

__all__ = ["MixedFloat"]


def _leaves(tree: Any) -> list[Any]:
    return tree_flatten(tree)[0]


def _mixes_float_types(tensors: list[Any]) -> bool:
    """True when ``tensors`` hold floating tensors of more than one dtype."""
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return len(dtypes) > 1


def _written(func: Any, args: tuple, kwargs: dict) -> Any:
    """The tensor ``func`` writes into (an in-place op's ``self``, an ``out=``), which a cast
    must leave alone: a cast copy would take the write instead."""
    if "out" in kwargs:
        return kwargs["out"]
    if getattr(func, "__name__", "").endswith("_") and args:
        return args[0]
    return None


# op -> whether the host differentiates its float16 CPU operands
_HALF_BACKWARD: dict[Any, bool] = {}


def _lacks_half_backward(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when ``func`` takes float16 CPU operands that need gradients and the host has a
    float16 kernel for its forward but none for its backward: the backward would fail where an
    IPU differentiates it. Found once per op by differentiating a copy of the call, out of any
    mode and with the generator restored (a random op draws as if the copy had not run)."""
    if not torch.is_grad_enabled() or _written(func, args, kwargs) is not None:
        return False
    leaves = _leaves((args, kwargs))
    if not any(
        isinstance(t, torch.Tensor)
        and t.dtype == torch.float16
        and t.requires_grad
        and t.device.type == "cpu"
        for t in leaves
    ):
        return False
    if func not in _HALF_BACKWARD:
        _HALF_BACKWARD[func] = _differentiates_half(func, args, kwargs)
    return not _HALF_BACKWARD[func]


def _differentiates_half(func: Any, args: tuple, kwargs: dict) -> bool:
    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_() if t.requires_grad else c

    args, kwargs = tree_map(copy, (args, kwargs))
    wrt = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.random.fork_rng(devices=[]), torch._C.DisableTorchFunction():
        try:
            out = func(*args, **kwargs)
        except Exception:  # noqa: BLE001 (the call itself raises it where it runs)
            return True
        outs = [
            t
            for t in _leaves(out)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
        ]
        if not outs:
            return True
        try:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
        except Exception as e:  # noqa: BLE001 (only a missing float16 kernel is ours)
            return not (isinstance(e, RuntimeError) and NO_HALF_KERNEL in str(e))
    return True


class MixedFloat(TorchFunctionMode):
    """Ops follow torch's type promotion; where torch refuses to mix floating dtypes (matmul,
    convolution, normalisation with float16 activations and float32 weights, or the reverse),
    the other floating operands take the first one's dtype, so the result has the activation's
    dtype, as PopTorch returns it. Gradients flow through the cast to the weights' own dtype
    (float32 master weights stay float32). Where the host has no float16 kernel for an op,
    or none for its backward (torch 2.0's CPU has ``mse_loss``'s forward in float16, not its
    backward), it runs in float32 and its result is rounded to float16. An op the host
    refuses for its int32 operands (``cross_entropy``'s or ``nll_loss``'s targets,
    ``one_hot``'s indices) runs on them as int64: an IPU's integers are int32 (PopTorch
    narrows int64 inputs to it) and its ops take them.
    ``cast`` tells whether an op needed a cast."""

    def __init__(self) -> None:
        super().__init__()
        self.cast = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return self._run(func, args, kwargs)
        except RuntimeError as refused:
            leaves = _leaves((args, kwargs))
            first = next(
                (t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()),
                None,
            )
            mixed = first is not None and _mixes_float_types(leaves)
            written = _written(func, args, kwargs)
            widen = any(
                isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t is not written
                for t in leaves
            )
            if not (mixed or widen):
                raise

            def cast(t: Any) -> Any:
                if not isinstance(t, torch.Tensor) or t is written:
                    return t
                if mixed and t.is_floating_point() and t.dtype != first:
                    return t.to(first)
                if widen and t.dtype == torch.int32:
                    return t.long()
                return t

            args, kwargs = tree_map(cast, (args, kwargs))
            try:
                out = self._run(func, args, kwargs)
            except RuntimeError:
                if mixed:
                    raise
                raise refused from None  # the int32 operands were not what the host refused
            self.cast = True
            return out

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``; where the host has no float16 kernel for it (torch 2.0's CPU
        has no float16 matmul or convolution), computed in float32 and rounded to float16, as
        the IPU's float16 op returns it."""
        if not _lacks_half_backward(func, args, kwargs):
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                if NO_HALF_KERNEL not in str(e):
                    raise
        self.cast = True
        return in_float32_as_float16(func, args, kwargs)
