"""poptorch.Options emulation: docs/poptorch-semantics.md §1, §8.8, §8.9, §9 (toDict)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from ipuloop.emulator.blocks import PipelinedExecution, ShardedExecution
from ipuloop.emulator.enums import (
    AutoStage,
    CommGroupType,
    ConnectionType,
    MeanReductionStrategy,
    OutputMode,
    ReductionType,
    SyncPattern,
)
from ipuloop.emulator.options import ConfigFileError, Options, TensorLocationSettings

FROZEN = "Can't modify frozen Options"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (
        "POPTORCH_CACHE_DIR",
        "POPTORCH_DEFAULT_OPTIONS",
        "POPLAR_ENGINE_OPTIONS",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
    ):
        monkeypatch.delenv(var, raising=False)


# -- §1.2 defaults ---------------------------------------------------------------------------
def test_defaults_match_poptorch():
    opts = Options()
    assert (opts.replication_factor, opts.device_iterations) == (1, 1)
    assert (opts.input_group_size, opts.input_cgt) == (1, CommGroupType.Consecutive)
    assert opts.output_mode == OutputMode.Default.value == 4 and type(opts.output_mode) is int
    assert opts.output_return_period == 1 and opts.defaultOutputMode()
    assert opts.auto_round_num_ipus is False and opts.broadcast_buffers is True
    assert opts.connection_type == ConnectionType.Always and opts.sync_pattern == SyncPattern.Full
    assert opts.available_memory_proportion == {} and opts.anchored_tensors == {}
    assert (opts.log_dir, opts.max_repeat_logs) == (".", 4)
    assert opts.Training.gradient_accumulation == 1
    assert opts.Training.accumulation_and_replication_reduction_type is ReductionType.Mean
    strategy = opts.Training.meanAccumulationAndReplicationReductionStrategy
    assert strategy is MeanReductionStrategy.Post
    assert (opts.Distributed.numProcesses, opts.Distributed.processId) == (1, 0)
    assert opts._Popart.options == {
        "instrumentWithHardwareCycleCounter": False,
        "rearrangeAnchorsOnHost": False,
    }
    strategy = opts._execution_strategy
    assert type(strategy) is PipelinedExecution and strategy._auto_stage == AutoStage.SameAsIpu
    for absent in ("random_seed", "use_model", "ipu_id", "model_name"):
        assert not opts.exists(absent)
    assert opts._show_compilation_progress_bar and not opts._relax_optimizer_checks
    assert opts._module_namescope_enabled


def test_distributed_reads_openmpi_environment(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    opts = Options()
    assert (opts.Distributed.numProcesses, opts.Distributed.processId) == (4, 3)
    assert opts.Distributed.configureProcessId(1, 2) is opts.Distributed
    assert (opts.Distributed.numProcesses, opts.Distributed.processId) == (2, 1)


# -- §1.1 storage model ----------------------------------------------------------------------
def test_set_checks_type_of_default():
    opts = Options()
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.deviceIterations(2.0)
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.Training.gradientAccumulation("4")
    opts.deviceIterations(True)  # bool subclasses int, as in PopTorch
    assert opts.device_iterations is True


def test_set_rejects_undeclared_keys_and_create_or_set_creates_them():
    opts = Options()
    with pytest.raises(AssertionError, match="Invalid option"):
        opts.set(not_an_option=1)
    assert not opts.exists("my_key")
    opts.createOrSet(my_key=3)
    assert opts.exists("my_key") and opts.my_key == 3
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.createOrSet(my_key="three")  # existing keys keep their type


def test_public_attribute_assignment_goes_through_set():
    opts = Options()
    opts.device_iterations = 4
    assert opts.device_iterations == 4 and opts("device_iterations") == 4
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.replication_factor = 2.5
    with pytest.raises(AssertionError, match="Invalid option"):
        opts.Training.not_an_option = 1
    with pytest.raises(AttributeError, match="Invalid private attribute"):
        opts._brand_new = 1
    with pytest.raises(AttributeError, match="Invalid attribute"):
        opts.no_such_option  # noqa: B018


# -- §1.3 chaining ----------------------------------------------------------------------------
OPTION_CALLS = [
    lambda o: o.deviceIterations(2),
    lambda o: o.replicationFactor(2),
    lambda o: o.outputMode(OutputMode.All),
    lambda o: o.randomSeed(1),
    lambda o: o.enableExecutableCaching("/tmp/x"),
    lambda o: o.enableProfiling(),
    lambda o: o.useIpuModel(True),
    lambda o: o.autoRoundNumIPUs(),
    lambda o: o.setExecutionStrategy(ShardedExecution()),
    lambda o: o.setAvailableMemoryProportion({"IPU0": 0.5}),
    lambda o: o.useIpuId(1),
    lambda o: o.useOfflineIpuTarget(),
    lambda o: o.connectionType(ConnectionType.OnDemand),
    lambda o: o.syncPattern(SyncPattern.SinglePipeline),
    lambda o: o.logDir("/tmp"),
    lambda o: o.logCycleCount(True),
    lambda o: o.enableSyntheticData(True),
    lambda o: o.maxRepeatLogs(2),
    lambda o: o.modelName("m"),
    lambda o: o.relaxOptimizerAttributesChecks(),
    lambda o: o.showCompilationProgressBar(False),
    lambda o: o.broadcastBuffers(False),
    lambda o: o.disableModuleNamescope(),
    lambda o: o.from_json('{"deviceIterations": 3}'),
    lambda o: o.enableStableNorm(True),
    lambda o: o.sourceLocationExcludes(["mylib/"]),
    lambda o: o.appendToLocationExcludes("x/"),
]
GROUP_CALLS = [
    ("Training", lambda g: g.gradientAccumulation(2)),
    ("Training", lambda g: g.accumulationAndReplicationReductionType(ReductionType.Sum)),
    (
        "Training",
        lambda g: g.setMeanAccumulationAndReplicationReductionStrategy(
            MeanReductionStrategy.Running
        ),
    ),
    ("Training", lambda g: g.setAutomaticLossScaling(True)),
    ("Training", lambda g: g.setConvolutionDithering(True)),
    ("TensorLocations", lambda g: g.setOptimizerLocation(TensorLocationSettings())),
    ("TensorLocations", lambda g: g.setActivationLocation(TensorLocationSettings())),
    ("TensorLocations", lambda g: g.setWeightLocation(TensorLocationSettings())),
    ("TensorLocations", lambda g: g.setAccumulatorLocation(TensorLocationSettings())),
    ("TensorLocations", lambda g: g.numIOTiles(32)),
    ("Precision", lambda g: g.setPartialsType(torch.half)),
    ("Precision", lambda g: g.enableStochasticRounding(True)),
    ("Precision", lambda g: g.enableFloatingPointExceptions(True)),
    ("Precision", lambda g: g.halfFloatCasting(None)),
    ("Precision", lambda g: g.runningStatisticsAlwaysFloat(True)),
    ("Distributed", lambda g: g.configureProcessId(0, 1)),
    ("Jit", lambda g: g.traceModel(False)),
    ("_Popart", lambda g: g.set("key", 1)),
]


@pytest.mark.parametrize("call", OPTION_CALLS)
def test_options_methods_return_the_options(call):
    opts = Options()
    assert call(opts) is opts


@pytest.mark.parametrize("group, call", GROUP_CALLS)
def test_group_methods_return_the_group(group, call):
    opts = Options()
    assert call(getattr(opts, group)) is getattr(opts, group)


# -- §1.3 freezing, clone, toDict ---------------------------------------------------------------
@pytest.mark.parametrize("call", OPTION_CALLS)
def test_every_options_setter_fails_once_frozen(call):
    opts = Options()
    opts._freeze()
    with pytest.raises(AttributeError, match=FROZEN):
        call(opts)


# Every group setter but the two deprecated no-ops (GROUP_CALLS[-5:-3]).
@pytest.mark.parametrize("group, call", GROUP_CALLS[:-5] + GROUP_CALLS[-3:])
def test_every_group_setter_fails_once_frozen(group, call):
    opts = Options()
    opts._freeze()
    with pytest.raises(AttributeError, match=FROZEN):
        call(getattr(opts, group))


def test_frozen_attribute_assignment_fails_and_random_seed_does_not_reseed():
    opts = Options()
    opts._freeze()
    with pytest.raises(AttributeError, match=FROZEN):
        opts.device_iterations = 3
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.randomSeed(99)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("copier", [Options.clone, copy.deepcopy])
def test_clone_is_an_unfrozen_deep_copy(copier):
    opts = Options().deviceIterations(5)
    opts.anchorTensor("t1", "tensor1")
    opts.Training.gradientAccumulation(4)
    opts._Popart.set("autoRecomputation", 3)
    opts.TensorLocations.setWeightLocation(TensorLocationSettings().useOnChipStorage(True))
    opts._freeze()
    copied = copier(opts)
    copied.deviceIterations(4)
    copied.anchorTensor("t2", "tensor2")
    copied.Training.gradientAccumulation(8)
    copied._Popart.set("autoRecomputation", 2)
    copied.TensorLocations.setWeightLocation(TensorLocationSettings().useOnChipStorage(False))
    copied.setExecutionStrategy(ShardedExecution())
    assert (opts.device_iterations, copied.device_iterations) == (5, 4)
    assert list(opts.anchored_tensors) == ["t1"] and list(copied.anchored_tensors) == ["t1", "t2"]
    assert (opts.Training.gradient_accumulation, copied.Training.gradient_accumulation) == (4, 8)
    assert opts._Popart.options["autoRecomputation"] == 3
    assert opts.TensorLocations.location_weight["onChip"] == 1
    assert type(opts._execution_strategy) is PipelinedExecution
    # The Precision and Training groups share the copied _Popart object, as in the original.
    copied.Precision.enableStochasticRounding(True)
    assert copied._Popart.options["enableStochasticRounding"] is True
    with pytest.raises(AttributeError, match=FROZEN):
        opts.deviceIterations(1)


def test_to_dict_requires_an_output_mode_then_merges_groups():
    opts = Options()
    with pytest.raises(AssertionError, match="An output mode must be picked before serialisation"):
        opts.toDict()
    opts.outputMode(OutputMode.All).enableExecutableCaching("/tmp/cache")
    opts.Training.gradientAccumulation(3)
    out = opts.toDict()
    assert out["output_mode"] == OutputMode.All and out["gradient_accumulation"] == 3
    assert out["replication_factor"] == 1 and out["num_distributed_processes"] == 1
    assert out["execution_mode"] == 0 and out["cachePath"] == "/tmp/cache"
    assert "trace_model" not in out and callable(out["compilation_progress_bar_fn"])
    opts._Popart.set("device_iterations", 2)
    with pytest.raises(AssertionError, match="Can't merge dictionaries"):
        opts.toDict()


def test_repr_shows_values():
    text = repr(Options().replicationFactor(4))
    assert text.startswith("Options(") and "replication_factor=4" in text
    assert "Training=_TrainingOptions(gradient_accumulation=1" in text


# -- §1.3 individual methods ----------------------------------------------------------------
def test_random_seed_asserts_int_seeds_torch_and_is_stored():
    with pytest.raises(AssertionError):
        Options().randomSeed(1.5)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(123)
    opts = Options().randomSeed(7)
    assert torch.equal(torch.rand(4), expected)
    assert opts.exists("random_seed") and opts.random_seed == 7


def test_output_mode_rules(caplog):
    opts = Options()
    with pytest.raises(AssertionError):
        opts.outputMode(2)
    with pytest.raises(AssertionError, match="EveryN"):
        opts.outputMode(OutputMode.EveryN)
    opts.outputMode(OutputMode.EveryN, 2)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN, 2)
    with caplog.at_level(logging.INFO, logger="poptorch::python"):
        opts.outputMode(OutputMode.Sum, 5)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.Sum, 1)
    assert "ignored" in caplog.text
    assert not opts.defaultOutputMode()


def test_anchor_tensor_inherits_model_mode_when_none():
    opts = Options()
    assert opts.anchorTensor("loss", "Loss:0") is None  # PopTorch's does not chain
    opts.anchorTensor("x", "X", OutputMode.EveryN, 3)
    opts.anchorTensor("y", "Y", OutputMode.All, 3)  # the period only counts for EveryN
    assert opts.anchored_tensors["loss"] == ["Loss:0", True, None, 1]
    assert opts.anchored_tensors["x"] == ["X", False, OutputMode.EveryN, 3]
    assert opts.anchored_tensors["y"] == ["Y", False, OutputMode.All, 1]
    opts._freeze()
    with pytest.raises(AttributeError, match=FROZEN):
        opts.anchorTensor("z", "Z")


def test_reduction_type_must_be_mean_or_sum():
    training = Options().Training
    for bad in (ReductionType.NoReduction, "Sum", 0):
        with pytest.raises(ValueError, match="Mean or poptorch.ReductionType.Sum"):
            training.accumulationAndReplicationReductionType(bad)
    training.accumulationAndReplicationReductionType(ReductionType.Sum)
    assert training.accumulation_and_replication_reduction_type is ReductionType.Sum


def test_input_replica_grouping_rules():
    opts = Options().replicationFactor(4)
    with pytest.raises(ValueError, match="CommGroupType.All"):
        opts.inputReplicaGrouping(2, CommGroupType.All)
    for bad in (8, 3):  # larger than RF, not a divisor
        with pytest.raises(ValueError):
            opts.inputReplicaGrouping(bad, CommGroupType.Consecutive)
    opts.inputReplicaGrouping(2, CommGroupType.Orthogonal)
    assert (opts.input_group_size, opts.input_cgt) == (2, CommGroupType.Orthogonal)


def test_precision_partials_and_deprecated_noops(caplog):
    precision = Options().Precision
    with pytest.raises(ValueError, match="torch.float or torch.half"):
        precision.setPartialsType(torch.int32)
    precision.setPartialsType(torch.half)
    assert precision._popart_options.options["partialsTypeMatMuls"] == "half"
    assert precision._popart_options.options["convolutionOptions"] == {"partialsType": "half"}
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        precision.halfFloatCasting(0)
        precision.runningStatisticsAlwaysFloat(True)
    assert caplog.text.count("deprecated") == 2
    with pytest.raises(AssertionError):
        precision.enableFloatingPointExceptions(1)


def test_enable_profiling_records_engine_options_and_warns_on_env(monkeypatch, caplog):
    opts = Options()
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        opts.enableProfiling("/tmp/prof")
    assert "POPLAR_ENGINE_OPTIONS" not in caplog.text
    assert opts._Popart.options["engineOptions"] == {
        "debug.allowOutOfMemory": "true",
        "autoReport.directory": "/tmp/prof",
        "autoReport.all": "true",
    }
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", '{"autoReport.all": "true"}')
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        Options().enableProfiling()
    assert "POPLAR_ENGINE_OPTIONS" in caplog.text


def test_executable_caching_and_offline_target():
    opts = Options().enableExecutableCaching("/tmp/c")
    assert opts._Popart.options["cachePath"] == "/tmp/c"
    assert opts._Popart.options["enableEngineCaching"] is True
    opts.enableExecutableCaching(None)
    assert opts._Popart.options["enableEngineCaching"] is False
    opts.useOfflineIpuTarget(21)
    assert opts.connection_type == ConnectionType.Never and opts.ipu_version == 21
    with pytest.raises(AssertionError):
        opts.connectionType(2)
    with pytest.raises(AssertionError):
        opts.useIpuId("0")


def test_tensor_locations_and_io_tiles():
    locations = Options().TensorLocations
    locations.setWeightLocation(
        TensorLocationSettings()
        .useOnChipStorage(False)
        .minElementsForOffChip(4)
        .useReplicatedTensorSharding()
        .useIOTilesToLoad(False)
    )
    assert locations.location_weight == {
        "onChip": 0,
        "minElementsForOffChip": 4,
        "useReplicatedTensorSharding": 1,
        "useIOTilesToLoad": 0,
    }
    settings = TensorLocationSettings().useOnChipStorage(True).useOnChipStorage(None)
    assert settings.toDict() == {}
    with pytest.raises(AssertionError):
        locations.setOptimizerLocation({"onChip": 1})
    for bad in (10, 33, 194):
        with pytest.raises(AssertionError, match="numIOTiles must be an even number between 32"):
            locations.numIOTiles(bad)
    locations.numIOTiles(192)
    assert locations.toDict()["numIOTiles"] == 192


def test_available_memory_proportion_and_strategy():
    opts = Options().setAvailableMemoryProportion({"IPU0": 0.5, "IPU3": 0.2})
    assert opts.available_memory_proportion == {0: 0.5, 3: 0.2}
    with pytest.raises(AssertionError, match="IPU0"):
        opts.setAvailableMemoryProportion({"0": 0.5})
    with pytest.raises(AssertionError):
        opts.setExecutionStrategy("pipelined")
    strategy = ShardedExecution()
    assert opts.setExecutionStrategy(strategy)._execution_strategy is strategy


def test_max_repeat_logs_accepts_none_and_simple_setters_record():
    opts = Options().maxRepeatLogs(None).modelName("net").logDir("/tmp/l").useIpuModel(True)
    assert opts.max_repeat_logs is None and opts.model_name == "net" and opts.log_dir == "/tmp/l"
    assert opts.use_model is True
    opts.enableSyntheticData(True).logCycleCount(True)
    assert opts._Popart.options["syntheticDataMode"] == 2
    assert opts._Popart.options["instrumentWithHardwareCycleCounter"] is True


# -- environment hooks, JSON and files -------------------------------------------------------
def test_poptorch_cache_dir_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", "/tmp/envcache")
    opts = Options()
    assert opts._Popart.options["cachePath"] == "/tmp/envcache"
    assert opts._Popart.options["enableEngineCaching"] is True


def test_poptorch_default_options_environment(monkeypatch):
    monkeypatch.setenv(
        "POPTORCH_DEFAULT_OPTIONS",
        (
            '{"deviceIterations": 2, "replicationFactor": 1, "logDir": "/tmp/d",'
            ' "enableSyntheticData": true, "Precision.enableFloatingPointExceptions": true,'
            ' "connectionType": "ConnectionType.OnDemand",'
            ' "_Popart.set": ["saveInitializersToFile", "my_file.onnx"]}'
        ),
    )
    from_env = Options()
    monkeypatch.delenv("POPTORCH_DEFAULT_OPTIONS")
    by_hand = Options().deviceIterations(2).replicationFactor(1).logDir("/tmp/d")
    by_hand.enableSyntheticData(True).connectionType(ConnectionType.OnDemand)
    by_hand.Precision.enableFloatingPointExceptions(True)
    by_hand._Popart.set("saveInitializersToFile", "my_file.onnx")
    assert repr(from_env) == repr(by_hand) != repr(Options())


def test_from_json_dotted_accessors_and_enum_values():
    opts = Options().from_json(
        '{"Training.gradientAccumulation": 4,'
        ' "Training.accumulationAndReplicationReductionType": "ReductionType.Sum",'
        ' "outputMode": ["OutputMode.EveryN", 2]}'
    )
    assert opts.Training.gradient_accumulation == 4
    assert opts.Training.accumulation_and_replication_reduction_type is ReductionType.Sum
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN, 2)


def test_load_from_file(tmp_path):
    path = tmp_path / "opts.conf"
    path.write_text(
        "deviceIterations(3)\n"
        "setExecutionStrategy(poptorch.ShardedExecution())\n"
        "  replicationFactor(2)\n \n"
        "enableSyntheticData(True) # inline comment\n"
        "# a comment line\n"
        "Training.gradientAccumulation(5)\n"
    )
    opts = Options().loadFromFile(str(path))
    assert (opts.device_iterations, opts.replication_factor) == (3, 2)
    assert type(opts._execution_strategy) is ShardedExecution
    assert opts.Training.gradient_accumulation == 5
    assert opts._Popart.options["syntheticDataMode"] == 2
    # PopTorch counts the option lines only (here the second), and a syntax error applies nothing
    path.write_text("deviceIterations(4)\n\n# comment\noutputMode(poptorch.OutputMode.All\n")
    fresh = Options()
    with pytest.raises(ConfigFileError, match=r"SyntaxError at line 2 of opts.conf: ") as info:
        fresh.loadFromFile(str(path))
    assert str(info.value).endswith("\n> options.outputMode(poptorch.OutputMode.All")
    assert fresh.device_iterations == 1
    path.write_text("deviceIterations(2)\nTraining.gradientAccumulation(2.5)\n")
    with pytest.raises(AssertionError, match="gradient"):  # a setter's own error, as raised
        Options().loadFromFile(str(path))
