"""The PopTorch rules both sides read (``ipuloop.rules``), checked against the emulator."""

from __future__ import annotations

import pytest
import torch

import ipuloop.emulator as poptorch
from ipuloop import rules
from ipuloop.outputs import Layout


def opts(di=1, rf=1, ga=1, g=1):
    o = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    if g != 1:
        o.inputReplicaGrouping(g, poptorch.CommGroupType.Consecutive)
    return o


def test_host_call_factor_counts_input_groups_and_accumulation():
    assert rules.host_call_factor(opts(2, 4, 3), training=True) == 2 * 4 * 3
    assert rules.host_call_factor(opts(2, 4, 3), training=False) == 2 * 4
    assert rules.host_call_factor(opts(2, 4, 3, g=2), training=True) == 2 * 2 * 3
    assert rules.describe_factors(opts(2, 4, 3, g=2), 5, True) == (
        "micro-batch 5 x deviceIterations 2 x replicationFactor 4 / input_group_size 2 x "
        "gradientAccumulation 3 = 60 samples per host call"
    )


def test_ipu_count():
    assert rules.ipu_count_error(opts(), 4, 2) is None
    assert "= 3 is not one" in rules.ipu_count_error(opts(), 3, 1)
    assert rules.ipu_count_error(opts().autoRoundNumIPUs(True), 3, 1) is None
    assert rules.reserved_ipus(opts().autoRoundNumIPUs(True), 6) == 8
    assert rules.reserved_ipus(opts(), 6) == 6
    assert "at most 64" in rules.ipu_count_error(opts(), 128, 1)
    assert "at most 64" in rules.ipu_count_error(opts().autoRoundNumIPUs(True), 33, 2)
    assert rules.ipu_count_error(opts().useIpuModel(True), 3 * 40, 1) is None


def test_return_period():
    rules.check_return_period(2, 4)
    with pytest.raises(
        ValueError,
        match=r"must divide deviceIterations \(4\)\. Received: "
        r"output_return_period=3\. Use one of \[1, 2, 4\]",
    ):
        rules.check_return_period(3, 4)
    with pytest.raises(poptorch.Error, match="Return period must be a factor"):
        rules.check_return_period(0, 4, poptorch.Error)


@pytest.mark.parametrize("mode", [rules.ALL, rules.EVERY_N, rules.FINAL, rules.SUM])
def test_returned_rows_agree_with_the_layout(mode):
    di, ga, rf, period = 4, 2, 2, 2
    layout = Layout(di, ga, rf, mode, period)
    rows = rules.returned_rows(mode, di, ga, rf, period)
    assert layout.returned_iterations() == rules.returned_iterations(mode, di, period)
    assert layout._loss_count[0] == sum(len(r) for r in rows)
    if mode != rules.SUM:
        assert [layout.micro_batch_index(i) for i in range(len(rows))] == [r[0] for r in rows]
    else:
        assert rows == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]


def test_optimizer_hyperparameters():
    w = torch.nn.Parameter(torch.ones(2))
    opt = poptorch.optim.SGD([w], lr=torch.tensor(0.5), loss_scaling=4.0)
    snap = rules.optimizer_hyperparameters(opt)
    assert snap["groups"][0]["lr"] == 0.5 and snap["global"]["loss_scaling"] == 4.0
    assert snap == rules.optimizer_hyperparameters(opt)
    opt.param_groups[0]["lr"].fill_(0.25)  # in place, as a scheduler may
    assert snap != rules.optimizer_hyperparameters(opt)
    assert rules.optimizer_hyperparameters(torch.optim.SGD([w], lr=0.1))["global"] == {}


@pytest.mark.parametrize("text", ["soon", "0", "-1", "nan", "inf"])
def test_dist_timeout_is_a_finite_number_of_seconds_on_both_sides(text, monkeypatch):
    """One reading of IPULOOP_DIST_TIMEOUT: the loop raises ValueError, the emulator
    poptorch.Error, for the same texts."""
    env = {rules.DIST_TIMEOUT_ENV: text}
    with pytest.raises(ValueError, match="expected a number of seconds > 0"):
        rules.dist_timeout(env)
    monkeypatch.setenv(rules.DIST_TIMEOUT_ENV, text)
    from ipuloop.emulator.device.distributed import timeout_seconds

    with pytest.raises(poptorch.Error, match="expected a number of seconds > 0"):
        timeout_seconds()
    assert rules.dist_timeout({}) == rules.DEFAULT_DIST_TIMEOUT == 300.0
    assert rules.dist_timeout({rules.DIST_TIMEOUT_ENV: "2.5"}) == 2.5
