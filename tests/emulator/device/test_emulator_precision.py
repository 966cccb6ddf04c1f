"""device/precision.py: the stochastic rounding of float32 values to float16, in closed form.
How an op takes float16 and float32 operands is ``test_mixed_float.py``'s; training under
both is in ``test_emulator_fidelity_numerics.py`` and ``test_emulator_fidelity_core.py``."""

from __future__ import annotations

import torch

from ipuloop.emulator.device.precision import stochastic_round_to_half


def test_stochastic_rounding_is_unbiased():
    """The IPU's stochastic rounding (PopTorch options.py ``enableStochasticRounding``: "rounds
    up or down ... randomly such that the expected (mean) result of rounded value is equal to
    the unrounded value"): to a float16 neighbour, each with the probability that makes the
    mean exact; float16 values are kept; normal and subnormal ranges alike."""
    g = torch.Generator().manual_seed(0)
    n = 200_000
    for x in (1 - 2.0**-14, -3.14159, 1e-6, -2.5e-7, 0.1):
        r = stochastic_round_to_half(torch.full((n,), x), g).float()
        neighbours = torch.unique(r)
        assert len(neighbours) == 2  # only the two float16 values around x
        spread = float(neighbours[1] - neighbours[0])
        # the mean of n Bernoulli choices: within 5 standard deviations of x
        assert abs(float(r.mean()) - x) < 5 * spread * 0.5 / n**0.5
    exact = torch.tensor([1.0, -0.5, 0.0, 65504.0, 2.0**-24])
    assert torch.equal(stochastic_round_to_half(exact, g).float(), exact)
