"""The torch ops PopTorch's compiler refuses, with its errors: checked on the ops a wrapped
model's trace runs (``TraceChecks``), so a program that cannot compile for an IPU fails here
too, when it compiles.

* ``F.one_hot`` without ``num_classes`` (popart_canonicalization/EmbeddingOps.cpp);
* ``torch.bincount`` without a positive ``minlength`` (dispatch_tracer/RegisterMetaOps.cpp.inc:
  on an IPU the minimum length is also the maximum);
* ``F.interpolate`` in the "linear" and "trilinear" modes (popart_canonicalization/
  ReshapeOps.cpp ``unsupportedUpsampleHandler``);
* ops whose output shape depends on the data (a boolean mask index, ``nonzero``,
  ``masked_select``): PopTorch's dispatcher computes every shape ahead of the data, and torch's
  ``DynamicOutputShapeException`` says it cannot.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import Error

__all__ = ["REFUSED", "check"]


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _one_hot(args: tuple, kwargs: dict) -> None:
    if _arg(args, kwargs, 1, "num_classes", -1) == -1:
        raise Error("OneHot num classes must be specified and must be constant.")


def _bincount(args: tuple, kwargs: dict) -> None:
    if _arg(args, kwargs, 2, "minlength", 0) <= 0:
        raise Error(
            "Bincount `minlength` must be specified and must be a constant. On the IPU "
            "MK2 platform the minimum length is also the maximum length"
        )


_UPSAMPLE_OPS = {"linear": "aten::upsample_linear1d", "trilinear": "aten::upsample_trilinear3d"}


def _interpolate(args: tuple, kwargs: dict) -> None:
    mode = _arg(args, kwargs, 3, "mode", "nearest")
    if mode in _UPSAMPLE_OPS:
        raise Error(
            f"Unsupported upsample mode {_UPSAMPLE_OPS[mode]}: currently only 'nearest' "
            "is supported"
        )


def _dynamic_shape(op: Any) -> Callable[[tuple, dict], None]:
    def refuse(args: tuple, kwargs: dict) -> None:
        from torch._subclasses.fake_tensor import DynamicOutputShapeException

        raise DynamicOutputShapeException(op)

    return refuse


def _getitem(args: tuple, kwargs: dict) -> None:
    index = args[1] if len(args) > 1 else None
    for i in index if isinstance(index, tuple) else (index,):
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            _dynamic_shape(torch.ops.aten.index.Tensor)(args, kwargs)


REFUSED: dict[Any, Callable[[tuple, dict], None]] = {
    F.one_hot: _one_hot,
    torch.bincount: _bincount,
    torch.Tensor.bincount: _bincount,
    F.interpolate: _interpolate,
    torch.Tensor.__getitem__: _getitem,
    torch.nonzero: _dynamic_shape(torch.ops.aten.nonzero.default),
    torch.Tensor.nonzero: _dynamic_shape(torch.ops.aten.nonzero.default),
    torch.masked_select: _dynamic_shape(torch.ops.aten.masked_select.default),
    torch.Tensor.masked_select: _dynamic_shape(torch.ops.aten.masked_select.default),
}


def check(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise PopTorch's error where ``func(*args, **kwargs)`` cannot compile for an IPU."""
    refuse = REFUSED.get(func)
    if refuse is not None:
        refuse(args, kwargs)
