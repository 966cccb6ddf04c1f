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
