"""The PopTorch API on CPU (and CUDA): ``import ipuloop.emulator as poptorch``.

Same names, same semantics, same errors as poptorch 3.x, where the host can reproduce them
(see the README section "Running PopTorch code without an IPU").
"""
from __future__ import annotations

import logging

from . import optim
from .blocks import (AutoStage, BeginBlock, Block, BlockFunction, ParallelPhasedExecution,
                     PipelinedExecution, SerialPhasedExecution, ShardedExecution, Stage,
                     removeBlocks)
from .data import AsynchronousDataAccessor, DataLoader
from .enums import (CommGroupType, ConnectionType, DataLoaderMode, MeanReductionStrategy,
                    OutputMode, ReductionType, SyncPattern)
from .errors import Error
from .executor import PoplarExecutor, identity_loss, inferenceModel, isRunningOnIpu, trainingModel
from .options import Options, TensorLocationSettings

__version__ = "3.4.0"  # the PopTorch API version this emulates

__all__ = [
    "AsynchronousDataAccessor", "AutoStage", "BeginBlock", "Block", "BlockFunction",
    "CommGroupType", "ConnectionType", "DataLoader", "DataLoaderMode", "Error",
    "MeanReductionStrategy", "Options", "OutputMode", "ParallelPhasedExecution",
    "PipelinedExecution", "PoplarExecutor", "ReductionType", "SerialPhasedExecution",
    "ShardedExecution", "Stage", "SyncPattern", "TensorLocationSettings", "identity_loss",
    "inferenceModel", "ipuHardwareIsAvailable", "ipuHardwareVersion", "isRunningOnIpu", "nop",
    "optim", "recomputationCheckpoint", "removeBlocks", "setLogLevel", "set_available_memory",
    "trainingModel",
]

_LEVELS = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
           "ERR": logging.ERROR, "OFF": logging.CRITICAL + 10}


def setLogLevel(level: int | str) -> None:
    """Set the "poptorch" logger's level: an int, or TRACE, DEBUG, INFO, WARN, ERR, OFF."""
    if isinstance(level, str):
        if level.upper() not in _LEVELS:
            raise ValueError(f"Unknown log level. Received: level={level!r}. Expected one of "
                             f"{sorted(_LEVELS)} or an int.")
        level = _LEVELS[level.upper()]
    logging.getLogger("poptorch").setLevel(level)


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """Always False: the emulator has no IPU."""
    return False


def ipuHardwareVersion() -> int:
    """0: no IPU hardware (PopTorch returns 2 for Mk2 systems)."""
    return 0


def recomputationCheckpoint(*tensors):
    """Identity on the emulator (on an IPU: a recomputation checkpoint for pipelined training)."""
    return tensors[0] if len(tensors) == 1 else tensors


def nop(tensor):
    """Identity (PopTorch: an op the compiler will not optimise away)."""
    return tensor


def set_available_memory(tensor, available_memory_proportion: float):
    """Identity on the emulator (on an IPU: a per-op memory proportion hint)."""
    return tensor
