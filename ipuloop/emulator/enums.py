"""PopTorch's enums, with PopTorch's names and integer values (``poptorch/enums.py``)."""

from __future__ import annotations

from enum import Enum, IntEnum

__all__ = [
    "AutoStage",
    "CommGroupType",
    "ConnectionType",
    "DataLoaderMode",
    "HalfFloatCastingBehavior",
    "Liveness",
    "MatMulSerializationMode",
    "MeanReductionStrategy",
    "MultiConvPlanType",
    "OutputMode",
    "OverlapMode",
    "ReductionType",
    "SharingStrategy",
    "SyncPattern",
    "VariableRetrievalMode",
]


class OutputMode(IntEnum):
    """Which outputs a call returns. ``Default``: Final for training, All for inference."""

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class DataLoaderMode(IntEnum):
    """How ``poptorch.DataLoader`` reads the dataset."""

    Sync = 0
    Async = 1
    AsyncRebatched = 2


class ReductionType(IntEnum):
    """Reduction of gradients over gradient-accumulation steps and replicas."""

    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(IntEnum):
    """When the mean reduction divides (numerics only; the emulator computes exact means)."""

    Running = 0
    Post = 1
    PostAndLoss = 2


class ConnectionType(IntEnum):
    """When to attach to the device."""

    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(IntEnum):
    """Host/IPU synchronisation pattern (hardware tuning; recorded only)."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class CommGroupType(IntEnum):
    """Replica grouping (``All`` is not valid for input grouping)."""

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class AutoStage(IntEnum):
    """How stage ids are derived when no explicit stages are given."""

    SameAsIpu = 0
    AutoIncrement = 1


class SharingStrategy(IntEnum):
    """How the AsynchronousDataAccessor's worker process starts and gets the dataset."""

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class HalfFloatCastingBehavior(IntEnum):
    """Accepted by the deprecated ``Precision.halfFloatCasting`` (a no-op in PopTorch 3.x)."""

    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class Liveness(IntEnum):
    """Tensor liveness between phases of phased execution (recorded only)."""

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class MatMulSerializationMode(Enum):
    """Which dimension ``poptorch.serializedMatMul`` splits (memory tuning; same result)."""

    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class OverlapMode(Enum):
    """Host IO overlap for ``set_overlap_for_input/output`` (speed tuning; recorded only)."""

    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class MultiConvPlanType(IntEnum):
    """Execution plan of a ``poptorch.MultiConv`` (speed tuning; same result)."""

    Parallel = 0
    Serial = 1


class VariableRetrievalMode(IntEnum):
    """How a weight given ``replicaGrouping`` is read back: one value per group, or per replica."""

    OnePerGroup = 0
    AllReplicas = 2
