"""device/checks.py: what PopTorch's compiler checks, driven by hand on small traces: finding
the one final loss, a host tensor meeting the graph's, writes to parameters and buffers, and
the checks of a compiled model outside the trace. Programs under them are in
``test_emulator_fidelity_checks.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipuloop.emulator as poptorch
from ipuloop.emulator.device import checks
from ipuloop.emulator.errors import Error


def trace(model: nn.Module, *inputs, training: bool = True):
    """``model(*inputs)`` traced as the executor traces it: (the checks, the outputs)."""
    mode = checks.TraceChecks([model], list(inputs), training)
    with mode:
        out = model(*inputs)
    return mode, out if isinstance(out, tuple) else (out,)


class TwoLosses(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.how = how

    def forward(self, x, y):
        out = self.lin(x)
        first = F.mse_loss(out, y)
        second = F.l1_loss(out, y)
        if self.how == "folded":  # the first feeds the second: one final loss
            return out, poptorch.identity_loss(first + second, reduction="none")
        if self.how == "dead":  # the first feeds no output: dead code
            return out, second
        if self.how == "unreturned":  # the outputs use the loss without returning it
            return (out * second,)
        return out, first, second  # independent


def test_the_one_final_loss_is_found():
    x, y = torch.ones(3, 2), torch.zeros(3, 2)
    mode, outs = trace(TwoLosses("folded"), x, y)
    assert mode.find_loss(list(outs)) == (1, 2)  # output 1; the third loss made
    mode, outs = trace(TwoLosses("dead"), x, y)
    assert mode.find_loss(list(outs)) == (1, 1)
    mode, outs = trace(TwoLosses("unreturned"), x, y)
    assert mode.find_loss(list(outs)) == (None, 1)  # taken from each forward (LossCapture)


def test_no_loss_or_independent_losses_are_refused():
    x, y = torch.ones(3, 2), torch.zeros(3, 2)
    mode, outs = trace(TwoLosses("independent"), x, y)
    with pytest.raises(Error, match="Multiple independent losses found in graph"):
        mode.find_loss(list(outs))
    mode, outs = trace(nn.Linear(2, 2), x)
    with pytest.raises(Error, match="Couldn't find a loss in graph"):
        mode.find_loss(list(outs))


def test_a_host_tensor_meeting_the_graph_s_is_refused_with_its_description():
    class Offset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) + torch.LongTensor([1, 2])  # a legacy constructor: host's

    with pytest.raises(Error, match=r"tensor\(device=cpu, shape=\[2\], dtype=Long\)"):
        trace(Offset(), torch.ones(1, 2), training=False)


def test_ops_on_host_tensors_alone_and_factories_are_the_graph_s():
    class Fine(nn.Module):
        def forward(self, x):
            host = torch.LongTensor([1, 2]) * 2  # host tensors alone: run on the host
            return x + torch.ones(2) + host.float().to(x.device)

    mode, (out,) = trace(Fine(), torch.ones(2), training=False)
    assert out.tolist() == [4.0, 6.0] and mode.updated == []


def test_in_place_writes_are_named_and_refused_with_broadcast_buffers():
    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count += 1
            return x * 2

    mode, _ = trace(Counts(), torch.ones(1), training=False)
    assert mode.updated == ["count"]
    checks.check_replicated_updates(mode, poptorch.Options())  # one replica: fine
    replicas = poptorch.Options().replicationFactor(2)
    with pytest.raises(Error, match="does not support broadcasting buffers.*: count"):
        checks.check_replicated_updates(mode, replicas)
    checks.check_replicated_updates(mode, replicas.broadcastBuffers(False))


def test_batch_norm_statistics_are_not_writes():
    mode, _ = trace(nn.BatchNorm1d(2), torch.randn(4, 2), training=False)
    assert mode.updated == []


def test_a_parameter_reassigned_or_removed_by_forward_is_refused():
    model = nn.Linear(1, 1)
    before = checks.tensor_addresses(model)
    checks.check_addresses(before, checks.tensor_addresses(model))
    model.weight = nn.Parameter(torch.zeros(1, 1))
    with pytest.raises(Error, match="Parameter weight is reassigned within the model"):
        checks.check_addresses(before, checks.tensor_addresses(model))
    other = nn.Linear(1, 1)
    before = checks.tensor_addresses(other)
    del other.bias
    with pytest.raises(Error, match="Parameter bias is removed from the model"):
        checks.check_addresses(before, checks.tensor_addresses(other))


def test_backward_on_outputs_is_forbidden():
    out = checks.forbid_backward({"a": (torch.ones(1, requires_grad=True) * 2,)})
    with pytest.raises(Error, match="backward\\(\\) cannot be called explicitly"):
        out["a"][0].backward()


def test_updatable_buffers_must_be_the_model_s():
    model = nn.BatchNorm1d(2)
    opts = poptorch.Options()
    opts.updatableNamedBuffers(["running_mean"])
    checks.check_updatable_buffers(opts, model)
    opts.updatableNamedBuffers(["running_mean", "nope"])
    with pytest.raises(Error, match=r"names \['nope'\], which are not buffers"):
        checks.check_updatable_buffers(opts, model)


def test_cycle_counts_need_hardware():
    checks.check_options(poptorch.Options())
    with pytest.raises(Error, match="Cycle count logging is only supported on actual IPU"):
        checks.check_options(poptorch.Options().logCycleCount(True))


def test_for_loop_and_cond_are_refused_in_a_training_trace_only():
    checks.note_inference_only("for_loop", "Unroll it.")  # no trace running: nothing
    with checks.TraceChecks([], [], training=False):
        checks.note_inference_only("for_loop", "Unroll it.")
    with checks.TraceChecks([], [], training=True), pytest.raises(
        Error, match="for_loop is only supported in inference. Unroll it."
    ):
        checks.note_inference_only("for_loop", "Unroll it.")
