"""The "16-mixed" advice: which matmuls compute in float32 as the device runs the model, and why.

One micro-batch runs on the host as the device gets it (float inputs float16, weights float32).
Each op computes as PopTorch computes it under the rule for float16 and float32 operands in one
op that the emulator's device runs too (``mixed_float.MixedFloat``, a leaf both import, so this
module imports no emulator), while ``MixedDtypes`` records the dtype each op gives. When most
matmuls and convolutions compute in float32, ``check_mixed`` warns, naming the float32 tensor
that promoted the activations, and how to keep them in float16.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Tuple, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .mixed_float import MixedFloat
from .modes import kept_weights
from .outputs import WithLoss

__all__ = ["check_mixed", "MixedDtypes"]

# torch functions (by name) that multiply matrices or convolve: what 16-bit precision speeds up
_MATMULS = frozenset(
    {
        "linear",
        "bilinear",
        "matmul",
        "mm",
        "bmm",
        "mv",
        "addmm",
        "addbmm",
        "baddbmm",
        "addmv",
        "einsum",
        "scaled_dot_product_attention",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    }
)

Args = Tuple[Any, ...]  # a model's positional inputs, as a batch gives them
Kwargs = Dict[str, Any]  # its keyword inputs (a dict batch's)


def _floats(values: list[Any]) -> list[torch.Tensor]:
    return [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError):  # (a tensor without storage)
        return -1


class MixedDtypes(TorchFunctionMode):
    """Records the dtype each op computes in. Entered above ``MixedFloat``, which
    computes each op as a 16-mixed device does, it sees every op's operands and result:
    ``matmuls``, the dtype of each matmul and convolution, in order; ``promoted``, the first op
    whose float16 operand met a float32 one and gave float32, as ``(op, float32 operand)``
    (a 0-dimensional float16 tensor does not promote); ``names``, parameters and buffers by
    storage, to name that operand."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.matmuls: list[tuple[str, torch.dtype]] = []
        self.promoted: tuple[str, str] | None = None

    def __torch_function__(
        self, func: Callable[..., Any], types: object, args: Args = (), kwargs: Kwargs | None = None
    ) -> Any:
        kwargs = kwargs or {}
        floats = _floats(tree_flatten((args, kwargs))[0])
        out = func(*args, **kwargs)  # (computed by the mode below: the device's rule)
        result = _floats(tree_flatten(out)[0])
        if result:
            name = getattr(func, "__name__", str(func)).strip("_")  # (Tensor.__add__: "add")
            self._note(name, floats, result[0].dtype)
        return out

    def _note(self, op: str, floats: list[torch.Tensor], dtype: torch.dtype) -> None:
        if op in _MATMULS:
            self.matmuls.append((op, dtype))
        if (
            self.promoted is None
            and dtype == torch.float32
            and any(t.dtype == torch.float16 and t.dim() for t in floats)
        ):
            self.promoted = (op, self._operand([t for t in floats if t.dtype == torch.float32]))

    def _operand(self, wides: list[torch.Tensor]) -> str:
        """The float32 operand that promoted an op, by name when it is a parameter or buffer."""
        wide = next((t for t in wides if _storage(t) in self.names), wides[0])
        what = self.names.get(_storage(wide))
        shape = list(wide.shape)
        return f"{what} (float32 {shape})" if what else f"a float32 tensor {shape}"


def _float32_names(model: torch.nn.Module) -> dict[int, str]:
    """The model's float32 parameters and buffers by storage, under the user's names."""
    own = cast(WithLoss, model).model if issubclass(type(model), WithLoss) else model
    names: dict[int, str] = {}
    for kind, named in (("parameter", own.named_parameters()), ("buffer", own.named_buffers())):
        for n, t in named:
            if t.is_floating_point() and t.dtype == torch.float32:
                names.setdefault(_storage(t), f"the {kind} {n!r}")
    return names


def _record(model: torch.nn.Module, args: Args, kwargs: Kwargs) -> MixedDtypes | None:
    """Run ``model`` once as the device computes it, recording each op's dtype (its weights,
    buffers and the host RNG as they were); None when the model fails this run."""
    record = MixedDtypes(_float32_names(model))
    try:
        with kept_weights(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the float32 probe has shown them)
                with MixedFloat(), record:  # (each module in the mode it trains in)
                    model(*args, **kwargs)
    except Exception:  # noqa: BLE001 (a model that runs in float32 may fail here in float16)
        return None
    return record


def _where(promoted: tuple[str, str] | None) -> str:
    """Where the float32 computing starts, and how to compute in float16 instead."""
    if promoted is None:
        return (
            "No float16 input reached them: the activations start as float32 (an embedding "
            "of integer inputs gives float32 activations from its float32 weights). To "
            "compute them in float16, cast the activations in forward (e.g. "
            "self.embed(ids).to(torch.float16))"
        )
    op, operand = promoted
    return (
        f"The first op that promoted float16 activations to float32 is {op!r}, where "
        f"{operand} met them: every op after it computes in float32. To compute them in "
        "float16, cast that tensor to the activations' dtype in forward (e.g. "
        "x + self.pos_embed.to(x.dtype))"
    )


def check_mixed(model: torch.nn.Module, args: Args, kwargs: Kwargs) -> MixedDtypes | None:
    """Run one micro-batch (float inputs float16, as sent under "16-mixed") through the model
    on the host as the device computes it, and warn when most matmuls and convolutions compute
    in float32: a float32 parameter or buffer mixed into the activations (a class token, a
    position embedding) promotes every op after it. A model that fails this run (an op the host
    cannot compute this way) is not checked: the float32 probe has passed. Returns the record
    (None then)."""
    record = _record(model, args, kwargs)
    if record is None:
        return None
    wide = [n for n, dtype in record.matmuls if dtype == torch.float32]
    if 2 * len(wide) <= len(record.matmuls):
        return record
    warnings.warn(
        f'precision="16-mixed": {len(wide)} of the model\'s {len(record.matmuls)} matmuls '
        "and convolutions compute in float32, run on the host with the first micro-batch as "
        "the device gets it (float inputs float16, weights float32). An op follows torch's "
        "type promotion: float16 with a float32 tensor gives float32. "
        f'{_where(record.promoted)}, or use precision="16-true" (float16 weights). '
        "docs/precision.md says what each precision computes in float16.",
        stacklevel=5,
    )
    return record
