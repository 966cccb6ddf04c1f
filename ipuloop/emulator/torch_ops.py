"""PopTorch's ``torch.ops.poptorch`` operators that programs call directly: name scopes
(``push_name_scope`` / ``pop_name_scope``, which model hooks call around each layer),
compiler attributes (``set_attribute`` / ``clear_attribute``) and ``internal_cast``.

PopTorch registers them in torch's ``poptorch`` operator namespace when it is imported; the
emulator registers them when it is imported, unless that namespace already holds them (the
real PopTorch loaded in the same process)."""

from __future__ import annotations

import torch

from .errors import Error
from .executor import isRunningOnIpu

__all__ = ["internal_cast", "register"]

# internal_cast's type names (PopART's) and the device type each casts to
_CAST_TYPES = {"FLOAT": torch.float32, "FLOAT32": torch.float32, "FLOAT16": torch.float16}

_library: torch.library.Library | None = None  # kept alive: dropping it unregisters the ops


def _names_only(*args: object) -> None:
    """Name scopes and attributes name or place the ops that follow on an IPU; no value
    changes, so nothing is done here."""
    return None


def internal_cast(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """``torch.ops.poptorch.internal_cast(tensor, "FLOAT" | "FLOAT16")``: on the device, the
    cast to that type (differentiable, as the IPU's cast); outside a wrapped model, PopTorch's
    CPU kernel, which returns "FLOAT16" and "FLOAT32" casts as float32 and any other unchanged."""
    if not isRunningOnIpu():
        if dtype in ("FLOAT16", "FLOAT32"):
            return tensor.to(torch.float32)
        return tensor.clone()
    if dtype not in _CAST_TYPES:
        raise Error(
            f"torch.ops.poptorch.internal_cast: unknown type {dtype!r}; expected one of "
            f"{sorted(_CAST_TYPES)} (poptorch's cast passes 'FLOAT' for torch.float and "
            "'FLOAT16' for torch.half)."
        )
    target = _CAST_TYPES[dtype]
    return tensor.to(target) if tensor.dtype != target else tensor.clone()


def register() -> None:
    """Define the operators in torch's ``poptorch`` namespace (once per process)."""
    global _library
    if _library is not None or hasattr(torch.ops.poptorch, "push_name_scope"):
        return
    library = torch.library.Library("poptorch", "DEF")
    # The host's autograd differentiates these Python bodies (CompositeImplicitAutograd).
    for schema, body in (
        ("push_name_scope(str name) -> ()", _names_only),
        ("pop_name_scope() -> ()", _names_only),
        ("set_attribute(str attribute, str key, str value) -> ()", _names_only),
        ("clear_attribute(str attribute, str key) -> ()", _names_only),
        ("internal_cast(Tensor self, str dtype) -> Tensor", internal_cast),
    ):
        library.define(schema)
        library.impl(schema.split("(")[0], body, "CompositeImplicitAutograd")
    _library = library
