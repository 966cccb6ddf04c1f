"""The stochastic rounding of float32 values to float16 (``Precision.enableStochasticRounding``).

How an op takes float16 and float32 operands (and int32 indices) is ``ipuloop/mixed_float.py``'s
``MixedFloat``, a leaf the loop's "16-mixed" advice runs too."""

from __future__ import annotations

import torch

__all__ = ["stochastic_round_to_half"]


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
