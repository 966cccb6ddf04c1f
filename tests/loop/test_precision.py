"""16-bit precision: mixed (float16 inputs, float32 weights) and pure (half weights)."""

from __future__ import annotations

import pytest
from torch_versions import newer_torch
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import IPUConfig, Loop, poptorch
from ipuloop.callbacks import Callback

# torch 2.0's CPU has no float16 kernels for many backward and optimizer ops
# ("mse_backward_cpu_out" not implemented for 'Half'): the emulator computes float16 forward
# ops it lacks in float32, but not autograd's backward, so 16-bit training needs torch >= 2.1.
NEEDS_CPU_HALF_BACKWARD = newer_torch(
    "torch < 2.1 has no float16 CPU kernels for backward and optimizer ops"
)


def task():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x @ torch.randn(8, generator=g) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)


def fit(precision: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(4),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=opt,
        precision=precision,
        progress=False,
    )
    hist = loop.fit(task(), epochs=5)
    return loop, model, hist


# "16-mixed" sends float16 inputs to float32 weights, as on an IPU: running it needs the
# emulator to execute mixed float16/float32 ops as PopTorch does (a float16 input casts the
# weights of its op to float16). Strict: these start failing, as XPASS, once it does.
def test_mixed_and_pure_16_bit_train_close_to_32_bit():
    _, _, h32 = fit("32")
    loop, model, hmix = fit("16-mixed")
    _, half, hpure = fit("16-true")
    # Stated tolerance: the final epoch loss is within 0.05 of the 32-bit run's (it falls
    # from ~0.7 to ~0.1 over the five epochs).
    assert h32[-1]["train_loss"] < 0.3
    assert abs(hmix[-1]["train_loss"] - h32[-1]["train_loss"]) < 0.05
    assert abs(hpure[-1]["train_loss"] - h32[-1]["train_loss"]) < 0.05
    assert all(p.dtype == torch.float32 for p in model.parameters())  # mixed: fp32 weights
    assert all(p.dtype == torch.float16 for p in half.parameters())  # pure: stays 16-bit
    logits = loop.predict(DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2))
    assert logits.shape == (8, 2)


@NEEDS_CPU_HALF_BACKWARD
def test_automatic_loss_scaling_with_mixed_precision():
    """``IPUConfig(auto_loss_scaling=True)`` under "16-mixed": float32 weights computing in
    float16 have float16 gradients, which PopART 3.4's automatic loss scaling counts (its
    default tracks every float16 gradient of the backward pass), so the loss scale adjusts
    each step and training ends as the 32-bit run does."""
    _, _, h32 = fit("32")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    factors = []

    class Factor(Callback):
        def on_train_step_end(self, loop):  # the device optimizer's state, read by PopTorch
            factors.append(float(opt.state_dict()["ipu_state"]["lossScaleUpdateFactor"]))

    loop = Loop(
        model,
        IPUConfig(device_iterations=4, auto_loss_scaling=True),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=opt,
        precision="16-mixed",
        callbacks=[Factor()],
        progress=False,
    )
    hist = loop.fit(task(), epochs=5)
    assert abs(hist[-1]["train_loss"] - h32[-1]["train_loss"]) < 0.05
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert factors[0] > 1.0  # small gradients: the loss scale rose from the optimizer's 1
    assert len(set(factors)) > 1


def test_mixed_precision_really_runs_in_16_bit():
    seen = []
    torch.manual_seed(0)
    lin = nn.Linear(8, 2)
    lin.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loop = Loop(lin, loss_fn=nn.CrossEntropyLoss(), precision="16-mixed", progress=False)
    loop.fit(task(), epochs=1, max_steps=1)
    assert torch.float16 in seen


@pytest.mark.parametrize("bad", ["bf16", 8, True, 16.0, None])
def test_unknown_precision_rejected(bad):
    with pytest.raises(ValueError, match="precision must be one of"):
        Loop(nn.Linear(2, 2), loss_fn=nn.MSELoss(), precision=bad)


@pytest.mark.parametrize(
    "given, meant",
    [(32, "32"), ("32-true", "32"), (16, "16-mixed"), ("16", "16-mixed"), ("16-true", "16-true")],
)
def test_lightning_precision_spellings(given, meant):
    """Lightning IPU users wrote precision=16 (mixed) or 32; lightning-graphcore "32-true"."""
    model = nn.Linear(2, 2)
    loop = Loop(model, loss_fn=nn.MSELoss(), precision=given, progress=False)
    assert loop.precision == meant
    assert model.weight.dtype == (torch.float16 if meant == "16-true" else torch.float32)


def _underflow_step(loss_scaling: float, precision: str) -> torch.Tensor:
    """One SGD step (lr 1) of w*x with x=1000 and loss 1e-8*w*x: the true update is -1e-5.

    In float16 the loss's gradient, 1e-8, is below the smallest subnormal (6e-8) and rounds to
    zero unless the loss is scaled; 1e-8 * 2**15 = 3.3e-4 is representable."""
    lin = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(lin.weight)
    opt = poptorch.optim.SGD(lin.parameters(), lr=1.0, loss_scaling=loss_scaling)
    loop = Loop(
        lin,
        loss_fn=lambda out, y: poptorch.identity_loss(out * 1e-8, "sum"),
        optimizer=opt,
        precision=precision,
        progress=False,
    )
    x, y = torch.full((1, 1), 1000.0), torch.zeros(1, 1)
    loop.fit(DataLoader(TensorDataset(x, y), batch_size=1), epochs=1)
    return lin.weight.detach().float().reshape(())


@NEEDS_CPU_HALF_BACKWARD
def test_static_loss_scaling_rescues_underflowing_16_bit_gradients():
    assert _underflow_step(1.0, "16-true") == 0.0  # the gradient underflowed: no update
    # Scaled by 2**15 in backward, divided by it before the update: the true step, to float16
    # rounding (a subnormal near 1e-5 has a spacing of 6e-8).
    assert _underflow_step(2.0**15, "16-true").item() == pytest.approx(-1e-5, rel=0.01)
    # In float32 the scale cancels: the update is the same with and without it.
    assert (
        _underflow_step(1.0, "32")
        == _underflow_step(2.0**15, "32")
        == pytest.approx(-1e-5, rel=1e-6)
    )


def test_loss_scaling_leaves_32_bit_training_unchanged():
    """The loss is multiplied by the scale before backward and the gradients divided by it
    before the update (clipping sees the true gradients): the weights match an unscaled run."""
    weights = []
    for scale in (1.0, 1024.0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        opt = poptorch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, loss_scaling=scale, max_grad_norm=0.5
        )
        opts = poptorch.Options().deviceIterations(2)
        opts.Training.gradientAccumulation(2)
        Loop(model, opts, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, progress=False).fit(
            task(), epochs=1
        )
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(weights[0][0], _initial_first_weight())  # it trained


def _initial_first_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return nn.Linear(8, 32).weight.detach()


def test_pure_16_bit_adamw_trains_close_to_32_bit():
    """AdamW's eps (1e-8) is below float16's range: the update must still be finite and close."""
    losses = {}
    for precision in ("32", "16-true"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        loop = Loop(
            model,
            poptorch.Options().deviceIterations(4),
            loss_fn=nn.CrossEntropyLoss(),
            optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-2),
            precision=precision,
            progress=False,
        )
        losses[precision] = [e["train_loss"] for e in loop.fit(task(), epochs=3)]
        if precision == "16-true":
            assert all(p.dtype == torch.float16 for p in model.parameters())
    # Stated tolerance: every epoch's loss within 0.01 of the 32-bit run's (0.41 -> 0.08).
    assert losses["32"][-1] < 0.1
    assert all(abs(a - b) < 0.01 for a, b in zip(losses["32"], losses["16-true"])), losses


class HalfNet(nn.Module):
    """A float16 model-with-loss (made with ``.half()``, not by ``precision``): its matmuls run
    in float16, which torch 2.0's CPU has no kernel for; the loss in float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x, labels=None):
        out = self.net(x)
        return out if labels is None else (out, nn.functional.cross_entropy(out.float(), labels))


def test_a_half_model_fits_as_its_training_model_trains():
    """``Loop.fit`` of a ``model.half()`` trains it as ``poptorch.trainingModel`` does on the
    same batches (the same weights, bitwise), where the host probe before compiling has no
    float16 kernel for an op (torch 2.0's CPU): it computes that op as the device does."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g).half()
    y = (x.float() @ torch.randn(8, generator=g) > 0).long()
    data = TensorDataset(x, y)

    def options():
        return poptorch.Options().deviceIterations(2)

    looped = HalfNet().half()
    loop = Loop(
        looped,
        options(),
        optimizer=poptorch.optim.SGD(looped.parameters(), lr=0.1),
        progress=False,
    )
    history = loop.fit(DataLoader(data, batch_size=4), epochs=2)

    plain = HalfNet().half()
    opts = options()
    model = poptorch.trainingModel(plain, opts, poptorch.optim.SGD(plain.parameters(), lr=0.1))
    for _ in range(2):
        for xb, yb in poptorch.DataLoader(opts, data, batch_size=4):
            model(xb, yb)
    model.copyWeightsToHost()

    assert all(p.dtype == torch.float16 for p in looped.parameters())
    assert not torch.equal(looped.net[0].weight, HalfNet().half().net[0].weight)  # it trained
    for (name, a), b in zip(looped.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert history[-1]["train_loss"] < history[0]["train_loss"]
