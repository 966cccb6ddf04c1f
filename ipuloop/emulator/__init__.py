"""The PopTorch API on CPU (and CUDA): ``import ipuloop.emulator as poptorch``.

Same names, same semantics, same errors as poptorch 3.x, where the host can reproduce them
(see docs/emulator.md, "Running PopTorch programs without an IPU").
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable, ClassVar

import torch

from . import _impl as _impl  # poptorch._impl
from . import _logging, optim, poptorch_core
from . import _pytree as pytree
from . import options as _options
from ._logging import logger
from .blocks import (
    AutoStage,
    BeginBlock,
    Block,
    BlockFunction,
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    module_repr,
    removeBlocks,
)
from .ctc import ctc_beam_search_decoder
from .data import AsynchronousDataAccessor, DataLoader, ICustomArgParser, registerCustomArgParser
from .device import checks as _checks
from .device import device_state as _device_state
from .enums import (
    CommGroupType,
    ConnectionType,
    DataLoaderMode,
    HalfFloatCastingBehavior,
    Liveness,
    MatMulSerializationMode,
    MeanReductionStrategy,
    MultiConvPlanType,
    OutputMode,
    OverlapMode,
    ReductionType,
    SharingStrategy,
    SyncPattern,
    VariableRetrievalMode,
)
from .errors import Error
from .executor import (
    PoplarExecutor,
    identity_loss,
    inferenceModel,
    isRunningOnIpu,
    registerPostCompileHook,
    registerPreCompileHook,
    trainingModel,
)
from .ops import cond, dynamic_slice, dynamic_update, for_loop, ipu_print_tensor
from .options import ConfigFileError, Options, TensorLocationSettings
from .poptorch_core import RecoverableError, UnrecoverableError
from .torch_ops import register as _register_torch_ops

__version__ = "3.4.0"  # the PopTorch API version this emulates

_register_torch_ops()  # torch.ops.poptorch.*, as importing PopTorch registers them
_options.read_files_with(sys.modules[__name__])  # an options file's ``poptorch.<name>``

__all__ = [
    "AsynchronousDataAccessor",
    "Attribute",
    "AutoStage",
    "BeginBlock",
    "Block",
    "BlockFunction",
    "CPU",
    "CommGroupType",
    "ConfigFileError",
    "ConnectionType",
    "DataLoader",
    "DataLoaderMode",
    "Error",
    "HalfFloatCastingBehavior",
    "ICustomArgParser",
    "Liveness",
    "MatMulSerializationMode",
    "MeanReductionStrategy",
    "MultiConv",
    "MultiConvPlanType",
    "NameScope",
    "Options",
    "OutputMode",
    "OverlapMode",
    "ParallelPhasedExecution",
    "Phase",
    "PipelinedExecution",
    "PoplarExecutor",
    "RecoverableError",
    "ReductionType",
    "UnrecoverableError",
    "logger",
    "poptorch_core",
    "SerialPhasedExecution",
    "ShardedExecution",
    "SharingStrategy",
    "Stage",
    "SyncPattern",
    "TensorLocationSettings",
    "VariableRetrievalMode",
    "cond",
    "ctc_beam_search_decoder",
    "custom_op",
    "dynamic_slice",
    "dynamic_update",
    "for_loop",
    "identity_loss",
    "inferenceModel",
    "ipuHardwareIsAvailable",
    "ipuHardwareVersion",
    "ipu_print_tensor",
    "isRunningOnIpu",
    "load",
    "module_repr",
    "nop",
    "optim",
    "recomputationCheckpoint",
    "registerCustomArgParser",
    "registerPostCompileHook",
    "registerPreCompileHook",
    "removeBlocks",
    "serializedMatMul",
    "setLogLevel",
    "set_available_memory",
    "set_overlap_for_input",
    "set_overlap_for_output",
    "trainingModel",
]

_REMOVED = {
    "AnchorMode": "poptorch.AnchorMode was removed in PopTorch 2.5: use poptorch.OutputMode "
    "(same members and values) with Options.outputMode().",
    "autocast": "poptorch.autocast was removed in PopTorch 3.1: remove it (mixed "
    "float16/float32 ops follow PyTorch's type promotion).",
}


def __getattr__(name: str) -> Any:
    if name in _REMOVED:
        raise AttributeError(_REMOVED[name])
    raise AttributeError(f"module 'poptorch' (ipuloop emulator) has no attribute {name!r}")


def setLogLevel(level: int | str) -> None:
    """Set how much PopTorch prints (``poptorch.logger``): TRACE, DEBUG, INFO, WARN, ERR or
    OFF, or PopTorch's legacy integer for one of them (0, 1, 2, 3, 4 or 6)."""
    _logging.setLogLevel(level)


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """Whether the emulated system has at least ``num_ipus`` IPUs (``IPULOOP_EMULATOR_IPUS``;
    none unless it is set, as PopTorch on a machine without IPUs; 16 under
    ``python -m ipuloop.emulate``)."""
    n = _device_state.system_ipus()
    return n > 0 and num_ipus <= n


def ipuHardwareVersion() -> int:
    """2 (Mk2) on an emulated system of IPUs (``IPULOOP_EMULATOR_IPUS`` > 0); without one, as
    PopTorch on a machine without IPUs, an ``AssertionError``."""
    assert _device_state.system_ipus() > 0, "No IPU hardware available on this system"
    return 2


def recomputationCheckpoint(*tensors):
    """Identity on the emulator (on an IPU: a recomputation checkpoint for pipelined training).

    One or more tensors, or one tuple or list of them; anything else is a ``ValueError``."""
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"All inputs must be tensors. Received: {type(t).__name__}.")
    return tensors[0] if len(tensors) == 1 else tensors


def _check_tensor(x: Any, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise Error(f"{what} must take a torch.tensor argument. {type(x)} is not supported.")


def nop(tensor):
    """Identity (PopTorch: an op the compiler will not optimise away)."""
    _check_tensor(tensor, "nop")
    return tensor


def set_available_memory(tensor, available_memory_proportion: float):
    """Identity on the emulator (on an IPU: a per-op memory proportion hint)."""
    return tensor


def _check_overlap(tensors: Any, mode: OverlapMode, what: str) -> Any:
    assert isinstance(mode, OverlapMode), (
        f"mode must be a poptorch.OverlapMode. Received: mode={mode!r}."
    )
    leaves = pytree.tree_leaves(tensors)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise Error(
                f"You may only set overlap for torch.tensor {what}. {type(leaf)} is not supported."
            )
    _checks.note_overlap(leaves, what)  # a model input / output (checked when compiled)
    return tensors


def set_overlap_for_input(input_tensors: Any, mode: OverlapMode) -> Any:
    """Identity on the emulator (on an IPU: overlap host->device copies with compute)."""
    return _check_overlap(input_tensors, mode, "inputs")


def set_overlap_for_output(output_tensors: Any, mode: OverlapMode) -> Any:
    """Identity on the emulator (on an IPU: overlap device->host copies with compute)."""
    return _check_overlap(output_tensors, mode, "outputs")


def serializedMatMul(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    mode: MatMulSerializationMode,
    factor: int = 0,
    keep_precision: bool = False,
) -> torch.Tensor:
    """``lhs @ rhs`` (an IPU splits it into ``factor`` pieces to save memory: same result)."""
    assert isinstance(keep_precision, bool), "keep_precision must be a bool"
    assert isinstance(factor, int), "factor must be an int"
    assert isinstance(mode, MatMulSerializationMode), (
        f"mode must be a poptorch.MatMulSerializationMode. Received: mode={mode!r}."
    )
    return torch.matmul(lhs, rhs)


class CPU:
    """Run ``layer_to_call`` on the host in the middle of a model (inference graphs on an IPU).
    The emulator already runs on the host, so this simply calls it."""

    def __init__(self, layer_to_call: Callable[..., Any], ID: str) -> None:
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._layer_to_call = layer_to_call
        self._ID = ID

    def __call__(self, *inputs: Any) -> Any:
        return self._layer_to_call(*inputs)


class MultiConv:
    """Context manager grouping independent convolutions (an IPU schedule; no effect here)."""

    def __init__(self) -> None:
        self._settings: dict[str, Any] = {}

    def _record(self, name: str, value: Any) -> MultiConv:
        self._settings[name] = value
        return self

    def availableMemoryProportions(self, value: float | list[float]) -> MultiConv:
        return self._record("available_memory_proportions", value)

    def partialsTypes(self, value: torch.dtype | list[torch.dtype]) -> MultiConv:
        for dtype in value if isinstance(value, (list, tuple)) else [value]:
            if dtype not in (torch.float32, torch.float16):
                raise ValueError("Invalid partials types. Expecting torch.float or torch.half")
        return self._record("partials_types", value)

    def enableConvDithering(self, value: bool | list[bool]) -> MultiConv:
        if not all(
            isinstance(v, bool) for v in (value if isinstance(value, (list, tuple)) else [value])
        ):
            raise ValueError("value must be bool or list of bools")
        return self._record("enable_conv_dithering", value)

    def planType(self, value: MultiConvPlanType) -> MultiConv:
        assert value is None or isinstance(value, MultiConvPlanType), "Invalid plan type!"
        return self._record("plan_type", value)

    def perConvReservedTiles(self, value: int) -> MultiConv:
        assert isinstance(value, int)
        return self._record("per_conv_reserved_tiles", value)

    def cycleBackOff(self, value: float) -> MultiConv:
        assert isinstance(value, float)
        return self._record("cycle_back_off", value)

    def __enter__(self) -> MultiConv:
        _checks.note_multiconv(begin=True)
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:  # a scope that raised reports its own error
            _checks.note_multiconv(begin=False)
        return None


class NameScope:
    """Context manager prefixing op names on an IPU (names only; no effect here)."""

    def __init__(self, name: str) -> None:
        assert isinstance(name, str), "Parameter to NameScope must be a string"
        self.name = name

    def __enter__(self) -> NameScope:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None


class Attribute:
    """Context manager setting compiler attributes on the ops it wraps, as
    ``poptorch.Attribute(__outline={"layer": "embedding"})`` (PopART's outlining, which reuses
    one layer's code for another with the same attribute). They place or reuse code on an
    IPU and change no value, so here they are only recorded: ``Attribute._current_attrs``
    holds those in force, merged over the enclosing scopes' and restored on exit."""

    _current_attrs: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, **kwargs: dict[str, Any]) -> None:
        self._kwargs = kwargs
        self._saved: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> None:
        self._saved = copy.deepcopy(Attribute._current_attrs)
        for attr, values in self._kwargs.items():
            Attribute._current_attrs.setdefault(attr, {}).update(values.items())

    def __exit__(self, *exc_info: object) -> None:
        Attribute._current_attrs = self._saved


def custom_op(
    inputs: tuple,
    name: str,
    domain: str,
    domain_version: int,
    example_outputs: tuple,
    attributes: dict | None = None,
) -> list[torch.Tensor]:
    """Not available on the emulator: PopART custom ops are compiled IPU code."""
    raise Error(
        f"poptorch.custom_op({name!r}) runs a PopART custom op, which is compiled IPU "
        "code the ipuloop emulator cannot load. On the emulator, compute the op with "
        "torch inside forward() instead (e.g. `if not poptorch.ipuHardwareIsAvailable()`, "
        "with IPULOOP_EMULATOR_IPUS=0: no emulated IPU)."
    )


def load(filename: str, edit_opts_fn: Callable[[Options], None] | None = None) -> PoplarExecutor:
    """Not available on the emulator: there are no Poplar executables to load."""
    raise Error(
        f"poptorch.load({filename!r}) needs a Poplar executable written by "
        "compileAndExport(), which the ipuloop emulator cannot produce or load. Save "
        "model.state_dict() with torch.save and re-wrap the model instead."
    )
