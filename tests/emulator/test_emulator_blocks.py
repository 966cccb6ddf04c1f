"""Block / BeginBlock / strategies and the stage tracer: docs/poptorch-semantics.md §5, §8.11."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ipuloop.emulator.blocks import (
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
    removeBlocks,
    trace_stages,
)
from ipuloop.emulator.errors import Error


def run_blocks(strategy, *blocks, code_before=False):
    """Enter Block(user_id, ipu_id) for each (user_id, ipu_id) pair, running an op in each."""
    x = torch.ones(2)
    with trace_stages(strategy) as trace:
        if code_before:
            x = x + 1
        for user_id, ipu_id in blocks:
            with Block(user_id, ipu_id):
                x = x * 2
    return trace


class FourStageModel(nn.Module):
    """The pipelining tutorial's shape: four layers annotated with BeginBlock on IPUs 0..3."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        for ipu, layer in enumerate(self.layers):
            BeginBlock(layer, ipu_id=ipu)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


# -- outside tracing: no-ops -------------------------------------------------------------------
def test_annotations_are_no_ops_outside_tracing():
    torch.manual_seed(0)
    model = FourStageModel()
    plain = nn.Sequential(*[nn.Sequential(layer, nn.ReLU()) for layer in model.layers])
    x = torch.randn(3, 4)
    assert torch.equal(model(x), plain(x))
    with Block("A", ipu_id=5) as block:
        assert isinstance(block, Block)
    Block.useAutoId()
    Block.start("B", 3)

    @BlockFunction("C", ipu_id=1)
    def double(t):
        return 2 * t

    assert torch.equal(double(x), 2 * x) and double.__name__ == "double"
    assert Block._trace is None


# -- F counting --------------------------------------------------------------------------------
def test_tutorial_four_stage_model_has_four_forward_stages():
    model = FourStageModel()
    with trace_stages(PipelinedExecution()) as trace:
        model(torch.randn(2, 4))
    assert trace.num_forward_stages == 4
    assert trace.ipus == {0, 1, 2, 3} and trace.is_pipelined
    assert [stage for _, stage, _ in trace.blocks] == [0, 1, 2, 3]
    with trace_stages(PipelinedExecution()) as again:  # a second trace starts from scratch
        model(torch.randn(2, 4))
    assert again.num_forward_stages == 4 and len(again.blocks) == 4


def test_consecutive_blocks_on_one_ipu_merge():
    trace = run_blocks(PipelinedExecution(), ("a", 0), ("b", 0), ("c", 1), ("d", 1))
    assert trace.num_forward_stages == 2 and trace.ipus == {0, 1}


def test_revisiting_an_ipu_adds_a_stage():
    trace = run_blocks(PipelinedExecution(AutoStage.AutoIncrement), ("a", 0), ("b", 1), ("c", 0))
    assert trace.num_forward_stages == 3 and trace.ipus == {0, 1}
    assert [stage for _, stage, _ in trace.blocks] == [1, 2, 3]


def test_same_as_ipu_revisit_is_not_ascending_when_pipelined_but_fine_when_sharded():
    with pytest.raises(Error, match="ascending order"):
        run_blocks(PipelinedExecution(), ("a", 0), ("b", 1), ("c", 0))
    trace = run_blocks(ShardedExecution(), ("a", 0), ("b", 1), ("c", 0))
    assert trace.num_forward_stages == 3 and not trace.is_pipelined


def test_counter_starts_at_ipu_zero_and_ipu_zero_counts_only_if_used():
    no_code_before = run_blocks(PipelinedExecution(), ("a", 1), ("b", 2))
    assert no_code_before.num_forward_stages == 3 and no_code_before.ipus == {1, 2}
    code_before = run_blocks(PipelinedExecution(), ("a", 1), ("b", 2), code_before=True)
    assert code_before.num_forward_stages == 3 and code_before.ipus == {0, 1, 2}
    with trace_stages(PipelinedExecution()) as no_blocks:
        torch.ones(2) + 1
    assert no_blocks.num_forward_stages == 1 and no_blocks.ipus == {0}


def test_same_as_ipu_requires_an_ipu_id():
    with pytest.raises(
        AssertionError, match="SameAsIpu was selected but no IPU was specified for block b"
    ):
        run_blocks(PipelinedExecution(AutoStage.SameAsIpu), ("a", 0), ("b", None))


def test_auto_increment_without_ipu_ids_uses_stage_ids():
    trace = run_blocks(PipelinedExecution(AutoStage.AutoIncrement), (None, None), (None, None))
    assert trace.blocks == [("0", 1, 1), ("1", 2, 2)]
    assert trace.num_forward_stages == 3  # IPU 0 -> 1 -> 2


# -- explicit stages -------------------------------------------------------------------------
def test_explicit_stages_by_position_and_stage_ipu_override():
    strategy = PipelinedExecution("A", ["B", "C"], Stage("D").ipu(3))
    trace = run_blocks(strategy, ("A", None), ("B", None), ("C", 7), ("D", 0))
    # IPU = Stage.ipu if set, else the block's ipu_id, else the stage id
    assert trace.blocks == [("A", 0, 0), ("B", 1, 1), ("C", 1, 7), ("D", 2, 3)]
    assert trace.num_forward_stages == 4 and trace.ipus == {0, 1, 3, 7}
    assert strategy.stage("C").blocks == ("B", "C")


def test_explicit_stages_reject_unknown_and_duplicated_blocks():
    with pytest.raises(AssertionError, match="Unknown Block 'Z'"):
        run_blocks(PipelinedExecution("A", "B"), ("A", None), ("Z", None))
    with pytest.raises(AssertionError, match="A associated with more than one stage"):
        PipelinedExecution("A", Stage("B", "A"))
    with pytest.raises(Error, match="ascending order"):
        run_blocks(PipelinedExecution("A", "B"), ("B", None), ("A", None))
    with pytest.raises(AssertionError):
        Stage("A", 1)
    with pytest.raises(AssertionError):
        Stage("A").ipu("1")


# -- annotations ---------------------------------------------------------------------------
def test_begin_block_twice_is_an_error_until_remove_blocks():
    layer = nn.Linear(2, 2)
    assert BeginBlock(layer, "x", ipu_id=1) is layer
    with pytest.raises(Error, match="already been assigned to a block"):
        BeginBlock(layer, "y", ipu_id=2)
    model = nn.Sequential(layer)
    removeBlocks(model)
    assert not layer._forward_pre_hooks
    with trace_stages(PipelinedExecution()) as trace:
        model(torch.ones(1, 2))
    assert trace.blocks == []
    BeginBlock(layer, "y", ipu_id=2)
    with pytest.raises(Error, match="not an instance of torch.nn.Module"):
        BeginBlock(3)


def test_begin_block_keeps_its_auto_id_and_legacy_callables_work():
    layer = nn.Linear(2, 2)
    BeginBlock(layer, ipu_id=1)
    fn = BeginBlock(lambda t: t + 1, ipu_id=2)
    with trace_stages(ShardedExecution()) as trace:  # block "0" is revisited
        layer(fn(layer(torch.ones(1, 2))))
    assert [(b, ipu) for b, _, ipu in trace.blocks] == [("0", 1), ("1", 2), ("0", 1)]


def test_block_function_and_use_auto_id():
    @BlockFunction(ipu_id=1)
    def f(t):
        return t * 3

    with trace_stages(ShardedExecution(AutoStage.AutoIncrement)) as trace:
        with Block(ipu_id=0):
            x = torch.ones(1)
        f(x)
        Block.useAutoId()
        with Block(ipu_id=2):
            pass
    assert [b for b, _, _ in trace.blocks] == ["0", "1", "0"]
    assert [stage for _, stage, _ in trace.blocks] == [1, 2, 1]  # "0" is the same block again


def test_trace_state_is_restored_after_an_exception():
    with pytest.raises(RuntimeError):
        with trace_stages(PipelinedExecution()):
            raise RuntimeError("boom")
    assert Block._trace is None


def test_block_argument_types_are_checked():
    with pytest.raises(TypeError, match="user_id"):
        Block(3.0)
    with pytest.raises(TypeError, match="ipu_id"):
        BlockFunction("a", ipu_id=-1)


# -- strategies ------------------------------------------------------------------------------
def test_strategies_backend_options():
    assert PipelinedExecution().backendOptions() == {"execution_mode": 0}
    assert ShardedExecution("A").backendOptions() == {"execution_mode": 1}
    serial = SerialPhasedExecution(Phase(Stage("A"), Stage("B")), ["C"])
    parallel = ParallelPhasedExecution(Phase("A"), Phase("B")).sendTensorsOffChipAfterFwd()
    assert serial.backendOptions()["serial_phases_execution"] is True
    assert parallel.backendOptions()["tensors_liveness"] == 1
    assert serial.stage("C").blocks == ("C",) and serial.phase(1).stages[0].blocks == ("C",)
    with pytest.raises(AssertionError, match="no AutoStage for PhasedExecution"):
        SerialPhasedExecution()
