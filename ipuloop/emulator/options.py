"""``poptorch.Options``: PopTorch's option storage, groups and setters (poptorch-semantics §1).

Options that only tune hardware are accepted and recorded (``toDict()`` shows them) but have no
effect on the emulator. Setters keep PopTorch's names, checks and chaining.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from . import _logging, enums
from .blocks import PipelinedExecution, _IExecutionStrategy
from .enums import (
    AutoStage,
    CommGroupType,
    ConnectionType,
    MeanReductionStrategy,
    OutputMode,
    ReductionType,
    SyncPattern,
)

__all__ = ["ConfigFileError", "Options", "TensorLocationSettings", "log_compiled_options"]

logger = _logging.logger

# What an options file's lines read as ``poptorch`` (``poptorch.SyncPattern.Full``): the emulator
# package, which hands itself over when imported (``read_files_with``). The package imports
# this module; this module never imports the package.
_options_file_poptorch: Any = None


def read_files_with(package: Any) -> None:
    """Makes ``package`` what ``Options.loadFromFile`` gives an options file as ``poptorch``."""
    global _options_file_poptorch
    _options_file_poptorch = package


# The IPU versions PopTorch 3.4 documents for useOfflineIpuTarget (an offline Poplar target).
_OFFLINE_IPU_VERSIONS = (1, 2, 21)

_FROZEN_MSG = (
    "Can't modify frozen Options: they were frozen when a model wrapper or "
    "DataLoader first used them. Call options.clone() to get a modifiable copy."
)


# Options older PopTorch versions had: the emulator follows PopTorch 3.4, as an IPU running a
# current SDK would, but says what replaced them.
_REMOVED = {
    "anchorMode": " Options.anchorMode was removed in PopTorch 2.5: use "
    "Options.outputMode(poptorch.OutputMode.<mode>) instead.",
    "autocastEnabled": " Precision.autocastEnabled was removed in PopTorch 3.1: remove the call "
    "(mixed float16/float32 ops follow PyTorch's type promotion).",
    "autocastPolicy": " Precision.autocastPolicy was removed in PopTorch 3.1: remove the call "
    "(mixed float16/float32 ops follow PyTorch's type promotion).",
}


class ConfigFileError(Exception):
    """A line of an options file passed to ``Options.loadFromFile`` failed."""


class _OptionsDict:
    """Dictionary of declared options: ``set()`` type-checks against the default's type."""

    def __init__(self, **default_values: Any) -> None:
        self._warnings: dict[str, str] = {}
        self._warnings_disabled: set[str] = set()
        self._is_frozen = False
        self._values = default_values  # must be the last attribute assigned in __init__

    def checkIsFrozen(self, option: str | None = None) -> None:
        if option != "_is_frozen" and self.__dict__.get("_is_frozen", False):
            raise AttributeError(_FROZEN_MSG)

    def set(self, **kwargs: Any) -> None:
        self.checkIsFrozen()
        for option, value in kwargs.items():
            assert self.exists(option), (
                f"Invalid option {option}, valid options are {list(self._values)}"
            )
            expected = type(self._values[option])
            assert isinstance(value, expected), (
                f"Unexpected type {type(value)} for option {option}. Expected {expected}. "
                f"Received: {option}={value!r}."
            )
            self._values[option] = value

    def createOrSet(self, **kwargs: Any) -> None:
        self.checkIsFrozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value

    def exists(self, option: str) -> bool:
        return option in self.__dict__.get("_values", {})

    def deleteIfExists(self, option: str) -> None:
        self.checkIsFrozen()
        self._values.pop(option, None)

    def _changeFreezeState(self, frozen: bool) -> None:
        self.__dict__["_is_frozen"] = frozen
        for value in self.__dict__.values():
            if isinstance(value, (_OptionsDict, _PopartOptions)):
                value._changeFreezeState(frozen)

    def _freeze(self) -> None:
        self._changeFreezeState(True)

    def _unfreeze(self) -> None:
        self._changeFreezeState(False)

    def __deepcopy__(self, memo: dict[int, Any]) -> _OptionsDict:
        # clone()/deepcopy always give an unfrozen copy, nested groups included.
        result = self.__class__.__new__(self.__class__)
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            result.__dict__[key] = False if key == "_is_frozen" else copy.deepcopy(value, memo)
        return result

    def __setattr__(self, option: str, value: Any) -> None:
        self.checkIsFrozen(option)
        if not option.startswith("_"):
            self.set(**{option: value})
        elif "_values" in self.__dict__ and option not in (*self.__dict__, "__class__"):
            # (assigning __class__ wraps a group in a subclass, as popdist does)
            raise AttributeError(
                f"Invalid private attribute {option}. Valid attributes: {list(self.__dict__)}"
            )
        else:
            object.__setattr__(self, option, value)

    def __getattr__(self, option: str) -> Any:
        values = self.__dict__.get("_values")
        if option.startswith("_") or values is None or option not in values:
            raise AttributeError(f"Invalid attribute {option}." + _REMOVED.get(option, ""))
        return values[option]

    def __call__(self, option: str) -> Any:
        return getattr(self, option)

    def update(self, other: dict[str, Any]) -> dict[str, Any]:
        for key, warning in self._warnings.items():
            if key not in self._warnings_disabled:
                logger.warning(warning)
        assert not set(self._values).intersection(other), (
            "Can't merge dictionaries, they have some keys in common"
        )
        other.update(self._values)
        return other

    def toDict(self) -> dict[str, Any]:
        return self.update({})

    def __repr__(self) -> str:
        items = [f"{k}={v!r}" for k, v in self._values.items()]
        items += [f"{k}={v!r}" for k, v in self.__dict__.items() if k != "_values"]
        return f"{type(self).__name__}({', '.join(items)})"


class _PopartOptions:
    """Back-end (PopART) options: any key, recorded as given. ``opts._Popart.set(key, value)``."""

    def __init__(self) -> None:
        self._is_frozen = False
        self.options: dict[str, Any] = {}
        self.set("instrumentWithHardwareCycleCounter", False)
        self.set("rearrangeAnchorsOnHost", False)

    def _changeFreezeState(self, frozen: bool) -> None:
        self._is_frozen = frozen

    def __deepcopy__(self, memo: dict[int, Any]) -> _PopartOptions:
        result = _PopartOptions()
        memo[id(self)] = result
        result.options = copy.deepcopy(self.options, memo)
        return result

    def set(self, key: str, value: Any) -> _PopartOptions:
        if self._is_frozen:
            raise AttributeError(_FROZEN_MSG)
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options: dict[str, str]) -> _PopartOptions:
        return self.set("engineOptions", engine_options)

    def setPatterns(self, patterns: dict[str, bool], level: int = 2) -> _PopartOptions:
        assert isinstance(level, int) and isinstance(patterns, dict)
        return self.set("patterns_level", level).set("patterns", patterns)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


class _JitOptions(_OptionsDict):
    """``opts.Jit``: kept for API compatibility (the emulator runs eagerly)."""

    def __init__(self) -> None:
        super().__init__(trace_model=True)

    def traceModel(self, trace_model: bool) -> _JitOptions:
        self.set(trace_model=trace_model)
        return self


class _PrecisionOptions(_OptionsDict):
    """``opts.Precision``: numeric settings of the device (recorded in ``_Popart``)."""

    def __init__(self, popart_options: _PopartOptions) -> None:
        self._popart_options = popart_options
        super().__init__()

    def halfFloatCasting(self, half_float_casting: Any) -> _PrecisionOptions:
        """Deprecated no-op: mixed float16/float32 ops follow PyTorch's promotion."""
        logger.warning(
            "Precision.halfFloatCasting is deprecated and has no effect: mixed "
            "float16/float32 ops follow PyTorch's type promotion."
        )
        return self

    def runningStatisticsAlwaysFloat(self, value: bool) -> _PrecisionOptions:
        """Deprecated no-op."""
        logger.warning("Precision.runningStatisticsAlwaysFloat is deprecated and has no effect.")
        return self

    def enableFloatingPointExceptions(self, enabled: bool) -> _PrecisionOptions:
        assert isinstance(enabled, bool), "enableFloatingPointExceptions needs to be set to a bool"
        self._popart_options.set("enableFloatingPointChecks", enabled)
        return self

    def enableStochasticRounding(self, enabled: bool) -> _PrecisionOptions:
        self._popart_options.set("enableStochasticRounding", enabled)
        return self

    def setPartialsType(self, dtype: torch.dtype) -> _PrecisionOptions:
        """Matmul/conv partials type: ``torch.float`` or ``torch.half`` (recorded only)."""
        names = {torch.float32: "float", torch.float16: "half"}
        if dtype not in names:
            raise ValueError(
                "parameter to setPartialsType should be either torch.float or "
                f"torch.half. Received: dtype={dtype!r}."
            )
        self._popart_options.set("partialsTypeMatMuls", names[dtype])
        self._popart_options.set("convolutionOptions", {"partialsType": names[dtype]})
        return self


class _TrainingOptions(_OptionsDict):
    """``opts.Training``: gradient accumulation and its reduction."""

    def __init__(self, popart_options: _PopartOptions) -> None:
        self._popart_options = popart_options
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=MeanReductionStrategy.Post,
        )

    def gradientAccumulation(self, gradient_accumulation: int) -> _TrainingOptions:
        """Micro-batches accumulated per optimizer update (1 for inference)."""
        self.set(gradient_accumulation=gradient_accumulation)
        return self

    def accumulationAndReplicationReductionType(
        self, reduction_type: ReductionType
    ) -> _TrainingOptions:
        """Combine GA x RF micro-batch gradients by ``Mean`` (default) or ``Sum``."""
        if (
            not isinstance(reduction_type, ReductionType)
            or reduction_type == ReductionType.NoReduction
        ):
            raise ValueError(
                "accumulationAndReplicationReductionType must be set to "
                "poptorch.ReductionType.Mean or poptorch.ReductionType.Sum. "
                f"Received: {reduction_type!r}."
            )
        self.set(accumulation_and_replication_reduction_type=reduction_type)
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(
        self, mean_reduction_strategy: MeanReductionStrategy
    ) -> _TrainingOptions:
        self.set(meanAccumulationAndReplicationReductionStrategy=mean_reduction_strategy)
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> _TrainingOptions:
        self._popart_options.set("automaticLossScalingSettings.enabled", enabled)
        return self

    def setConvolutionDithering(self, enabled: bool) -> _TrainingOptions:
        self._popart_options.set("convolutionOptions", {"enableConvDithering": enabled})
        return self


class _DistributedOptions(_OptionsDict):
    """``opts.Distributed``: process id / count (read from OMPI_COMM_WORLD_* by default)."""

    def __init__(self) -> None:
        super().__init__(num_distributed_processes=1, distributed_process_id=0, ipuof_configs={})
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    def disable(self) -> _DistributedOptions:
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str) -> _DistributedOptions:
        return self.configureProcessId(
            int(os.environ.get(var_process_id, "0")), int(os.environ.get(var_num_processes, "1"))
        )

    def configureProcessId(self, process_id: int, num_processes: int) -> _DistributedOptions:
        self.set(distributed_process_id=process_id, num_distributed_processes=num_processes)
        return self

    @property
    def processId(self) -> int:
        return self.distributed_process_id

    @property
    def numProcesses(self) -> int:
        return self.num_distributed_processes


class TensorLocationSettings(_OptionsDict):
    """Where a class of tensors lives: ``TensorLocationSettings().useOnChipStorage(False)``."""

    def minElementsForOffChip(self, min_elements: int) -> TensorLocationSettings:
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForOffChip=min_elements)
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements: int) -> TensorLocationSettings:
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForReplicatedTensorSharding=min_elements)
        return self

    def useOnChipStorage(self, use: bool | None = True) -> TensorLocationSettings:
        if use is None:
            self.deleteIfExists("onChip")
        else:
            assert isinstance(use, bool)
            self.createOrSet(onChip=int(use))
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> TensorLocationSettings:
        assert isinstance(use, bool)
        self.createOrSet(useReplicatedTensorSharding=int(use))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> TensorLocationSettings:
        assert isinstance(use, bool)
        self.createOrSet(useIOTilesToLoad=int(use))
        return self

    def useIOTilesToStore(self, use: bool = True) -> TensorLocationSettings:
        assert isinstance(use, bool)
        self.createOrSet(useIOTilesToStore=int(use))
        return self


class _TensorLocationOptions(_OptionsDict):
    """``opts.TensorLocations``: on/off-chip placement (recorded only)."""

    def numIOTiles(self, num_tiles: int) -> _TensorLocationOptions:
        msg = f"numIOTiles must be an even number between 32 and 192. Received: {num_tiles!r}."
        assert isinstance(num_tiles, int) and 32 <= num_tiles <= 192 and num_tiles % 2 == 0, msg
        self.createOrSet(numIOTiles=num_tiles)
        return self

    def _location(self, key: str, location: TensorLocationSettings) -> _TensorLocationOptions:
        assert isinstance(location, TensorLocationSettings), (
            f"Expected a poptorch.TensorLocationSettings. Received: {type(location).__name__}."
        )
        self.createOrSet(**{key: location.toDict()})
        return self

    def setActivationLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._location("location_activation", location)

    def setWeightLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._location("location_weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._location("location_optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._location("location_accumulator", location)


def _no_progress_bar(progress: int, total: int) -> None:
    """Stands for PopTorch's compilation progress bar (the emulator does not compile)."""


# Keys PopTorch's compiler takes without logging them: Python-only ones, and those it turns
# into other settings (per-IPU memory proportions, patterns, tensor locations).
_UNLOGGED = (
    "anchored_tensors",
    "compilation_progress_bar_fn",
    "patterns_level",
    "patterns",
    "available_memory_proportion",
)


def _as_logged(value: Any) -> str:
    """A value as PopTorch's C++ logs it: booleans in lower case, numbers shortest."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return str(int(value))  # IntEnum members as their value
    return str(value)


def log_compiled_options(options: Options, ipus_per_replica: int) -> None:
    """At compile, at DEBUG, what PopTorch's compiler logs as it receives the options
    (``poptorch.Options set NAME to value VALUE``; ``... set NAME[KEY] to VALUE`` for a dict
    entry, ``... added ITEM to NAME`` for a list's) and then the settings it derives itself
    (``enablePipelining set to value N``): popart_compiler's SessionOptions and Compiler."""
    if not logger.isEnabledFor(10):  # DEBUG: nothing to build otherwise
        return
    values = options.toDict()
    for name, value in values.items():
        if name in _UNLOGGED or name.startswith("location_"):
            continue
        if isinstance(value, dict):
            for key, item in value.items():
                logger.debug("poptorch.Options set %s[%s] to %s", name, key, item)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                logger.debug("poptorch.Options added %s to %s", item, name)
        else:
            logger.debug("poptorch.Options set %s to value %s", name, _as_logged(value))
    if "debug.retainDebugInformation" not in values.get("engineOptions", {}):
        logger.debug("engineOptions[debug.retainDebugInformation] set to value false")
    pipelining = values.get("execution_mode") == 0 and ipus_per_replica > 1
    if "enablePipelining" in values and bool(values["enablePipelining"]) != pipelining:
        logger.warning(
            "enablePipelining forced by the user from default to %d, ignoring value %d",
            bool(values["enablePipelining"]),
            pipelining,
        )
    else:
        logger.debug("enablePipelining set to value %d", pipelining)


def _from_json_value(value: Any) -> Any:
    """Turn "ConnectionType.OnDemand" into the enum member; other values pass through."""
    if isinstance(value, list):
        return [_from_json_value(v) for v in value]
    if isinstance(value, str) and value.count(".") == 1:
        enum_name, member = value.split(".")
        enum_cls = getattr(enums, enum_name, None)
        if enum_cls is not None and member in enum_cls.__members__:
            return enum_cls[member]
    return value


class Options(_OptionsDict):
    """All the options controlling how a model is compiled and run. Example::

    opts = poptorch.Options().deviceIterations(4)
    opts.Training.gradientAccumulation(8)
    """

    def __init__(self) -> None:
        self._jit = _JitOptions()
        self._popart = _PopartOptions()
        self._graphProcessing = _PrecisionOptions(self._popart)
        self._training = _TrainingOptions(self._popart)
        self._distributed = _DistributedOptions()
        self._tensor_locations = _TensorLocationOptions()
        self._execution_strategy = PipelinedExecution(AutoStage.SameAsIpu)
        self._relax_optimizer_checks = False
        self._show_compilation_progress_bar = True
        self._module_namescope_enabled = True
        self._source_location_excludes = [
            "install/poptorch",
            "site-packages/torch",
            "site-packages/poptorch",
        ]
        super().__init__(
            replication_factor=1,
            input_group_size=1,
            input_cgt=CommGroupType.Consecutive,
            broadcast_buffers=True,
            device_iterations=1,
            log_dir=".",
            auto_round_num_ipus=False,
            anchored_tensors={},
            output_mode=OutputMode.Default.value,
            output_return_period=1,
            connection_type=ConnectionType.Always.value,
            sync_pattern=SyncPattern.Full.value,
            available_memory_proportion={},
            max_repeat_logs=4,
        )
        path = os.environ.get("POPTORCH_CACHE_DIR", "")
        if path:
            self.enableExecutableCaching(path)
        defaults = os.environ.get("POPTORCH_DEFAULT_OPTIONS", "")
        if defaults:
            self.from_json(defaults)

    # -- groups -----------------------------------------------------------------------------
    @property
    def Training(self) -> _TrainingOptions:
        return self._training

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        return self._tensor_locations

    @property
    def Precision(self) -> _PrecisionOptions:
        return self._graphProcessing

    @property
    def Distributed(self) -> _DistributedOptions:
        return self._distributed

    @property
    def Jit(self) -> _JitOptions:
        return self._jit

    @property
    def _Popart(self) -> _PopartOptions:
        return self._popart

    # -- batching and outputs ---------------------------------------------------------------
    def deviceIterations(self, device_iterations: int) -> Options:
        """Iterations the device runs per call (training: optimizer updates per call)."""
        self.set(device_iterations=device_iterations)
        return self

    def replicationFactor(self, replication_factor: int) -> Options:
        """Number of data-parallel replicas."""
        self.set(replication_factor=replication_factor)
        return self

    def inputReplicaGrouping(
        self, input_group_size: int, input_group_type: CommGroupType
    ) -> Options:
        """Replicas in a group of ``input_group_size`` receive the same input data."""
        if input_group_type == CommGroupType.NoGrouping:  # as PopTorch: each replica its own
            input_group_size, input_group_type = 1, CommGroupType.Consecutive
        if input_group_type == CommGroupType.All:
            raise ValueError(
                "CommGroupType.All is not supported for input replica grouping. "
                "Use CommGroupType.Consecutive or CommGroupType.Orthogonal."
            )
        rf = self.replication_factor
        if (
            not isinstance(input_group_size, int)
            or input_group_size < 1
            or input_group_size > rf
            or rf % input_group_size != 0
        ):
            raise ValueError(
                f"Input replica group size ({input_group_size}) must divide the "
                f"replication factor ({rf}). Set replicationFactor() first."
            )
        self.set(input_group_size=input_group_size, input_cgt=CommGroupType(input_group_type))
        return self

    def outputMode(
        self, output_mode: OutputMode, output_return_period: int | None = None
    ) -> Options:
        """Which outputs to return: All, Sum, Final, EveryN (with a period) or Default."""
        assert isinstance(output_mode, OutputMode), (
            f"outputMode expects a poptorch.OutputMode. Received: {output_mode!r}."
        )
        if output_mode == OutputMode.EveryN:
            assert output_return_period and output_return_period > 0, (
                "EveryN anchor must have output_return_period set to valid positive integer. "
                f"Received: output_return_period={output_return_period!r}."
            )
        elif output_return_period:
            logger.info(
                "Anchor return period argument ignored with output_mode set to %s", output_mode
            )
            output_return_period = None
        self.set(output_mode=output_mode.value, output_return_period=output_return_period or 1)
        return self

    def defaultOutputMode(self) -> bool:
        return self.output_mode == OutputMode.Default

    def anchorTensor(
        self,
        short_name: str,
        long_name: str,
        output_mode: OutputMode | None = None,
        output_return_period: int | None = 1,
    ) -> None:
        """Return an extra named tensor (``None`` mode: same as the model outputs). Returns
        None, as PopTorch's does: this is the one setter that does not chain."""
        self.checkIsFrozen()
        if output_mode != OutputMode.EveryN:
            output_return_period = 1
        self.anchored_tensors[short_name] = [
            long_name,
            output_mode is None,
            output_mode,
            output_return_period,
        ]

    def randomSeed(self, random_seed: int) -> Options:
        """Seed the device RNG; like PopTorch this also calls ``torch.manual_seed``."""
        self.checkIsFrozen()
        assert isinstance(random_seed, int), (
            f"randomSeed expects an int. Received: random_seed={random_seed!r}."
        )
        torch.manual_seed(random_seed)
        self.createOrSet(random_seed=random_seed)
        return self

    # -- device selection and model parallelism ---------------------------------------------
    def useIpuModel(self, use_model: bool) -> Options:
        self.createOrSet(use_model=use_model)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Options:
        """Round the requested IPU count up to a power of two instead of failing."""
        self.set(auto_round_num_ipus=auto_round_num_ipus)
        return self

    def setExecutionStrategy(self, strategy: _IExecutionStrategy) -> Options:
        assert isinstance(strategy, _IExecutionStrategy), (
            "setExecutionStrategy expects a PipelinedExecution, ShardedExecution, SerialPhased"
            f"Execution or ParallelPhasedExecution. Received: {type(strategy).__name__}."
        )
        self._execution_strategy = strategy
        return self

    def setAvailableMemoryProportion(
        self, available_memory_proportion: dict[str, float]
    ) -> Options:
        """Per-IPU temporary memory proportion, e.g. ``{"IPU0": 0.5}`` (recorded only)."""
        actual = {}
        for key, mem in available_memory_proportion.items():
            assert key.startswith("IPU"), (
                'Available memory proportions are expected to be in a dictionary of {"IPU0": 0.5} '
                f"where the 0 in IPU is the index of the IPU. Invalid key: {key}"
            )
            actual[int(key[3:])] = mem
        self.createOrSet(available_memory_proportion=actual)
        return self

    def useIpuId(self, ipu_id: int) -> Options:
        assert isinstance(ipu_id, int), f"useIpuId expects an int. Received: {ipu_id!r}."
        self.createOrSet(ipu_id=ipu_id)
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Options:
        """Compile only, for IPU ``ipu_version``: 1 (Mk1), 2 (Mk2) or 21 (Mk2 with FP8)."""
        if isinstance(ipu_version, bool) or ipu_version not in _OFFLINE_IPU_VERSIONS:
            # PopTorch fails later, when Poplar cannot make the offline device at compile.
            hint = (
                " 0 is no IPU version: pass the version to target, e.g. 2 (Mk2)."
                if ipu_version == 0
                else ""
            )
            raise ValueError(
                "useOfflineIpuTarget: ipu_version must be 1 (Mk1), 2 (Mk2) or 21 "
                f"(Mk2 with FP8 support). Received: ipu_version={ipu_version!r}." + hint
            )
        self.connectionType(ConnectionType.Never)
        self.createOrSet(ipu_version=ipu_version)
        return self

    def connectionType(self, connection_type: ConnectionType) -> Options:
        assert isinstance(connection_type, ConnectionType), (
            f"connectionType expects a poptorch.ConnectionType. Received: {connection_type!r}."
        )
        self.set(connection_type=connection_type.value)
        return self

    def syncPattern(self, sync_pattern: SyncPattern) -> Options:
        assert isinstance(sync_pattern, SyncPattern), (
            f"syncPattern expects a poptorch.SyncPattern. Received: {sync_pattern!r}."
        )
        self.set(sync_pattern=sync_pattern.value)
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> Options:
        self.set(broadcast_buffers=broadcast_buffers)
        return self

    # -- caching, logging, profiling (recorded) ---------------------------------------------
    def enableExecutableCaching(self, path: str | None) -> Options:
        if path is None:
            self._Popart.set("enableEngineCaching", False)
        else:
            self._Popart.set("cachePath", path)
            self._Popart.set("enableEngineCaching", True)
        return self

    def enableProfiling(self, profile_dir: str | None = None) -> Options:
        """Record PopART's profiling engine options (``POPLAR_ENGINE_OPTIONS`` wins if set)."""
        env = os.getenv("POPLAR_ENGINE_OPTIONS", default="")
        if any(
            k in env for k in ("debug.allowOutOfMemory", "autoReport.directory", "autoReport.all")
        ):
            logger.warning(
                "Profiling setting overridden by environment variable. "
                "Check content of POPLAR_ENGINE_OPTIONS."
            )
        engine = dict(self._popart.options.get("engineOptions", {}))
        engine.update(
            {
                "debug.allowOutOfMemory": "true",
                "autoReport.directory": profile_dir or ".",
                "autoReport.all": "true",
            }
        )
        self._popart.setEngineOptions(engine)
        return self

    def logDir(self, log_dir: str) -> Options:
        self.set(log_dir=log_dir)
        return self

    def logCycleCount(self, log_cycle_count: bool) -> Options:
        self._Popart.set("instrumentWithHardwareCycleCounter", log_cycle_count)
        return self

    def enableSyntheticData(self, enabled: bool) -> Options:
        self._Popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    def enableStableNorm(self, enabled: bool) -> Options:
        self._Popart.set("enableStableNorm", enabled)
        return self

    def maxRepeatLogs(self, max_lines: int | None) -> Options:
        """Repeated log lines shown before suppression (None: never suppress)."""
        self.checkIsFrozen()
        assert max_lines is None or isinstance(max_lines, int), (
            f"maxRepeatLogs expects an int or None. Received: {max_lines!r}."
        )
        self._values["max_repeat_logs"] = max_lines
        return self

    def modelName(self, name: str) -> Options:
        self.createOrSet(model_name=name)
        return self

    def updatableNamedBuffers(self, buffers: list[str]) -> Options:
        """Buffers (by ``named_buffers()`` name) that ``copyNamedBuffersToDevice()`` uploads."""
        self._popart.set("updatableNamedBuffers", list(buffers))
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Options:
        self._relax_optimizer_checks = relax
        return self

    def showCompilationProgressBar(self, show: bool = True) -> Options:
        self._show_compilation_progress_bar = show
        return self

    def disableModuleNamescope(self) -> Options:
        self._module_namescope_enabled = False
        return self

    def sourceLocationExcludes(self, excludes: list[str]) -> Options:
        """Frames to skip when IR ops are traced back to source (recorded only)."""
        self._source_location_excludes = list(excludes)
        return self

    def appendToLocationExcludes(self, *excludes: str) -> Options:
        """Add frames to skip when IR ops are traced back to source (recorded only)."""
        self._source_location_excludes = [*self._source_location_excludes, *excludes]
        return self

    # -- loading, serialising, copying ------------------------------------------------------
    def loadFromFile(self, filepath: str) -> Options:
        """Run each non-comment line of ``filepath`` as ``options.<line>``. As in PopTorch, a
        syntax error anywhere applies nothing and raises ``ConfigFileError`` naming the line
        among the file's option lines (blank and comment lines are not counted)."""
        with open(filepath, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        commands = [f"options.{line}" for line in lines if line and not line.startswith("#")]
        try:
            # (line numbers are those of the option lines, so not the file's own name)
            code = compile("\n".join(commands), f"<option lines of {filepath}>", "exec")
        except SyntaxError as e:
            n = e.lineno or 0
            line = commands[n - 1] if 0 < n <= len(commands) else (e.text or "").rstrip()
            raise ConfigFileError(
                f"{type(e).__name__} at line {n} of {os.path.basename(filepath)}: {e.msg}\n> {line}"
            ) from e
        namespace = {"poptorch": _options_file_poptorch, "torch": torch, "options": self}
        exec(code, namespace)  # noqa: S102
        return self

    def from_json(self, string: str) -> Options:
        """Apply ``{"Dotted.method": args}`` (list = several args; "Enum.Member" strings ok)."""
        for accessor, value in json.loads(string).items():
            target: Any = self
            for part in accessor.split("."):
                target = getattr(target, part)
            value = _from_json_value(value)
            if isinstance(value, list):
                target(*value)
            else:
                target(value)
        return self

    def toDict(self) -> dict[str, Any]:
        """Back-end dictionary (all groups but Jit/Precision); needs a resolved output mode."""
        assert not self.defaultOutputMode(), "An output mode must be picked before serialisation"
        out = self._execution_strategy.backendOptions()
        out.update(self._popart.options)
        out = self.update(out)
        out = self._training.update(out)
        out = self._distributed.update(out)
        out = self._tensor_locations.update(out)
        if self._show_compilation_progress_bar:
            out["compilation_progress_bar_fn"] = _no_progress_bar
        return out

    def clone(self) -> Options:
        """An unfrozen deep copy."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        groups = [p for p in dir(type(self)) if isinstance(getattr(type(self), p), property)]
        items = [f"{k}={v!r}" for k, v in self._values.items()]
        items += [f"{p}={getattr(self, p)}" for p in groups]
        return f"{type(self).__name__}({', '.join(items)})"
