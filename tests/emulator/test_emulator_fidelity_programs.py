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
from ipuloop.emulator import (
    CommGroupType,
    Liveness,
    ParallelPhasedExecution,
    Phase,
    SerialPhasedExecution,
    Stage,
    VariableRetrievalMode,
)


# -- plain tensor attributes: constants of the traced graph ----------------------------------
class Counter(nn.Module):
    def __init__(self, buffer: bool) -> None:
        super().__init__()
        if buffer:
            self.register_buffer("i", torch.tensor([0.0]))
        else:
            self.i = torch.tensor([0.0])

    def forward(self):
        self.i += 1
        return self.i


def test_plain_tensor_attribute_is_a_constant_frozen_at_trace():
    """A plain tensor attribute's value is captured when the graph is built: ``self.i += 1``
    returns [1.] on every call, and the host attribute is left as the trace left it; a
    registered buffer counts on (PopTorch 3.4 docs/user_guide/buffers.py and overview.rst
    "PyTorch buffers"; python/_poplar_executor.py PoplarExecutor._compileWithDispatch moves
    only parameters and buffers to the IPU)."""
    plain = Counter(buffer=False)
    model = poptorch.inferenceModel(plain)
    assert [model().tolist() for _ in range(3)] == [[1.0], [1.0], [1.0]]
    assert plain.i.tolist() == [1.0]

    counted = Counter(buffer=True)
    model = poptorch.inferenceModel(counted)
    assert [model().tolist() for _ in range(3)] == [[1.0], [2.0], [3.0]]
    model.copyWeightsToHost()
    assert counted.i.tolist() == [3.0]


class Stateful(nn.Module):
    """Python-side state of all kinds that ``forward`` changes (in a submodule too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.t = torch.zeros(1)
        self.calls = 0
        self.history: list = [torch.zeros(1)]
        self.table = {"scale": torch.ones(1)}
        self.inner = nn.Module()
        self.inner.count = torch.zeros(1)

    def forward(self, x, y):
        self.t = self.t + 1  # rebinding
        self.calls += 1  # a Python number
        self.history[0].add_(1)  # in place, inside a list
        self.history.append(x.sum().detach())  # the list itself
        self.table["scale"] = self.table["scale"] * 3  # an entry of a dict
        self.inner.count += 1  # a submodule's, in place
        self.last_input = x  # an attribute forward adds
        shift = (self.t + self.history[0] + self.table["scale"] + self.inner.count).to(x.device)
        out = self.fc(x) + shift
        return out, nn.functional.mse_loss(out, y)


def test_state_forward_changes_is_changed_once_and_every_micro_batch_sees_the_trace_values():
    """PopTorch runs ``forward``'s Python once, to trace it, and each call (each of its
    micro-batches) runs the graph: tensors and other plain attributes read as constants with
    their values when traced, and whatever the trace changed on the host stays as the trace
    left it (PopTorch 3.4 docs/user_guide/buffers.py; python/_poplar_executor.py
    PoplarExecutor._compileWithDispatch traces once, PoplarExecutor.__call__ runs the
    executable). Training: the constant shift is 1 + 1 + 3 + 1 = 6 in every micro-batch."""
    torch.manual_seed(0)
    net = Stateful()
    start = copy.deepcopy(net.fc)
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    calls = [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    for x, y in calls:
        out, _ = model(x, y)

    ref = copy.deepcopy(start)  # plain torch: the same updates with the constant shift 6
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in calls:
        for d in range(2):
            for a in range(2):
                i = d * 2 + a
                last = ref(x[i : i + 1]) + 6
                (nn.functional.mse_loss(last, y[i : i + 1]) / 2).backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(net.fc.weight, ref.weight)
    torch.testing.assert_close(net.fc.bias, ref.bias)
    torch.testing.assert_close(out, last.detach())  # Final: the call's last micro-batch
    # the host's state as the trace left it, once
    assert net.t.tolist() == [1.0] and net.calls == 1 and net.history[0].tolist() == [1.0]
    assert len(net.history) == 2 and net.table["scale"].tolist() == [3.0]
    assert net.inner.count.tolist() == [1.0] and net.last_input.shape == (1, 2)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.scale = torch.tensor([2.0])

    def forward(self, x):
        return self.fc(x) * self.scale.to(x.device)


def test_host_changes_to_a_tensor_constant_after_compile_do_not_reach_the_graph():
    """The graph holds the value the attribute had when traced: rebinding the host attribute
    later leaves the compiled model's result unchanged (PopTorch 3.4 overview.rst "PyTorch
    buffers": the dispatcher freezes the value as a constant)."""
    net = Scaled()
    model = poptorch.inferenceModel(net)
    x = torch.ones(3, 2)
    before = model(x)
    net.scale = torch.tensor([100.0])
    torch.testing.assert_close(model(x), before)
    torch.testing.assert_close(before, net.fc(x).detach() * 2)
    assert net.scale.tolist() == [100.0]  # the host keeps its own value


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


@pytest.mark.parametrize(
    "strategy",
    [
        _parallel,
        lambda: _serial(Liveness.OffChipAfterEachPhase),
        lambda: _serial(Liveness.AlwaysLive),
    ],
    ids=["parallel", "serial-offchip-each-phase", "serial-always-live"],
)
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
    assert model.num_ipus == (
        4 if isinstance(opts._execution_strategy, ParallelPhasedExecution) else 2
    )


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
    with pytest.raises(
        poptorch.Error,
        match=r"When phases are executed in parallel: even phases "
        r"must run on even IPUs and odd phases on odd IPUs\. Received: block '2' "
        r"in phase 1 on IPU 2",
    ):
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


# -- replica-grouped weights -----------------------------------------------------------------
class MatMulLoss(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.W = nn.Parameter(w)

    def forward(self, x):
        z = x @ self.W
        return z, poptorch.identity_loss(z**2, reduction="mean")


@pytest.mark.parametrize(
    "input_type,weight_type",
    [
        (CommGroupType.Consecutive, CommGroupType.Orthogonal),
        (CommGroupType.Orthogonal, CommGroupType.Consecutive),
    ],
    ids=["consecutive-input", "orthogonal-input"],
)
def test_replica_grouped_weights_train_each_group_on_its_own_slice(input_type, weight_type):
    """PopTorch's per-replica variables: ``W`` of shape [groups, 40, 14] split 4 ways across 8
    replicas in groups of 2, the input split 2 ways (inputReplicaGrouping); each group's
    gradient is all-reduced within the group, so 4 steps equal plain torch on the unsplit
    [40, 56] weight, and the host tensor holds one slice per group (OnePerGroup) (PopTorch 3.4
    tests/replicated_graph_test.py test_per_replica_variables, docs/user_guide/
    replica_grouped_weights.py; python/_poplar_executor.py PoplarExecutor.__getattr__ and
    _compileWithDispatch)."""
    shards, data_shards = 4, 2
    g = torch.Generator().manual_seed(100)
    x = torch.randn(24, 40, generator=g)
    w = torch.randn(40, 56, generator=g) * (5 * 8) ** -0.5
    full = nn.Parameter(w.clone())
    opt = torch.optim.SGD([full], lr=0.01)
    losses = []
    for _ in range(4):
        loss = ((x @ full) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    net = MatMulLoss(w.reshape(40, shards, 14).transpose(0, 1).contiguous())
    opts = poptorch.Options().replicationFactor(shards * data_shards)
    opts.inputReplicaGrouping(shards, input_type).outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))
    model.W.replicaGrouping(weight_type, data_shards, VariableRetrievalMode.OnePerGroup)
    got = [model(x.reshape(data_shards, 12, 40))[1].sum().item() / 8 for _ in range(4)]
    assert got == pytest.approx(losses, abs=1e-6)
    torch.testing.assert_close(
        net.W.detach().transpose(0, 1).reshape(40, 56), full.detach(), atol=1e-6, rtol=0
    )
    assert net.W.shape == (shards, 40, 14)


class Product(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.W = nn.Parameter(w)

    def forward(self, x):
        return x @ self.W


class Regress(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.W = nn.Parameter(w)

    def forward(self, x, y):
        return nn.functional.mse_loss(x @ self.W, y)


def test_replica_grouped_weights_match_a_per_group_reference_with_adam_and_accumulation():
    """Each group's slice is updated from the gradients of that group's replicas only (summed,
    then divided by GA x RF under the Mean reduction, as every weight is), with the optimizer's
    state one slice per group (PopTorch 3.4 tests/replicated_graph_test.py
    test_per_replica_variables_no_grouping; popart VariableSettings: the host shape is
    [groups, *shape])."""
    rf, ga = 4, 2
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 3, 2, generator=g)  # Consecutive groups of 2: {0, 1}, {2, 3}
    calls = [
        (torch.randn(ga * rf * 2, 3, generator=g), torch.randn(ga * rf * 2, 2, generator=g))
        for _ in range(3)
    ]
    net = Regress(w.clone())
    opts = poptorch.Options().replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    optimizer = poptorch.optim.Adam(net.parameters(), lr=0.1)
    model = poptorch.trainingModel(net, opts, optimizer)
    model.W.replicaGrouping(CommGroupType.Consecutive, 2, VariableRetrievalMode.OnePerGroup)
    for x, y in calls:
        model(x, y)

    full = nn.Parameter(w.clone())  # plain torch: the same per-group math
    ref_opt = torch.optim.Adam([full], lr=0.1)
    for x, y in calls:
        xs, ys = x.split(2), y.split(2)  # micro-batches in [GA, RF] order
        total = sum(
            nn.functional.mse_loss(xs[a * rf + r] @ full[r // 2], ys[a * rf + r])
            for a in range(ga)
            for r in range(rf)
        )
        (total / (ga * rf)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(net.W.detach(), full.detach())
    assert optimizer.state_dict()["state"][0]["exp_avg"].shape == (2, 3, 2)  # the device's


def test_replica_grouped_weights_in_inference_and_the_weight_copies():
    """An inference model's replica r computes with its group's slice (NoGrouping: each
    replica its own, as PopTorch's KGE programs use); ``copyWeightsToDevice`` uploads every
    slice, ``copyWeightsToHost`` reads one per group; ``executor.W`` offers the parameter's
    attributes; inputReplicaGrouping's NoGrouping is groups of 1 (PopTorch 3.4
    python/_poplar_executor.py PoplarExecutor.__getattr__ ReplicaGroupingWrapper,
    copyWeightsToDevice, copyWeightsToHost; python/options.py inputReplicaGrouping)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(4, 3, 2, generator=g)
    net = Product(w.clone())
    opts = poptorch.Options().replicationFactor(4).inputReplicaGrouping(3, CommGroupType.NoGrouping)
    model = poptorch.inferenceModel(net, opts)
    model.W.replicaGrouping(CommGroupType.NoGrouping, 0, VariableRetrievalMode.AllReplicas)
    assert model.W.shape == (4, 3, 2)
    x = torch.randn(8, 3, generator=g)
    expected = torch.cat([x[2 * r : 2 * r + 2] @ w[r] for r in range(4)])
    torch.testing.assert_close(model(x), expected)
    with torch.no_grad():
        net.W[2] += 1  # host edit: reaches the device on copyWeightsToDevice
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x)[4:6], x[4:6] @ (w[2] + 1))
    with torch.no_grad():
        net.W.zero_()
    model.copyWeightsToHost()
    torch.testing.assert_close(
        net.W.detach(), w + torch.tensor([0.0, 0.0, 1.0, 0.0])[:, None, None]
    )


def test_replica_grouping_checks():
    """What a compile of grouped weights checks (PopTorch 3.4 python/_poplar_executor.py
    _compileWithDispatch "Scalars cannot be passed as per-replica weight tensor values"; popart
    VariableSettings::shapeOnReplica: the first dimension must be the number of groups);
    CommGroupType.All gives every replica the same value (python/enums.py CommGroupType)."""
    opts = poptorch.Options().replicationFactor(4)
    model = poptorch.inferenceModel(Product(torch.ones(3, 3, 2)), opts)
    with pytest.raises(
        poptorch.Error,
        match=r"needs shape \[2, \.\.\.\] for 2 groups .* "
        r"Received: shape \[3, 3, 2\]",
    ):
        model.W.replicaGrouping(CommGroupType.Orthogonal, 2, VariableRetrievalMode.OnePerGroup)
    with pytest.raises(ValueError, match="must divide replicationFactor"):
        model.W.replicaGrouping(CommGroupType.Consecutive, 3, VariableRetrievalMode.OnePerGroup)
    pairs = poptorch.inferenceModel(Product(torch.ones(2, 3, 2)), opts)
    with pytest.raises(poptorch.Error, match=r"AllReplicas returns one value per replica \(4\)"):
        pairs.W.replicaGrouping(CommGroupType.Consecutive, 2, VariableRetrievalMode.AllReplicas)
    scalar = poptorch.inferenceModel(Product(torch.tensor(1.0)), opts)
    with pytest.raises(poptorch.Error, match="Scalars cannot be passed as per-replica weight"):
        scalar.W.replicaGrouping(CommGroupType.NoGrouping, 0, VariableRetrievalMode.OnePerGroup)

    net = Regress(torch.randn(4, 3, 2))
    lamb = poptorch.trainingModel(net, opts, poptorch.optim.LAMB(net.parameters(), lr=0.1))
    lamb.W.replicaGrouping(CommGroupType.NoGrouping, 0, VariableRetrievalMode.OnePerGroup)
    with pytest.raises(poptorch.Error, match="replicaGrouping with LAMB or max_grad_norm"):
        lamb(torch.ones(8, 3), torch.ones(8, 2))

    shared = Product(torch.randn(3, 2))
    model = poptorch.inferenceModel(shared, opts)
    model.W.replicaGrouping(CommGroupType.All, 0, VariableRetrievalMode.OnePerGroup)
    x = torch.randn(8, 3)
    torch.testing.assert_close(model(x), x @ shared.W.detach())


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
    model = poptorch.inferenceModel(
        nn.Linear(2, 1), poptorch.Options().useOfflineIpuTarget().useIpuModel(True)
    )
    with pytest.raises(
        poptorch.Error,
        match=r"^ConnectionType.Never / poptorch.Options."
        "useOfflineIpuTarget not supported for the IPU model",
    ):
        model.compile(x)
    model = poptorch.inferenceModel(
        nn.Linear(2, 1), poptorch.Options().useOfflineIpuTarget().useIpuId(1)
    )
    with pytest.raises(
        poptorch.Error, match="^Offline compilation targeting a specific id not supported"
    ):
        model.compile(x)
