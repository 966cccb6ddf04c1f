"""device/loss_scaling.py: PopART 3.x's automatic loss scaling rule in closed form: its
settings, the two-bin histogram of the float16 gradients, and the factor's update. Training
under it is in ``test_emulator_fidelity_numerics.py``."""

from __future__ import annotations

import pytest
import torch

import ipuloop.emulator as poptorch
from ipuloop.emulator.device.loss_scaling import (
    AutoLossScale,
    check_float16_gradients,
    settings,
)

EDGE = 65504 * 0.125  # the default bin edge: float16's maximum times binEdgeLocation
DEFAULTS = {"binEdgeLocation": 0.125, "thresholdUpperCountProportion": 1e-7, "updatePeriod": 1}


def als_options(**values) -> poptorch.Options:
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    for name, value in values.items():
        opts._Popart.set(f"automaticLossScalingSettings.{name}", value)
    return opts


def test_settings_off_defaults_and_set():
    assert settings(poptorch.Options()) is None
    assert settings(als_options()) == DEFAULTS
    assert settings(als_options(updatePeriod=3))["updatePeriod"] == 3


@pytest.mark.parametrize(
    "values,match",
    [
        ({"binEdgeLocation": 1.5}, "Out of range value for 'binEdgeLocation'"),
        ({"thresholdUpperCountProportion": -0.1}, "thresholdUpperCountProportion"),
        ({"updatePeriod": 0}, "updatePeriod must be >= 1"),
    ],
)
def test_out_of_range_settings_raise_popart_s_errors(values, match):
    with pytest.raises(poptorch.Error, match=match):
        settings(als_options(**values))


def test_a_model_without_float16_gradients_is_refused():
    check_float16_gradients(True)
    with pytest.raises(poptorch.Error, match="No tracked gradient tensors of type fp16"):
        check_float16_gradients(False)


def step(als: AutoLossScale, gradient: list[float], loss_scaling: float = 1.0) -> None:
    """One micro-batch whose float16 weight gradient is ``gradient``, then the update."""
    w = torch.ones(len(gradient), dtype=torch.float16, requires_grad=True)
    loss = (w * torch.tensor(gradient, dtype=torch.float16)).sum()
    als.track(loss)
    loss.backward()
    als.after_step(loss_scaling)


def test_the_factor_doubles_without_overflow_and_halves_near_it():
    als = AutoLossScale(DEFAULTS, micro_batch_scale=1.0)
    assert als.final(8.0) == 8.0  # the factor starts at 1
    step(als, [1.0, 2.0])
    assert als.factor == 2.0 and als.final(8.0) == 16.0
    step(als, [1.0, EDGE])  # one of two at the edge: u = 1 > l * 1e-7 / (1 - 1e-7)
    assert als.factor == 1.0
    step(als, [1.0, EDGE / 2])
    assert als.factor == 2.0


def test_a_non_finite_gradient_counts_as_an_overflow():
    als = AutoLossScale(DEFAULTS, micro_batch_scale=1.0)
    step(als, [1.0, float("inf")])
    assert als.factor == 0.5


def test_the_threshold_is_a_proportion_of_the_lower_count():
    # t = 0.5: halve only when u > l * t / (1 - t) = l
    als = AutoLossScale({**DEFAULTS, "thresholdUpperCountProportion": 0.5}, 1.0)
    step(als, [EDGE, EDGE, 1.0, 1.0])  # u = l = 2: kept growing
    assert als.factor == 2.0
    step(als, [EDGE, EDGE, EDGE, 1.0])  # u = 3 > l = 1
    assert als.factor == 1.0


def test_the_final_loss_scale_is_clipped_at_2_to_the_15():
    als = AutoLossScale(DEFAULTS, micro_batch_scale=1.0)
    step(als, [1.0], loss_scaling=2.0**14)
    assert als.factor == 2.0 and als.final(2.0**14) == 2.0**15
    step(als, [1.0], loss_scaling=2.0**14)
    assert als.factor == 2.0  # 2**16 clipped back
    assert als.last_final == 2.0**15


def test_the_factor_changes_on_the_first_step_of_each_update_period():
    als = AutoLossScale({**DEFAULTS, "updatePeriod": 2}, micro_batch_scale=1.0)
    factors = []
    for gradient in ([1.0], [EDGE], [1.0], [EDGE]):
        step(als, gradient)
        factors.append(als.factor)
    # steps 0 and 2 decide (no overflow, both); the overflows of steps 1 and 3 are not read
    assert factors == [2.0, 2.0, 4.0, 4.0]


def test_micro_batch_scale_undoes_the_executor_s_division_before_counting():
    # the executor scales a micro-batch's backward by 1 / (GA * RF) = 1/4 under Mean:
    # a gradient of EDGE / 4 is EDGE in PopART's tensors
    als = AutoLossScale(DEFAULTS, micro_batch_scale=4.0)
    step(als, [1.0, EDGE / 4])
    assert als.factor == 0.5
