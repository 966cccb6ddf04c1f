"""16-bit training as an IPU runs it: automatic loss scaling (PopART's histogram rule) and
stochastic rounding of float16 weight updates.

Each test names the PopTorch 3.4 / PopART source whose behaviour it pins. Closed-form models:
a float16 weight ``w`` with loss ``sum(w * c)``, whose gradient is ``c`` times the loss scale.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ipuloop.emulator as poptorch

NEEDS_CPU_HALF_BACKWARD = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 1),
    reason="torch < 2.1 has no float16 CPU kernels for backward and optimizer ops",
)

EDGE = 65504 * 0.125  # PopART's float16 bin edge at the default binEdgeLocation


class Dot(nn.Module):
    """loss = sum(w * c): d loss / d w = c, so the float16 gradient is c * loss scale."""

    def __init__(self, n: int, init: float = 1.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((n,), init))

    def forward(self, c):
        return poptorch.identity_loss((self.w * c).sum(), reduction="none")


def _als_run(
    c: torch.Tensor,
    steps: int,
    loss_scaling: float,
    opts=None,
    lr: float = 0.0,
    optimizer=poptorch.optim.SGD,
):
    """Train Dot(len(c)).half() with automatic loss scaling: the final loss scale of each
    step (anchored as PopART names it) and the update factor after the run."""
    model = Dot(c.shape[-1]).half()
    opts = opts or poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("final", "finalLossScale", poptorch.OutputMode.Final)
    opts.anchorTensor("factor", "lossScaleUpdateFactor", poptorch.OutputMode.Final)
    kwargs = {"loss_scaling": loss_scaling} if optimizer is not torch.optim.SGD else {}
    train = poptorch.trainingModel(model, opts, optimizer(model.parameters(), lr=lr, **kwargs))
    finals = []
    for _ in range(steps):
        train(c.half())
        finals.append(float(train.getAnchoredTensor("final")))
    return finals, float(train.getAnchoredTensor("factor")), train, model


# -- 6. automatic loss scaling ---------------------------------------------------------------


@NEEDS_CPU_HALF_BACKWARD
def test_loss_scale_doubles_below_the_bin_edge_and_halves_above():
    """PopART transforms/automaticlossscaling.cpp (``getLevels``: one bin edge at 65504 *
    binEdgeLocation) and popx/op/lossscaleupdatex.cpp (factor / 2 if the upper count exceeds
    the threshold, else * 2): with c = 100 and loss_scaling 64, the gradient 6400 is below
    the edge (8188), 12800 above it, so the loss scale alternates 64, 128, 64, 128."""
    assert 100 * 64 < EDGE < 100 * 128
    finals, factor, _, _ = _als_run(torch.full((4,), 100.0), 5, 64.0)
    assert finals == [64.0, 128.0, 64.0, 128.0, 64.0]
    assert factor == 2.0


@NEEDS_CPU_HALF_BACKWARD
def test_threshold_upper_count_proportion_decides():
    """popx/op/lossscaleupdatex.cpp: scale down when u > l * t / (1 - t). One gradient of four
    above the edge (u/(u+l) = 0.25): up with t = 0.5, down with t = 0.1."""
    c = torch.tensor([1000.0, 1.0, 1.0, 1.0])  # with loss scale 16: 16000 > EDGE > 16
    for t, expected in ((0.5, [16.0, 32.0]), (0.1, [16.0, 8.0])):
        opts = poptorch.Options()
        opts._Popart.set("automaticLossScalingSettings.thresholdUpperCountProportion", t)
        assert _als_run(c, 2, 16.0, opts)[0] == expected


@NEEDS_CPU_HALF_BACKWARD
def test_update_period_and_bin_edge_location():
    """transforms/automaticlossscaling.cpp ``executeLossScaleUpdateNTimesEveryMTimes``: with
    updatePeriod P the factor changes on the first step of every P; ``binEdgeLocation``
    moves the edge (0.5: 32752)."""
    opts = poptorch.Options()
    opts._Popart.set("automaticLossScalingSettings.updatePeriod", 3)
    finals, _, _, _ = _als_run(torch.ones(2), 7, 1.0, opts)
    assert finals == [1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0]
    opts = poptorch.Options()
    opts._Popart.set("automaticLossScalingSettings.binEdgeLocation", 0.5)
    # gradient 100 * 256 = 25600: above the default edge, below 32752
    assert _als_run(torch.full((2,), 100.0), 3, 256.0, opts)[0] == [256.0, 512.0, 256.0]


@NEEDS_CPU_HALF_BACKWARD
def test_final_loss_scale_is_clipped_at_2_pow_15():
    """popx/op/lossscaleupdatex.cpp ``clipOutput``: the factor stays at most 2**15 /
    loss_scaling, so the final loss scale fits float16. (The gradient of the sum below the
    loss equals the loss scale and is counted too: binEdgeLocation 1 keeps 2**15 below the
    edge.)"""
    opts = poptorch.Options()
    opts._Popart.set("automaticLossScalingSettings.binEdgeLocation", 1.0)
    finals, factor, _, _ = _als_run(torch.full((2,), 1e-3), 4, 2.0**13, opts)
    assert finals == [2.0**13, 2.0**14, 2.0**15, 2.0**15]
    assert factor == 4.0


@NEEDS_CPU_HALF_BACKWARD
@pytest.mark.parametrize("optimizer", [poptorch.optim.SGD, poptorch.optim.Adam, torch.optim.SGD])
def test_update_factor_in_ipu_state_and_the_update_unscaled(optimizer):
    """tests/options_test.py ``test_automatic_loss_scaling``: finalLossScale = loss_scaling *
    the ``ipu_state["lossScaleUpdateFactor"]`` read before the call (poptorch.optim); the
    gradients are divided by the loss scale their backward used, so SGD moves w by lr * c
    whatever the scale."""
    model = Dot(4).half()
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("final", "finalLossScale", poptorch.OutputMode.Final)
    ours = optimizer is not torch.optim.SGD
    opt = optimizer(model.parameters(), lr=2.0**-4, **({"loss_scaling": 2.0} if ours else {}))
    train = poptorch.trainingModel(model, opts, opt)
    c = torch.full((4,), 0.5).half()
    train.compile(c)
    assert {"finalLossScale", "lossScaleUpdateFactor"} <= set(train.getTensorNames())
    for step in range(4):
        if ours:
            factor = float(opt.state_dict()["ipu_state"]["lossScaleUpdateFactor"])
            assert factor == 2.0**step
        before = model.w.detach().clone()
        train(c)
        base = 2.0 if ours else 1.0
        assert float(train.getAnchoredTensor("final")) == base * 2.0**step
        if optimizer is not poptorch.optim.Adam:
            assert torch.equal(model.w.detach(), before - 2.0**-5)


@NEEDS_CPU_HALF_BACKWARD
def test_gradient_accumulation_counts_micro_batch_gradients():
    """transforms/automaticlossscaling.cpp: with gradient accumulation the histograms of the
    step's micro-batches are summed (``autoLossScaleStats`` accumulator) and the factor is
    updated once per step; each micro-batch's gradient carries the whole loss scale (the
    Mean reduction divides the accumulated gradient, not the histogrammed one)."""
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    c = torch.full((4, 2), 100.0)  # one row per micro-batch: gradient 100 * loss scale
    finals, factor, _, _ = _als_run(c, 3, 64.0, opts)
    assert finals == [64.0, 128.0, 64.0]  # as with GA = 1: 6400 < EDGE < 12800
    assert factor == 2.0


class MixedDot(nn.Module):
    """float32 master weights computing in float16: loss = sum(c @ w) with c float16, so the
    matmul runs in float16 on a float16 cast of w (``mixed_float.MixedFloat``, as PopTorch
    computes an op in its first operand's type); d loss / d w16 = c (times the loss scale)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n, 1))

    def forward(self, c):
        return poptorch.identity_loss((c @ self.w).sum(), reduction="sum")


@NEEDS_CPU_HALF_BACKWARD
def test_float32_weights_computing_in_float16_scale_from_the_float16_cast_gradients():
    """transforms/automaticlossscaling.cpp ``getToTrackTensorsAuto`` (PopART 3.4's default
    ``AllNonViewChangingGradientTensors``): the float16 gradients of the backward pass are
    counted whatever the weights' dtype, so float32 master weights used in float16 (the
    Loop's "16-mixed") train with automatic loss scaling; the gradient of the float16 cast
    of w (c * loss scale) crosses the bin edge as the Dot model's does."""
    model = MixedDot(4)
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("final", "finalLossScale", poptorch.OutputMode.Final)
    train = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=64.0)
    )
    finals = []
    for _ in range(4):
        train(torch.full((1, 4), 100.0).half())
        finals.append(float(train.getAnchoredTensor("final")))
    assert finals == [64.0, 128.0, 64.0, 128.0]  # 100 * 64 < EDGE < 100 * 128
    assert model.w.dtype == torch.float32


@NEEDS_CPU_HALF_BACKWARD
def test_float16_weights_computing_in_float32_scale_from_their_gradients():
    """tests/options_test.py ``test_automatic_loss_scaling``: a ``model.half()`` fed float32
    inputs computes in float32 (the weights cast to the input's type), and the float16
    gradient of each weight (the cast's gradient, which PopART tracks) drives the loss scale:
    c = 100 crosses the bin edge at loss scale 128 as in the Dot model."""

    class Float32Dot(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 1))

        def forward(self, c):
            return poptorch.identity_loss((c @ self.w).sum(), reduction="sum")

    model = Float32Dot().half()
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("final", "finalLossScale", poptorch.OutputMode.Final)
    train = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=64.0)
    )
    finals = []
    for _ in range(3):
        out = train(torch.full((1, 4), 100.0))
        finals.append(float(train.getAnchoredTensor("final")))
    assert out.dtype == torch.float32 and finals == [64.0, 128.0, 64.0]


def test_automatic_loss_scaling_needs_float16_gradients():
    """transforms/automaticlossscaling.cpp ``getToTrackTensorsAuto``: "No tracked gradient
    tensors of type fp16 were found" at compile for a float32 model; out of range settings
    raise PopART's errors, before any step."""
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    model = Dot(2)
    train = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="No tracked gradient tensors of type fp16"):
        train(torch.ones(2))
    assert torch.equal(model.w.detach(), torch.ones(2))
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opts._Popart.set("automaticLossScalingSettings.binEdgeLocation", 1.5)
    model = Dot(2).half()
    train = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        poptorch.Error,
        match=r"Out of range value for 'binEdgeLocation'. The "
        r"current value is 1.5",
    ):
        train.compile(torch.ones(2).half())


# -- 7. stochastic rounding --------------------------------------------------------------------


def _tiny_updates(steps: int, seed: int | None, stochastic: bool) -> torch.Tensor:
    """Train w = 1 (float16, 4096 of them) by SGD with lr * gradient = 2**-14 per step: below
    half the float16 spacing under 1 (2**-12), so rounding to nearest loses every update."""
    model = Dot(4096).half()
    opts = poptorch.Options()
    if seed is not None:
        opts.randomSeed(seed)
    opts.Precision.enableStochasticRounding(stochastic)
    train = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=2.0**-14))
    for _ in range(steps):
        train(torch.ones(4096).half())
    return model.w.detach().float()


@NEEDS_CPU_HALF_BACKWARD
def test_stochastic_rounding_keeps_tiny_float16_updates():
    """options.py ``enableStochasticRounding``: float16 weight updates round stochastically
    (seeded from ``randomSeed``), so many tiny updates add up in the mean (E[w] = 1 - 32 *
    2**-14) where rounding to nearest loses them all."""
    steps = 32
    nearest = _tiny_updates(steps, 0, stochastic=False)
    assert torch.equal(nearest, torch.ones(4096))
    w = _tiny_updates(steps, 0, stochastic=True)
    expected = 1 - steps * 2.0**-14
    # each weight moves by whole float16 steps of 2**-11 (below 1): its sd over 32 steps of
    # probability 1/8 is 2**-11 * sqrt(32 * 1/8 * 7/8); the mean of 4096 within 5 sds
    sd = 2.0**-11 * (steps * 7 / 64) ** 0.5 / 64
    assert abs(float(w.mean()) - expected) < 5 * sd
    assert torch.equal(w, _tiny_updates(steps, 0, stochastic=True))  # the seed fixes it
    assert not torch.equal(w, _tiny_updates(steps, 1, stochastic=True))


# -- PopART options that change an op's math -----------------------------------------------------


def test_strided_channel_grouping_of_group_norms():
    """PopLibs popnn/GroupNorm.hpp (``groupNormStridedChannelGrouping``, which PopART passes on
    from its session option, popx/op/groupnormx.cpp): group g holds channels g, g + G, ...;
    without the option, torch's contiguous groups. Reference: each strided group normalised by
    hand, then the per-channel affine; gradients reach the affine weights."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, 4)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    x = torch.randn(3, 4, 5)
    expected = torch.empty_like(x)
    for group in ([0, 2], [1, 3]):
        part = x[:, group]
        mean = part.mean(dim=(1, 2), keepdim=True)
        var = part.var(dim=(1, 2), unbiased=False, keepdim=True)
        expected[:, group] = (part - mean) / torch.sqrt(var + norm.eps)
    expected = expected * norm.weight.detach()[None, :, None] + norm.bias.detach()[None, :, None]
    opts = poptorch.Options()
    opts._Popart.set("groupNormStridedChannelGrouping", True)
    out = poptorch.inferenceModel(norm, opts)(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(poptorch.inferenceModel(norm)(x), norm(x))  # option off: torch's

    class Trained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)

        def forward(self, x):
            return poptorch.identity_loss(
                (self.norm(x) * torch.arange(4.0)[:, None]).sum(), reduction="none"
            )

    model = Trained()
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1.0))
    train(x)
    # d loss / d bias_c = (number of elements in channel c) * c: the affine is per channel
    assert torch.allclose(model.norm.bias.detach(), -torch.arange(4.0) * 15)
