"""PopART's strided channel grouping of group norms (``opts._Popart.set(
"groupNormStridedChannelGrouping", True)``): group g holds channels g, g + G, g + 2G, ...
(PopLibs' popnn/GroupNorm.hpp) where torch's holds channels g * C/G to (g + 1) * C/G - 1."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["StridedGroupNorm", "strided"]


def strided(options: Any) -> bool:
    """Whether ``options`` ask for strided channel grouping."""
    return bool(options._Popart.options.get("groupNormStridedChannelGrouping", False))


def _strided_group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    channels = x.shape[1]
    per_group = channels // num_groups
    # channel k * G + g moves to position g * C/G + k: torch's contiguous groups are then
    # PopLibs' strided ones
    order = torch.arange(channels, device=x.device).reshape(per_group, num_groups).t().reshape(-1)
    normed = F.group_norm(x.index_select(1, order), num_groups, None, None, eps)
    out = normed.index_select(1, torch.argsort(order))
    shape = [1, channels] + [1] * (x.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out


class StridedGroupNorm(TorchFunctionMode):
    """``F.group_norm`` with PopLibs' strided channel grouping (gradients flow as usual)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.group_norm:
            return _strided_group_norm(*args, **kwargs)
        return func(*args, **kwargs)
