"""Emulator fidelity: what real PopTorch programs rely on beyond the training loop itself.

Plain attributes frozen when the graph is traced, phased execution, replica-grouped weights and
offline IPU targets. Each test follows PopTorch 3.4's documented behaviour (the source is cited
in its docstring); expected values come from plain torch doing the same math.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ipuloop.emulator as poptorch
from ipuloop.emulator import (CommGroupType, Liveness, ParallelPhasedExecution, Phase,
                              SerialPhasedExecution, Stage, VariableRetrievalMode)


# -- phased execution: a memory and scheduling plan, the unsplit model's arithmetic -----------
class Phased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, y):
        poptorch.Block.useAutoId()
        for layer in self.layers[:-1]:
            with poptorch.Block():  # ids "0", "1", "2"
                x = torch.relu(layer(x))
        with poptorch.Block():  # "3"
            x = self.layers[-1](x)
            return x, nn.functional.mse_loss(x, y)


def _parallel() -> ParallelPhasedExecution:
    strategy = ParallelPhasedExecution(Phase(Stage("0"), Stage("1")), Phase(Stage("2"), Stage("3")))
    strategy.phase(0).ipus(0, 2)
    strategy.phase(1).ipus(1, 3)
    return strategy.sendTensorsOffChipAfterFwd()


def _serial(liveness: Liveness) -> SerialPhasedExecution:
    strategy = SerialPhasedExecution(["0", "1"], ["2"], [Stage("3")])
    for block in "0123":
        strategy.stage(block).ipu(int(block) % 2)
    return strategy.setTensorsLiveness(liveness).useSeparateBackwardPhase()


@pytest.mark.parametrize("strategy", [_parallel, lambda: _serial(Liveness.OffChipAfterEachPhase),
                                      lambda: _serial(Liveness.AlwaysLive)],
                         ids=["parallel", "serial-offchip-each-phase", "serial-always-live"])
def test_phased_execution_trains_as_the_unsplit_model(strategy):
    """SerialPhasedExecution and ParallelPhasedExecution (Phase, Stage, Liveness,
    useSeparateBackwardPhase) decide where weights and activations live between phases; the
    result is the model's own (PopTorch 3.4 python/options.py _IPhasedExecution,
    ParallelPhasedExecution, SerialPhasedExecution; docs/user_guide/phased_execution.py).
    The IPUs counted are those the stages name (popart_compiler CompilerImpl::createDevice)."""
    torch.manual_seed(0)
    net = Phased()
    start = copy.deepcopy(net)
    opts = poptorch.Options().setExecutionStrategy(strategy())
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)) for _ in range(3)]
    for x, y in data:
        model(x, y)
    opt = torch.optim.SGD(start.parameters(), lr=0.1)
    for x, y in data:
        start(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(net.parameters(), start.parameters()):
        torch.testing.assert_close(p, q)
    assert model.num_ipus == (4 if isinstance(opts._execution_strategy,
                                              ParallelPhasedExecution) else 2)


def test_phased_execution_checks_phases_against_ipus():
    """PopTorch's checks while tracing a phased model (popart_compiler Compiler.cpp
    Compiler::setActiveIpu; python/options.py _IPhasedExecution's PhaseManager.getStage): in
    parallel, even phases on even IPUs and odd phases on odd IPUs; a block in no phase is an
    unknown block; a stage with no IPU cannot be placed."""
    x, y = torch.ones(1, 4), torch.ones(1, 4)

    def compile_with(strategy):
        opts = poptorch.Options().setExecutionStrategy(strategy)
        poptorch.inferenceModel(Phased(), opts).compile(x, y)

    wrong = ParallelPhasedExecution(Phase(Stage("0"), Stage("1")), Phase(Stage("2"), Stage("3")))
    wrong.phase(0).ipus(0, 2)
    wrong.phase(1).ipus(2, 3)  # phase 1 on IPU 2
    with pytest.raises(poptorch.Error, match=r"When phases are executed in parallel: even phases "
                       r"must run on even IPUs and odd phases on odd IPUs\. Received: block '2' "
                       r"in phase 1 on IPU 2"):
        compile_with(wrong)
    missing = SerialPhasedExecution(["0", "1"], ["2"])  # no phase has block "3"
    for block in "012":
        missing.stage(block).ipu(0)
    with pytest.raises(AssertionError, match=r"Unknown Block '3' list of expected Blocks"):
        compile_with(missing)
    with pytest.raises(poptorch.Error, match=r"block '0' \(phase 0\) has no IPU"):
        compile_with(SerialPhasedExecution(["0", "1"], ["2", "3"]))
    with pytest.raises(AssertionError, match="associated with more than one stage"):
        SerialPhasedExecution(["0"], ["0", "1"])


# -- offline IPU targets ----------------------------------------------------------------------
def test_offline_target_takes_the_documented_ipu_versions():
    """``useOfflineIpuTarget(ipu_version)`` targets 1 (Mk1), 2 (Mk2) or 21 (Mk2 with FP8
    support) (PopTorch 3.4 python/options.py Options.useOfflineIpuTarget); an offline target
    is a Poplar device of its own, not the IPU Model nor a given IPU id (popart_compiler
    CompilerImpl::createDevice)."""
    for version in (1, 2, 21):
        opts = poptorch.Options().useOfflineIpuTarget(version)
        assert opts.ipu_version == version and opts.connection_type == 2
    for version in (3, 0, True, "2"):
        with pytest.raises(ValueError, match=r"ipu_version must be 1 \(Mk1\), 2 \(Mk2\) or 21"):
            poptorch.Options().useOfflineIpuTarget(version)
    x = torch.ones(1, 2)
    model = poptorch.inferenceModel(nn.Linear(2, 1), poptorch.Options().useOfflineIpuTarget()
                                    .useIpuModel(True))
    with pytest.raises(poptorch.Error, match=r"^ConnectionType.Never / poptorch.Options."
                       "useOfflineIpuTarget not supported for the IPU model"):
        model.compile(x)
    model = poptorch.inferenceModel(nn.Linear(2, 1), poptorch.Options().useOfflineIpuTarget()
                                    .useIpuId(1))
    with pytest.raises(poptorch.Error, match="^Offline compilation targeting a specific id not "
                       "supported"):
        model.compile(x)
