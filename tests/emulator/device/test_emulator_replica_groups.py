"""device/replica_groups.py: which replicas share a weight's value under each
``CommGroupType`` (PopTorch's python/enums.py), and what ``check_setting`` refuses, in closed
form. Training with grouped weights is in ``test_emulator_fidelity_programs.py``."""

from __future__ import annotations

import pytest
import torch

from ipuloop.emulator.device.replica_groups import check_setting, replica_groups
from ipuloop.emulator.enums import CommGroupType, VariableRetrievalMode
from ipuloop.emulator.errors import Error

ONE = VariableRetrievalMode.OnePerGroup
ALL = VariableRetrievalMode.AllReplicas


@pytest.mark.parametrize(
    "comm,shards,groups",
    [
        (CommGroupType.All, 0, None),  # one value for every replica
        (CommGroupType.NoGrouping, 0, [0, 1, 2, 3, 4, 5]),  # each replica its own
        (CommGroupType.Consecutive, 2, [0, 0, 1, 1, 2, 2]),  # groups of 2 neighbours
        (CommGroupType.Consecutive, 3, [0, 0, 0, 1, 1, 1]),
        (CommGroupType.Orthogonal, 2, [0, 1, 2, 0, 1, 2]),  # {0, 3}, {1, 4}, {2, 5}
        (CommGroupType.Orthogonal, 3, [0, 1, 0, 1, 0, 1]),  # {0, 2, 4}, {1, 3, 5}
        (CommGroupType.Consecutive, 1, [0, 1, 2, 3, 4, 5]),  # groups of one
    ],
)
def test_the_group_of_each_replica(comm, shards, groups):
    assert replica_groups((comm, shards, ONE), 6) == groups


def test_check_setting_returns_the_number_of_groups():
    setting = (CommGroupType.Orthogonal, 2, ONE)
    assert check_setting("w", torch.zeros(2, 5), setting, 4) == 2
    assert check_setting("w", torch.tensor(1.0), (CommGroupType.All, 0, ONE), 4) == 1
    assert check_setting("w", torch.zeros(4, 1), (CommGroupType.NoGrouping, 0, ALL), 4) == 4


@pytest.mark.parametrize(
    "param,setting,error,match",
    [
        (
            torch.zeros(3, 2),
            (CommGroupType.Orthogonal, 2, ONE),
            Error,
            r"needs shape \[2, \.\.\.\]",
        ),
        (torch.zeros(2), (CommGroupType.Consecutive, 3, ONE), ValueError, "must divide"),
        (torch.zeros(2), (CommGroupType.Consecutive, True, ONE), ValueError, "must divide"),
        (torch.tensor(1.0), (CommGroupType.NoGrouping, 0, ONE), Error, "Scalars cannot be"),
        (torch.zeros(2), (CommGroupType.Consecutive, 2, ALL), Error, r"per replica \(4\)"),
        (torch.zeros(2), ("Consecutive", 2, ONE), ValueError, "must be a poptorch.CommGroupType"),
        (torch.zeros(2), (CommGroupType.All, 0, "one"), ValueError, "VariableRetrievalMode"),
    ],
)
def test_check_setting_refuses(param, setting, error, match):
    with pytest.raises(error, match=match) as info:
        check_setting("layer.w", param, setting, 4)
    assert str(info.value).startswith("layer.w.replicaGrouping(") or "Scalars" in match
