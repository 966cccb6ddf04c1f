"""float16 and float32 operands in one op, as PopTorch 3.x runs them on an IPU, and the
stochastic rounding of float32 values to float16 (``Precision.enableStochasticRounding``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import _pytree as pytree

__all__ = ["MixedFloat", "stochastic_round_to_half"]


def stochastic_round_to_half(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (float32) rounded to float16 stochastically: to the float16 value just above with
    probability (x - below) / (above - below), else to the one just below, so that
    E[result] = x; a value float16 holds exactly is returned as it is. As the IPU rounds
    with stochastic rounding on; ``generator`` (on ``x``'s device) draws the choices."""
    x = x.float()
    # The float16 spacing around |x|: 2**(e - 10) for |x| in [2**e, 2**(e + 1)), and the
    # subnormal spacing 2**-24 below 2**-14. Powers of two: the divisions below are exact.
    _, exp = torch.frexp(x)
    spacing = torch.ldexp(torch.ones_like(x), (exp - 1).clamp(min=-14) - 10)
    below = torch.floor(x / spacing) * spacing
    up = torch.rand(x.shape, generator=generator, device=x.device) * spacing < x - below
    return torch.where(up, below + spacing, below).to(torch.float16)


def _mixes_float_types(tensors: list[Any]) -> bool:
    """True when ``tensors`` hold floating tensors of more than one dtype."""
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return len(dtypes) > 1


class MixedFloat(TorchFunctionMode):
    """Ops follow torch's type promotion; where torch refuses to mix floating dtypes (matmul,
    convolution, normalisation with float16 activations and float32 weights, or the reverse),
    the other floating operands take the first one's dtype, so the result has the activation's
    dtype, as PopTorch returns it. Gradients flow through the cast to the weights' own dtype
    (float32 master weights stay float32). Where the host has no float16 kernel for an op,
    it runs in float32 and its result is rounded to float16. ``cast`` tells whether an op
    needed the cast."""

    def __init__(self) -> None:
        super().__init__()
        self.cast = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return self._run(func, args, kwargs)
        except RuntimeError:
            leaves = pytree.tree_leaves((args, kwargs))
            first = next(
                (t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()),
                None,
            )
            if first is None or not _mixes_float_types(leaves):
                raise

            def cast(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != first:
                    return t.to(first)
                return t

            args, kwargs = pytree.tree_map(cast, (args, kwargs))
            self.cast = True
            return self._run(func, args, kwargs)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``; where the host has no float16 kernel for it (torch 2.0's CPU
        has no float16 matmul or convolution), computed in float32 and rounded to float16, as
        the IPU's float16 op returns it."""
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if "for 'Half'" not in str(e):
                raise

        def up(t: Any) -> Any:
            return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t

        def down(t: Any) -> Any:
            return t.half() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t

        self.cast = True
        args, kwargs = pytree.tree_map(up, (args, kwargs))
        return pytree.tree_map(down, func(*args, **kwargs))
