"""``import popart`` where ``poptorch`` is bound to the emulator (``python -m ipuloop.emulate``).

PopTorch programs read a few of PopART's enums to pass to ``Options._Popart.set`` (back-end
options, which the emulator records and does not act on): those, with PopART 3.4's names and
values, are all this module has. PopART itself (builders, sessions, its IR) is not emulated:
any other name raises ``AttributeError`` saying so.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "AccumulateOuterFragmentSchedule",
    "BatchSerializationBatchSchedule",
    "RecomputationType",
    "SubgraphCopyingStrategy",
    "SyntheticDataMode",
    "VirtualGraphMode",
]


class AccumulateOuterFragmentSchedule(enum.IntEnum):
    """How the accumulate outer fragment of a pipelined model is scheduled over its IPUs."""

    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(enum.IntEnum):
    """When the inputs and outputs of a called subgraph are copied."""

    OnEnterAndExit = 0
    JustInTime = 1


class VirtualGraphMode(enum.IntEnum):
    """How ops are placed on virtual graphs (IPUs)."""

    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class RecomputationType(enum.IntEnum):
    """Which forward ops are recomputed in the backward pass (PopART's ``None`` is
    ``NoRecompute`` in Python, as there)."""

    NoRecompute = 0
    Standard = 1
    NormOnly = 2
    Pipeline = 3
    RecomputeAll = 4


class BatchSerializationBatchSchedule(enum.IntEnum):
    """How the serialized batches' subgraphs are scheduled."""

    Scheduler = 0
    Isomorphic = 1
    OverlapOnIo = 2
    OverlapOnCompute = 3


class SyntheticDataMode(enum.IntEnum):
    """What a synthetic-data run feeds its inputs with."""

    Off = 0
    Zeros = 1
    RandomNormal = 2
    RandomUniform = 3


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"popart.{name} is not emulated: with poptorch bound to ipuloop's emulator, popart "
        "offers only the enums PopTorch programs pass to Options._Popart.set "
        f"({', '.join(__all__)})"
    )
