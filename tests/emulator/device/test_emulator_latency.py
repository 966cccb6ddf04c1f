"""device/latency.py: PopTorch's ``_computeLatency`` over a host call's timestamps, in
closed form (``tests/emulator/test_emulator_executor.py`` checks ``getLatency`` on timed calls)."""

from __future__ import annotations

import pytest

import ipuloop.emulator as poptorch
from ipuloop.emulator.device.latency import latency


def test_latency_groups_the_starts_of_each_returned_output_as_poptorch_does():
    assert latency([], []) == (0.0, 0.0, 0.0)  # not run: PopTorch's zeros
    # 4 device iterations, 2 outputs: each output's latency runs from its group's first start
    assert latency([0.0, 1.0, 2.0, 3.0], [5.0, 9.0]) == (5.0, 7.0, 6.0)
    with pytest.raises(poptorch.Error, match="do not group"):
        latency([0.0, 1.0, 2.0], [5.0, 9.0])
